"""Expert alignment for the fused MoE in one Triton launch (reference: ``reference.moe_align_block_size``).

The fused MoE GEMM (``kernels/fused_moe.py``) wants the T*k (token, slot) pairs sorted by expert,
each expert's run padded to a multiple of BLOCK_M, so that every M-tile belongs to one expert.
The PyTorch version (``fused_moe.moe_align_block_size``) takes a scatter-add, two cumsums, a stable
argsort, a searchsorted and a dozen elementwise ops: about 37 launches per MoE layer. At decode
there are only a few hundred pairs, so one program does it all here: it counts pairs per expert,
prefix-sums the padded counts, writes each tile's expert, the pad slots and then every pair's slot.

Within a chunk of pairs, "how many earlier pairs went to the same expert" is an exclusive cumsum of
the [chunk, E] one-hot matrix, so pairs keep their order inside an expert (the order a stable
argsort gives) and no atomics are needed: the result is bit-identical to the PyTorch version.
vLLM/SGLang use a 4-stage grid of E programs for large E (vllm-project/vllm,
``vllm/model_executor/layers/fused_moe/moe_align_block_size.py``); one program is enough for a
decode step and costs one launch.
"""

import torch
import triton
import triton.language as tl

from kernels._checks import check_device

_ONEHOT_ELEMENTS = 8192  # [chunk, BLOCK_E] one-hot tiles stay about this size (registers)


@triton.jit
def _moe_align_kernel(
    ids_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    numel, E, size, num_blocks,
    BLOCK_SIZE: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
):
    e = tl.arange(0, BLOCK_E)
    real = e < E  # ids >= E (E marks "computed elsewhere") get no slot
    p = tl.arange(0, CHUNK)

    # 1. pairs per expert
    counts = tl.zeros((BLOCK_E,), tl.int32)
    for start in range(0, numel, CHUNK):
        offs = start + p
        ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
        onehot = ((ids[:, None] == e[None, :]) & real[None, :]).to(tl.int32)  # [CHUNK, BE]
        counts += tl.sum(onehot, axis=0)
    padded = (counts + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE  # [BE]
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    filled_end = padded_start + counts  # slots past this (to padded_end) are padding
    tl.store(num_post_ptr, tl.sum(padded, axis=0))

    # 2. the expert of each M-tile: how many experts end at or before the tile's first slot
    for b0 in range(0, num_blocks, CHUNK):
        blocks = b0 + p
        first = blocks * BLOCK_SIZE
        before = ((padded_end[None, :] <= first[:, None]) & real[None, :]).to(tl.int32)
        owner = tl.sum(before, axis=1)
        owner = tl.where(owner < E, owner, E - 1)  # tiles past the end: skipped by the GEMM
        tl.store(expert_ids_ptr + blocks, owner, mask=blocks < num_blocks)

    # 3. slots no pair fills (each expert's tail, everything past the last expert) get the pad id numel;
    #    written apart from step 4's slots, so no store races another
    for s0 in range(0, size, CHUNK):
        slots = s0 + p
        holds_pair = ((padded_start[None, :] <= slots[:, None]) & (slots[:, None] < filled_end[None, :])
                      & real[None, :]).to(tl.int32)  # [CHUNK, BE]
        is_pad = tl.sum(holds_pair, axis=1) == 0
        tl.store(sorted_ptr + slots, tl.zeros((CHUNK,), tl.int32) + numel, mask=(slots < size) & is_pad)

    # 4. each pair's slot: its expert's start + pairs of that expert seen before it
    cursor = padded_start
    for start in range(0, numel, CHUNK):
        offs = start + p
        ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
        onehot = ((ids[:, None] == e[None, :]) & real[None, :]).to(tl.int32)  # [CHUNK, BE]
        earlier = tl.cumsum(onehot, axis=0) - onehot  # same-expert pairs before it in this chunk
        dest = tl.sum(onehot * (cursor[None, :] + earlier), axis=1)
        routed = (ids >= 0) & (ids < E)
        tl.store(sorted_ptr + dest, offs, mask=routed & (offs < numel))
        cursor += tl.sum(onehot, axis=0)


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int):
    """Drop-in for ``fused_moe.moe_align_block_size``, one launch and no host sync.

    ``topk_ids [T, k]`` int32/int64; an id equal to ``num_experts`` marks a pair computed elsewhere
    (another rank, host RAM): it gets no slot. Returns ``sorted_token_ids`` int32
    [num_blocks * block_size] (pad id T*k), ``expert_ids`` int32 [num_blocks] and
    ``num_tokens_post_padded`` int32 [1]; the sizes depend only on the shapes (static for a graph).
    """
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"moe_align_block_size: topk_ids must be int32/int64 [T, k], got {topk_ids.dtype} "
                         f"{tuple(topk_ids.shape)}")
    if block_size < 1:
        raise ValueError(f"moe_align_block_size: block_size must be positive, got {block_size}")
    if num_experts < 1:
        raise ValueError(f"moe_align_block_size: num_experts must be positive, got {num_experts}")
    flat = topk_ids.reshape(-1)  # [T*k]
    if not flat.is_contiguous():
        flat = flat.contiguous()
    numel = flat.numel()
    device = flat.device
    # Each non-empty tile holds at least one pair, so at most T*k tiles are used (as fused_moe's).
    num_blocks = min(triton.cdiv(numel + num_experts * (block_size - 1), block_size), numel)
    size = num_blocks * block_size
    sorted_ids = torch.empty(size, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    check_device(flat, sorted_ids)
    if numel == 0:
        return sorted_ids, expert_ids, num_post.zero_()
    block_e = triton.next_power_of_2(num_experts)
    chunk = max(1, min(64, _ONEHOT_ELEMENTS // block_e))
    _moe_align_kernel[(1,)](
        flat, sorted_ids, expert_ids, num_post, numel, num_experts, size, num_blocks,
        BLOCK_SIZE=block_size, BLOCK_E=block_e, CHUNK=chunk, num_warps=8 if block_e >= 512 else 4,
    )
    return sorted_ids, expert_ids, num_post
