"""Split-K for the decode GEMVs: enough programs to fill the device at batch 1-16 (reference: the sum over K).

At decode a weight GEMM has M = 1-16 rows, so one [16, 64] output tile per 64 output features is
all the parallelism the N dimension gives: Kimi K2's ``kv_a_proj_with_mqa`` (7168 -> 576) is 9
programs, ``q_a_proj`` (7168 -> 1536) 24, K3's ``f_a_proj`` (7168 -> 128) 2, on a device with 132
(H200) to 256 (MI355X) compute units, each of which wants a few programs in flight to hide memory
latency. The weight is read once either way; what the programs add is memory requests in flight.

``plan_gemm`` splits K as well: program (m, n, s) sums K-steps ``[s * steps, (s + 1) * steps)`` of
its tile into an fp32 partial ``[S, M, N]``, and ``_split_k_reduce_kernel`` adds the S partials in
order and rounds once (two launches, no atomics: the result depends only on the shapes, the same
in a CUDA graph as eagerly, run after run). The split is chosen so that the grid has at least
``TARGET_PROGRAMS`` programs (2 x MI355X's 256 CUs), or, where the shape has fewer tiles x K-steps
than that (K3's ``f_a_proj``: 2 tiles x 112 steps), one K-step per program: as many as the shape
allows. Above ``SPLIT_MAX_M`` rows the N x M tiles alone fill the device and nothing is split.
vLLM's and SGLang's Triton w4a16 / FP8 GEMMs (``SPLIT_K`` of vllm-project/vllm
``vllm/model_executor/layers/quantization/awq_triton.py``) split the same way, with atomics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import triton
import triton.language as tl

TARGET_PROGRAMS = 512  # 2 x the 256 CUs of an MI355X (an H200 has 132 SMs)
SPLIT_MAX_M = 64  # above this many rows no split (the M x N tiles fill the device)
_REDUCE_BLOCK = 256  # a decode output (M x N = 576 to 16 x 36864) spreads over 3 to 2304 programs


@dataclass(frozen=True)
class GemmPlan:
    """The launch of one weight GEMM ``[M, K] x [N, K]^T`` (the wrapper launches exactly this)."""

    m: int
    n: int
    k: int
    block_m: int
    block_n: int
    block_k: int
    split: int  # K ranges (grid axis 2); 1: no partials, the GEMM writes the output itself
    steps_per_split: int  # BLOCK_K steps per K range

    @property
    def k_steps(self) -> int:
        return triton.cdiv(self.k, self.block_k)

    @property
    def grid(self) -> tuple[int, int, int]:
        return (triton.cdiv(self.m, self.block_m), triton.cdiv(self.n, self.block_n), self.split)

    @property
    def programs(self) -> int:
        g = self.grid
        return g[0] * g[1] * g[2]

    @property
    def fills_device(self) -> bool:
        """At least TARGET_PROGRAMS programs, or the most the shape allows (one K-step each)."""
        return self.programs >= TARGET_PROGRAMS or self.steps_per_split == 1


def block_m_for(m: int) -> int:
    # Decode (M <= 16) wastes least with 16-row tiles; tl.dot needs at least 16.
    return 16 if m <= 16 else 32 if m <= 32 else 64


def plan_gemm(m: int, n: int, k: int, block_n: int = 64, block_k: int = 64) -> GemmPlan:
    """Tiles and K split for ``m`` rows, ``n`` output and ``k`` input features (see the module doc)."""
    block_m = block_m_for(m)
    tiles = triton.cdiv(max(m, 1), block_m) * triton.cdiv(max(n, 1), block_n)
    k_steps = max(triton.cdiv(k, block_k), 1)
    steps = k_steps
    if m <= SPLIT_MAX_M and tiles < TARGET_PROGRAMS:
        # the largest steps per split that still gives TARGET_PROGRAMS programs (at least one step)
        steps = max(1, tiles * k_steps // TARGET_PROGRAMS)
    split = triton.cdiv(k_steps, steps)
    return GemmPlan(
        m=m,
        n=n,
        k=k,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        split=split,
        steps_per_split=triton.cdiv(k_steps, split),
    )


@triton.jit
def _split_k_reduce_kernel(ws_ptr, out_ptr, MN, S, BLOCK: tl.constexpr):
    # out[i] = sum over s, in order, of ws[s, i] (fp32), rounded once to out's dtype
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    ptrs = ws_ptr + offs
    for _ in range(S):
        acc += tl.load(ptrs, mask=mask, other=0.0)
        ptrs += MN
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def outputs(plan: GemmPlan, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [M, N] in ``dtype``, what the GEMM kernel writes: ``out`` itself, or the fp32 partials
    [S, M, N] when K is split)."""
    out = torch.empty((plan.m, plan.n), dtype=dtype, device=device)
    if plan.split == 1:
        return out, out
    return out, torch.empty((plan.split, plan.m, plan.n), dtype=torch.float32, device=device)


def finish(plan: GemmPlan, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Sum the partials into ``out`` (nothing to do without a split)."""
    if plan.split > 1:
        mn = plan.m * plan.n
        _split_k_reduce_kernel[(triton.cdiv(mn, _REDUCE_BLOCK),)](target, out, mn, plan.split, BLOCK=_REDUCE_BLOCK)
    return out
