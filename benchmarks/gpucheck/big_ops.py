"""Kernel checks, part 2: the fused MoE in every expert format, the quantised GEMMs, and KDA.

Shapes on a GPU: Kimi K2's routed experts (hidden 7168, expert width 2048, 384 experts, top-8) for
INT4 (K2.5 / K2.6), block FP8 (K2-Instruct) and bf16 (K2 bf16); K3's latent MoE (3584 in, 3072
wide, 896 experts, top-16) for MXFP4; K3's KDA (96 heads of 128). Weights are random bytes in each
format (quantising 384 real experts would take longer than the check), scaled so the products stay
in range. The references loop over experts in PyTorch: their times say what the kernels save.
KDA on a GPU is fla-core's Triton kernels (``kernels/triton/kda_fla.py``) against the PyTorch forms of
``kernels/kda.py`` in fp32; fla-core does not run on a CPU, so the self-test reports it skipped.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch

from benchmarks.gpucheck.common import FAIL, SKIP, Row, best_ms, rel_err, status_for, sync
from kimitui.kernels import reference as ref

S = "kernels"


def _max_err(got, want) -> float:
    if isinstance(got, torch.Tensor):
        return rel_err(got, want)
    return max(rel_err(a, b) for a, b in zip(got, want))  # every output of a tuple (KDA: output and state)


def _check(mode, name, fn, reference, nbytes=None, note="") -> Row:
    """The kernel's best time and output against the reference's, which runs once (a Python loop
    over experts: its single time, first-call costs included, is what the kernel replaces)."""
    sync(mode.device)
    t = time.perf_counter()
    want = reference()
    sync(mode.device)
    slow = (time.perf_counter() - t) * 1e3
    err = _max_err(fn(), want)
    fast = best_ms(fn, mode.device, repeats=mode.pick(10, 1), warmup=mode.pick(1, 0))
    gbps = nbytes / (fast * 1e-3) / 1e9 if nbytes else None
    return Row(S, name, status_for(err, mode.tolerance), err, fast, slow, gbps, note=note)


def _int4(mode, *shape):
    """Random INT4 words [..., N, K/8] and bf16 group scales [..., N, K/32] (weights ~ 1/sqrt(K))."""
    n, k = shape[-2], shape[-1]
    packed = torch.randint(-(2**31), 2**31 - 1, (*shape[:-1], k // 8), dtype=torch.int32, device=mode.device)
    scale = (torch.rand(*shape[:-1], k // 32, device=mode.device) + 0.5) / (4.6 * k**0.5)
    return packed, scale.to(torch.bfloat16)


def _mxfp4(mode, *shape):
    """Random E2M1 codes [..., N, K/2] and E8M0 scales [..., N, K/32] near 2^-8 (weights ~ 0.01)."""
    k = shape[-1]
    packed = torch.randint(0, 256, (*shape[:-1], k // 2), dtype=torch.uint8, device=mode.device)
    scale = torch.randint(118, 121, (*shape[:-1], k // 32), dtype=torch.uint8, device=mode.device)
    return packed, scale


def _chunked(mode, shape, dtype, scale: float = 1.0):
    """randn(shape) * scale in ``dtype``, made a few experts at a time: a whole fp32 stack of 384
    K2 experts would be a 45 GB temporary."""
    out = torch.empty(shape, dtype=dtype, device=mode.device)
    for i in range(0, shape[0], 16):
        part = torch.randn(out[i : i + 16].shape, device=mode.device).mul_(scale)
        out[i : i + 16] = part.clamp_(-4, 4) if dtype == torch.float8_e4m3fn else part
    return out


def _fp8(mode, *shape, block=(128, 128)):
    n, k = shape[-2], shape[-1]
    w = _chunked(mode, shape, torch.float8_e4m3fn)
    nb, kb = -(-n // block[0]), -(-k // block[1])
    scale_inv = (torch.rand(*shape[:-2], nb, kb, device=mode.device) + 0.5) / (2 * k**0.5)
    return w, scale_inv


def _experts_that_fit(mode, wanted: int, bytes_per_expert: float) -> int:
    """Kimi's expert count, or as many as half the free device memory holds (a smaller GPU than the
    H200 this was sized for: the kernels' per-expert work is the same, only fewer experts exist)."""
    if mode.device.type != "cuda":
        return wanted
    free, _ = torch.cuda.mem_get_info(mode.device)
    return max(8, min(wanted, int(free * 0.5 / bytes_per_expert)))


def _routing(mode, t, e, k):
    weights, ids = torch.rand(t, e, device=mode.device).topk(k, dim=-1)
    return ids, weights / weights.sum(-1, keepdim=True)


def _touched(ids, e) -> int:
    return int(torch.unique(ids[ids < e]).numel())


def moe_rows(mode) -> Iterator[Row]:
    from kimitui.kernels.triton import fused_moe as fm

    e, d, inter, k = mode.pick((384, 7168, 2048, 8), (8, 64, 32, 2))
    e = _experts_that_fit(mode, e, 3 * 2 * inter * d * mode.dtype.itemsize)  # the bf16 stack is the largest
    shape = f"E={e} D={d} I={inter} top-{k}"
    tokens = mode.pick((1, 64, 2048), (5,))
    # INT4 (K2.5 / K2.6): the format a single-node Kimi K2 runs
    w13, s13 = _int4(mode, e, 2 * inter, d)
    w2, s2 = _int4(mode, e, d, inter)
    per_expert = sum(t[0].nbytes + t[1].nbytes for t in ((w13, s13), (w2, s2))) / e
    for t in tokens:
        x = torch.randn(t, d, device=mode.device, dtype=mode.dtype)
        ids, tw = _routing(mode, t, e, k)
        args = (x, ids, tw, w13, s13, w2, s2)
        yield _check(
            mode,
            f"fused MoE INT4 {shape} T={t}",
            lambda: fm.fused_moe_w4a16(*args),
            lambda: ref.moe_experts_reference_w4a16(*args),
            _touched(ids, e) * per_expert,
        )
    del w13, s13, w2, s2
    # block FP8 (K2-Instruct), a pair held elsewhere in each batch (id == E)
    block = mode.pick((128, 128), (16, 16))  # the toy expert width is below one 128-row block
    w13, s13 = _fp8(mode, e, 2 * inter, d, block=block)
    w2, s2 = _fp8(mode, e, d, inter, block=block)
    per_expert = sum(t.nbytes for t in (w13, s13, w2, s2)) / e
    for t in tokens:
        x = torch.randn(t, d, device=mode.device, dtype=mode.dtype)
        ids, tw = _routing(mode, t, e, k)
        ids[0, -1] = e
        args = (x, ids, tw, w13, s13, w2, s2, block)
        yield _check(
            mode,
            f"fused MoE FP8 {shape} T={t}",
            lambda: fm.fused_moe_fp8(*args),
            lambda: ref.moe_experts_reference_fp8(*args),
            _touched(ids, e) * per_expert,
            "one pair held elsewhere",
        )
    del w13, s13, w2, s2
    # bf16 experts (K2 bf16)
    w13 = _chunked(mode, (e, 2 * inter, d), mode.dtype, d**-0.5)
    w2 = _chunked(mode, (e, d, inter), mode.dtype, inter**-0.5)
    for t in mode.pick((1, 64), (5,)):
        x = torch.randn(t, d, device=mode.device, dtype=mode.dtype)
        ids, tw = _routing(mode, t, e, k)
        args = (x, ids, tw, w13, w2)
        yield _check(
            mode,
            f"fused MoE {str(mode.dtype)[6:]} {shape} T={t}",
            lambda: fm.fused_moe(*args),
            lambda: ref.moe_experts_reference(*args),
            _touched(ids, e) * (w13[0].nbytes + w2[0].nbytes),
        )


def moe_mxfp4_rows(mode) -> Iterator[Row]:
    from kimitui.kernels.triton import fused_moe as fm

    e, d, inter, k = mode.pick((896, 3584, 3072, 16), (8, 64, 32, 2))  # K3's latent MoE
    e = _experts_that_fit(mode, e, 3 * inter * d * 0.6)  # 4-bit codes + a scale byte per 32
    w13, s13 = _mxfp4(mode, e, 2 * inter, d)
    w2, s2 = _mxfp4(mode, e, d, inter)
    per_expert = sum(t.nbytes for t in (w13, s13, w2, s2)) / e
    for t in mode.pick((1, 64, 2048), (5,)):
        x = torch.randn(t, d, device=mode.device, dtype=mode.dtype)
        ids, tw = _routing(mode, t, e, k)
        args = (x, ids, tw, w13, s13, w2, s2)
        yield _check(
            mode,
            f"fused MoE MXFP4 E={e} D={d} I={inter} top-{k} T={t}",
            lambda: fm.fused_moe_mxfp4(*args),
            lambda: ref.moe_experts_reference_mxfp4(*args),
            _touched(ids, e) * per_expert,
        )


def gemm_rows(mode) -> Iterator[Row]:
    from kimitui.kernels.triton.gemm.fp8_block import fp8_block_gemm
    from kimitui.kernels.triton.gemm.mxfp4 import mxfp4_gemm
    from kimitui.kernels.triton.gemm.w4a16 import w4a16_gemm

    # FP8: K2-Instruct's dense MLP gate+up [2 x 18432, 7168]
    n, kk = mode.pick((36864, 7168), (48, 64))
    w, s = _fp8(mode, n, kk)
    for m in mode.pick((1, 64, 2048), (3,)):
        x = torch.randn(m, kk, device=mode.device, dtype=mode.dtype)
        yield _check(
            mode,
            f"FP8 block GEMM M={m} N={n} K={kk}",
            lambda: fp8_block_gemm(x, w, s),
            lambda: ref.linear_fp8_block(x, w, s),
            w.nbytes + s.nbytes,
        )
    # INT4 w4a16: an expert's gate+up [2 x 2048, 7168]
    n, kk = mode.pick((4096, 7168), (48, 64))
    p, s = _int4(mode, n, kk)
    for m in mode.pick((1, 64), (3,)):
        x = torch.randn(m, kk, device=mode.device, dtype=mode.dtype)
        yield _check(
            mode,
            f"w4a16 GEMM M={m} N={n} K={kk}",
            lambda: w4a16_gemm(x, p, s),
            lambda: ref.linear_w4a16(x, p, s, kk),
            p.nbytes + s.nbytes,
        )
    # MXFP4: a K3 latent expert's gate+up [2 x 3072, 3584]
    n, kk = mode.pick((6144, 3584), (48, 64))
    p, s = _mxfp4(mode, n, kk)
    for m in mode.pick((1, 64), (3,)):
        x = torch.randn(m, kk, device=mode.device, dtype=mode.dtype)
        yield _check(
            mode,
            f"MXFP4 GEMM M={m} N={n} K={kk}",
            lambda: mxfp4_gemm(x, p, s),
            lambda: ref.linear_mxfp4(x, p, s),
            p.nbytes + s.nbytes,
        )


@contextmanager
def _one_split():
    """The GEMM wrappers launch without split-K inside (the grid before issue 38: N/64 programs)."""
    from kimitui.kernels.triton import split_k

    target = split_k.TARGET_PROGRAMS
    split_k.TARGET_PROGRAMS = 0
    try:
        yield
    finally:
        split_k.TARGET_PROGRAMS = target


def gemv_split_rows(mode) -> Iterator[Row]:
    """Decode GEMVs at Kimi's narrow projections, split-K (the wrappers' plan) against one K range
    per tile, back to back: K2's kv_a_proj_with_mqa [576, 7168] (9 tiles of 64 columns) and q_a_proj
    [1536, 7168] in block FP8, K3's MXFP4 expert w2 [3584, 3072], an INT4 [576, 7168]."""
    from kimitui.kernels.triton.gemm.fp8_block import fp8_block_gemm
    from kimitui.kernels.triton.gemm.mxfp4 import mxfp4_gemm
    from kimitui.kernels.triton.gemm.w4a16 import w4a16_gemm
    from kimitui.kernels.triton.split_k import plan_gemm

    cases = []
    for n, kk in mode.pick(((576, 7168), (1536, 7168)), ((40, 256),)):
        w, s = _fp8(mode, n, kk)
        cases.append(
            (
                f"FP8 GEMV N={n} K={kk}",
                n,
                kk,
                lambda x, w=w, s=s: fp8_block_gemm(x, w, s),
                lambda x, w=w, s=s: ref.linear_fp8_block(x, w, s),
                w.nbytes + s.nbytes,
            )
        )
    n, kk = mode.pick((576, 7168), (40, 256))
    p4, s4 = _int4(mode, n, kk)
    cases.append(
        (
            f"w4a16 GEMV N={n} K={kk}",
            n,
            kk,
            lambda x: w4a16_gemm(x, p4, s4),
            lambda x: ref.linear_w4a16(x, p4, s4, kk),
            p4.nbytes + s4.nbytes,
        )
    )
    n, kk = mode.pick((3584, 3072), (40, 256))
    pm, sm = _mxfp4(mode, n, kk)
    cases.append(
        (
            f"MXFP4 GEMV N={n} K={kk}",
            n,
            kk,
            lambda x: mxfp4_gemm(x, pm, sm),
            lambda x: ref.linear_mxfp4(x, pm, sm),
            pm.nbytes + sm.nbytes,
        )
    )
    for name, n, kk, fn, reference, nbytes in cases:
        for m in mode.pick((1, 16), (3,)):
            x = torch.randn(m, kk, device=mode.device, dtype=mode.dtype)
            plan = plan_gemm(m, n, kk)
            with _one_split():
                before = _check(
                    mode,
                    f"{name} M={m} one K range ({plan.grid[1]} programs)",
                    lambda: fn(x),
                    lambda: reference(x),
                    nbytes,
                )
            after = _check(
                mode, f"{name} M={m} split-K ({plan.programs} programs)", lambda: fn(x), lambda: reference(x), nbytes
            )
            if before.ms and after.ms:
                after = replace(after, note=f"{before.ms / after.ms:.2f}x the speed of one K range")
            yield before
            yield after


def kda_rows(mode) -> Iterator[Row]:
    from kimitui.kernels import kda
    from kimitui.kernels.triton import kda_fla

    if mode.device.type != "cuda":
        yield Row(S, "KDA fla-core vs kernels/kda.py", SKIP, note="fla-core's kernels need a CUDA/ROCm device")
        return
    if not kda_fla.available():
        yield Row(
            S,
            "KDA fla-core vs kernels/kda.py",
            FAIL,
            note=f"{kda_fla.unavailable_reason()}: K3 cannot run on this GPU (see the env rows)",
        )
        return
    dev, dt = mode.device, mode.dtype
    h, dk = 96, 128  # K3's KDA heads
    lens = [1000, 3000, 17]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=dev)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, dk, device=dev).to(dt) for _ in range(3))
    g = -5.0 * torch.sigmoid(torch.randn(t, h, dk, device=dev))  # K3's bounded log-decay, fp32
    beta = torch.rand(t, h, device=dev)
    h0 = torch.randn(len(lens), h, dk, dk, device=dev) * 0.1
    scale = dk**-0.5
    # the reference gets the same (bf16-valued) inputs in fp32: what differs is the kernels' arithmetic
    yield _check(
        mode,
        f"KDA chunk prefill fla vs torch T={t} ({len(lens)} seqs) H={h}",
        lambda: kda_fla.chunk_kda(q, k, v, g, beta, h0, cu, scale),
        lambda: kda.chunk_kda(q.float(), k.float(), v.float(), g, beta, h0, cu, scale),
    )
    n = 64
    pool = torch.randn(2 * n, h, dk, dk, device=dev) * 0.1
    slots = torch.randperm(2 * n, device=dev)[:n]
    args = (q[:n], k[:n], v[:n], g[:n], beta[:n])

    def run(fn, inputs):
        state = pool.clone()  # both update the pool in place: each call starts from the same one
        return fn(*inputs, state, slots, scale), state

    yield _check(
        mode,
        f"KDA recurrent decode fla vs torch N={n} H={h}",
        lambda: run(kda_fla.recurrent_kda, args),
        lambda: run(kda.recurrent_kda, [a.float() for a in args]),
        note="times include a copy of the state pool",
    )
    c = h * dk
    x = torch.randn(t, c, device=dev).to(dt)
    w = torch.randn(c, 4, device=dev) * 0.5
    hist = torch.randn(len(lens), c, 3, device=dev).to(dt)
    yield _check(
        mode,
        f"KDA short conv fla vs torch T={t} C={c}",
        lambda: kda_fla.causal_conv1d(x, w, hist, cu),
        lambda: kda.causal_conv1d(x, w, hist, cu),
        2 * x.nbytes,
    )


CHECKS = [
    ("fused MoE int4/fp8/dense", moe_rows),
    ("fused MoE mxfp4", moe_mxfp4_rows),
    ("quantised GEMMs", gemm_rows),
    ("decode GEMVs, split-K", gemv_split_rows),
    ("KDA", kda_rows),
]
