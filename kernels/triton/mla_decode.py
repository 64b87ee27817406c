"""MLA decode over the paged latent cache, in the absorbed form (reference:
``reference.mla_decode_reference``).

Each sequence has one query per head: ``q = [q_nope @ W_UK, q_pe]`` of width r + rope. Its keys are
the cached rows ``[c_kv, k_pe]`` and its values the latents ``c_kv`` themselves, read in place
through the block table: no gathered copy of the context. Programs split a sequence's context
into ``num_splits`` ranges (flash-decoding) so that a small batch still fills the device. The grid
depends only on the batch and a bound on the context (the step's longest, or a CUDA graph's
capacity); each sequence's ranges are sized in the kernel from its own length, so a short sequence
next to a long one, or under a graph captured for long ones, still spreads over the splits. Each
keeps a running max and sum (online softmax) over tiles of BLOCK_N cached tokens for BLOCK_H
heads, and writes its unnormalised partial result; a second launch merges the splits (one launch
instead of the ~9 PyTorch ops of the same merge: the decode step is launch-bound).

Every head block reads the whole latent context of its sequence, so the heads per program decide
how often the cache is read: 64 heads in blocks of 16 read it four times. The tile is therefore
chosen per architecture (``mla_decode_launch_params``): as many heads per program as the registers
and shared memory / LDS of the device hold without spilling, read from the device's properties.
"""

import functools
from dataclasses import dataclass

import torch

import triton
import triton.language as tl
from kimitui.kernels.triton.common import FLOAT_DTYPES, check_device


@triton.jit
def _mla_decode_kernel(
    q_ptr,
    cache_ptr,
    table_ptr,
    lens_ptr,
    acc_ptr,
    ml_ptr,
    H,
    num_splits,
    block_size,
    scale,
    stride_qb,
    stride_qh,
    stride_cs,
    stride_tb,
    stride_ab,
    stride_as,
    stride_ah,
    stride_mb,
    stride_ms,
    stride_mh,
    R: tl.constexpr,
    P: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_TILES: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(lens_ptr + b)
    # This sequence's own split length: its context in num_splits ranges of whole tiles, at least
    # MIN_TILES tiles each (the grid is fixed by the batch's bound, e.g. a CUDA graph's capacity, so a
    # short sequence still spreads over several programs instead of filling the first split alone).
    tiles = (context + BLOCK_N - 1) // BLOCK_N
    split_len = tl.maximum((tiles + num_splits - 1) // num_splits, MIN_TILES) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, context)  # start >= end: an empty split, merged as nothing

    heads = (head_block * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    mask_h = heads < H
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_p = tl.arange(0, BLOCK_P)
    mask_p = offs_p < P
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_rows + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)  # [BH, BR]
    q_pe = tl.load(q_rows + R + offs_p[None, :], mask=mask_h[:, None] & mask_p[None, :], other=0.0)  # [BH, BP]

    m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        mask_n = pos < end
        block = tl.load(table_ptr + b * stride_tb + pos // block_size, mask=mask_n, other=0).to(tl.int64)
        rows = cache_ptr + (block * block_size + pos % block_size)[:, None] * stride_cs
        kv = tl.load(rows + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0)  # [BN, BR]
        pe = tl.load(rows + R + offs_p[None, :], mask=mask_n[:, None] & mask_p[None, :], other=0.0)  # [BN, BP]
        kv = kv.to(q_lat.dtype)
        scores = tl.dot(q_lat, tl.trans(kv), input_precision="ieee")
        scores = tl.dot(q_pe, tl.trans(pe.to(q_pe.dtype)), scores, input_precision="ieee") * scale
        scores = tl.where(mask_n[None, :], scores, float("-inf"))  # [BH, BN]
        # Every tile holds at least one valid token, so m_new is finite.
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision="ieee")
        m = m_new

    split64 = split.to(tl.int64)
    tl.store(
        acc_ptr + b * stride_ab + split64 * stride_as + heads[:, None] * stride_ah + offs_r[None, :],
        acc,
        mask=mask_h[:, None] & mask_r[None, :],
    )
    ml = ml_ptr + b * stride_mb + split64 * stride_ms + heads * stride_mh
    tl.store(ml, m, mask=mask_h)
    tl.store(ml + 1, l, mask=mask_h)


@triton.jit
def _mla_merge_kernel(
    acc_ptr,
    ml_ptr,
    out_ptr,
    H,
    S,
    stride_ab,
    stride_as,
    stride_ah,
    stride_mb,
    stride_ms,
    stride_mh,
    stride_ob,
    stride_oh,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # out[b, h] = sum_s acc[b, s, h] * w_s / sum_s l[b, s, h] * w_s with w_s = exp(m_s - max_s m_s);
    # a split past its sequence's end kept m = -inf and l = 0 (and acc = 0), so weighs nothing.
    b = tl.program_id(0).to(tl.int64)
    heads = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    mask_h = heads < H
    offs_r = tl.arange(0, BLOCK_R)
    mask = mask_h[:, None] & (offs_r[None, :] < R)
    ml = ml_ptr + b * stride_mb + heads * stride_mh
    m_max = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    ml_s = ml  # split s's (m, l): pointers step by the stride (64-bit), no split * stride product
    for s in range(0, S):
        m_max = tl.maximum(m_max, tl.load(ml_s, mask=mask_h, other=float("-inf")))
        ml_s += stride_ms
    m_max = tl.where(mask_h, m_max, 0.0)  # padding heads: no -inf - -inf
    num = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)
    den = tl.zeros((BLOCK_H,), dtype=tl.float32)
    ml_s = ml
    acc_s = acc_ptr + b * stride_ab + heads[:, None] * stride_ah + offs_r[None, :]
    for s in range(0, S):
        w = tl.exp(tl.load(ml_s, mask=mask_h, other=float("-inf")) - m_max)  # [BH]
        den += tl.load(ml_s + 1, mask=mask_h, other=0.0) * w
        a = tl.load(acc_s, mask=mask, other=0.0)
        num += a * w[:, None]
        ml_s += stride_ms
        acc_s += stride_as
    out = num / tl.where(mask_h, den, 1.0)[:, None]
    tl.store(
        out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_r[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


_MIN_TILES = 4  # the shortest split, in tiles of BLOCK_N tokens
_MERGE_BLOCK_H = 16  # heads per program of the merge (its [16, r] fp32 sum needs no larger tile)


@dataclass(frozen=True)
class GpuLimits:
    """What one program may hold on a GPU: shared memory / LDS and registers."""

    arch: str  # "sm_90", "gfx942", ...
    backend: str  # "cuda" | "hip"
    warp_size: int
    shared_bytes: int  # shared memory (CUDA: the opt-in maximum per block) or LDS one program may use
    regs_per_program: int  # 32-bit registers one program may hold, over all its threads
    max_regs_per_thread: int


# Known targets. Sources: sm_90 - CUDA C++ Programming Guide, "Technical Specifications per Compute
# Capability": 227 KB (232,448 B) shared memory per block with opt-in, 64K 32-bit registers per
# block, 255 per thread (fla-org/flash-linear-attention ``fla/utils`` uses the same 232,448 B for
# Hopper). gfx942 (MI300X/MI325X, CDNA3) - AMD CDNA3 ISA reference and the MI300 "hardware
# specifications" table of the ROCm docs: 64 KB LDS per CU, 512 VGPRs per lane (256 arch + 256
# accumulation) per wave, 4 SIMDs per CU. gfx950 (MI350X/MI355X, CDNA4) - CDNA4 ISA reference and
# the same ROCm table: LDS grown to 160 KB (163,840 B) per CU, registers as CDNA3 (the HIP runtime
# of some ROCm releases still reports 64 KB: lightseekorg/tokenspeed PR #119 "Correct gfx950 LDS
# size to 160 KB"). For AMD, a workgroup of <= 4 waves puts one wave on each SIMD, so each lane can
# have all 512 registers.
_AMD_VGPRS = 512
KNOWN_GPUS = {
    "sm_90": GpuLimits("sm_90", "cuda", 32, 232448, 65536, 255),
    "gfx942": GpuLimits("gfx942", "hip", 64, 64 * 1024, _AMD_VGPRS * 64 * 4, _AMD_VGPRS),
    "gfx950": GpuLimits("gfx950", "hip", 64, 160 * 1024, _AMD_VGPRS * 64 * 4, _AMD_VGPRS),
}


def gpu_limits(arch_or_props) -> GpuLimits:
    """``GpuLimits`` for an architecture name ("sm_90", "gfx950", or a ROCm ``gcnArchName`` such as
    "gfx942:sramecc+:xnack-") or a ``torch.cuda.get_device_properties(...)`` object.

    On CUDA the shared memory and registers come from the properties (``shared_memory_per_block_optin``,
    ``regs_per_multiprocessor``); on ROCm the LDS size is taken from the architecture (64 KB on gfx942,
    160 KB on gfx950) because the properties have reported 64 KB for gfx950, and from
    ``shared_memory_per_block`` only for an architecture not in the table.
    """
    if isinstance(arch_or_props, str):
        name = arch_or_props.split(":")[0].strip().lower()
        if name in KNOWN_GPUS:
            return KNOWN_GPUS[name]
        if name.startswith("sm_") and name[3:].isdigit():  # another NVIDIA part: Hopper's limits are its ceiling
            return GpuLimits(name, "cuda", 32, 48 * 1024 if int(name[3:]) < 70 else 99 * 1024, 65536, 255)
        if name.startswith("gfx"):  # another AMD part: the smallest LDS of the table
            return GpuLimits(name, "hip", 64, 64 * 1024, _AMD_VGPRS * 64 * 4, _AMD_VGPRS)
        raise ValueError(f"unknown GPU architecture {arch_or_props!r}: expected sm_NN, gfxNNN or device properties")
    props = arch_or_props
    gcn = str(getattr(props, "gcnArchName", "") or "")
    if gcn.startswith("gfx"):
        name = gcn.split(":")[0]
        if name in KNOWN_GPUS:
            return KNOWN_GPUS[name]
        lds = int(getattr(props, "shared_memory_per_block", 0) or 64 * 1024)
        warp = int(getattr(props, "warp_size", 0) or 64)
        return GpuLimits(name, "hip", warp, lds, _AMD_VGPRS * warp * 4, _AMD_VGPRS)
    major, minor = getattr(props, "major", None), getattr(props, "minor", None)
    if major is None or minor is None:
        raise ValueError(f"device properties without a compute capability or gcnArchName: {props!r}")
    name = f"sm_{major}{minor}"
    base = KNOWN_GPUS.get(name) or gpu_limits(name)
    shared = int(getattr(props, "shared_memory_per_block_optin", 0) or base.shared_bytes)
    regs = min(int(getattr(props, "regs_per_multiprocessor", 0) or base.regs_per_program), 65536)
    warp = int(getattr(props, "warp_size", 0) or 32)
    return GpuLimits(name, "cuda", warp, shared, regs, 255)


@dataclass(frozen=True)
class MLALaunchParams:
    """The decode kernel's tile for one architecture and model shape.

    ``shared_bytes`` and ``regs_per_thread`` are the estimates the choice was made on (see
    ``_estimate``); ``fits`` is False only when even the smallest tile exceeds them.
    """

    arch: str
    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    shared_bytes: int
    regs_per_thread: int
    fits: bool = True

    def head_blocks(self, num_heads: int) -> int:
        """Programs per sequence and split along the heads: how many times the latent cache is read."""
        return triton.cdiv(num_heads, self.block_h)


def _estimate(limits: GpuLimits, block_h, block_n, warps, stages, block_r, block_p, nbytes):
    """(shared bytes, 32-bit registers per thread) of one program, as triton 3.9 allocates them.

    Fitted to the compiler's own reports (``metadata.shared``; ptxas ``-v``; the AMDGPU ``NumVgprs``,
    ``NumAgprs`` and ``ScratchSize``) for r = 512, rope = 64, bf16, and checked for every chosen tile
    by tests/kernels/triton/test_compile_targets.py:
    - every program holds the fp32 accumulator [BLOCK_H, BLOCK_R] and the query [BLOCK_H, width]
      spread over its threads;
    - CUDA (sm_90, wgmma): the key tile is staged in shared memory (with the query, and room for the
      second operand layout, hence 2 x BLOCK_H rows), each thread also holds its share of the loaded
      tile and of the [BLOCK_H, BLOCK_N] scores, plus about 72 registers of addresses and softmax state;
    - AMD (MFMA): the waves split the heads, so every wave holds the whole [width, BLOCK_N] key tile
      as the score product's operand - about three copies per lane (the loaded tile and two operand
      layouts); LDS holds the pipelined key tiles and the probabilities, or the largest operand
      conversion ([max(BLOCK_H, BLOCK_N), BLOCK_R]), whichever is larger.
    """
    width = block_r + block_p
    threads = warps * limits.warp_size
    acc_q = block_h * (block_r * 4 + width * nbytes) / 4 / threads
    if limits.backend == "cuda":
        regs = acc_q + block_n * width * nbytes / 4 / threads + 2 * block_h * block_n / threads + 72
        shared = (block_n + 2 * block_h) * width * nbytes
    else:
        regs = acc_q + 3 * block_n * width * nbytes / 4 / limits.warp_size + 20
        shared = max(
            stages * block_n * width * nbytes + block_h * block_n * nbytes, max(block_h, block_n) * block_r * nbytes
        )
    return int(shared), int(regs + 0.999)


def mla_decode_launch_params(
    arch_or_props, num_heads: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype
) -> MLALaunchParams:
    """The decode tile for a GPU (name or ``torch.cuda.get_device_properties`` object, see ``gpu_limits``).

    Heads per program: all of them (rounded up to a power of two) when the tile fits the program's
    registers and shared memory / LDS, so the latent cache is read once per sequence; else the
    largest power of two that fits (at least 16, the smallest ``tl.dot`` M). Then the longest key
    tile (32, else 16 tokens) and, on CUDA, 8 warps before 4. Pipelining: 2 stages on CUDA and on
    gfx950 (async copies), 1 on other AMD parts (as vLLM's Triton MLA on ROCm,
    ``vllm/v1/attention/ops/triton_decode_attention.py``).
    Kimi K2 (64 heads, r 512, rope 64, bf16): H200 32 heads x 32 tokens, 8 warps (the cache read
    twice, not four times); MI300X and MI355X 64 heads x 16 tokens, 4 waves (read once).
    """
    if num_heads < 1 or kv_lora_rank < 1 or rope_dim < 0:
        raise ValueError(
            f"num_heads ({num_heads}) and kv_lora_rank ({kv_lora_rank}) must be positive, "
            f"rope_dim ({rope_dim}) not negative"
        )
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be fp16/bf16/fp32, got {dtype}")
    limits = gpu_limits(arch_or_props)
    nbytes = torch.empty((), dtype=dtype).element_size()
    block_r, block_p = triton.next_power_of_2(kv_lora_rank), max(16, triton.next_power_of_2(rope_dim))
    stages = 2 if limits.backend == "cuda" or limits.arch == "gfx950" else 1
    warps_options = (8, 4) if limits.backend == "cuda" else (4,)
    block_h = max(16, triton.next_power_of_2(num_heads))
    candidates = []
    while block_h >= 16:
        for block_n in (32, 16):
            for warps in warps_options:
                candidates.append((block_h, block_n, warps))
        block_h //= 2
    for block_h, block_n, warps in candidates:
        shared, regs = _estimate(limits, block_h, block_n, warps, stages, block_r, block_p, nbytes)
        cap = min(limits.max_regs_per_thread, limits.regs_per_program // (warps * limits.warp_size))
        if shared <= limits.shared_bytes and regs <= cap:
            return MLALaunchParams(limits.arch, block_h, block_n, warps, stages, shared, regs)
    block_h, block_n, warps = candidates[-1]
    shared, regs = _estimate(limits, block_h, block_n, warps, stages, block_r, block_p, nbytes)
    return MLALaunchParams(limits.arch, block_h, block_n, warps, stages, shared, regs, fits=False)


def _interpreter_params(num_heads: int) -> MLALaunchParams:
    # Under TRITON_INTERPRET=1 (CPU tensors) nothing spills: all heads in one block as on a large GPU,
    # short key tiles to keep the interpreted loop cheap.
    return MLALaunchParams("interpreter", max(16, triton.next_power_of_2(num_heads)), 16, 4, 1, 0, 0)


@functools.lru_cache(maxsize=None)
def _device_params(index: int, num_heads: int, r: int, rope: int, dtype: torch.dtype) -> MLALaunchParams:
    return mla_decode_launch_params(torch.cuda.get_device_properties(index), num_heads, r, rope, dtype)


def _num_splits(batch: int, head_blocks: int, max_context_len: int, block_n: int, block_h: int = 16) -> int:
    # About 256 programs of 16 heads' worth (4096 head rows) to fill a large GPU: a program of more
    # heads counts as several, which keeps the fp32 partial sums [B, splits, H, r] within the bound
    # engine/plan/activation_reserve.py reserves for them. No more splits than the longest context
    # has minimum-length splits (the kernel sizes each sequence's splits from its own length).
    want = triton.cdiv(256 * 16, batch * head_blocks * block_h)
    return max(1, min(want, triton.cdiv(max_context_len, _MIN_TILES * block_n)))


def mla_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    block_size: int,
    kv_lora_rank: int,
    scale: float,
    params: MLALaunchParams | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode: q [B, H, r + rope], cache [slots, r + rope] (latent then rope key),
    block_tables [B, max_blocks] int32, context_lens [B] int32 (>= 1, <= max_context_len) -> [B, H, r]
    in q.dtype. ``params`` overrides the tile chosen for the device (tests run each architecture's
    tile under the interpreter)."""
    if q.dim() != 3 or q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q must be a 3-D fp16/bf16/fp32 tensor [B, H, r + rope], got {tuple(q.shape)} {q.dtype}")
    b, h, width = q.shape
    r = kv_lora_rank
    if not 0 < r < width:
        raise ValueError(f"kv_lora_rank {r} must be positive and below the query width {width}")
    if cache.dim() != 2 or cache.shape[1] != width or cache.dtype not in FLOAT_DTYPES:
        raise ValueError(f"cache must be fp16/bf16/fp32 [slots, {width}], got {tuple(cache.shape)} {cache.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != b or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be int32 [B={b}, max_blocks], got {tuple(block_tables.shape)} {block_tables.dtype}"
        )
    if tuple(context_lens.shape) != (b,) or context_lens.dtype != torch.int32:
        raise ValueError(f"context_lens must be int32 [B={b}], got {tuple(context_lens.shape)} {context_lens.dtype}")
    if block_size <= 0 or max_context_len <= 0:
        raise ValueError(f"block_size ({block_size}) and max_context_len ({max_context_len}) must be positive")
    if q.stride(-1) != 1 or cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("q, cache and block_tables must be contiguous in their last dimension")
    check_device(q, cache, block_tables, context_lens)
    if params is None:
        if q.device.type == "cuda":
            params = _device_params(
                q.device.index if q.device.index is not None else torch.cuda.current_device(), h, r, width - r, q.dtype
            )
        else:
            params = _interpreter_params(h)
    head_blocks = params.head_blocks(h)
    splits = _num_splits(b, head_blocks, max_context_len, params.block_n, params.block_h)
    acc = torch.empty((b, splits, h, r), dtype=torch.float32, device=q.device)
    ml = torch.empty((b, splits, h, 2), dtype=torch.float32, device=q.device)  # running max, sum
    _mla_decode_kernel[(b, head_blocks, splits)](
        q,
        cache,
        block_tables,
        context_lens,
        acc,
        ml,
        h,
        splits,
        block_size,
        scale,
        q.stride(0),
        q.stride(1),
        cache.stride(0),
        block_tables.stride(0),
        acc.stride(0),
        acc.stride(1),
        acc.stride(2),
        ml.stride(0),
        ml.stride(1),
        ml.stride(2),
        R=r,
        P=width - r,
        BLOCK_R=triton.next_power_of_2(r),
        BLOCK_P=max(16, triton.next_power_of_2(width - r)),
        BLOCK_H=params.block_h,
        BLOCK_N=params.block_n,
        MIN_TILES=_MIN_TILES,
        num_warps=params.num_warps,
        num_stages=params.num_stages,
    )
    out = torch.empty((b, h, r), dtype=q.dtype, device=q.device)
    _mla_merge_kernel[(b, triton.cdiv(h, _MERGE_BLOCK_H))](
        acc,
        ml,
        out,
        h,
        splits,
        acc.stride(0),
        acc.stride(1),
        acc.stride(2),
        ml.stride(0),
        ml.stride(1),
        ml.stride(2),
        out.stride(0),
        out.stride(1),
        R=r,
        BLOCK_R=triton.next_power_of_2(r),
        BLOCK_H=_MERGE_BLOCK_H,
    )
    return out
