"""Kimi K3 / Kimi Linear decode pieces on the CPU (``cpu_k3_decode.cpp``), built on first use.

``kda_sequential``: the KDA recurrence of prefill chunks token by token (the chunked form's result);
``kda_decode``: a KDA layer's step between its projections (short conv, gate, beta, delta rule, gated
output norm) for one token of each of N sequences, in one call instead of about 25 ATen operations;
``attn_res_mix_norm``: an attention-residual mix and the RMSNorm after it, one call instead of about
15; ``situ_and_mul``: K3's SiTU of a dense MLP's gate/up product (about 10 ATen operations). They compute what ``kernels.backend.Backend`` computes (its methods of the same names are the
oracles), in float32, rounding to the activations' dtype where the PyTorch path rounds. The CPU
backend (``kernels.cpu.backend``) calls them for float32 and bf16 decode steps; ``available()`` is
False where the extension does not build (or ``KIMITUI_CPU_KERNELS=0``) and the PyTorch path runs.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from kimitui.kernels.cpu import few_rows as cpu_few_rows
from kimitui.kernels.cpu.build import K3_DECODE, load_extension

log = logging.getLogger(__name__)

DTYPES = (torch.float32, torch.bfloat16)
_ABSENT = torch.empty(0)


@functools.cache
def _module():
    if os.environ.get("KIMITUI_CPU_KERNELS", "1").lower() in ("0", "false", "off"):
        return None
    module = load_extension(K3_DECODE, log, "CPU K3 decode kernels")
    if module is not None and cpu_few_rows.available():
        module.use_team(cpu_few_rows.team_capsule())  # one thread team for both extensions
        cpu_few_rows.use_kda_decode(module.kda_capsule())  # for its kda_block
    return module


def available() -> bool:
    """True when the extension is built (building it on the first call)."""
    return _module() is not None


def kda_decode_fits(qkv: torch.Tensor, rec_state: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor) -> bool:
    """Whether ``kda_decode`` takes these: CPU float32 / bf16 activations, contiguous float32 states,
    one head width for keys and values, int64 slots."""
    return (
        qkv.device.type == "cpu"
        and qkv.dtype in DTYPES
        and rec_state.dtype is torch.float32
        and conv_state.dtype is torch.float32
        and rec_state.is_contiguous()
        and conv_state.is_contiguous()
        and rec_state.shape[2] == rec_state.shape[3]
        and slots.dtype is torch.int64
    )


def kda_decode(
    qkv, f_b, b, gate, conv_weight, A_log, dt_bias, lower_bound, norm_weight, eps, conv_state, rec_state, slots, scale
) -> torch.Tensor:
    """``Backend.kda_decode`` in one call (every slot real and distinct; ``kda_decode_fits`` holds).
    ``lower_bound`` None: Kimi Linear's softplus gate. -> [N, P] in qkv's dtype."""
    return _module().kda_decode(
        qkv,
        f_b,
        b,
        gate,
        conv_weight,
        A_log,
        dt_bias,
        0.0 if lower_bound is None else float(lower_bound),
        norm_weight,
        float(eps),
        conv_state,
        rec_state,
        slots,
        float(scale),
    )


def kda_sequential_fits(q, k, v, g, beta) -> bool:
    """Whether ``kda_sequential`` takes these: CPU q, k, v of one dtype (float32 / bf16) with contiguous
    last dims and one head width, float32 g and beta."""
    return (
        q.device.type == "cpu"
        and q.dtype in DTYPES
        and k.dtype is q.dtype
        and v.dtype is q.dtype
        and all(t.dim() == 3 and t.stride(-1) == 1 for t in (q, k, v))
        and g.dtype is torch.float32
        and beta.dtype is torch.float32
    )


def kda_sequential(q, k, v, g, beta, initial_state, cu_seqlens, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """``Backend.kda_chunk`` token by token in one call (``kda_sequential_fits`` holds): packed sequences
    ``cu_seqlens`` [N+1] from ``initial_state`` [N, H, K, V]. -> (o [T, H, V] in v's dtype, final state
    float32)."""
    out, state = _module().kda_sequential(
        q, k, v, g, beta, initial_state, cu_seqlens.to(device="cpu", dtype=torch.int64), float(scale)
    )
    return out, state


def attn_res_mix_fits(x: torch.Tensor, blocks: torch.Tensor, delta: torch.Tensor | None) -> bool:
    """Whether ``attn_res_mix_norm`` takes these: CPU float32 / bf16 rows, contiguous snapshots in x's dtype."""
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.dtype in DTYPES
        and x.stride(-1) == 1
        and blocks.dtype is x.dtype
        and blocks.is_contiguous()
        and (delta is None or (delta.dtype is x.dtype and delta.stride(-1) == 1))
    )


def attn_res_mix_norm(
    x, blocks, n, res_norm_weight, res_eps, proj_weight, norm_weight, norm_eps, delta=None, save=False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Backend.attn_res_mix_norm`` in one call (``attn_res_mix_fits`` holds) -> (normed mix, s)."""
    out, s = _module().attn_res_mix_norm(
        x,
        blocks,
        n,
        res_norm_weight,
        float(res_eps),
        proj_weight,
        norm_weight,
        float(norm_eps),
        _ABSENT if delta is None else delta,
        bool(save),
    )
    return out, s


def situ_fits(gu: torch.Tensor) -> bool:
    """Whether ``situ_and_mul`` takes ``gu``: a CPU float32 / bf16 [T, 2I] with contiguous rows."""
    return gu.device.type == "cpu" and gu.dim() == 2 and gu.dtype in DTYPES and gu.stride(-1) == 1


def situ_and_mul(gu: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """``kernels.activation.situ_and_mul(gu[:, :I], gu[:, I:], beta, linear_beta)`` in one call -> [T, I]."""
    return _module().situ_and_mul(gu, float(beta), 0.0 if linear_beta is None else float(linear_beta))
