"""Kernel checks, part 1: the fused small ops and the MLA decode, each Triton kernel against its
PyTorch reference (``kernels.reference``) at Kimi K2's shapes on a GPU (hidden 7168, 64 query
heads, latent 512 + rope 64, 384 experts top-8), toy shapes in the CPU self-test.

Each check returns Rows: max relative error, the kernel's and the reference's best time, and the
bandwidth the kernel reaches where it is a memory-bound op (bytes it must read and write / time).
"""

from __future__ import annotations

import torch

from benchmarks.gpucheck.common import FAIL, PASS, Row, best_ms, rel_err, status_for
from kimitui.kernels import reference as ref

S = "kernels"


def _timed(mode, fn, reference, nbytes=None, repeats=None):
    """(kernel ms, reference ms, GB/s) with fewer repeats under the (slow) interpreter."""
    reps = repeats or mode.pick(20, 1)
    fast = best_ms(fn, mode.device, repeats=reps, warmup=mode.pick(2, 0))
    slow = best_ms(reference, mode.device, repeats=mode.pick(3, 1), warmup=mode.pick(1, 0))
    gbps = nbytes / (fast * 1e-3) / 1e9 if nbytes else None
    return fast, slow, gbps


def _row(mode, name, err, times, note=""):
    fast, slow, gbps = times
    return Row(S, name, status_for(err, mode.tolerance), err, fast, slow, gbps, note=note)


def rms_norm_rows(mode) -> list[Row]:
    from kimitui.kernels.triton.rms_norm import rms_norm

    h = mode.pick(7168, 96)
    rows = []
    for t in mode.pick((1, 64, 2048), (3,)):
        x = torch.randn(t, h, device=mode.device, dtype=mode.dtype)
        w = (torch.rand(h, device=mode.device) + 0.5).to(mode.dtype)
        err = rel_err(rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
        times = _timed(mode, lambda: rms_norm(x, w, 1e-6), lambda: ref.rms_norm(x, w, 1e-6), 2 * x.nbytes)
        rows.append(_row(mode, f"rms_norm T={t} H={h}", err, times))
    return rows


def add_rms_norm_rows(mode) -> list[Row]:
    from kimitui.kernels.triton.fused_add_rms_norm import fused_add_rms_norm

    h = mode.pick(7168, 96)
    rows = []
    for t in mode.pick((1, 64, 2048), (3,)):
        x, r = (torch.randn(t, h, device=mode.device, dtype=mode.dtype) for _ in range(2))
        w = (torch.rand(h, device=mode.device) + 0.5).to(mode.dtype)
        y, s = fused_add_rms_norm(x, r, w, 1e-6)
        want_y, want_s = ref.fused_add_rms_norm(x, r, w, 1e-6)
        err = max(rel_err(y, want_y), rel_err(s, want_s))
        times = _timed(
            mode, lambda: fused_add_rms_norm(x, r, w, 1e-6), lambda: ref.fused_add_rms_norm(x, r, w, 1e-6), 4 * x.nbytes
        )
        rows.append(_row(mode, f"add+rms_norm T={t} H={h}", err, times))
    return rows


def _rope_tables(mode, positions: int, half: int):
    angles = torch.rand(positions, half, device=mode.device) * 6.2832
    return angles.cos(), angles.sin()


def rope_rows(mode) -> list[Row]:
    from kimitui.kernels.triton.rope_fused import rope_mla

    heads, nope, rope, r = mode.pick((64, 128, 64, 512), (4, 16, 16, 16))
    cos, sin = _rope_tables(mode, mode.pick(8192, 64), rope // 2)
    rows = []
    for t in mode.pick((1, 64, 2048), (3,)):
        q = torch.randn(t, heads, nope + rope, device=mode.device, dtype=mode.dtype)
        kv = torch.randn(t, r + rope, device=mode.device, dtype=mode.dtype)
        pos = torch.randint(0, cos.shape[0], (t,), device=mode.device)
        q_pe, k_pe = q[..., nope:], kv[:, r:]  # strided views, as MLA hands them over
        got_q, got_k = rope_mla(q_pe, k_pe, cos, sin, pos)
        want_q, want_k = ref.rope_mla(q_pe, k_pe, cos, sin, pos)
        err = max(rel_err(got_q, want_q), rel_err(got_k, want_k))
        nbytes = 2 * (q_pe.numel() + k_pe.numel()) * q.element_size()
        times = _timed(
            mode, lambda: rope_mla(q_pe, k_pe, cos, sin, pos), lambda: ref.rope_mla(q_pe, k_pe, cos, sin, pos), nbytes
        )
        rows.append(_row(mode, f"mla query+key rope T={t} heads={heads}", err, times))
    return rows


def cache_write_rows(mode) -> list[Row]:
    from kimitui.kernels.triton.mla_cache_write import mla_cache_write

    r, rope, block = mode.pick((512, 64, 16), (16, 16, 16))
    cos, sin = _rope_tables(mode, mode.pick(8192, 64), rope // 2)
    rows = []
    for t in mode.pick((1, 64, 2048), (3,)):
        blocks = mode.pick(4096, 4)
        kv = torch.randn(t, 7 + r + rope, device=mode.device, dtype=mode.dtype)[:, 7:]  # a strided view
        w = (torch.rand(r, device=mode.device) + 0.5).to(mode.dtype)
        pos = torch.randint(0, cos.shape[0], (t,), device=mode.device)
        slots = torch.randperm(blocks * block, device=mode.device)[:t]
        got = torch.zeros(blocks, block, r + rope, device=mode.device, dtype=mode.dtype)
        want = got.clone()
        mla_cache_write(kv, w, 1e-6, cos, sin, pos, slots, got)
        ref.mla_cache_write(kv, w, 1e-6, cos, sin, pos, slots, want)
        err = rel_err(got, want)
        times = _timed(
            mode,
            lambda: mla_cache_write(kv, w, 1e-6, cos, sin, pos, slots, got),
            lambda: ref.mla_cache_write(kv, w, 1e-6, cos, sin, pos, slots, want),
            2 * t * (r + rope) * 2,
        )
        rows.append(_row(mode, f"mla cache write T={t}", err, times))
    return rows


def router_rows(mode) -> list[Row]:
    from kimitui.kernels.triton.moe_router import moe_route_logits

    rows = []
    # K2 (384 experts, no groups, top-8) and DeepSeek-V3's grouped top-k (256 in 8 groups, 4 kept)
    cases = mode.pick(((384, 8, 1, 1), (256, 8, 8, 4)), ((16, 4, 1, 1), (16, 4, 4, 2)))
    for e, k, groups, keep in cases:
        for t in mode.pick((1, 64, 2048), (5,)):
            logits = torch.randn(t, e, device=mode.device)
            bias = torch.randn(e, device=mode.device) * 0.1
            args = (logits, bias, k, groups, keep, "sigmoid", True, 2.827)
            ids, w = moe_route_logits(*args)
            want_ids, want_w = ref.moe_route_logits(*args)
            same = torch.equal(ids.long(), want_ids)
            err = rel_err(w, want_w)
            times = _timed(mode, lambda: moe_route_logits(*args), lambda: ref.moe_route_logits(*args))
            row = _row(
                mode,
                f"router E={e} top-{k} groups {keep}/{groups} T={t}",
                err,
                times,
                "" if same else "expert ids differ from the reference",
            )
            row.status = row.status if same else FAIL
            rows.append(row)
    return rows


def align_rows(mode) -> list[Row]:
    from kimitui.kernels.triton.moe_align import moe_align_block_size

    e, k = mode.pick((384, 8), (8, 2))
    rows = []
    for t, block in mode.pick(((1, 16), (64, 64), (256, 64)), ((5, 4),)):
        ids = torch.randint(0, e + 1, (t, k), device=mode.device)  # id e: a pair held elsewhere
        got = moe_align_block_size(ids, block, e)
        want = ref.moe_align_block_size(ids, block, e)
        used = int(want[2].item())
        same = (
            torch.equal(got[2], want[2])
            and torch.equal(got[0][:used], want[0][:used])
            and torch.equal(got[1][: used // block], want[1][: used // block])
        )
        times = _timed(
            mode,
            lambda: moe_align_block_size(ids, block, e),
            lambda: ref.moe_align_block_size(ids, block, e),
            repeats=mode.pick(20, 1),
        )
        rows.append(
            Row(
                S,
                f"moe_align E={e} top-{k} T={t} block {block}",
                PASS if same else FAIL,
                0.0 if same else None,
                times[0],
                times[1],
                note="" if same else "sorted ids / expert ids differ",
            )
        )
    return rows


def mla_decode_rows(mode) -> list[Row]:
    from kimitui.kernels.triton.mla_decode import mla_decode

    r, rope, heads, block = mode.pick((512, 64, 64, 16), (16, 16, 4, 16))
    rows = []
    for batch, ctx in mode.pick(((1, 4096), (64, 4096), (64, 16384), (1, 131072)), ((2, 40),)):
        blocks = -(-ctx // block)
        table = torch.randperm(batch * blocks, device=mode.device).view(batch, blocks).to(torch.int32)
        cache = torch.randn(batch * blocks * block, r + rope, device=mode.device, dtype=mode.dtype)
        q = torch.randn(batch, heads, r + rope, device=mode.device, dtype=mode.dtype)
        lens = torch.randint(max(1, ctx // 2), ctx + 1, (batch,), device=mode.device, dtype=torch.int32)
        lens[0] = ctx
        args = (q, cache, table, lens, ctx, block, r, (192**-0.5))
        err = rel_err(mla_decode(*args), ref.mla_decode_reference(*args))
        read = int(lens.sum().item()) * (r + rope) * cache.element_size()
        times = _timed(mode, lambda: mla_decode(*args), lambda: ref.mla_decode_reference(*args), read)
        rows.append(_row(mode, f"mla decode (split + merge) B={batch} ctx={ctx} heads={heads}", err, times))
    return rows


CHECKS = [
    ("rms_norm", rms_norm_rows),
    ("add+rms_norm", add_rms_norm_rows),
    ("mla rope", rope_rows),
    ("mla cache write", cache_write_rows),
    ("router", router_rows),
    ("moe_align", align_rows),
    ("mla decode", mla_decode_rows),
]
