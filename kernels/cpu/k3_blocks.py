"""A Kimi Linear / K3 attention layer's decode step as one C++ call, for a few float32 or bf16 rows
on a CPU (``CpuBackend.fuse_attention``, asked once per layer after loading).

``MlaBlock``: the gated NoPE MLA layer (``engine/layers/mla.py``) through ``attention_block`` in its
K3 form: normed rows in, ``o_proj(sigmoid(g_proj(x)) * MLA(x))`` out, each sequence's newest latent
written. ``KdaBlock``: a KDA layer (``engine/layers/kda.py``) through ``kda_block``: the fused input
projection, ``f_b_proj`` (and Kimi Linear's ``g_b_proj``), the step between (``kda_decode``: conv,
gate, delta rule, gated norm, on the slots' states) and ``o_proj``.

As the DeepSeek-V3 blocks (``decode_block.py``), the matrices stay in the model's dtype (read
widened in registers), the activations are float32 inside and the output is rounded to the model's
dtype once: within bf16 rounding of the op-by-op layer (bit-identical to nothing in bf16), and equal
to it up to float32 summation order for a float32 model. A step the block does not take (prefill
chunks, speculative verification, padding rows, more than MAX_K3_BLOCK_ROWS rows) runs op by op.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kimitui.kernels.backend import written_rows
from kimitui.kernels.cpu import few_rows as cpu_few_rows
from kimitui.kernels.cpu import k3_decode as cpu_k3_decode
from kimitui.kernels.cpu.decode_block import AttentionBlockWeights, attention_call, attention_weights, block_rows
from kimitui.kernels.cpu.packed_ffn_block import ABSENT, DTYPES, dense_cpu

# Rows a K3 attention block takes: at 1, 4 and 8 bf16 decodes it beat the layers op by op (per request 1.28x,
# 1.17x, 1.21x on the benchmark's K3 shape, 2-core Xeon), at 16 it lost (0.85x: its products' oneDNN threads
# and the team's KDA / MLA passes then trade places inside one call); wider steps run op by op.
MAX_K3_BLOCK_ROWS = 8


def _rows(x: torch.Tensor) -> bool:
    return x.shape[0] <= MAX_K3_BLOCK_ROWS and block_rows(x)


class MlaBlock:
    """A NoPE / gated ``MLAttention``'s decode step in one call (see the module docstring)."""

    def __init__(self, weights: AttentionBlockWeights):
        self.weights = weights
        self.dtype = weights.in_proj.dtype

    def takes(self, x: torch.Tensor, meta) -> bool:
        """Decodes only, every output wanted, no padding rows, at most ``MAX_K3_BLOCK_ROWS`` rows, x in
        the weights' dtype."""
        return (
            x.dtype is self.dtype
            and _rows(x)
            and meta.decodes_only(x.shape[0])
            and written_rows(meta.slot_mapping) is None
        )

    def __call__(self, x: torch.Tensor, meta, cache: torch.Tensor) -> torch.Tensor:
        return attention_call(x, meta, cache, self.weights)


@dataclass(frozen=True, eq=False)
class KdaBlock:
    """A ``KimiDeltaAttention``'s decode step in one call: its fixed arguments (in the C++ function's
    order), and the check and call."""

    in_proj: torch.Tensor  # q | k | v | f_a | b | g_proj (or g_a_proj) rows [3P + hd + H + G, D]
    heads: int
    head_dim: int
    f_b: torch.Tensor  # f_b_proj [P, hd]
    g_b: torch.Tensor  # Kimi Linear's g_b_proj [P, hd], or empty (K3's full-rank g_proj is in in_proj)
    conv_weight: torch.Tensor  # the three convs [3P, W] float32
    A_log: torch.Tensor  # [H] float32
    dt_bias: torch.Tensor  # [P] float32
    lower_bound: float  # K3's safe gate bound (negative), or 0.0: Kimi Linear's softplus gate
    norm_weight: torch.Tensor  # o_norm [hd]
    eps: float
    scale: float
    o_proj: torch.Tensor  # [D, P]

    @functools.cached_property
    def dtype(self) -> torch.dtype:
        return self.in_proj.dtype

    @functools.cached_property
    def kernel_args(self) -> tuple:
        """The fields in order, as the C++ ``kda_block`` takes them after the step's rows and states."""
        return tuple(getattr(self, f) for f in self.__dataclass_fields__)

    def takes(self, x: torch.Tensor, meta, state) -> bool:
        """A plain decode step (no prefill chunk, no speculative verification), at most
        ``MAX_K3_BLOCK_ROWS`` rows, x in the weights' dtype, every slot real, float32 contiguous states."""
        return (
            x.dtype is self.dtype
            and _rows(x)
            and meta.num_decode_tokens == x.shape[0]
            and not meta.prefills
            and meta.kda_spec is None
            and meta.kda_verify_rows is None
            and meta.state_slots is not None
            and cpu_k3_decode.kda_decode_fits(x, state.recurrent, state.conv, meta.state_slots)
            and written_rows(meta.state_slots) is None
        )

    def __call__(self, x: torch.Tensor, meta, state) -> torch.Tensor:
        return cpu_few_rows.kda_block(x, meta.state_slots, state.conv, state.recurrent, self)


def mla_block(attn) -> MlaBlock | None:
    """The one-call decode of a Kimi Linear / K3 ``MLAttention`` (normed rows in, no residual), or None
    where the kernel cannot take its weights (quantised, sharded, not dense float32 / bf16 CPU tensors)."""
    weights = attention_weights(None, attn)
    return None if weights is None else MlaBlock(weights)


def kda_block(attn) -> KdaBlock | None:
    """The one-call decode of a ``KimiDeltaAttention`` whose projections are dense float32 or bf16 CPU
    matrices of one dtype on one rank (its input projections fused into ``in_proj``), or None."""
    c = attn.config
    g_b = getattr(attn, "g_b_proj", None)
    if (
        attn.in_proj is None
        or attn.par.is_parallel
        or not cpu_k3_decode.available()
        or any(p.fmt != "dense" for p in (attn.f_b_proj, attn.o_proj, *([g_b] if g_b is not None else [])))
    ):
        return None
    dtype = attn.in_proj.dtype
    mats = [attn.in_proj, attn.f_b_proj.weight, attn.o_proj.weight] + ([g_b.weight] if g_b is not None else [])
    small = [attn.conv_weight, attn.A_log, attn.dt_bias, attn.o_norm.weight]
    if dtype not in DTYPES or not dense_cpu(dtype, *mats) or not dense_cpu(torch.float32, *small):
        return None
    return KdaBlock(
        in_proj=attn.in_proj,
        heads=int(attn.num_heads),
        head_dim=int(attn.head_dim),
        f_b=attn.f_b_proj.weight,
        g_b=ABSENT if g_b is None else g_b.weight,
        conv_weight=attn.conv_weight,
        A_log=attn.A_log,
        dt_bias=attn.dt_bias,
        lower_bound=0.0 if c.gate_lower_bound is None else float(c.gate_lower_bound),
        norm_weight=attn.o_norm.weight,
        eps=float(c.rms_norm_eps),
        scale=float(attn.scale),
        o_proj=attn.o_proj.weight,
    )
