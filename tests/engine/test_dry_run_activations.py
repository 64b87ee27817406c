"""Activation memory of one step of full-size Kimi K3 (one rank), measured on fake tensors: a decode
step at batch 64 and prefill chunks up to 128K tokens, against the planner's per-GPU reserve.

The model runs under FakeTensorMode on the meta device (no storage), its weights and caches built as
the engine builds them. A TorchDispatchMode counts the bytes of every tensor an op creates until the
last reference to it dies, and keeps the peak. Three kernels whose control flow reads tensor values
(which fake tensors do not have) are replaced for the run by stand-ins that create what the GPU
kernels create:
- routed experts: the fused-MoE worst case, every (token, expert) pair at once: the gathered rows
  [T*k, L], the gate/up output [T*k, 2I], the activation [T*k, I] and the fp32 down output [T*k, L];
- KDA short conv and chunked recurrence: their outputs plus the per-64-token-chunk states
  [T/64, H, K, V] fp32 and the fp32 w/u rows [T, H, K+V] of the chunked delta rule
  (fla-org/flash-linear-attention, fla/ops/kda/chunk.py);
- MLA prefill attention: a flash kernel's output only (no [H, T, T] score matrix, which the CPU
  reference path does materialise).
"""

from __future__ import annotations

import types
import weakref
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import engine.layers.mla as mla
from engine.config import ModelConfig
from engine.layers.attn_metadata import AttentionMetadata, PrefillChunk
from engine.loader import build_model
from engine.offload.param_count import compute_dtype
from kimitui.commands.plan import DEFAULT_RESERVE_GB
from kernels.backend import Backend

K3 = Path(__file__).resolve().parents[1] / "fixtures" / "configs" / "kimi_k3.json"
BLOCK = 64
GiB = 2**30


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


def _experts(x, ids, weights, inter):
    k = ids.shape[1]
    rows = x.repeat_interleave(k, 0)                                               # [T*k, L]
    gu = torch.empty(rows.shape[0], 2 * inter, dtype=x.dtype, device=x.device)    # [T*k, 2I]
    act = gu[:, :inter] * gu[:, inter:]                                            # [T*k, I]
    y = torch.empty(rows.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    del act
    return (y.view(-1, k, x.shape[1]) * weights[..., None].float()).sum(1).to(x.dtype)


def _conv(x, w, hist, cu=None):
    return torch.empty_like(x), torch.empty_like(hist)


def _chunk(q, k, v, g, beta, h0, cu, scale):
    n, H, K = q.shape
    states = torch.empty(-(-n // 64), H, K, v.shape[-1], dtype=torch.float32, device=q.device)
    wu = torch.empty(n, H, K + v.shape[-1], dtype=torch.float32, device=q.device)
    del states, wu
    return torch.empty_like(v), torch.empty(h0.shape, dtype=torch.float32, device=q.device)


def _sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None, **kw):
    return torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)


@pytest.fixture(scope="module")
def k3_model():
    config = ModelConfig.from_pretrained(K3)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        model = build_model(config, torch.device("meta"), compute_dtype(config))
        model.post_load()
    return config, model, mode


@pytest.fixture
def stand_ins(monkeypatch, k3_model):
    inter = k3_model[0].moe_intermediate_size
    for op in ("moe_experts", "moe_experts_w4a16", "moe_experts_mxfp4", "moe_experts_fp8"):
        monkeypatch.setattr(Backend, op, lambda self, x, ids, w, *a, **k: _experts(x, ids, w, inter))
    # the layers call their backend (the reference one for a model never loaded onto a device)
    monkeypatch.setattr(Backend, "causal_conv1d", lambda self, *a, **k: _conv(*a, **k))
    monkeypatch.setattr(Backend, "kda_chunk", lambda self, *a, **k: _chunk(*a, **k))
    monkeypatch.setattr(mla, "F", types.SimpleNamespace(**{**vars(torch.nn.functional),
                                                           "scaled_dot_product_attention": _sdpa}))


def step_peak(k3_model, decodes: int = 0, prefill: int = 0) -> int:
    """Peak activation bytes of one step: ``decodes`` sequences at 4K context, or one prefill chunk."""
    config, model, mode = k3_model
    dev, i64 = torch.device("meta"), torch.int64
    with mode:
        if decodes:
            ctx, n = 4096, decodes
            blocks = n * ctx // BLOCK
            meta = AttentionMetadata(positions=torch.full((n,), ctx - 1, dtype=i64, device=dev),
                                     slot_mapping=torch.arange(n, dtype=i64, device=dev), block_size=BLOCK,
                                     num_decode_tokens=n,
                                     decode_block_tables=torch.zeros(n, ctx // BLOCK, dtype=torch.int32, device=dev),
                                     decode_context_lens=torch.full((n,), ctx, dtype=torch.int32, device=dev),
                                     decode_max_context_len=ctx, state_slots=torch.arange(n, device=dev))
        else:
            n, blocks, seqs = prefill, -(-prefill // BLOCK), 1
            table = torch.arange(blocks, dtype=torch.int32, device=dev)
            last = torch.tensor([n - 1], device=dev)
            meta = AttentionMetadata(positions=torch.arange(n, device=dev), slot_mapping=torch.arange(n, device=dev),
                                     block_size=BLOCK, prefills=[PrefillChunk(0, n, n, table)],
                                     state_slots=torch.zeros(1, dtype=i64, device=dev), out_rows=last)
            meta.out_meta = AttentionMetadata(positions=last, slot_mapping=last, block_size=BLOCK,
                                              prefills=[PrefillChunk(0, 1, n, table)],
                                              state_slots=torch.zeros(1, dtype=i64, device=dev))
        caches = [s.allocate(blocks, BLOCK, max(decodes, 1), dev) for s in model.cache_specs(compute_dtype(config))]
        known = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
        for c in caches:
            known |= {t.untyped_storage()._cdata for t in (c if isinstance(c, torch.Tensor) else vars(c).values())}
        known |= {t.untyped_storage()._cdata for t in tree_flatten(vars(meta))[0] if isinstance(t, torch.Tensor)}
        ids = torch.zeros(meta.positions.shape[0], dtype=i64, device=dev)
        with torch.no_grad(), PeakBytes(known) as peak:
            logits = model.compute_logits(model(ids, meta, caches))
    assert tuple(logits.shape) == (decodes or 1, config.vocab_size)
    return peak.peak


def test_decode_64_and_default_chunk_fit_the_reserve(k3_model, stand_ins):
    reserve = DEFAULT_RESERVE_GB * GiB
    decode = step_peak(k3_model, decodes=64)
    # at least the experts' gate/up output for 64 x 16 (token, expert) pairs and the fp32 logits
    assert 64 * 16 * 2 * 3072 * 2 + 64 * 163840 * 4 < decode < reserve
    chunk = step_peak(k3_model, prefill=2048)  # the engine's default max_num_batched_tokens
    assert decode < chunk < reserve


@pytest.mark.slow
def test_128k_prefill_chunk_is_linear_and_needs_its_own_reserve(k3_model, stand_ins):
    small, big = step_peak(k3_model, prefill=2048), step_peak(k3_model, prefill=131_072)
    # with flash attention and the chunked KDA recurrence every term is linear in the chunk length
    assert big / small == pytest.approx(64, rel=0.02)
    assert big > 100 * GiB  # one rank, fused-MoE worst case: a 128K chunk needs far more than 4 GiB
