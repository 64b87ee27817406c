"""Where users meet speculative decoding outside the engine: the CLI flag, `kimitui bench`'s JSON
(vLLM's spec_decode_* keys, from the engine or a server's /metrics), the server's /metrics counters,
the TUI's throughput panel and `kimitui plan`."""

from __future__ import annotations

import argparse
import json

import pytest

from kimitui.bench.spec_counters import parse_spec_counters
from kimitui.cli import main
from kimitui.commands.engine_flags import add_engine_arguments, engine_args_from
from kimitui.engine.metrics import EngineStats
from kimitui.engine.spec_decode.stats import SpecDecodeStats
from kimitui.server.metrics import ServerMetrics
from tests.kimitui.bench.test_e2e import WORKLOAD, _bench, _saved, demo_checkpoint  # noqa: F401
from tests.kimitui.commands.test_plan import CONFIGS, run_plan

SPEC_KEYS = (
    "spec_decode_acceptance_rate",
    "spec_decode_acceptance_length",
    "spec_decode_num_drafts",
    "spec_decode_draft_tokens",
    "spec_decode_accepted_tokens",
    "spec_decode_per_position_acceptance_rates",
)


def _stats(spec):
    return EngineStats(
        num_running=0,
        num_waiting=0,
        kv_cache_usage=0.0,
        prefix_cache_hit_rate=0.0,
        prefill_tokens_per_s=0.0,
        decode_tokens_per_s=0.0,
        num_preemptions=0,
        kv_cache_capacity_tokens=16,
        total_prompt_tokens=0,
        total_generation_tokens=0,
        num_finished=0,
        spec_decode=spec,
    )


def test_flag_parses_into_engine_args_and_bad_json_is_one_line(capsys):
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    args = engine_args_from(p.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']))
    assert args.speculative.method == "ngram" and args.speculative.num_speculative_tokens == 3
    assert args.speculative.prompt_lookup_min == args.speculative.prompt_lookup_max == 5
    for bad, needle in (
        ('{"method": "medusa", "num_speculative_tokens": 3}', "method 'medusa'"),
        ('{"method": "ngram", "num_speculative_token": 3}', "unknown key 'num_speculative_token'"),
        ('{"method": "ngram"', "not valid JSON"),
        ('{"method": "eagle3", "num_speculative_tokens": 3}', "needs model"),
    ):
        with pytest.raises(SystemExit) as e:
            p.parse_args(["--speculative-config", bad])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert needle in err, err


def test_metrics_render_vllm_counter_names_and_parse_back():
    spec = SpecDecodeStats()
    spec.observe(4, 3)
    spec.observe(4, 1)
    text = ServerMetrics("m").render(_stats(spec))
    assert "kimitui:spec_decode_num_drafts" in text and 'position="2"' in text
    back = parse_spec_counters(text)
    assert (back.num_drafts, back.num_draft_tokens, back.num_accepted_tokens) == (2, 8, 4)
    assert back.accepted_per_pos == [2, 1, 1, 0]
    assert parse_spec_counters(ServerMetrics("m").render(_stats(None))) is None


def test_vllm_exposition_text_parses():
    # the counters as a vLLM 0.32 server exposes them (prometheus_client counters: _total samples,
    # per-position by label), see vllm/v1/spec_decode/metrics.py
    text = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="kimi"} 10.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="kimi"} 30.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="kimi"} 18.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="kimi",position="0"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="kimi",position="1"} 6.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="kimi",position="2"} 3.0
"""
    got = parse_spec_counters(text)
    assert (got.num_drafts, got.num_draft_tokens, got.num_accepted_tokens) == (10, 30, 18)
    assert got.accepted_per_pos == [9, 6, 3]
    assert got.as_json()["spec_decode_acceptance_length"] == pytest.approx(2.8)
    assert got.as_json()["spec_decode_acceptance_rate"] == pytest.approx(60.0)


def test_bench_json_has_spec_keys(demo_checkpoint, tmp_path, capsys):  # noqa: F811
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
    rc, out, err = _bench(
        [*WORKLOAD, "--speculative-config", spec, "--save-result", "--result-dir", str(tmp_path)], capsys
    )
    assert rc == 0, err
    result = _saved(tmp_path)
    for key in SPEC_KEYS:
        assert key in result, key
    assert result["spec_decode_num_drafts"] >= 0 and result["total_output_tokens"] == 8 * 16


def test_throughput_panel_shows_acceptance():
    from textual.app import App

    from kimitui.tui.widgets.throughput_panel import ThroughputPanel

    spec = SpecDecodeStats()
    spec.observe(4, 2)

    class One(App):
        def compose(self):
            yield ThroughputPanel(id="tp")

    async def run():
        async with One().run_test() as pilot:
            panel = pilot.app.query_one(ThroughputPanel)
            panel.update_stats(_stats(spec))
            await pilot.pause()
            body = str(panel.query_one("#throughput-body").render())
            assert "spec accept  50%" in body and "mean length 3.00" in body and "100% 100% 0% 0%" in body

    import asyncio

    asyncio.run(run())


def test_plan_counts_scratch_states_and_the_drafter(tmp_path, capsys):
    k3 = str(CONFIGS / "kimi_k3.json")
    assert run_plan(["--config", k3, "--gpus", "4", "--json"]) in (0, 1)
    base = json.loads(capsys.readouterr().out)
    spec = '{"method": "ngram", "num_speculative_tokens": 4}'
    assert run_plan(["--config", k3, "--gpus", "4", "--json", "--speculative-config", spec]) in (0, 1)
    with_spec = json.loads(capsys.readouterr().out)
    s0, s1 = base["devices"][0]["state_bytes"], with_spec["devices"][0]["state_bytes"]
    assert s0 > 0 and s1 == 5 * s0  # a state per sequence, plus one per draft position
    drafter = tmp_path / "eagle3"
    drafter.mkdir()
    (drafter / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "hidden_size": 7168,
                "intermediate_size": 18432,
                "num_attention_heads": 64,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "draft_vocab_size": 32000,
                "torch_dtype": "bfloat16",
            }
        )
    )
    k26 = str(CONFIGS / "kimi_k26.json")
    assert run_plan(["--config", k26, "--gpus", "6", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    eagle = json.dumps({"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 3})
    assert run_plan(["--config", k26, "--gpus", "6", "--json", "--speculative-config", eagle]) in (0, 1)
    spec3 = json.loads(capsys.readouterr().out)
    w0 = spec3["devices"][0]["weight_bytes"] - plain["devices"][0]["weight_bytes"]
    assert 1.5e9 < w0 < 3.5e9  # fc 3x7168^2 + one layer + a 32k lm_head, bf16: about 2.2 GB on GPU 0
    assert spec3["devices"][1]["weight_bytes"] == plain["devices"][1]["weight_bytes"]
    assert spec3["devices"][0]["kv_bytes"] > plain["devices"][0]["kv_bytes"]
    assert (
        main(
            [
                "plan",
                "--config",
                k26,
                "--gpus",
                "6",
                "--speculative-config",
                '{"method": "eagle3", "model": "/nonexistent", "num_speculative_tokens": 3}',
            ]
        )
        == 2
    )
    assert "does not exist" in capsys.readouterr().err
