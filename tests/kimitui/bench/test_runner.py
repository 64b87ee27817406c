"""run_benchmark / run_sweep end to end on a fake in-process engine, plus flags and imports."""

import argparse
import asyncio
import json
import math
import subprocess
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from kimitui.bench.args import add_bench_arguments, config_from_args
from kimitui.bench.clients import InProcessClient
from kimitui.bench.metrics import format_result_block
from kimitui.bench.runner import (
    BenchmarkConfig,
    default_result_filename,
    run_benchmark,
    run_sweep,
)
from tests.kimitui.bench.test_metrics import OUR_KEYS, VLLM_KEYS
from tests.kimitui.bench_fakes import WordTokenizer


@dataclass
class Params:
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 1.0


@dataclass
class FakeEngine:
    """Yields cumulative outputs, two tokens in the first yield, one per later yield."""

    step_s: float = 0.002
    aborted: list = field(default_factory=list)

    async def generate(self, prompt, params, request_id):
        ids = []
        while len(ids) < params.max_tokens:
            await asyncio.sleep(self.step_s)
            ids = ids + ([7, 8] if not ids else [9])
            ids = ids[: params.max_tokens]
            comp = SimpleNamespace(
                index=0, text=" ".join(map(str, ids)), token_ids=ids, logprobs=None, finish_reason=None
            )
            yield SimpleNamespace(
                request_id=request_id,
                prompt_token_ids=prompt["prompt_token_ids"],
                outputs=[comp],
                finished=len(ids) >= params.max_tokens,
                metrics=None,
            )

    async def abort(self, request_id):
        self.aborted.append(request_id)


class FakeSampler:
    interval_s = 0.01

    def history(self, since_t=None):
        return []

    def backend_status(self):
        return [SimpleNamespace(name="amdsmi", available=False, detail="not installed")]


def _config(**kw):
    base = dict(random_input_len=16, random_output_len=4, num_prompts=6, max_concurrency=2, num_warmups=2, seed=1)
    base.update(kw)
    return BenchmarkConfig(**base)


def test_run_benchmark_end_to_end(tmp_path):
    engine = FakeEngine()
    client = InProcessClient(engine, model="demo", sampling_params_cls=Params)
    seen = []
    cfg = _config(save_result=True, result_dir=str(tmp_path), num_gpus=2)
    result = asyncio.run(
        run_benchmark(cfg, client, WordTokenizer(), sampler=FakeSampler(), progress=lambda *a: seen.append(a))
    )
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == 24 and result["total_input_tokens"] == 96
    assert result["max_concurrency"] == 2 and result["cancelled"] is False
    for k in VLLM_KEYS + OUR_KEYS:
        assert k in result, k
    assert result["energy_j"] is None and result["avg_gpu_power_w"] is None
    assert result["tput_per_gpu"] == pytest.approx(result["total_token_throughput"] / 2)
    assert result["telemetry_backends"] == [{"name": "amdsmi", "available": False, "detail": "not installed"}]
    assert seen[0][:2] == (0, 6) and seen[-1][:2] == (6, 6)
    # One yield carried two tokens: 3 yields -> 2 ITL gaps, TPOT over 3 token gaps.
    assert result["mean_tpot_ms"] > 0 and result["mean_itl_ms"] > 0
    saved = json.loads(open(result["result_file"]).read())
    assert saved["completed"] == 6
    assert result["result_file"].split("/")[-1].startswith("kimitui-infqps-concurrency2-demo-")
    assert "Serving Benchmark Result" in format_result_block(result)


def test_cancel_aborts_in_flight_requests():
    async def main():
        engine = FakeEngine(step_s=0.05)
        client = InProcessClient(engine, sampling_params_cls=Params)
        cancel = asyncio.Event()
        # Each request needs 20 steps of 50 ms; cancel while the first two are mid-stream.
        asyncio.get_running_loop().call_later(0.3, cancel.set)
        cfg = _config(num_prompts=50, random_output_len=20, num_warmups=0)
        result = await asyncio.wait_for(run_benchmark(cfg, client, WordTokenizer(), cancel_event=cancel), 10)
        return engine, result

    engine, result = asyncio.run(main())
    assert result["cancelled"] is True
    assert result["completed"] == 0 and result["failed"] == 2  # the 48 never issued are absent
    assert result["errors_sample"] == ["cancelled", "cancelled"]
    assert sorted(engine.aborted) == ["bench-0", "bench-1"]


def test_sweep_reports_frontier_and_ladder():
    client = InProcessClient(FakeEngine(), sampling_params_cls=Params)
    cfg = _config(sweep_concurrency=(1, 2), num_warmups=0, num_prompts=4)
    out = asyncio.run(run_sweep(cfg, client, WordTokenizer()))
    assert [p["max_concurrency"] for p in out["points"]] == [1, 2]
    assert out["frontier"] and set(out["ladder"]) == {30, 50, 75, 100, 150, 200}
    assert set(out["ladder_cost_per_mtok"]) == set(out["ladder"])


def test_flags_build_a_config(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(
        [
            "--random-input-len",
            "8192",
            "--random-output-len",
            "1024",
            "--random-range-ratio",
            "0.2",
            "--num-prompts",
            "64",
            "--max-concurrency",
            "16",
            "--no-ignore-eos",
            "--temperature",
            "0",
            "--metric-percentiles",
            "50,99.9",
            "--percentile-metrics",
            "ttft,tpot,itl,e2el",
            "--sweep-concurrency",
            "1,2,4",
            "--pricing-tier",
            "retail=2.90",
            "--pricing-tier",
            "own=1",
            "--usd-per-kwh",
            "0.2",
            "--base-url",
            "http://127.0.0.1:8000",
            "--num-gpus",
            "6",
        ]
    )
    cfg = config_from_args(args)
    assert cfg.random_input_len == 8192 and cfg.max_concurrency == 16 and cfg.ignore_eos is False
    assert cfg.metric_percentiles == (50.0, 99.9) and cfg.sweep_concurrency == (1, 2, 4)
    assert cfg.percentile_metrics == ("ttft", "tpot", "itl", "e2el") and cfg.num_gpus == 6
    tiers = {t.name: t.usd_per_gpu_hour for t in cfg.pricing_tiers}
    assert tiers["retail"] == 2.90 and tiers["own"] == 1.0 and cfg.usd_per_kwh == 0.2
    defaults = config_from_args(parser.parse_args([]))
    assert defaults.request_rate == math.inf and defaults.ignore_eos is True
    assert defaults.percentile_metrics == ("ttft", "tpot", "itl") and defaults.metric_percentiles == (99.0,)
    with pytest.raises(ValueError, match="percentile-metrics"):
        BenchmarkConfig(percentile_metrics=("ttft", "latency"))
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        BenchmarkConfig(random_range_ratio=1.0)


def test_default_filename_is_vllms():
    r = {
        "backend": "openai",
        "request_rate": 4.0,
        "max_concurrency": None,
        "model_id": "moonshotai/Kimi-K2.6",
        "date": "20260101-120000",
        "label": None,
    }
    assert default_result_filename(r) == "openai-4.0qps-Kimi-K2.6-20260101-120000.json"


def test_bench_never_imports_ui_server_or_engine():
    code = (
        "import sys, kimitui.bench.runner, kimitui.bench.clients, kimitui.bench.sweep; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('textual', 'fastapi', 'torch')"
        " or m.startswith('kimitui.engine') or m.startswith('kimitui.server') or m.startswith('kimitui.tui')]; print(bad); assert not bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


class ConstantPowerSampler(FakeSampler):
    """Bracketing samples of 2 GPUs at 300 W each and a CPU package at 50 W."""

    def __init__(self):
        self.samples = []

    def sample_now(self):
        import time

        from kimitui.telemetry import GpuSample, Sample

        gpus = tuple(GpuSample(i, "gpu", "amd", power_w=300.0) for i in range(2))
        self.samples.append(Sample(time.monotonic(), time.time(), gpus, cpu_power_w=50.0))
        return self.samples[-1]

    def history(self, since_t=None):
        return [s for s in self.samples if since_t is None or s.t >= since_t]


def test_power_is_integrated_over_the_benchmark_window():
    client = InProcessClient(FakeEngine(), sampling_params_cls=Params)
    cfg = _config(num_warmups=0, num_gpus=2, usd_per_kwh=0.1)
    r = asyncio.run(run_benchmark(cfg, client, WordTokenizer(), sampler=ConstantPowerSampler()))
    assert r["avg_gpu_power_w"] == pytest.approx(600.0)
    assert r["avg_cpu_power_w"] == pytest.approx(50.0)
    assert r["energy_scope"] == "gpu+cpu"
    assert r["energy_j"] == pytest.approx(650.0 * r["duration"], rel=0.05)
    assert r["joules_per_output_token"] == pytest.approx(r["energy_j"] / r["total_output_tokens"])
    assert r["electricity_cost_per_mtok"] == pytest.approx(
        0.65 * 0.1 * 1e6 / (r["total_token_throughput"] * 3600), rel=0.05
    )
