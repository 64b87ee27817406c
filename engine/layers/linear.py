"""Linear layers in every checkpoint format kimitui reads.

Parameter names equal the checkpoint's (``weight``, ``weight_scale_inv``, ``weight_packed``,
``weight_scale``) so the loader copies tensors by name. Quantised weights stay packed in memory;
the matmul dequantises (Triton on GPU, PyTorch reference on CPU, see ``kernels.dispatch``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.config import QuantConfig
from kernels import dispatch


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


class Linear(nn.Module):
    """y = x @ W.T without bias, W stored dense or quantised."""

    def __init__(self, in_features: int, out_features: int, quant: QuantConfig | None = None,
                 module_name: str = ""):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.fmt = linear_format(quant, module_name)
        self.quant = quant
        for name, t in quantized_params(self.fmt, out_features, in_features, quant).items():
            # Packed integer storage is not trainable; a Parameter keeps naming uniform for the loader.
            self.register_parameter(name, nn.Parameter(t, requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fmt == "dense":
            return nn.functional.linear(x, self.weight)
        if self.fmt == "fp8":
            return dispatch.linear_fp8_block(x, self.weight, self.weight_scale_inv, self.quant.weight_block_size)
        if self.fmt == "int4":
            return dispatch.linear_w4a16(x, self.weight_packed, self.weight_scale, self.in_features,
                                         self.quant.group_size)
        return dispatch.linear_mxfp4(x, self.weight_packed, self.weight_scale)

    def dense_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantised weight [out, in]; used where the maths needs W itself (absorbed MLA)."""
        if self.fmt == "dense":
            return self.weight.to(dtype)
        eye = torch.eye(self.in_features, dtype=dtype, device=self._storage().device)
        return self.forward(eye).T.contiguous()

    def _storage(self) -> torch.Tensor:
        return self.weight if self.fmt in ("dense", "fp8") else self.weight_packed

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, format={self.fmt}"
