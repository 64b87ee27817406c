"""`kimitui bench --dataset-name multi-turn` (kimitui/bench/multi_turn.py): sessions that resend the
conversation, per-turn TTFT, and a prefix-cache hit rate that agrees with the engine's counters,
in process and against the server over HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kimitui.bench.multi_turn import parse_prefix_counters, sample_sessions
from kimitui.cli import main
from tests.helpers.http_server import serving

WORKLOAD = [
    "--dataset-name",
    "multi-turn",
    "--num-prompts",
    "2",
    "--multi-turn-turns",
    "3",
    "--random-input-len",
    "16",
    "--random-output-len",
    "24",
    "--multi-turn-system-len",
    "64",
    "--multi-turn-think-time",
    "0.05",
    "--max-concurrency",
    "2",
    "--ignore-eos",
]


class _Tok:
    vocab_size = 300
    special_ids = {0, 1}

    def encode(self, text: str) -> list[int]:
        return [2 + b % 290 for b in text.encode()][:40]

    def decode(self, ids):
        return ""


def test_sessions_share_the_tools_and_system_prefix():
    sessions = sample_sessions(_Tok(), 3, 4, system_len=100, user_len=10, output_len=7, seed=1)
    assert len(sessions) == 3 and all(len(s.user_ids) == len(s.output_lens) == 4 for s in sessions)
    assert len(sessions[0].prefix_ids) == 100 and all(s.prefix_ids == sessions[0].prefix_ids for s in sessions)
    assert all(len(u) == 10 and not set(u) & {0, 1} for s in sessions for u in s.user_ids)
    assert sessions[0].user_ids != sessions[1].user_ids
    assert sample_sessions(_Tok(), 3, 4, 100, 10, 7, seed=1) == sessions  # seeded
    with pytest.raises(ValueError, match="--multi-turn-turns must be >= 1"):
        sample_sessions(_Tok(), 1, 0, 10, 10, 10)


def test_prefix_counters_parse_from_prometheus_text():
    text = (
        "# TYPE kimitui:prefix_cache_queries_total counter\n"
        'kimitui:prefix_cache_queries_total{model_name="m"} 120\n'
        "# TYPE kimitui:prefix_cache_hits_total counter\n"
        'kimitui:prefix_cache_hits_total{model_name="m"} 96\n'
    )
    assert parse_prefix_counters(text) == (120, 96)
    assert parse_prefix_counters("# TYPE other_total counter\nother_total 1\n") is None


def _run(argv, tmp: Path, capsys) -> dict:
    rc = main(["bench", *argv, "--save-result", "--result-dir", str(tmp)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "Multi-turn" in out and "Prefix cache hit rate (engine):" in out
    [f] = tmp.glob("*.json")
    return json.loads(f.read_text())


def _check(result: dict) -> None:
    assert result["completed"] == 6 and result["dataset_name"] == "multi-turn"
    assert result["total_output_tokens"] == 6 * 24
    turns = result["per_turn"]
    assert [t["turn"] for t in turns] == [1, 2, 3] and all(t["completed"] == 2 for t in turns)
    # later turns find the whole previous turn (prompt + reply) but its last partial block:
    # turn 2 hits 96 of 120 tokens (103 computed), turn 3 128 of 160 (143 computed)
    assert turns[1]["prefix_cache_hit_rate"] == pytest.approx(96 / 120)
    assert turns[2]["prefix_cache_hit_rate"] == pytest.approx(128 / 160)
    assert turns[1]["mean_prompt_len"] == 64 + 2 * 16 + 24
    # the requests' cached tokens and the engine's counters agree
    assert result["prefix_cache_hit_rate"] == pytest.approx(result["engine_prefix_cache_hit_rate"])
    assert 0.5 < result["prefix_cache_hit_rate"] < 1
    assert result["multi_turn_system_len"] == 64


def test_multi_turn_in_process(tmp_path, capsys):
    _check(_run(WORKLOAD, tmp_path, capsys))


def test_multi_turn_over_http(tmp_path, capsys):
    pytest.importorskip("uvicorn")
    from kimitui.engine import AsyncLLM, EngineArgs

    with serving(AsyncLLM(engine_args=EngineArgs(model=None)), "kimitui-demo") as port:
        result = _run([*WORKLOAD, "--base-url", f"http://127.0.0.1:{port}"], tmp_path, capsys)
    assert result["backend"] == "openai"
    _check(result)
