"""Linear layers in every checkpoint format kimitui reads.

Parameter names equal the checkpoint's (``weight``, ``weight_scale_inv``, ``weight_packed``,
``weight_scale``) so the loader copies tensors by name. Quantised weights stay packed in memory;
the matmul dequantises (in the model's backend, see ``kernels.backend``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.config import QuantConfig
from kernels import reference
from kernels.backend import REFERENCE, Backend


def linear_format(quant: QuantConfig | None, module_name: str) -> str:
    """'dense', 'fp8', 'int4' or 'mxfp4' for the HF module ``module_name``."""
    if quant is None or not quant.applies_to(module_name):
        return "dense"
    if quant.method == "fp8" and (module_name == "lm_head" or module_name.endswith("mlp.gate")):
        return "dense"  # FP8 checkpoints keep the router and lm_head in bf16
    return quant.method


def quantized_params(fmt: str, out_features: int, in_features: int, quant: QuantConfig | None,
                     lead: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """Empty storage for one (or ``lead``-stacked) weight in format ``fmt``, checkpoint names as keys."""
    n, k = out_features, in_features
    if fmt == "dense":
        return {"weight": torch.empty(*lead, n, k)}
    if fmt == "fp8":
        bn, bk = quant.weight_block_size
        return {
            "weight": torch.empty(*lead, n, k, dtype=torch.float8_e4m3fn),
            "weight_scale_inv": torch.empty(*lead, math.ceil(n / bn), math.ceil(k / bk)),
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


def sharded_params(fmt: str, out_features: int, in_features: int, quant: QuantConfig | None,
                   shard: tuple[int, int, int] | None, what: str) -> dict[str, nn.Parameter]:
    """Parameters for this rank's slice of a weight.

    ``shard`` = (axis, start, end) in logical units: axis 0 splits output rows (column parallel),
    axis 1 input columns (row parallel). Each parameter records ``full_shape`` (the checkpoint's)
    and ``shard`` in its own storage units, so the loader reads just this rank's slice.
    """
    with torch.device("meta"):
        full = quantized_params(fmt, out_features, in_features, quant)
    out = {}
    for name, t in full.items():
        shape = list(t.shape)
        spec = None
        if shard is not None:
            axis, start, end = shard
            unit = _storage_unit(fmt, name, axis, quant)
            logical = (out_features, in_features)[axis]
            if start % unit or (end % unit and end != logical):
                raise ValueError(f"{what}: shard [{start}, {end}) of dim {axis} does not align with the "
                                 f"{fmt} storage unit of {unit} ({name})")
            lo, hi = start // unit, -(-end // unit)
            shape[axis] = hi - lo
            spec = (axis, lo, hi)
        p = nn.Parameter(torch.empty(shape, dtype=t.dtype), requires_grad=False)
        p.full_shape = tuple(t.shape)
        p.shard = spec
        out[name] = p
    return out


class Linear(nn.Module):
    """y = x @ W.T without bias, W stored dense or quantised; optionally one rank's shard of W."""

    ops: Backend = REFERENCE  # the model's backend, set when it is loaded

    def __init__(self, in_features: int, out_features: int, quant: QuantConfig | None = None,
                 module_name: str = "", shard: tuple[int, int, int] | None = None):
        super().__init__()
        self.fmt = linear_format(quant, module_name)
        self.quant = quant
        params = sharded_params(self.fmt, out_features, in_features, quant, shard, module_name)
        for name, p in params.items():
            self.register_parameter(name, p)
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
            return self.ops.linear_fp8_block(x, self.weight, self.weight_scale_inv, self.quant.weight_block_size)
        if self.fmt == "int4":
            return self.ops.linear_w4a16(x, self.weight_packed, self.weight_scale, self.in_features,
                                         self.quant.group_size)
        return self.ops.linear_mxfp4(x, self.weight_packed, self.weight_scale)

    def dense_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantised weight [out, in]; used where the maths needs W itself (absorbed MLA)."""
        if self.fmt == "dense":
            return self.weight.to(dtype)
        if self.fmt == "fp8":
            return reference.dequant_fp8_block(self.weight, self.weight_scale_inv, self.quant.weight_block_size, dtype)
        if self.fmt == "int4":
            return reference.dequant_int4(self.weight_packed, self.weight_scale, self.in_features,
                                          self.quant.group_size, dtype)
        return reference.dequant_mxfp4(self.weight_packed, self.weight_scale, dtype)

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
        w.data = fused[start: start + w.shape[0]]
        start += w.shape[0]
    return fused
