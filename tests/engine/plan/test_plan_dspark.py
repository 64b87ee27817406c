"""A DSpark drafter in the memory plan, on Kimi K3's real config.json: its own weights (counted from
its config alone, equal to the drafter module built at full size on the meta device) and its KV (the
5 dense MLA layers' paged latent caches: 5 x (512 + 64) bf16 values per token) sit on GPU 0 beside
the target's; `kimitui plan --speculative-config '<vLLM's DSpark recipe JSON>'` prints them.

The drafter's shape is an assumption (the published K3.1 drafter's config.json is not in this
repository): 5 MLA layers at the target's hidden size with K3's own MLA dims, in
lightseekorg/kimi-k3-dspark's key set (taps [7, 31, 47, 63, 87], ``fc_norm``, ``attn_res``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from kimitui.commands import plan as plan_cmd
from kimitui.engine.config import ModelConfig
from kimitui.engine.plan.planner import GiB, plan_placement
from kimitui.engine.spec_decode.config import SpeculativeConfig
from kimitui.engine.spec_decode.dspark.model import DSparkConfig, DSparkDrafter
from tests.helpers.spec.dspark_checkpoint import dspark_config

K3 = Path(__file__).resolve().parents[2] / "fixtures" / "configs" / "kimi_k3.json"
LAYERS, LATENT = 5, 512 + 64
SEQS, LEN = 4, 131072


@pytest.fixture(scope="module")
def k3() -> ModelConfig:
    return ModelConfig.from_pretrained(K3)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, k3) -> Path:
    text = json.loads(K3.read_text())["text_config"]
    c = dspark_config(text, "lightseek", target_layer_ids=[7, 31, 47, 63, 87], heads=64, markov_rank=256, layers=5)
    c |= {k: text[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    c["intermediate_size"] = 18432
    path = tmp_path_factory.mktemp("k3-dspark")
    (path / "config.json").write_text(json.dumps(c))  # config only: the plan reads no weight
    return path


def recipe(drafter_dir: Path) -> dict:
    return {
        "method": "dspark",
        "model": str(drafter_dir),
        "num_speculative_tokens": 7,
        "draft_sample_method": "probabilistic",
        "rejection_sample_method": "block",
    }


def test_plan_counts_the_drafter_on_gpu0(k3, drafter_dir):
    spec = SpeculativeConfig.parse(recipe(drafter_dir))
    # the same verification rows either way: only the drafter differs between the two plans
    ngram = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 7})
    base = plan_placement(k3, 6, 288 * GiB, LEN, SEQS, speculative=ngram)
    plan = plan_placement(k3, 6, 288 * GiB, LEN, SEQS, speculative=spec)
    d = plan.drafter
    assert d is not None and d.method == "dspark" and base.drafter is None
    # the drafter module at full size on the meta device: its parameters are what the plan counts (bf16)
    cfg = DSparkConfig.from_dict(
        json.loads((drafter_dir / "config.json").read_text()), k3.num_hidden_layers, k3.hidden_size, k3.vocab_size
    )
    with torch.device("meta"):
        module = DSparkDrafter(cfg, torch.bfloat16)
    assert d.weight_bytes == sum(p.numel() * p.element_size() for p in module.parameters())
    assert d.weight_bytes > 1 * GiB  # 5 layers at hidden 7168 plus two [V, r] Markov matrices
    assert d.kv_bytes_per_token == LAYERS * LATENT * 2 == 5760
    tokens = SEQS * LEN
    g0, b0 = plan.devices[0], base.devices[0]
    assert g0.non_expert_bytes - b0.non_expert_bytes == d.weight_bytes
    assert g0.kv_bytes - b0.kv_bytes == tokens * d.kv_bytes_per_token
    # the room they take is room for routed experts no more: GPU 0 holds fewer, and stays within capacity
    assert g0.num_experts < b0.num_experts and g0.free_bytes >= 0 and plan.fits
    for a, b in zip(plan.devices[1:], base.devices[1:]):  # the other GPUs hold no part of it
        assert (a.non_expert_bytes, a.kv_bytes) == (b.non_expert_bytes, b.kv_bytes)
    # the longest context that fits shrinks: each token also pays the drafter's KV on GPU 0
    assert plan.max_model_len_by_memory < base.max_model_len_by_memory
    assert plan.to_dict()["drafter"] == {"weight_bytes": d.weight_bytes, "kv_bytes_per_token": 5760, "method": "dspark"}


def test_cli_prints_the_drafter(capsys, drafter_dir):
    parser = argparse.ArgumentParser(prog="kimitui")
    plan_cmd.add_parser(parser.add_subparsers(dest="command"))
    argv = ["--config", str(K3), "--gpus", "6", "--max-model-len", str(LEN), "--max-num-seqs", str(SEQS)]
    args = parser.parse_args(["plan", *argv, "--speculative-config", json.dumps(recipe(drafter_dir))])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("drafter"))
    assert line.startswith("drafter (dspark, on GPU 0): weights ") and "KV 5.62 KiB/token" in line
    assert f"({SEQS * LEN * 5760 / GiB:.2f} GiB at {LEN:,} tokens x {SEQS} seq)" in line
