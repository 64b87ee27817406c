"""Decode graphs for hybrid (Kimi K3: KDA + MLA) models and their routing statistics, on the
static-buffer path a CPU runs in place of the captured graph (engine/runner/graphs.py,
engine/runner/graph_padding.py): the same tokens, KDA states and routing counts as the eager step.

A padded bucket is the case that matters: rows past the step's repeat row 0's inputs but carry slot
-1 for their KDA state and their MLA cache slot, so they write nothing and leave every cache as the
eager step leaves it; and they are not tokens, so they must not count. Capture warm-ups (which run
the model for real, twice, before a bucket is captured) are checked the same way through
``DecodeGraphRunner._parked``, the context the capture runs in: they write nothing at all.
"""

from __future__ import annotations

import pytest
import torch

from kimitui.engine import LLM, SamplingParams
from kimitui.engine.kv_cache.state import KDAState
from kimitui.engine.layers.moe import RoutedExperts
from kimitui.engine.runner.model_runner import ModelRunner, StepInputs
from tests.helpers.checkpoints import write_hf_checkpoint
from tests.helpers.k3_checkpoint import write_k3_checkpoint

MAX_SEQS = 8


def _runners(llm: LLM):
    eager = llm.engine.runner
    assert eager.graphs is None  # a CPU runner is eager unless asked
    graphed = ModelRunner(
        eager.model,
        eager.kv_caches,
        eager.block_size,
        eager.device,
        max_num_seqs=MAX_SEQS,
        max_model_len=96,
        decode_graphs=True,
    )
    return eager, graphed


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    path = tmp_path_factory.mktemp("k3")
    write_k3_checkpoint(path, seed=3)  # KDA layers 1, 2, 4; MLA 3, 5; MXFP4 latent MoE
    llm = LLM(str(path), max_model_len=96, max_num_seqs=MAX_SEQS, enable_prefix_caching=False, kv_cache_tokens=512)
    return llm, *_runners(llm)


def _counts(model) -> list[torch.Tensor]:
    return [m.routing_counts.clone() for m in model.modules() if isinstance(m, RoutedExperts)]


def _snapshot(runner) -> list[torch.Tensor]:
    """Clones of every cache tensor (KDA recurrent and conv state, MLA latents)."""
    out = []
    for c in runner.kv_caches:
        out += [c.recurrent.clone(), c.conv.clone()] if isinstance(c, KDAState) else [c.clone()]
    return out


def _restore(runner, snap: list[torch.Tensor]) -> None:
    it = iter(snap)
    for c in runner.kv_caches:
        for t in [c.recurrent, c.conv] if isinstance(c, KDAState) else [c]:
            t.copy_(next(it))


def _step(slots=(2, 5, 1)) -> StepInputs:
    # three decodes, each mid-sequence in its own KDA slot: bucket 4, one padding row
    return StepInputs(
        ids=[11, 12, 13],
        num_decodes=3,
        decode_tables=[[1, 2], [3], [4, 5, 6]],
        decode_lens=[20, 5, 40],
        prefills=[],
        sample_rows=[0, 1, 2],
        state_slots=list(slots),
    )


def test_hybrid_decode_step_on_static_buffers_matches_eager(k3):
    _, eager, graphed = k3
    g = graphed.graphs
    states = [c for c in eager.kv_caches if isinstance(c, KDAState)]
    assert all(s.num_slots == MAX_SEQS for s in states)  # no spare slot: padding rows have none
    assert g.accepts(3, 3, has_prefills=False, stateful=True)  # KDA slots no longer force eager
    torch.manual_seed(0)
    for s in states:  # sequences mid-way: every slot holds some state
        s.recurrent.normal_(std=0.3)
        s.conv.normal_()
    before, counts0 = _snapshot(eager), _counts(eager.model)
    want, _ = eager.forward_step(_step())
    want_state, want_counts = _snapshot(eager), [c - c0 for c, c0 in zip(_counts(eager.model), counts0)]
    _restore(eager, before)
    counts1 = _counts(eager.model)
    got, _ = graphed.forward_step(_step())
    assert g.slots[:4].tolist() == [2, 5, 1, -1] and g.ids[:4].tolist() == [11, 12, 13, 11]
    assert g._metadata(4).slot_mapping[3].item() == -1  # the padding row writes no cache slot
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for i, (a, b) in enumerate(zip(_snapshot(graphed), want_state)):  # every slot and latent as eager
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"cache {i}")
    got_counts = [c - c1 for c, c1 in zip(_counts(eager.model), counts1)]
    k = eager.model.config.num_experts_per_tok
    assert got_counts and all(int(c.sum()) == 3 * k for c in got_counts)  # 3 tokens, not the bucket's 4
    assert all(torch.equal(a, b) for a, b in zip(got_counts, want_counts))


def test_capture_warmups_touch_no_real_slot_and_count_nothing(k3):
    # What a capture does before recording a bucket: two real forward passes inside ``_parked``,
    # then the replay (here: the same forward pass, direct). Together they must leave what the
    # step alone leaves: KDA slots, MLA latents and counts (the warm-ups write and count nothing).
    _, eager, graphed = k3
    g = graphed.graphs
    before, counts0 = _snapshot(graphed), _counts(eager.model)
    want, _ = graphed.forward_step(_step())  # fills the static rows of this step
    want_state, want_counts = _snapshot(graphed), [c - c0 for c, c0 in zip(_counts(eager.model), counts0)]
    _restore(graphed, before)
    counts1 = _counts(eager.model)
    with torch.inference_mode():  # as in run(), which captures
        with g._parked(3, 4):
            assert g.slots[:4].tolist() == [-1] * 4 and int(g.routing.rows.sum()) == 0
            for _ in range(2):
                g._forward(4)
        assert all(torch.equal(a, b) for a, b in zip(_snapshot(graphed), before))  # warm-ups wrote nothing
        assert all(torch.equal(a, b) for a, b in zip(_counts(eager.model), counts1))  # warm-ups count nothing
        assert g.slots[:4].tolist() == [2, 5, 1, -1] and g.routing.rows[:5].tolist() == [1, 1, 1, 0, 0]
        got = graphed.model.compute_logits(g._forward(4)[:3])  # the replay
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(_snapshot(graphed), want_state):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert all(torch.equal(c - c1, w) for c, c1, w in zip(_counts(eager.model), counts1, want_counts))
    assert all(m.count_rows is None for m in g.routing.experts)  # eager steps count every row again


def test_hybrid_generation_with_the_static_decode_path_matches_eager(k3):
    llm, eager, graphed = k3
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}, {"prompt_token_ids": [30, 31, 32, 33]}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    want = llm.generate(prompts, params)
    llm.engine.runner = graphed
    try:
        got = llm.generate(prompts, params)
    finally:
        llm.engine.runner = eager
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for a, b in zip(got, want):
        lp_a = [d[t] for d, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]
        lp_b = [d[t] for d, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
        assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) < 1e-4
    assert graphed.graphs.lens[:4].tolist() == [8, 7, 9, 8]  # the last decode step ran on the static rows


def test_k2_padding_rows_count_no_routing(tmp_path):
    # DeepSeek-V3 MoE: the router counts in its own call (on this CPU, the C++ decode block's FFN
    # when it may: not while a graph's row mask is set, since it counts every row)
    write_hf_checkpoint(tmp_path, seed=5, num_hidden_layers=2)
    llm = LLM(str(tmp_path), max_model_len=96, max_num_seqs=MAX_SEQS, enable_prefix_caching=False, kv_cache_tokens=512)
    eager, graphed = _runners(llm)
    inp = StepInputs(
        ids=[11, 12, 13],
        num_decodes=3,
        decode_tables=[[1, 2], [3], [4, 5, 6]],
        decode_lens=[20, 5, 40],
        prefills=[],
        sample_rows=[0, 1, 2],
    )
    c0 = _counts(eager.model)
    want, _ = eager.forward_step(inp)
    c1 = _counts(eager.model)
    got, _ = graphed.forward_step(inp)
    c2 = _counts(eager.model)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert c0 and all(torch.equal(b - a, d - c) for a, b, c, d in zip(c0, c1, c1, c2))
    assert all(int((d - c).sum()) == 3 * llm.engine.config.num_experts_per_tok for c, d in zip(c1, c2))
