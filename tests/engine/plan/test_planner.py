"""Parameter counts (from the engine's own meta-device builds) against published checkpoint sizes, and the
placement planner's rules."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kimitui.engine.config import ModelConfig
from kimitui.engine.layers.linear import linear_format
from kimitui.engine.parallel.state import split_sizes
from kimitui.engine.plan.param_count import count_params, meta_model
from kimitui.engine.plan.placement import expert_placement_for
from kimitui.engine.plan.planner import GiB, PlacementError, plan_placement
from kimitui.engine.plan.report import render
from kimitui.engine.plan.routing_stats import load_routing_stats, save_routing_stats

CONFIGS = Path(__file__).resolve().parents[2] / "fixtures" / "configs"


def cfg(name: str) -> ModelConfig:
    return ModelConfig.from_pretrained(CONFIGS / f"{name}.json")


def plan(name: str, gpus: int, gib: float, **kw):
    c = cfg(name)
    kw.setdefault("max_model_len", c.max_position_embeddings)
    kw.setdefault("max_num_seqs", 1)
    return plan_placement(c, gpus, int(gib * GiB), **kw)


def hot_stats(config: ModelConfig, seed: int = 0) -> dict[int, list[int]]:
    rng = random.Random(seed)
    return {
        i: [rng.randrange(1, 10_000) for _ in range(config.n_routed_experts)]
        for i in range(config.num_hidden_layers)
        if config.is_moe_layer(i)
    }


# -- parameter counts ----------------------------------------------------------------------------


def test_k2_instruct_matches_published_checkpoint():
    c = cfg("kimi_k2_instruct")
    # The hub's 1,026,470,731,056 counts every stored element: weights + fp32 scale_inv blocks +
    # 61 stray `self_attn.rotary_emb.inv_freq` tensors of shape [56], one per layer, which the
    # checkpoint (moonshotai/Kimi-K2-Instruct) stores and the loader skips. The engine's own
    # parameters (built on the meta device, as the planner counts them) are exactly those tensors.
    model = meta_model(c)
    assert sum(p.numel() for p in model.parameters()) + 61 * 56 == 1_026_470_731_056
    scales = [p for n, p in model.named_parameters() if n.endswith("scale_inv")]
    assert scales and all(p.dtype == torch.float32 for p in scales)  # fp32 whatever the model dtype
    size = count_params(c)
    assert size.total.params == sum(p.numel() for n, p in model.named_parameters() if not n.endswith("scale_inv"))
    # The hub's "958.51 GB" is GiB; the engine keeps the router in fp32 (+0.31 GiB over the bf16 on disk).
    assert size.total.nbytes / GiB == pytest.approx(958.51 + 60 * 384 * 7168 * 2 / GiB, rel=1e-4)


def test_int4_and_bf16_sizes():
    k25, k26, bf16 = count_params(cfg("kimi_k25")), count_params(cfg("kimi_k26")), count_params(cfg("kimi_k2_bf16"))
    # 554.30 GiB published includes the ~0.9 GiB vision tower; the text part is within a few %.
    assert k25.total.nbytes / GiB == pytest.approx(554.30, rel=0.01)
    assert k26.total == k25.total
    # gate/up/down [2048, 7168] int4 = 0.5 B/param + bf16 scale per 32 = 0.5625 B/param
    assert k25.routed_expert.nbytes == 3 * 2048 * 7168 * 0.5625
    router = 60 * (384 * 7168 + 384)  # weight and correction bias, fp32 in the engine
    assert bf16.total.nbytes == 2 * bf16.total.params + 2 * router
    assert bf16.total.params == k25.total.params


def test_formats_follow_quantization_config():
    k2, k26 = cfg("kimi_k2_instruct").quantization, cfg("kimi_k26").quantization
    assert linear_format(k2, "lm_head") == "dense"
    assert linear_format(k2, "model.layers.3.mlp.gate") == "dense"
    for name in (
        "model.layers.3.self_attn.q_a_proj",
        "model.layers.0.mlp.gate_proj",
        "model.layers.3.mlp.shared_experts.up_proj",
        "model.layers.3.mlp.experts.7.gate_proj",
    ):
        assert linear_format(k2, name) == "fp8"
        assert linear_format(k26, name) == ("int4" if ".experts." in name else "dense")
    assert linear_format(k26, "lm_head") == "dense"


# -- splits ------------------------------------------------------------------------------------------


def test_split_sizes():
    assert split_sizes(64, 6) == [11, 11, 11, 11, 10, 10]
    assert split_sizes(163840, 6) == [27307] * 4 + [27306] * 2
    assert split_sizes(2048, 6, unit=128) == [384, 384, 384, 384, 256, 256]
    assert split_sizes(576, 4, unit=128) == [256, 128, 128, 64]
    assert sum(split_sizes(1000, 7, unit=32)) == 1000


def test_uneven_split_on_six_gpus():
    p = plan("kimi_k26", 6, 288)
    assert [d.heads for d in p.devices] == [11, 11, 11, 11, 10, 10]
    assert [d.vocab_rows for d in p.devices] == [27307] * 4 + [27306] * 2
    ne = [d.non_expert_bytes for d in p.devices]
    assert ne[0] >= ne[3] > ne[4] >= ne[5]  # 11 vs 10 heads; shared expert rows 342/341
    # 384 experts on 6 GPUs: 64 each per layer, contiguous ids (plain expert parallelism)
    row = p.expert_device[1]
    assert row == tuple(i // 64 for i in range(384))
    assert p.expert_device[0] == ()  # layer 0 is dense


def test_fp8_k2_on_six_gpus_counts_what_each_rank_builds():
    # 11 heads x 192 = 2112 q_b_proj rows (16.5 scale blocks) on ranks 0-3: the planner and the
    # engine agree because the planner sums the engine's own per-rank meta builds.
    c = cfg("kimi_k2_instruct")
    p = plan("kimi_k2_instruct", 6, 288)
    assert p.fits
    for rank in (0, 1, 4):
        model = meta_model(c, 6, rank)
        q_b = model.model.layers[0].self_attn.q_b_proj
        assert q_b.weight.shape[0] == (2112 if rank < 4 else 1920)
        assert q_b.weight_scale_inv.shape[0] * q_b.block[0] >= q_b.weight.shape[0]
        own = sum(t.numel() * t.element_size() for n, t in model.named_parameters() if ".mlp.experts." not in n)
        assert p.devices[rank].non_expert_bytes == own
        # shared experts split on whole 128-row blocks: 2048 rows = 3,3,3,3,2,2 blocks
        shared = model.model.layers[1].mlp.shared_experts
        assert shared.gate_proj.weight.shape[0] == (384 if rank < 4 else 256)


# -- fitting -----------------------------------------------------------------------------------------


def test_k26_fits_entirely_on_six_mi355x():
    p = plan("kimi_k26", 6, 288)
    assert p.fits and p.num_cpu_experts == 0 and p.host_bytes == 0
    assert all(d.free_bytes > 0 for d in p.devices)
    # the MLA latent cache is replicated: every GPU holds all 262144 tokens
    assert all(d.kv_bytes == 262144 * 576 * 61 * 2 for d in p.devices)
    assert p.max_model_len_that_fits == 262144


def test_k26_on_four_140gb_needs_cpu_experts():
    p = plan("kimi_k26", 4, 140)
    assert p.fits and p.num_cpu_experts > 0
    gpu_counts = [g for g, _ in p.experts_per_layer().values()]
    assert max(gpu_counts) - min(gpu_counts) <= 1
    assert all(0 <= d.free_bytes < p.expert_bytes for d in p.devices)  # auto fills the GPUs
    assert p.host_bytes == p.num_cpu_experts * p.expert_bytes

    with pytest.raises(PlacementError) as err:
        plan("kimi_k26", 4, 140, cpu_offload="none")
    attempted = err.value.placement
    assert attempted is not None and not attempted.fits and attempted.num_cpu_experts == 0
    assert f"short by {attempted.shortfall_bytes / GiB:.1f} GiB" in str(err.value)
    assert 60 * GiB < attempted.shortfall_bytes < 120 * GiB


def test_int_offload_puts_n_experts_per_layer_on_cpu():
    p = plan("kimi_k26", 4, 140, cpu_offload=100)
    assert p.fits
    assert all(c == 100 for _, c in p.experts_per_layer().values())
    assert all(row[-100:] == (-1,) * 100 for row in p.expert_device if row)  # no stats: highest ids
    too_few = plan("kimi_k26", 4, 140, cpu_offload=10)
    assert not too_few.fits and too_few.problems
    assert all(c == 10 for _, c in too_few.experts_per_layer().values())


def test_hottest_experts_stay_on_gpu():
    c = cfg("kimi_k26")
    stats = hot_stats(c)
    for kw in ({}, {"cpu_offload": 100}):
        p = plan("kimi_k26", 4, 140, routing_stats=stats, **kw)
        for layer, counts in stats.items():
            row = p.expert_device[layer]
            on_gpu = [counts[e] for e in range(384) if row[e] >= 0]
            on_cpu = [counts[e] for e in range(384) if row[e] < 0]
            assert on_cpu and min(on_gpu) >= max(on_cpu)
    # all fit: the 4 hottest experts of a layer land on 4 different GPUs (balanced load)
    p = plan("kimi_k26", 4, 288, routing_stats=stats)
    top = sorted(range(384), key=lambda e: -stats[5][e])[:4]
    assert sorted(p.expert_device[5][e] for e in top) == [0, 1, 2, 3]


def test_host_memory_limit():
    p = plan("kimi_k26", 4, 140, host_memory_bytes=10 * GiB)
    assert not p.fits and any("host RAM" in x for x in p.problems)
    ok = plan("kimi_k26", 4, 140, host_memory_bytes=200 * GiB)
    assert ok.fits and ok.host_bytes <= 200 * GiB


# -- largest context ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,gpus,gib,offload,seqs",
    [
        ("kimi_k26", 4, 140, "auto", 16),
        ("kimi_k26", 6, 288, "none", 16),
        ("kimi_k26", 4, 140, 150, 16),
        ("kimi_k2_instruct", 6, 288, "auto", 64),
    ],
)
def test_largest_context_is_tight(name, gpus, gib, offload, seqs):
    # several sequences make memory, not max_position_embeddings, the limit
    block = 64
    p = plan(name, gpus, gib, max_num_seqs=seqs, cpu_offload=offload, max_model_len=8192)
    best = p.max_model_len_by_memory
    assert 0 < best < p.max_position_embeddings and best % block == 0
    assert p.max_model_len_that_fits == best
    assert plan(name, gpus, gib, max_num_seqs=seqs, cpu_offload=offload, max_model_len=best).fits
    if offload == "none":
        with pytest.raises(PlacementError):
            plan(name, gpus, gib, max_num_seqs=seqs, cpu_offload=offload, max_model_len=best + block)
    else:
        assert not plan(name, gpus, gib, max_num_seqs=seqs, cpu_offload=offload, max_model_len=best + block).fits


def test_context_with_current_placement():
    p = plan("kimi_k26", 6, 288, max_num_seqs=16, max_model_len=8192)
    kept = p.max_model_len_with_placement
    assert p.max_model_len <= kept <= p.max_model_len_by_memory
    per_block = 16 * 64 * p.kv_bytes_per_token
    tight = min(d.capacity_bytes - d.weight_bytes - d.reserve_bytes for d in p.devices)
    assert 16 * kept * p.kv_bytes_per_token <= tight < 16 * kept * p.kv_bytes_per_token + per_block


def test_summary_lines():
    text = "\n".join(render(plan("kimi_k26", 4, 140)))
    for needle in (
        "GPU heads",
        "non-expert",
        "host RAM:",
        "fits: yes",
        "largest context that fits",
        "on GPU",
        "on CPU",
    ):
        assert needle in text


# -- routing statistics and inputs -------------------------------------------------------------------


def test_routing_stats_round_trip(tmp_path):
    c = cfg("kimi_k26")
    stats = hot_stats(c, seed=1)
    path = tmp_path / "stats.json"
    save_routing_stats(path, stats)
    loaded = load_routing_stats(path)
    assert loaded == {k: [float(x) for x in v] for k, v in stats.items()}
    as_list = [stats.get(i, []) for i in range(61)]  # nested list over all layers
    a = plan("kimi_k26", 4, 140, routing_stats=loaded)
    b = plan("kimi_k26", 4, 140, routing_stats=as_list)
    assert a.expert_device == b.expert_device
    with pytest.raises(ValueError, match="layer 3"):
        plan("kimi_k26", 4, 140, routing_stats={3: [1.0] * 10})
    with pytest.raises(FileNotFoundError, match="not found"):
        load_routing_stats(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_routing_stats(tmp_path / "bad.json")


def test_missing_routing_stats_file_starts_without_stats(tmp_path):
    # A first run has no statistics yet: the placement falls back to the highest ids, no abort.
    c = cfg("kimi_k26")
    rows = expert_placement_for(
        c, 100, torch.device("cpu"), 4, 4096, 1, routing_stats_path=str(tmp_path / "routing.json")
    )
    assert all(row[-100:] == [-1] * 100 for row in rows if row)


def test_bad_arguments():
    with pytest.raises(ValueError, match="cpu_offload"):
        plan("kimi_k26", 4, 140, cpu_offload="sometimes")
    with pytest.raises(ValueError, match="between 0"):
        plan("kimi_k26", 4, 140, cpu_offload=385)
    with pytest.raises(ValueError, match="max_num_seqs"):
        plan("kimi_k26", 4, 140, max_num_seqs=0)
