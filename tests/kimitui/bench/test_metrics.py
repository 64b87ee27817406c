import math

import numpy as np
import pytest

from kimitui.bench.metrics import calculate_metrics, format_result_block, percentile_key, result_json
from tests.kimitui.bench_fakes import synthetic_outputs

VLLM_KEYS = [
    "date",
    "endpoint_type",
    "backend",
    "label",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
]
OUR_KEYS = [
    "num_gpus",
    "tput_per_gpu",
    "avg_gpu_power_w",
    "avg_cpu_power_w",
    "energy_j",
    "tokens_per_kwh",
    "joules_per_output_token",
    "cost_per_mtok",
    "electricity_cost_per_mtok",
    "telemetry_backends",
]


def _metrics(percentiles=(99.0,)):
    return calculate_metrics([], synthetic_outputs(), 2.0, ("ttft", "tpot", "itl", "e2el"), percentiles)


def test_counts_and_throughputs():
    m = _metrics()
    assert (m.completed, m.failed, m.total_input, m.total_output) == (3, 1, 60, 9)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.5)
    assert m.total_token_throughput == pytest.approx(34.5)
    assert m.actual_output_lens == (5, 3, 1, 0)


def test_tpot_is_per_request_and_skips_single_token_outputs():
    s = _metrics().latency["tpot"]
    # A: (0.4 - 0.1) / 4 = 75 ms, B: (0.5 - 0.2) / 2 = 150 ms, C (1 token) excluded.
    assert s.mean_ms == pytest.approx(112.5)
    assert s.median_ms == pytest.approx(112.5)
    assert s.std_ms == pytest.approx(37.5)
    assert s.percentiles_ms[0][1] == pytest.approx(75 + 0.99 * 75)  # numpy linear percentile


def test_itl_is_pooled_over_all_chunk_gaps():
    s = _metrics().latency["itl"]
    # [50, 50, 100, 100, 100, 200] ms
    assert s.mean_ms == pytest.approx(100)
    assert s.median_ms == pytest.approx(100)
    assert s.std_ms == pytest.approx(50)
    assert s.percentiles_ms[0][1] == pytest.approx(195)


def test_ttft_e2el_and_percentiles():
    m = _metrics((50.0, 90.0, 99.9))
    t = m.latency["ttft"]
    assert t.mean_ms == pytest.approx(200) and t.std_ms == pytest.approx(math.sqrt(20000 / 3))
    assert [p for p, _ in t.percentiles_ms] == [50.0, 90.0, 99.9]
    assert t.percentiles_ms[1][1] == pytest.approx(np.percentile([100, 200, 300], 90))
    assert m.latency["e2el"].median_ms == pytest.approx(400)
    assert percentile_key(99.0) == "99" and percentile_key(99.9) == "99.9"


def test_peaks_follow_vllm():
    m = _metrics()
    assert m.max_output_tokens_per_s == 8.0  # 5 + 3 chunks land in the first second
    assert m.max_concurrent_requests == 2  # A [0, .4) overlaps B [.3, .8)


def test_empty_run_reads_zero_not_nan():
    m = calculate_metrics([], synthetic_outputs()[3:], 1.0)
    assert m.completed == 0 and m.latency["tpot"].mean_ms == 0.0


def _result(**kw):
    args = dict(
        duration_s=2.0,
        selected_percentile_metrics=("ttft", "tpot", "itl"),
        backend="openai",
        model_id="org/Kimi-K2",
        num_prompts=4,
        request_rate=math.inf,
        burstiness=1.0,
        max_concurrency=2,
        date="20260101-000000",
    )
    args.update(kw)
    return result_json(_metrics(), **args)


def test_json_keys_superset_of_vllm():
    r = _result()
    for k in VLLM_KEYS + OUR_KEYS:
        assert k in r, k
    assert list(r)[: len(VLLM_KEYS)] == VLLM_KEYS
    for name in ("ttft", "tpot", "itl"):
        for stat in ("mean", "median", "std", "p99"):
            assert f"{stat}_{name}_ms" in r
    assert "mean_e2el_ms" not in r
    assert r["request_rate"] == "inf" and r["request_goodput"] is None


def test_energy_keys_none_without_power():
    r = _result()
    for k in (
        "avg_gpu_power_w",
        "avg_cpu_power_w",
        "energy_j",
        "tokens_per_kwh",
        "joules_per_output_token",
        "electricity_cost_per_mtok",
    ):
        assert r[k] is None, k
    assert r["tput_per_gpu"] == pytest.approx(34.5)
    assert set(r["cost_per_mtok"]) == {"hyperscaler", "neocloud", "retail"}


def test_printed_block_matches_vllm_format():
    block = format_result_block(_result(request_rate=4.0))
    lines = block.split("\n")
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[1] == "{:<40} {:<10}".format("Successful requests:", 3)
    assert lines[1] == "Successful requests:                     3         "
    assert lines[2] == "Failed requests:                         1         "
    assert lines[3] == "Maximum request concurrency:             2         "
    assert lines[4] == "Request rate configured (RPS):           4.00      "
    assert lines[5] == "Benchmark duration (s):                  2.00      "
    assert lines[6].startswith("Total input tokens:") and lines[6].rstrip().endswith(" 60")
    assert "Peak concurrent requests:                2.00      " in lines
    assert "Request throughput (req/s):              1.50      " in lines
    assert "---------------Time to First Token----------------" in lines
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert "---------------Inter-token Latency----------------" in lines
    assert "Mean TPOT (ms):                          112.50    " in lines
    assert "P99 ITL (ms):                            195.00    " in lines
    assert "End-to-end Latency" not in block
    assert lines[-1] == "=" * 50
    assert all(len(line) == 51 for line in lines if not line.startswith(("-", "=")))  # 40 + 1 + 10
    assert "Request rate configured" not in format_result_block(_result())
