"""Linear layers in every checkpoint format kimitui reads.

Parameter names equal the checkpoint's (``weight``, ``weight_scale_inv``, ``weight_packed``,
``weight_scale``) so the loader copies tensors by name. Quantised weights stay packed in memory;
the matmul dequantises (in the model's backend, see ``kernels.backend``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kimitui.engine.config import QuantConfig
from kimitui.engine.loader.source import TensorSource, copy_into
from kimitui.kernels import reference
from kimitui.kernels.backend import REFERENCE, Backend


def linear_format(quant: QuantConfig | None, module_name: str) -> str:
    """'dense', 'fp8', 'int4' or 'mxfp4' for the HF module ``module_name``."""
    if quant is None or not quant.applies_to(module_name):
        return "dense"
    if quant.method == "fp8" and (module_name == "lm_head" or module_name.endswith("mlp.gate")):
        return "dense"  # FP8 checkpoints keep the router and lm_head in bf16
    return quant.method


# Logical weight values per stored element (planner parameter counts): INT4 packs 8 nibbles per
# int32, MXFP4 two e2m1 per byte; scales hold no weights of their own.
_VALUES_PER_ELEMENT = {"weight": 1, "weight_packed": None, "weight_scale_inv": 0, "weight_scale": 0}


def values_per_element(fmt: str, name: str) -> int:
    """Logical weight values in one stored element of parameter ``name`` in format ``fmt``."""
    v = _VALUES_PER_ELEMENT[name]
    return v if v is not None else (8 if fmt == "int4" else 2)


def quantized_params(
    fmt: str,
    out_features: int,
    in_features: int,
    quant: QuantConfig | None,
    lead: tuple[int, ...] = (),
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Empty storage for one (or ``lead``-stacked) weight in format ``fmt``, checkpoint names as keys.

    Every dtype is explicit: a dense weight is ``dtype`` (the model's), FP8 scales are fp32 whatever
    the model dtype (the FP8 GEMM and fused MoE take fp32 scales), INT4 scales bf16 as stored.
    """
    n, k = out_features, in_features
    if fmt == "dense":
        return {"weight": torch.empty(*lead, n, k, dtype=dtype)}
    if fmt == "fp8":
        bn, bk = quant.weight_block_size
        return {
            "weight": torch.empty(*lead, n, k, dtype=torch.float8_e4m3fn),
            "weight_scale_inv": torch.empty(*lead, math.ceil(n / bn), math.ceil(k / bk), dtype=torch.float32),
        }
    if fmt == "int4":
        g = quant.group_size
        return {
            "weight_packed": torch.empty(*lead, n, math.ceil(k / 8), dtype=torch.int32),
            "weight_scale": torch.empty(*lead, n, math.ceil(k / g), dtype=torch.bfloat16),
        }
    if fmt == "mxfp4":
        return {
            "weight_packed": torch.empty(*lead, n, k // 2, dtype=torch.uint8),
            "weight_scale": torch.empty(*lead, n, k // 32, dtype=torch.uint8),
        }
    raise ValueError(f"unknown weight format {fmt!r}")


def split_unit(fmt: str, quant: QuantConfig | None) -> int:
    """Granularity to split a dim that is the output rows of some Linears and the input columns of
    others (an MLP's intermediate dim) without cutting an FP8 scale block or an INT4/MXFP4 group."""
    if fmt == "fp8":
        return math.lcm(*quant.weight_block_size)
    if fmt == "int4":
        return quant.group_size
    if fmt == "mxfp4":
        return 32
    return 1


def _storage_unit(fmt: str, name: str, axis: int, quant: QuantConfig | None) -> int:
    """Logical rows (axis 0) or input columns (axis 1) per stored element of parameter ``name``."""
    if fmt == "fp8" and name == "weight_scale_inv":
        return quant.weight_block_size[axis]
    if axis == 0:
        return 1
    if fmt == "int4":
        return 8 if name == "weight_packed" else quant.group_size
    if fmt == "mxfp4":
        return 2 if name == "weight_packed" else 32
    return 1


def local_fp8_block(quant: QuantConfig, shard: tuple[int, int, int] | None) -> tuple[int, int]:
    """The scale block of this rank's FP8 shard. A shard starting inside a checkpoint block (11
    heads x 192 rows = 2112 = 16.5 blocks of 128) keeps the block grid of its own first row: blocks
    of gcd(128, 2112 % 128) = 64 rows, each inside one checkpoint block, so each takes one
    checkpoint scale (repeated on load, see ``sharded_params``)."""
    block = list(quant.weight_block_size)
    if shard is not None:
        axis, start, _ = shard
        block[axis] = math.gcd(block[axis], start % block[axis])
    return block[0], block[1]


def sharded_params(
    fmt: str,
    out_features: int,
    in_features: int,
    quant: QuantConfig | None,
    shard: tuple[int, int, int] | None,
    what: str,
    dtype: torch.dtype = torch.float32,
) -> dict[str, nn.Parameter]:
    """Parameters for this rank's slice of a weight.

    ``shard`` = (axis, start, end) in logical units: axis 0 splits output rows (column parallel),
    axis 1 input columns (row parallel). Each parameter records ``full_shape`` (the checkpoint's),
    ``shard`` in its own storage units and, for FP8 scales of a shard that starts inside a block,
    ``shard_index`` (which checkpoint scale each local block takes), so the loader reads just this
    rank's slice (see ``engine.loader.source.copy_into``). INT4/MXFP4 groups cannot be cut: a shard
    that would is refused naming the tensor.
    """
    with torch.device("meta"):
        full = quantized_params(fmt, out_features, in_features, quant, dtype=dtype)
    out = {}
    for name, t in full.items():
        shape = list(t.shape)
        spec = index = None
        if shard is not None:
            axis, start, end = shard
            unit = _storage_unit(fmt, name, axis, quant)
            logical = (out_features, in_features)[axis]
            lo, hi = start // unit, -(-end // unit)
            if fmt == "fp8" and name == "weight_scale_inv" and start % unit:
                # checkpoint scale rows lo..hi-1 cover [start, end); local block j starts at logical
                # start + j * b and lies inside checkpoint block (start + j * b) // unit
                b = local_fp8_block(quant, shard)[axis]
                index = torch.arange(start, end, b, device="cpu") // unit - lo
                shape[axis] = len(index)
            elif start % unit or (end % unit and end != logical and name != "weight_scale_inv"):
                raise ValueError(
                    f"{what}.{name}: rows/columns [{start}, {end}) of dim {axis} cut a {fmt} "
                    f"storage unit of {unit}; this split is impossible"
                )
            else:
                shape[axis] = hi - lo
            spec = (axis, lo, hi)
        p = nn.Parameter(torch.empty(shape, dtype=t.dtype), requires_grad=False)
        p.full_shape = tuple(t.shape)
        p.shard = spec
        p.shard_index = index
        p.values_per_element = values_per_element(fmt, name)
        out[name] = p
    return out


class Linear(nn.Module):
    """y = x @ W.T without bias, W stored dense or quantised; optionally one rank's shard of W."""

    ops: Backend = REFERENCE  # the model's backend, set when it is loaded

    def __init__(
        self,
        in_features: int,
        out_features: int,
        quant: QuantConfig | None = None,
        module_name: str = "",
        shard: tuple[int, int, int] | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.fmt = linear_format(quant, module_name)
        self.quant = quant
        # FP8 scale block of this rank's weight (finer than the checkpoint's for a mid-block shard)
        self.block = local_fp8_block(quant, shard) if self.fmt == "fp8" else None
        params = sharded_params(self.fmt, out_features, in_features, quant, shard, module_name, dtype)
        for name, p in params.items():
            self.register_parameter(name, p)
        self.full_features = (out_features, in_features)
        self.out_features, self.in_features = out_features, in_features
        if shard is not None:
            axis, start, end = shard
            if axis == 0:
                self.out_features = end - start
            else:
                self.in_features = end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fmt == "dense":
            return self.ops.linear(x, self.weight)
        if self.fmt == "fp8":
            return self.ops.linear_fp8_block(x, self.weight, self.weight_scale_inv, self.block)
        if self.fmt == "int4":
            return self.ops.linear_w4a16(
                x, self.weight_packed, self.weight_scale, self.in_features, self.quant.group_size
            )
        return self.ops.linear_mxfp4(x, self.weight_packed, self.weight_scale)

    def dense_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantised weight [out, in]; used where the maths needs W itself (absorbed MLA)."""
        if self.fmt == "dense":
            return self.weight.to(dtype)
        if self.fmt == "fp8":
            return reference.dequant_fp8_block(self.weight, self.weight_scale_inv, self.block, dtype)
        if self.fmt == "int4":
            return reference.dequant_int4(
                self.weight_packed, self.weight_scale, self.in_features, self.quant.group_size, dtype
            )
        return reference.dequant_mxfp4(self.weight_packed, self.weight_scale, dtype)

    def load_weight(self, name: str, shard_id, src: TensorSource) -> list[tuple[str, object]] | None:
        """Take checkpoint tensor ``<module>.<name>``; returns the (parameter, shard id) pairs it
        filled, or None for a name this layer does not have."""
        if name == "weight_shape":  # compressed-tensors' record of the logical [out, in]
            shape = src.read().tolist()
            if shape != list(self.full_features):
                raise src.error(f"records shape {shape}, expected {list(self.full_features)}")
            return []
        param = self._parameters.get(name)
        if param is None:
            return None
        copy_into(param, src)
        return [(name, None)]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, format={self.fmt}"


def fuse_dense_rows(*linears: Linear) -> torch.Tensor | None:
    """One weight [sum of outs, in] for dense Linears that read the same input, each Linear's weight
    re-pointed at its rows of it (no second copy): one product instead of several, as vLLM's merged
    projections. None, and nothing changed, when any of them is quantised or they do not stack."""
    if any(lin.fmt != "dense" for lin in linears):
        return None
    weights = [lin.weight for lin in linears]
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
        return None
    fused = torch.cat([w.data for w in weights])
    start = 0
    for w in weights:
        w.data = fused[start : start + w.shape[0]]
        start += w.shape[0]
    return fused
