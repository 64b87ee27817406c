"""Activation memory of one step of full-size Kimi K2 (FP8), K2.6 (INT4) and K3 (MXFP4), the rank
with the most heads of 1 or 6, measured on fake tensors, and checked against the planner's estimate
(engine.offload.activation_reserve): the estimate must cover the measured peak and stay within
1.5x + 64 MiB of it, for a decode step of 64 and prefill chunks of 2048 and 8192 tokens (fresh, over
a long cached context, and 64 short prompts at once).

The model runs under FakeTensorMode on the meta device (no storage), its weights and caches built as
the engine builds them. A TorchDispatchMode counts the bytes of every tensor an op creates until the
last reference to it dies, and keeps the peak. Kernels whose control flow reads tensor values (which
fake tensors do not have), or whose CPU reference allocates what the GPU kernel does not, are
replaced for the run by stand-ins that create what the GPU kernels create:
- routed experts, SiLU: kernels/triton/fused_moe.py's [T*k, I] hidden and fp32 [T*k, D] output;
- routed experts, SiTU (K3): the fused-MoE worst case, every (token, expert) pair at once: the
  gathered rows [T*k, L], the gate/up output [T*k, 2I], the activation [T*k, I], the fp32 output;
- quantised linears (FP8 / INT4 / MXFP4 GEMMs): their output only (the reference dequantises);
- absorbed MLA decode: kernels/triton/mla_decode.py's split-K partial sums and output;
- KDA short conv and chunked recurrence: their outputs plus the per-64-token-chunk states
  [T/64, H, K, V] fp32 and the fp32 w/u rows [T, H, K+V] of the chunked delta rule
  (fla-org/flash-linear-attention, fla/ops/kda/chunk.py); the decode recurrence updates the state
  pool in place (fla's fused_recurrent_kda_fwd);
- MLA prefill attention: a flash kernel's output only (no [H, T, T] score matrix, which the CPU
  reference path does materialise);
- collectives: no-ops (all_gather fills nothing), so tensor-parallel ranks run alone.
"""

from __future__ import annotations

import functools
import types
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import kimitui.engine.layers.mla as mla
from kimitui.engine.config import ModelConfig
from kimitui.engine.layers.attn_metadata import AttentionMetadata, PrefillChunk
from kimitui.engine.loader import build_model, finish_load
from kimitui.engine.parallel.state import ParallelState
from kimitui.engine.plan.activation_reserve import StepShape, step_peak
from kimitui.engine.plan.param_count import compute_dtype
from kimitui.engine.sampling.sampler import SamplingBatch, sample
from kimitui.engine.sampling_params import SamplingParams
from kimitui.kernels.backend import Backend
from kimitui.kernels.triton.mla_decode import _num_splits

CONFIGS = Path(__file__).resolve().parents[2] / "fixtures" / "configs"
BLOCK = 64
GiB, MiB = 2**30, 2**20


class PeakBytes(TorchDispatchMode):
    """Peak bytes of tensors created inside the mode (storages in ``known`` are not counted)."""

    def __init__(self, known: set[int]):
        super().__init__()
        self.known, self.live, self.now, self.peak = known, {}, 0, 0

    def _drop(self, key: int) -> None:
        n, refs = self.live[key]
        if refs > 1:
            self.live[key] = (n, refs - 1)
        else:
            del self.live[key]
            self.now -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage()._cdata
            if key in self.known:
                continue  # a weight or a cache written in place
            n, refs = self.live.get(key, (t.untyped_storage().nbytes(), 0))
            if refs == 0:
                self.now += n
                self.peak = max(self.peak, self.now)
            self.live[key] = (n, refs + 1)
            weakref.finalize(t, self._drop, key)
        return out


def _fused_moe(x, ids, weights, w13, *rest, **kw):
    # kernels/triton/fused_moe.py: sorted pair ids, [T*k, I] hidden, fp32 [T*k, D] output, its k-sum
    t, k = ids.shape
    inter = w13.shape[1] // 2
    order = torch.argsort(ids.reshape(-1))
    hidden = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    out = torch.zeros(t * k, x.shape[1], dtype=torch.float32, device=x.device)
    del order, hidden
    return out.view(t, k, -1).sum(1).to(x.dtype)


def _gemm(x, w, *rest, **kw):  # a quantised GEMM writes only its output
    return torch.empty(*x.shape[:-1], w.shape[0], dtype=x.dtype, device=x.device)


def _mla_decode(q, cache, tables, lens, max_len, block_size, r, scale):
    b, h, _ = q.shape
    splits = _num_splits(b, -(-h // 16), max_len, 64)
    acc = torch.empty(b, splits, h, r, dtype=torch.float32, device=q.device)
    ml = torch.empty(b, splits, h, 2, dtype=torch.float32, device=q.device)
    del acc, ml
    return torch.empty(b, h, r, dtype=q.dtype, device=q.device)


def _conv(x, w, hist, cu=None):
    return torch.empty_like(x), torch.empty_like(hist)


def _chunk(q, k, v, g, beta, h0, cu, scale):
    n, H, K = q.shape
    states = torch.empty(-(-n // 64), H, K, v.shape[-1], dtype=torch.float32, device=q.device)
    wu = torch.empty(n, H, K + v.shape[-1], dtype=torch.float32, device=q.device)
    del states, wu
    return torch.empty_like(v), torch.empty(h0.shape, dtype=torch.float32, device=q.device)


def _recurrent(q, k, v, g, beta, state, slots, scale):
    # fla's fused recurrence reads contiguous [N, 1, ...] copies and updates the pool in place
    copies = [t.contiguous().clone() for t in (q, k, v, g)]
    del copies
    return torch.empty_like(v)


def _sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None, **kw):
    return torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)


def _all_gather(parts, x, group=None):
    for p in parts:
        p.copy_(x)


@functools.cache
def fake_model(name: str, tp: int):
    """Rank 0 (the most heads) of ``tp``, full size, storage-free."""
    config = ModelConfig.from_pretrained(CONFIGS / f"{name}.json")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        model = build_model(
            config, torch.device("meta"), compute_dtype(config), par=ParallelState(rank=0, world_size=tp)
        )
        finish_load(model)
    return config, model, mode


@pytest.fixture
def stand_ins(monkeypatch):
    for op in ("moe_experts", "moe_experts_w4a16", "moe_experts_mxfp4", "moe_experts_fp8"):
        monkeypatch.setattr(Backend, op, lambda self, *a, **k: _fused_moe(*a, **k))
    for op in ("linear_fp8_block", "linear_w4a16", "linear_mxfp4"):
        monkeypatch.setattr(Backend, op, lambda self, x, w, *a, **k: _gemm(x, w))
    monkeypatch.setattr(Backend, "mla_decode", lambda self, *a, **k: _mla_decode(*a, **k))
    # the layers call their backend (the reference one for a model never loaded onto a device)
    monkeypatch.setattr(Backend, "causal_conv1d", lambda self, *a, **k: _conv(*a, **k))
    monkeypatch.setattr(Backend, "kda_chunk", lambda self, *a, **k: _chunk(*a, **k))
    monkeypatch.setattr(Backend, "kda_recurrent", lambda self, *a, **k: _recurrent(*a, **k))
    monkeypatch.setattr(
        mla, "F", types.SimpleNamespace(**{**vars(torch.nn.functional), "scaled_dot_product_attention": _sdpa})
    )
    monkeypatch.setattr(dist, "all_reduce", lambda x, group=None: None)
    monkeypatch.setattr(dist, "all_gather", _all_gather)


def _prefill_meta(chunks: list[tuple[int, int]], dev) -> tuple[AttentionMetadata, int]:
    """Prefill chunks (tokens, context) in one step, each row of a chunk's last token sampled."""
    i64 = torch.int64
    tables, pos, slots, parts, out_parts, last = [], [], [], [], [], []
    row, base = 0, 0
    for i, (n, ctx) in enumerate(chunks):
        blocks = -(-ctx // BLOCK)
        table = torch.arange(base, base + blocks, dtype=torch.int32, device=dev)
        p = torch.arange(ctx - n, ctx, device=dev)
        pos.append(p)
        slots.append(table[p // BLOCK].long() * BLOCK + p % BLOCK)
        parts.append(PrefillChunk(row, row + n, ctx, table))
        out_parts.append(PrefillChunk(i, i + 1, ctx, table))
        last.append(row + n - 1)
        row, base = row + n, base + blocks
    out = torch.tensor(last, dtype=i64, device=dev)
    seqs = torch.arange(len(chunks), dtype=i64, device=dev)
    meta = AttentionMetadata(
        positions=torch.cat(pos),
        slot_mapping=torch.cat(slots),
        block_size=BLOCK,
        prefills=parts,
        state_slots=seqs,
        out_rows=out,
    )
    meta.out_meta = AttentionMetadata(
        positions=meta.positions[out], slot_mapping=out, block_size=BLOCK, prefills=out_parts, state_slots=seqs
    )
    return meta, base


def _decode_meta(n: int, ctx: int, dev) -> tuple[AttentionMetadata, int]:
    i64 = torch.int64
    meta = AttentionMetadata(
        positions=torch.full((n,), ctx - 1, dtype=i64, device=dev),
        slot_mapping=torch.arange(n, dtype=i64, device=dev),
        block_size=BLOCK,
        num_decode_tokens=n,
        decode_block_tables=torch.zeros(n, ctx // BLOCK, dtype=torch.int32, device=dev),
        decode_context_lens=torch.full((n,), ctx, dtype=torch.int32, device=dev),
        decode_max_context_len=ctx,
        state_slots=torch.arange(n, device=dev),
    )
    return meta, n * ctx // BLOCK


def measure(name: str, tp: int, decodes: int = 0, chunks: list[tuple[int, int]] = ()) -> int:
    """Peak activation bytes of one step, logits and a top-k/top-p sampler included: ``decodes``
    sequences at 4K context, or the prefill ``chunks`` (tokens, context)."""
    config, model, mode = fake_model(name, tp)
    dev = torch.device("meta")
    with mode:
        meta, blocks = _decode_meta(decodes, 4096, dev) if decodes else _prefill_meta(list(chunks), dev)
        seqs = decodes or len(chunks)
        caches = [s.allocate(blocks, BLOCK, seqs, dev) for s in model.cache_specs(compute_dtype(config))]
        known = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
        for c in caches:
            known |= {t.untyped_storage()._cdata for t in (c if isinstance(c, torch.Tensor) else vars(c).values())}
        known |= {t.untyped_storage()._cdata for t in tree_flatten(vars(meta))[0] if isinstance(t, torch.Tensor)}
        ids = torch.zeros(meta.positions.shape[0], dtype=torch.int64, device=dev)
        batch = SamplingBatch.build([SamplingParams(temperature=0.7, top_k=50, top_p=0.9)] * seqs, [None] * seqs, dev)
        known |= {t.untyped_storage()._cdata for t in (batch.temperature, batch.top_p, batch.top_k)}
        with torch.no_grad(), PeakBytes(known) as peak:
            logits = model.compute_logits(model(ids, meta, caches))
            sample(logits, batch)
    assert tuple(logits.shape) == (seqs, config.vocab_size)
    return peak.peak


def check(name: str, tp: int, shape: StepShape, measured: int) -> None:
    estimate = step_peak(ModelConfig.from_pretrained(CONFIGS / f"{name}.json"), tp, shape).total
    assert measured <= estimate <= 1.5 * measured + 64 * MiB, (
        f"{name} tp={tp} {shape.name}: estimate {estimate / GiB:.3f} GiB, measured {measured / GiB:.3f} GiB"
    )


def run_grid(name: str, tp: int, sizes=(2048, 8192)) -> None:
    check(name, tp, StepShape(64, 64, 0, 4096, 64, "decode 64"), measure(name, tp, decodes=64))
    for t in sizes:
        check(name, tp, StepShape(t, 0, 1, t, 1, f"chunk {t}"), measure(name, tp, chunks=[(t, t)]))
        long = t + mla.PREFILL_SLICE
        check(name, tp, StepShape(t, 0, 1, long, 1, f"chunk {t} at {long}"), measure(name, tp, chunks=[(t, long)]))
    t = sizes[0]
    check(
        name, tp, StepShape(t, 0, 64, t // 64, 64, "64 prefills"), measure(name, tp, chunks=[(t // 64, t // 64)] * 64)
    )


def test_k3_one_rank_estimate_covers_the_measured_peak(stand_ins):
    run_grid("kimi_k3", 1, sizes=(2048,))


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 6])
@pytest.mark.parametrize("name", ["kimi_k2_instruct", "kimi_k26", "kimi_k3"])
def test_estimate_covers_the_measured_peak(stand_ins, name, tp):
    run_grid(name, tp)


@pytest.mark.slow
def test_128k_prefill_chunk_is_linear(stand_ins):
    small, big = measure("kimi_k3", 1, chunks=[(2048, 2048)]), measure("kimi_k3", 1, chunks=[(131_072, 131_072)])
    # a chunk longer than the MLA slice goes through kv_b_proj slice by slice: every term but the
    # [H, n, slice] scores is linear in the chunk length, and those are too once n > slice
    assert big > 100 * GiB  # one rank, fused-MoE worst case: a 128K chunk needs far more than 4 GiB
    assert big / small > 64
