"""Expert alignment for the fused MoE in one Triton launch (reference: ``reference.moe_align_block_size``).

The fused MoE GEMM (``kernels/triton/fused_moe.py``) wants the T*k (token, slot) pairs sorted by expert,
each expert's run padded to a multiple of BLOCK_M, so that every M-tile belongs to one expert.
The PyTorch version (``moe_align_block_size_torch``, below) takes a scatter-add, two cumsums, a stable
argsort, a searchsorted and a dozen elementwise ops: about 37 launches per MoE layer. Here it is one
launch of many small programs, none of which loops over experts or slots:

- every program histograms all the pair ids (``tl.histogram``: a decode step has a few hundred to
  a few thousand pairs, one or two chunks) and prefix-sums the padded counts, so each knows where
  every expert's run starts without talking to the others;
- program p places PAIRS pairs: a pair's slot is its expert's start, plus the pairs of that expert
  before this program's chunk (a second histogram, of the ids before it), plus those earlier in the
  chunk (a [32, 32] compare). Pairs keep their order inside an expert (what a stable argsort
  gives), without atomics, so the result is bit-identical to the PyTorch version;
- program p also owns TILES M-tiles: it finds each tile's expert by a binary search of the padded
  run ends (log2(E) gathers, not an [tiles, E] compare), writes it, and writes the pad id into the
  tile's slots that no pair fills (an expert's tail, or anything past the last expert). Pair slots
  and pad slots are disjoint, so no store races another.

The previous version did all of this in one program, with [chunk, E] one-hot compares for every
chunk of slots: Kimi K2 (384 experts, BLOCK_M 64) at batch 64 ran about 1,500 serial [16 x 512]
iterations, K3 (896 experts) about 7,000. vLLM/SGLang split the same work into four launches of
E programs for large E (vllm-project/vllm, ``vllm/model_executor/layers/fused_moe/moe_align_block_size.py``);
redundant histograms keep it to one launch here (a decode step is launch-bound).
"""

from dataclasses import dataclass

import torch

import triton
import triton.language as tl
from kimitui.kernels.triton.check import _version
from kimitui.kernels.triton.common import check_device

_ID_CHUNK = (128, 1024)  # pair ids histogrammed per loop step: all of a decode step's in one, 4 at 4096
_PAIRS = 32  # pairs placed per program: a [32, 32] compare for the order inside the chunk
_TILE_SLOTS = 512  # slots per program for the expert ids and the pad fill (TILES = this / BLOCK_M)


def native_ops() -> bool:
    """Whether the installed Triton has ``tl.gather`` (3.2) and ``tl.histogram``'s mask (3.4).

    The floor is 3.0 (torch 2.4's, kernels/triton/check.py). Below 3.4 the kernel takes the portable
    forms (PORTABLE=True): a one-hot sum for each gather, and an unmasked histogram with the
    masked-out lanes (all put in bin 0) taken back out of bin 0.
    """
    return _version(getattr(triton, "__version__", "0")) >= (3, 4)


# The native ops are named only where this Triton has them: Triton 3.0's JIT resolves every
# ``tl.<name>`` in a kernel's source (untaken constexpr branches included) when it hashes the kernel.
if native_ops():

    @triton.jit
    def _native_gather(src, idx):
        return tl.gather(src, idx, 0)

    @triton.jit
    def _native_histogram(ids, mask, N: tl.constexpr):
        return tl.histogram(ids, N, mask=mask)
else:

    @triton.jit
    def _native_gather(src, idx):  # never called: PORTABLE is set below 3.4
        return src

    @triton.jit
    def _native_histogram(ids, mask, N: tl.constexpr):  # never called: PORTABLE is set below 3.4
        return ids


@triton.jit
def _gather(src, idx, N: tl.constexpr, PORTABLE: tl.constexpr):
    # src[idx] for src [N] and idx of any 1-D shape (every idx in [0, N))
    if PORTABLE:
        lanes = tl.arange(0, N)
        return tl.sum(tl.where(idx[:, None] == lanes[None, :], src[None, :], 0), axis=1)
    else:
        return _native_gather(src, idx)


@triton.jit
def _histogram(ids, mask, N: tl.constexpr, PORTABLE: tl.constexpr):
    # how many lanes in ``mask`` hold each id (ids in [0, N) wherever mask is set)
    if PORTABLE:  # lanes outside the mask all go to bin 0, and their count is taken back out of it
        dropped = tl.sum((mask == 0).to(tl.int32), axis=0)
        return tl.histogram(tl.where(mask, ids, 0), N) - tl.where(tl.arange(0, N) == 0, dropped, 0)
    else:
        return _native_histogram(ids, mask, N)


@triton.jit
def _moe_align_kernel(
    ids_ptr,
    sorted_ptr,
    expert_ids_ptr,
    num_post_ptr,
    numel,
    E,
    num_blocks,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_SIZE_P2: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    ID_CHUNK: tl.constexpr,
    PAIRS: tl.constexpr,
    TILES: tl.constexpr,
    PORTABLE: tl.constexpr = False,
):
    pid = tl.program_id(0)
    pair_start = pid * PAIRS
    c = tl.arange(0, ID_CHUNK)

    # 1. pairs per expert (ids outside [0, E), e.g. E for "computed elsewhere", get no slot), and
    #    per expert the pairs before this program's chunk
    counts = tl.zeros((BLOCK_E,), tl.int32)
    before = tl.zeros((BLOCK_E,), tl.int32)
    for start in range(0, numel, ID_CHUNK):
        offs = start + c
        ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1)
        routed = (ids >= 0) & (ids < E)  # masked lanes loaded -1
        ids = tl.where(routed, ids, 0).to(tl.int32)
        counts += _histogram(ids, routed, BLOCK_E, PORTABLE)
        before += _histogram(ids, routed & (offs < pair_start), BLOCK_E, PORTABLE)
    padded = (counts + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE  # [BE]; 0 for experts >= E
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    filled_end = padded_start + counts  # slots from here to padded_end are padding
    if pid == 0:
        tl.store(num_post_ptr, tl.sum(padded, axis=0))

    # 2. this program's pairs: expert start + same-expert pairs before the chunk + earlier in it
    i = tl.arange(0, PAIRS)
    p = pair_start + i
    ids = tl.load(ids_ptr + p, mask=p < numel, other=-1)
    routed = (ids >= 0) & (ids < E)
    ids = tl.where(routed, ids, 0).to(tl.int32)
    same = (ids[:, None] == ids[None, :]) & routed[None, :] & (i[None, :] < i[:, None])  # [PAIRS, PAIRS]
    earlier = tl.sum(same.to(tl.int32), axis=1)
    dest = _gather(padded_start + before, ids, BLOCK_E, PORTABLE) + earlier
    tl.store(sorted_ptr + dest, p, mask=routed)

    # 3. this program's tiles. Owner = how many of the E experts end at or before the tile's first
    #    slot (runs are whole tiles, so the tile lies inside that expert's run), found bit by bit
    #    from the top: the largest n <= E with padded_end[n - 1] <= first.
    t = pid * TILES + tl.arange(0, TILES)
    first = t * BLOCK_SIZE
    owner = tl.zeros((TILES,), tl.int32)
    for s in tl.static_range(SEARCH_STEPS):
        cand = owner + (BLOCK_E >> s)
        ends = _gather(padded_end, tl.maximum(tl.minimum(cand, E) - 1, 0), BLOCK_E, PORTABLE)
        owner = tl.where((cand <= E) & (ends <= first), cand, owner)
    real = owner < E  # else the tile is past the last expert's run: all padding, skipped by the GEMM
    expert = tl.minimum(owner, E - 1)
    tl.store(expert_ids_ptr + t, expert, mask=t < num_blocks)
    fill_end = tl.where(real, _gather(filled_end, expert, BLOCK_E, PORTABLE), 0)  # [TILES]
    j = tl.arange(0, BLOCK_SIZE_P2)
    slots = first[:, None] + j[None, :]  # [TILES, BLOCK_SIZE_P2]
    pad = (t[:, None] < num_blocks) & (j[None, :] < BLOCK_SIZE) & (slots >= fill_end[:, None])
    tl.store(sorted_ptr + slots, tl.zeros((TILES, BLOCK_SIZE_P2), tl.int32) + numel, mask=pad)


@dataclass(frozen=True)
class AlignLaunch:
    """How ``moe_align_block_size`` launches its kernel for one shape (the wrapper launches exactly this).

    ``work_per_program`` is the element count of the vector operations one program runs, the figure
    that bounds its time on a GPU, where the programs run side by side.
    """

    numel: int
    num_experts: int
    num_blocks: int
    programs: int
    block_size: int
    block_size_p2: int
    block_e: int
    search_steps: int
    id_chunk: int
    pairs: int
    tiles: int

    @property
    def serial_steps(self) -> int:
        """Trips of the one runtime loop in a program (the id histogram); the search is unrolled."""
        return triton.cdiv(self.numel, self.id_chunk)

    @property
    def work_per_program(self) -> int:
        """Elements of the vector operations one program runs, as written in the kernel: about 12 per
        id per chunk (load, masks, two histograms), 12 per expert slot of BLOCK_E (padding, prefix sum),
        6 per entry of the [PAIRS, PAIRS] compare and 8 per pair, 7 per tile per search step and 8 per
        slot of the pad tile. (The interpreter also materialises splats, casts and broadcasts, about
        five times this: tests/kernels/triton/test_moe_align.py measures that figure.)"""
        return (
            self.serial_steps * self.id_chunk * 12
            + self.block_e * 12
            + self.pairs * (6 * self.pairs + 8)
            + self.tiles * (7 * self.search_steps + 8 * self.block_size_p2)
        )

    def kernel_args(self) -> dict:
        return dict(
            BLOCK_SIZE=self.block_size,
            BLOCK_SIZE_P2=self.block_size_p2,
            BLOCK_E=self.block_e,
            SEARCH_STEPS=self.search_steps,
            ID_CHUNK=self.id_chunk,
            PAIRS=self.pairs,
            TILES=self.tiles,
        )


def align_launch(numel: int, block_size: int, num_experts: int) -> AlignLaunch:
    """The grid and tile sizes for ``numel`` (token, slot) pairs; sizes as ``moe_align_block_size``'s."""
    # Each non-empty tile holds at least one pair, so at most T*k tiles are used (as fused_moe's).
    num_blocks = min(triton.cdiv(numel + num_experts * (block_size - 1), block_size), numel)
    block_size_p2 = triton.next_power_of_2(block_size)
    block_e = max(16, triton.next_power_of_2(num_experts))
    tiles = max(1, _TILE_SLOTS // block_size_p2)
    programs = max(triton.cdiv(numel, _PAIRS), triton.cdiv(num_blocks, tiles), 1)
    return AlignLaunch(
        numel=numel,
        num_experts=num_experts,
        num_blocks=num_blocks,
        programs=programs,
        block_size=block_size,
        block_size_p2=block_size_p2,
        block_e=block_e,
        search_steps=block_e.bit_length(),  # steps BLOCK_E, BLOCK_E/2, ..., 1
        id_chunk=min(max(triton.next_power_of_2(numel), _ID_CHUNK[0]), _ID_CHUNK[1]),
        pairs=_PAIRS,
        tiles=tiles,
    )


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int, portable: bool | None = None):
    """Drop-in for ``moe_align_block_size_torch`` (below), one launch and no host sync.

    ``portable``: take the forms that Triton 3.0-3.3 compile (no ``tl.gather``, no masked
    ``tl.histogram``); None: only where the installed Triton is older than 3.4. Same outputs.

    ``topk_ids [T, k]`` int32/int64; an id equal to ``num_experts`` marks a pair computed elsewhere
    (another rank, host RAM): it gets no slot. Returns ``sorted_token_ids`` int32
    [num_blocks * block_size] (pad id T*k), ``expert_ids`` int32 [num_blocks] and
    ``num_tokens_post_padded`` int32 [1]; the sizes depend only on the shapes (static for a graph).
    """
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"moe_align_block_size: topk_ids must be int32/int64 [T, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}"
        )
    if block_size < 1:
        raise ValueError(f"moe_align_block_size: block_size must be positive, got {block_size}")
    if num_experts < 1:
        raise ValueError(f"moe_align_block_size: num_experts must be positive, got {num_experts}")
    flat = topk_ids.reshape(-1)  # [T*k]
    if not flat.is_contiguous():
        flat = flat.contiguous()
    numel = flat.numel()
    device = flat.device
    launch = align_launch(numel, block_size, num_experts)
    sorted_ids = torch.empty(launch.num_blocks * block_size, dtype=torch.int32, device=device)
    expert_ids = torch.empty(launch.num_blocks, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    check_device(flat, sorted_ids)
    if numel == 0:
        return sorted_ids, expert_ids, num_post.zero_()
    _moe_align_kernel[(launch.programs,)](
        flat,
        sorted_ids,
        expert_ids,
        num_post,
        numel,
        num_experts,
        launch.num_blocks,
        **launch.kernel_args(),
        PORTABLE=(not native_ops()) if portable is None else bool(portable),
        num_warps=4,
    )
    return sorted_ids, expert_ids, num_post


def moe_align_block_size_torch(topk_ids: torch.Tensor, block_size: int, num_experts: int):
    """Sort (token, slot) pairs by expert, padding each expert to a multiple of ``block_size``.

    An id equal to ``num_experts`` marks a pair computed elsewhere (another rank, or host RAM):
    it gets no tile, and its output rows stay zero.

    Returns ``sorted_token_ids`` int32 [num_blocks * block_size] (pad id = T*k), ``expert_ids``
    int32 [num_blocks] and ``num_tokens_post_padded`` int32 [1]. No host sync: the buffer is sized
    by the worst case, and tiles past ``num_tokens_post_padded`` exit early in the kernel.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)  # [T*k]
    numel = flat.numel()
    device = flat.device
    # scatter_add_ instead of bincount: bincount syncs on CUDA to size its output. The last bucket
    # collects the pairs marked "elsewhere".
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    counts[num_experts] = 0  # no tiles for pairs computed elsewhere
    padded = (counts + block_size - 1) // block_size * block_size  # [E + 1]
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # pair indices grouped by expert
    experts = flat[order]
    rank = torch.arange(numel, device=device) - start[experts]  # position within its expert
    # Each non-empty tile holds at least one pair, so at most T*k tiles are used.
    num_blocks = min(triton.cdiv(numel + num_experts * (block_size - 1), block_size), numel)
    size = num_blocks * block_size
    # One spare slot past the end takes every "elsewhere" pair, and is cut off.
    sorted_token_ids = torch.full((size + 1,), numel, dtype=torch.int32, device=device)
    dest = torch.where(experts < num_experts, padded_start[experts] + rank, size)
    sorted_token_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=device) * block_size
    expert_ids = torch.searchsorted(padded_end[:num_experts], block_starts, right=True).clamp_(max=num_experts - 1)
    return (
        sorted_token_ids[:size],
        expert_ids.to(torch.int32),
        padded_end[num_experts - 1 : num_experts].to(torch.int32),
    )


# Up to this many (token, slot) pairs (decode), one Triton launch aligns them (moe_align_block_size);
# beyond it (prefill, not launch-bound) the PyTorch version above, whose ops scale across the GPU.
_TRITON_ALIGN_MAX_PAIRS = 4096


def align_pairs(topk_ids: torch.Tensor, block_size: int, num_experts: int):
    """The fused MoE's alignment: ``moe_align_block_size`` (one launch) for a decode's few pairs,
    ``moe_align_block_size_torch`` for a prefill's many."""
    if topk_ids.numel() <= _TRITON_ALIGN_MAX_PAIRS:
        return moe_align_block_size(topk_ids, block_size, num_experts)
    return moe_align_block_size_torch(topk_ids, block_size, num_experts)
