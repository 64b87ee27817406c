"""KDA on CUDA/ROCm through fla-core's Triton kernels (optional dependency: ``pip install fla-core``).

Same arguments and results as kernels/kda.py; these wrappers only map them onto fla-core 0.6's API
(fla-org/flash-linear-attention: ``fla/ops/kda/chunk.py`` ``chunk_kda``,
``fla/ops/kda/fused_recurrent.py`` ``fused_recurrent_kda_fwd``, ``fla/modules/causal_conv1d/ops.py``):

- fla takes a batch dim: packed sequences are one batch row ``[1, T, ...]`` with ``cu_seqlens``.
- fla's conv state is ``[N, C, W]``, the last W inputs (its column 0 is never read by a W-tap
  conv); ours is the last W-1 inputs ``[N, C, W-1]``, so one zero column is put in front and dropped.
- The decode uses fla's in-place continuous-batching mode (``ssm_state_indices``): each sequence
  reads and writes its own row of the state pool, no gather or scatter. Speculative verification
  uses its spec-decoding mode (``ssm_state_indices [N, T]`` + ``num_accepted_tokens``): one launch
  for all drafted positions, each position's state written to its own row.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch
import torch.nn.functional as F


@functools.cache
def unavailable_reason() -> str | None:
    """Why fla-core cannot serve KDA here (checked once; a broken install counts as missing), or None."""
    if importlib.util.find_spec("fla") is None:
        return "fla-core is not installed"
    try:
        importlib.import_module("fla.ops.kda")
        importlib.import_module("fla.modules.causal_conv1d")
    except Exception as e:  # noqa: BLE001 - any import failure means the package is unusable
        return f"fla-core does not import ({type(e).__name__}: {e})"
    return None


def available() -> bool:
    """Whether fla-core imports here."""
    return unavailable_reason() is None


def require() -> None:
    """Raise, naming the package, when a model with KDA layers would run on a GPU without fla-core:
    the PyTorch forms of kernels/kda.py are the CPU path and an oracle, far too slow to serve from."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(
            f"Kimi Delta Attention on a GPU needs fla-core>=0.6 ({reason}): "
            "pip install fla-core, or set KIMITUI_KERNELS=reference to run the PyTorch reference path"
        )


def chunk_kda(q, k, v, g, beta, initial_state, cu_seqlens, scale):
    """Varlen prefill: q, k [T, H, K]; v [T, H, V]; g [T, H, K]; beta [T, H]; initial_state
    [N, H, K, V] fp32; cu_seqlens [N+1] int64 on q's device. -> (o [T, H, V], final [N, H, K, V])"""
    from fla.ops.kda import chunk_kda as fla_chunk_kda  # optional dependency: fla-core

    o, final = fla_chunk_kda(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        scale=scale,
        initial_state=initial_state.float().contiguous(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens.long(),
    )
    return o[0], final.float()


def recurrent_kda(q, k, v, g, beta, state, slots, scale):
    """One token per sequence: q, k, g [N, H, K]; v [N, H, V]; beta [N, H]; state [num_slots, H, K, V]
    fp32, rows ``slots`` [N] updated in place. -> o [N, H, V]"""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd  # optional dependency: fla-core

    if not state.is_contiguous():
        raise ValueError("recurrent_kda: the state pool must be contiguous (fla writes it in place by slot)")
    # [N, 1, ...]: N sequences of one token each.
    o, _ = fused_recurrent_kda_fwd(
        q[:, None].contiguous(),
        k[:, None].contiguous(),
        v[:, None].contiguous(),
        g[:, None].contiguous(),
        beta[:, None].contiguous(),
        initial_state=state,
        scale=scale,
        inplace_final_state=True,
        ssm_state_indices=slots.to(torch.int32),
        use_qk_l2norm_in_kernel=True,
    )
    return o[:, 0]


def recurrent_kda_spec(q, k, v, g, beta, state, indices, lengths, scale):
    """Speculative verification (kernels/kda.py ``recurrent_kda_spec``) in one launch: fla's
    continuous-batching spec mode, varlen rows, ``ssm_state_indices`` = ``indices`` [N, T] and
    ``num_accepted_tokens`` = the lengths, so each sequence starts from its row at its last position
    and every position's state is written in place."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd  # optional dependency: fla-core

    if not state.is_contiguous():
        raise ValueError("recurrent_kda_spec: the state pool must be contiguous (fla writes it in place by slot)")
    lens = torch.tensor(lengths, dtype=torch.int32).to(q.device, non_blocking=True)
    cu = F.pad(lens.cumsum(0), (1, 0)).long()
    o, _ = fused_recurrent_kda_fwd(
        q[None].contiguous(),
        k[None].contiguous(),
        v[None].contiguous(),
        g[None].contiguous(),
        beta[None].contiguous(),
        initial_state=state,
        scale=scale,
        inplace_final_state=True,
        cu_seqlens=cu,
        ssm_state_indices=indices.to(torch.int32).contiguous(),
        num_accepted_tokens=lens,
        use_qk_l2norm_in_kernel=True,
    )
    return o[0]


def causal_conv1d(x, weight, history, cu_seqlens=None):
    """x [T, C]; weight [C, W]; history [N, C, W-1]; cu_seqlens [N+1] or None for one row per
    sequence. -> (y [T, C] in x.dtype, new history [N, C, W-1] in history.dtype)"""
    from fla.modules.causal_conv1d import causal_conv1d as fla_conv  # optional dependency: fla-core
    from fla.modules.causal_conv1d import causal_conv1d_update  # optional dependency: fla-core

    cache = F.pad(history, (1, 0)).contiguous()  # [N, C, W]
    if cu_seqlens is None:
        y, cache = causal_conv1d_update(x.contiguous(), cache, weight=weight, activation="silu")
        return y, cache[..., 1:].to(history.dtype)
    y, final = fla_conv(
        x[None].contiguous(),
        weight=weight,
        initial_state=cache,
        output_final_state=True,
        activation="silu",
        cu_seqlens=cu_seqlens.long(),
    )
    return y[0], final[..., 1:].to(history.dtype)
