"""Real-shape dry runs: Kimi K2 (FP8), K2.6 (INT4) and K3 (MXFP4) built at full size for 4, 6 and 8
ranks, each rank exactly as the engine builds it with the planner's expert placement, under
FakeTensorMode on the meta device (shapes and dtypes, no storage; the host-RAM experts the engine puts
on the CPU become fake CPU tensors, so nothing is allocated). Every rank's shards are checked against
the one-rank build (split along one dim, the pieces summing to the whole, or replicated) and every
rank's bytes against the planner's table.

The K3 on four ranks case runs by default; the full grid is marked slow (about a minute per model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kimitui.engine.config import ModelConfig
from kimitui.engine.loader import build_model
from kimitui.engine.parallel.state import ParallelState
from kimitui.engine.plan import param_count
from kimitui.engine.plan.param_count import compute_dtype, meta_model
from kimitui.engine.plan.planner import GiB, Placement, plan_placement

CONFIGS = Path(__file__).resolve().parents[2] / "fixtures" / "configs"
MODELS = {"kimi_k2_instruct": "fp8", "kimi_k26": "int4", "kimi_k3": "mxfp4"}
CONTEXT, SEQS = 131_072, 4


def rank_model(config: ModelConfig, plan: Placement, rank: int) -> torch.nn.Module:
    """Rank ``rank`` of ``plan.num_devices`` with the plan's expert placement, storage-free."""
    par = ParallelState(rank=rank, world_size=plan.num_devices)
    with FakeTensorMode(allow_non_fake_inputs=True):
        return build_model(
            config,
            torch.device("meta"),
            compute_dtype(config),
            par=par,
            expert_placement=[list(r) for r in plan.expert_device],
        )


def nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def dry_run(name: str, gpus: int) -> None:
    config = ModelConfig.from_pretrained(CONFIGS / f"{name}.json")
    plan = plan_placement(config, gpus, 288 * GiB, CONTEXT, SEQS)
    assert plan.fits, plan.problems
    whole = {n: p for n, p in meta_model(config).named_parameters()}
    assert any(getattr(p, "values_per_element", 1) > 1 or p.dtype == torch.float8_e4m3fn for p in whole.values())
    pieces: dict[str, list[tuple[int, ...]]] = {}
    host = 0
    for rank in range(gpus):
        model = rank_model(config, plan, rank)
        dev = plan.devices[rank]
        on_gpu = {"expert": 0, "other": 0}
        for n, p in model.named_parameters():
            routed = ".experts.local." in n or ".experts.host." in n
            if p.device.type == "cpu":
                assert ".experts.host." in n, f"{name} rank {rank}: {n} is in host RAM but is not a routed expert"
                host += nbytes(p)
                continue
            on_gpu["expert" if routed else "other"] += nbytes(p)
            if routed:
                continue
            full = whole[n]
            assert p.dtype == full.dtype, f"{name} rank {rank}: {n} is {p.dtype}, the one-rank build {full.dtype}"
            diff = [d for d in range(full.dim()) if p.shape[d] != full.shape[d]]
            assert p.dim() == full.dim() and len(diff) <= 1, (
                f"{name} rank {rank}: {n} {tuple(p.shape)} is not a one-dim shard of {tuple(full.shape)}"
            )
            pieces.setdefault(n, []).append((tuple(p.shape), getattr(p, "shard", None)))
        assert on_gpu["other"] == dev.non_expert_bytes, f"{name} rank {rank}: non-expert bytes"
        assert on_gpu["expert"] == dev.expert_bytes == dev.num_experts * plan.expert_bytes, (
            f"{name} rank {rank}: routed-expert bytes"
        )
        # the cache this rank allocates per token and per sequence, as the planner charged it
        specs = model.cache_specs(compute_dtype(config))
        assert sum(s.bytes_per_block(1) for s in specs) == plan.kv_bytes_per_token
        assert SEQS * sum(s.bytes_per_seq() for s in specs) == dev.state_bytes
    assert host == plan.host_bytes
    for n, got in pieces.items():
        full = tuple(whole[n].shape)
        assert len(got) == gpus, f"{name}: {n} is missing on some rank"
        shapes = [shape for shape, _ in got]
        if all(shape == full for shape in shapes):
            continue  # replicated
        d = next(i for i in range(len(full)) if any(shape[i] != full[i] for shape in shapes))
        if n.endswith("weight_scale_inv") and got[0][1] is not None:
            # FP8 block scales: a rank whose rows start inside a 128-row block keeps finer local blocks
            # (engine.layers.linear), so the pieces overlap; together they must cover every block.
            ranges = sorted((lo, hi) for _, (axis, lo, hi) in got if axis == d)
            assert (
                ranges[0][0] == 0 and ranges[-1][1] == full[d] and all(b[0] <= a[1] for a, b in zip(ranges, ranges[1:]))
            ), f"{name}: the shards of {n} leave a gap"
        else:
            assert sum(shape[d] for shape in shapes) == full[d], f"{name}: the shards of {n} do not add up to {full}"


def test_k3_on_four_ranks():
    dry_run("kimi_k3", 4)


@pytest.mark.slow
@pytest.mark.parametrize("gpus", [4, 6, 8])
@pytest.mark.parametrize("name", list(MODELS))
def test_real_shapes(name, gpus):
    dry_run(name, gpus)


@pytest.mark.parametrize("name,gpus,builds", [("kimi_k3", 4, 2), ("kimi_k3", 6, 4), ("kimi_k2_instruct", 6, 7)])
def test_one_build_per_rank_class_equals_one_per_rank(monkeypatch, name, gpus, builds):
    # The planner builds the whole model, then one meta model per class of ranks that split alike (K3
    # on 4: 24 heads, 224 experts, 40960 vocab rows each; on 6: 150/149 experts, 598/597 latent
    # columns, 27307/27306 vocab rows make three classes). FP8 K2 quantises attention, whose 11- and 10-head shards
    # start at different offsets within the 128-row scale blocks: every rank is its own class.
    config = ModelConfig.from_pretrained(CONFIGS / f"{name}.json")
    exact = param_count.footprint.__wrapped__(config, gpus, exact=True)
    calls = []
    real = param_count.meta_model
    monkeypatch.setattr(param_count, "meta_model", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert param_count.footprint.__wrapped__(config, gpus) == exact
    assert len(calls) == builds
