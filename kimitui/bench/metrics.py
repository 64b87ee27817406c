"""Serving metrics, printed block and saved JSON, with `vllm bench serve`'s exact math.

Mirrors vllm/benchmarks/serve.py `calculate_metrics`: stats use numpy defaults
(np.percentile's linear method, population std), `x or 0` for empty lists, seconds -> ms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np

from kimitui.bench.clients import RequestFuncOutput
from kimitui.bench.cost import DEFAULT_TIERS, PricingTier, efficiency_keys

METRICS = ("ttft", "tpot", "itl", "e2el")
_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


@dataclass(frozen=True)
class LatencyStats:
    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class BenchmarkMetrics:
    """vLLM's BenchmarkMetrics; latency stats per metric name in `latency`."""

    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    latency: dict[str, LatencyStats]
    actual_output_lens: tuple[int, ...]


def _stats(values: list[float], percentiles: Sequence[float]) -> LatencyStats:
    v = values or 0  # vLLM's `np.mean(x or 0)`: an empty list reads as 0, not NaN
    return LatencyStats(
        float(np.mean(v)) * 1000,
        float(np.median(v)) * 1000,
        float(np.std(v)) * 1000,
        tuple((float(p), float(np.percentile(v, p)) * 1000) for p in percentiles),
    )


def _peaks(ok: list[RequestFuncOutput]) -> tuple[float, int]:
    if not ok:
        return 0.0, 0
    t0 = min(o.start_time for o in ok)
    t_end = max(o.start_time + o.latency for o in ok)
    buckets = np.zeros(int(np.ceil(t_end - t0)) + 1)
    for o in ok:
        # Reconstructed chunk arrival times, bucketed per second as vLLM does.
        t = o.start_time + o.ttft
        times = [t]
        for gap in o.itl:
            t += gap
            times.append(t)
        for t in times:
            b = int(t - t0)
            if 0 <= b < len(buckets):
                buckets[b] += 1
    # Sweep line over half-open [start, end): departures sort before arrivals at ties.
    events = sorted([(o.start_time, 1) for o in ok] + [(o.start_time + o.latency, -1) for o in ok])
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return float(buckets.max()), peak


def calculate_metrics(
    input_requests: Sequence[Any],
    outputs: Sequence[RequestFuncOutput],
    duration_s: float,
    selected_percentile_metrics: Sequence[str] = ("ttft", "tpot", "itl"),
    selected_percentiles: Sequence[float] = (99.0,),
) -> BenchmarkMetrics:
    """Per-request TTFT/E2EL, TPOT = (latency - ttft)/(output_len - 1) for output_len > 1
    averaged across requests, ITL pooled over all chunk gaps. All stats are computed;
    `selected_percentile_metrics` only decides what is printed and saved."""
    del input_requests, selected_percentile_metrics  # kept for vLLM's signature
    lens: list[int] = []
    total_input = completed = 0
    ttfts, tpots, itls, e2els = [], [], [], []
    for o in outputs:
        if not o.success:
            lens.append(0)
            continue
        # vLLM retokenizes when a server sends no usage; our clients already count chunks,
        # so a zero here means a genuinely empty answer and vLLM's no-tokenizer rule (1) holds.
        n = o.output_tokens or 1
        lens.append(n)
        total_input += o.prompt_len
        if n > 1:
            tpots.append((o.latency - o.ttft) / (n - 1))
        itls.extend(o.itl)
        ttfts.append(o.ttft)
        e2els.append(o.latency)
        completed += 1
    total_output = sum(lens)
    peak_tok_s, peak_conc = _peaks([o for o in outputs if o.success])
    return BenchmarkMetrics(
        completed=completed,
        failed=sum(1 for o in outputs if not o.success),
        total_input=total_input,
        total_output=total_output,
        request_throughput=completed / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        max_output_tokens_per_s=peak_tok_s,
        max_concurrent_requests=peak_conc,
        latency={
            "ttft": _stats(ttfts, selected_percentiles),
            "tpot": _stats(tpots, selected_percentiles),
            "itl": _stats(itls, selected_percentiles),
            "e2el": _stats(e2els, selected_percentiles),
        },
        actual_output_lens=tuple(lens),
    )


def percentile_key(p: float) -> str:
    """vLLM's percentile spelling: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def result_json(
    metrics: BenchmarkMetrics,
    *,
    duration_s: float,
    selected_percentile_metrics: Sequence[str],
    backend: str,
    model_id: str,
    num_prompts: int,
    request_rate: float,
    burstiness: float,
    max_concurrency: int | None,
    tokenizer_id: str | None = None,
    label: str | None = None,
    endpoint_type: str = "openai",
    date: str | None = None,
    num_gpus: int = 1,
    energy: Any = None,
    pricing_tiers: Sequence[PricingTier] = DEFAULT_TIERS,
    usd_per_kwh: float | None = None,
    telemetry_backends: Sequence[dict[str, Any]] = (),
    http_client: str | None = None,
) -> dict[str, Any]:
    """The `--save-result` dict: vLLM's keys in vLLM's order, then kimitui's per-GPU,
    power, energy and cost keys (`energy` is a telemetry EnergyWindow over the benchmark
    window, or None; missing power gives None, never an estimate), and the HTTP client that
    timed the requests (None in process)."""
    result: dict[str, Any] = {
        "date": date or datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": endpoint_type,
        "backend": backend,
        "label": label,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": num_prompts,
        "request_rate": request_rate if request_rate < math.inf else "inf",
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        "duration": duration_s,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": None,  # no --goodput SLOs
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
    }
    for name in METRICS:
        if name not in selected_percentile_metrics:
            continue
        s = metrics.latency[name]
        result[f"mean_{name}_ms"] = s.mean_ms
        result[f"median_{name}_ms"] = s.median_ms
        result[f"std_{name}_ms"] = s.std_ms
        for p, v in s.percentiles_ms:
            result[f"p{percentile_key(p)}_{name}_ms"] = v
    result.update(
        efficiency_keys(
            total_token_throughput=metrics.total_token_throughput,
            total_output_tokens=metrics.total_output,
            total_tokens=metrics.total_input + metrics.total_output,
            duration_s=duration_s,
            num_gpus=num_gpus,
            energy=energy,
            pricing_tiers=pricing_tiers,
            usd_per_kwh=usd_per_kwh,
        )
    )
    result["telemetry_backends"] = list(telemetry_backends)
    result["http_client"] = http_client
    return result


def _row(label: str, value: Any) -> str:
    # vLLM prints counts with "{:<40} {:<10}" and rates/times with "{:<40} {:<10.2f}".
    if isinstance(value, int) and not isinstance(value, bool):
        return "{:<40} {:<10}".format(label, value)
    return "{:<40} {:<10.2f}".format(label, value)


def format_result_block(result: dict[str, Any]) -> str:
    """vLLM's "Serving Benchmark Result" block, rendered from a `result_json` dict (so a
    saved file prints the same way). Metric sections follow the keys present."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines.append(_row("Successful requests:", result["completed"]))
    lines.append(_row("Failed requests:", result["failed"]))
    if result.get("max_concurrency") is not None:
        lines.append(_row("Maximum request concurrency:", result["max_concurrency"]))
    if result.get("request_rate", "inf") != "inf":
        lines.append(_row("Request rate configured (RPS):", float(result["request_rate"])))
    lines.append(_row("Benchmark duration (s):", float(result["duration"])))
    lines.append(_row("Total input tokens:", result["total_input_tokens"]))
    lines.append(_row("Total generated tokens:", result["total_output_tokens"]))
    lines.append(_row("Request throughput (req/s):", float(result["request_throughput"])))
    lines.append(_row("Output token throughput (tok/s):", float(result["output_throughput"])))
    lines.append(_row("Peak output token throughput (tok/s):", float(result["max_output_tokens_per_s"])))
    lines.append(_row("Peak concurrent requests:", float(result["max_concurrent_requests"])))
    lines.append(_row("Total token throughput (tok/s):", float(result["total_token_throughput"])))
    for name in METRICS:
        if f"mean_{name}_ms" not in result:
            continue
        short, header = _HEADERS[name]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append(_row(f"Mean {short} (ms):", float(result[f"mean_{name}_ms"])))
        lines.append(_row(f"Median {short} (ms):", float(result[f"median_{name}_ms"])))
        suffix = f"_{name}_ms"
        for key, value in result.items():
            if key.startswith("p") and key.endswith(suffix) and key[1 : -len(suffix)].replace(".", "").isdigit():
                lines.append(_row(f"P{key[1 : -len(suffix)]} {short} (ms):", float(value)))
    lines.append("=" * 50)
    return "\n".join(lines)
