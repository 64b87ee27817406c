"""The activation reserve (engine.offload.activation_reserve): how it moves with the step size, the
batch and the tensor-parallel size, what the planner and the engine take from it. Its absolute size
is checked against fake-tensor measurements in test_dry_run_activations.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kimitui.engine.config import ModelConfig
from kimitui.engine.plan.activation_reserve import (
    FRAGMENTATION,
    WORKSPACE_BYTES,
    StepShape,
    _Dims,
    _experts,
    activation_reserve,
    step_peak,
)
from kimitui.engine.plan.placement import device_reserve_bytes
from kimitui.engine.plan.planner import plan_placement
from kimitui.engine.plan.report import render
from kimitui.engine.units import GiB

CONFIGS = Path(__file__).resolve().parents[2] / "fixtures" / "configs"


@pytest.fixture(scope="module", params=["kimi_k2_instruct", "kimi_k26", "kimi_k3"])
def config(request) -> ModelConfig:
    return ModelConfig.from_pretrained(CONFIGS / f"{request.param}.json")


def test_grows_with_the_chunk_and_the_batch(config):
    by_chunk = [activation_reserve(config, 1, t, 64).total for t in (512, 2048, 8192, 32768)]
    assert by_chunk == sorted(by_chunk) and by_chunk[0] < by_chunk[-1] / 8
    by_batch = [activation_reserve(config, 1, 2048, s).total for s in (1, 16, 64, 256, 1024)]
    assert by_batch == sorted(by_batch) and by_batch[0] < by_batch[-1]
    # a step is max(max_num_batched_tokens, max_num_seqs) rows, as the engine's scheduler allows
    assert activation_reserve(config, 1, 16, 256).step.shape.tokens == 256


def test_every_part_is_linear_in_fresh_chunk_length(config):
    # a chunk starting a sequence, above the MLA slice: every tensor but the slice-sized keys is
    # [T, ...] or [H, T, slice]
    a, b = (step_peak(config, 1, StepShape(t, 0, 1, t, 1)).forward for t in (16384, 32768))
    assert b == pytest.approx(2 * a, rel=0.02) and b < 2 * a


def test_tensor_parallel_splits_attention_not_the_experts(config):
    shape = StepShape(8192, 0, 1, 16384, 1)
    one, eight = step_peak(config, 1, shape), step_peak(config, 8, shape)
    # heads split 8 ways (MLA scores, KDA states); every rank sees all T*k routed pairs, so the routed
    # experts' buffers do not shrink (the shared experts' and K3's latent projections' do)
    assert eight.parts["attention"] < one.parts["attention"] / 6
    assert _experts(_Dims(config, 8), 8192) == _experts(_Dims(config, 1), 8192)
    assert eight.parts["ffn"] >= _experts(_Dims(config, 8), 8192)
    assert [activation_reserve(config, tp, 8192, 64).total for tp in (1, 2, 4, 8)] == sorted(
        [activation_reserve(config, tp, 8192, 64).total for tp in (1, 2, 4, 8)], reverse=True
    )


def test_graphs_pool_and_margin_add_up(config):
    eager, graphs = activation_reserve(config, 1, 2048, 64, graphs=False), activation_reserve(config, 1, 2048, 64)
    assert eager.graph_pool == 0 and graphs.graph_pool > 0
    assert graphs.total - eager.total == pytest.approx(graphs.graph_pool * (1 + FRAGMENTATION), abs=2)
    assert eager.margin == int(FRAGMENTATION * eager.step.total) + WORKSPACE_BYTES
    assert eager.total == eager.step.total + eager.margin


def test_long_context_costs_more_than_a_fresh_chunk(config):
    short, long = activation_reserve(config, 1, 2048, 1, 2048), activation_reserve(config, 1, 2048, 1, 131072)
    assert long.total > short.total and "context" in long.step.shape.name


def test_the_line_names_the_reserve_and_its_parts():
    k3 = ModelConfig.from_pretrained(CONFIGS / "kimi_k3.json")
    r = activation_reserve(k3, 1, 2048, 64)
    line = r.line()
    assert line.startswith(f"reserve per GPU {r.total / GiB:.2f} GiB = ") and "\n" not in line
    assert "attn-res mix" in line and "decode graphs" in line and "margin" in line
    assert "max_num_batched_tokens 2,048, max_num_seqs 64" in line


@pytest.mark.parametrize("bad", [dict(tp=0), dict(max_num_batched_tokens=0), dict(max_num_seqs=-1)])
def test_bad_sizes_are_refused(bad):
    k3 = ModelConfig.from_pretrained(CONFIGS / "kimi_k3.json")
    args = dict(tp=1, max_num_batched_tokens=2048, max_num_seqs=64) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        activation_reserve(k3, **args)


def test_planner_and_engine_use_one_number():
    k26 = ModelConfig.from_pretrained(CONFIGS / "kimi_k26.json")
    p = plan_placement(k26, 6, 288 * GiB, 32768, 8, max_num_batched_tokens=4096)
    expected = activation_reserve(k26, 6, 4096, 8, 32768, graphs=False)
    assert p.activation == expected and all(d.reserve_bytes == expected.total for d in p.devices)
    assert p.to_dict()["reserve"]["bytes"] == expected.total
    assert expected.line() in render(p)
    # the engine's number for the same arguments (a cuda device object needs no GPU)
    assert device_reserve_bytes(k26, torch.device("cuda", 0), 6, 4096, 8, 32768, False) == expected.total
    assert device_reserve_bytes(k26, torch.device("cpu"), 6, 4096, 8, 32768, False) == 0
    given = plan_placement(k26, 6, 288 * GiB, 32768, 8, reserve_bytes_per_device=GiB)
    assert given.activation is None and given.devices[0].reserve_bytes == GiB
    assert "reserve per GPU 1.00 GiB (given)" in render(given)
