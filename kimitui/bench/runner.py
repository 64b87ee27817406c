"""One benchmark run (or a concurrency sweep) from a validated config (its CLI flags: args.py).

The flow is vLLM's `benchmark()`: sample the workload, warm up, issue requests on the
arrival schedule, time the window, compute metrics. We add the energy window (monotonic
clock, bracketed by telemetry samples) and the per-GPU and cost keys.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from kimitui.bench.arrivals import dispatch, run_warmups
from kimitui.bench.cost import (
    DEFAULT_TIERS,
    DEFAULT_USD_PER_KWH,
    PricingTier,
    usd_per_mtok,
)
from kimitui.bench.metrics import METRICS, calculate_metrics, result_json
from kimitui.bench.spec_counters import read_spec_counters
from kimitui.bench.sweep import frontier, ladder, point_from_result
from kimitui.bench.workload import sample_random

ProgressFn = Callable[[int, int, float], None]


@dataclass(frozen=True)
class BenchmarkConfig:
    """Every `kimitui bench` setting, validated once."""

    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    num_prompts: int = 1000
    max_concurrency: int | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    ignore_eos: bool = True
    temperature: float | None = None
    seed: int = 0
    num_warmups: int = 0
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    metric_percentiles: tuple[float, ...] = (99.0,)
    save_result: bool = False
    result_filename: str | None = None
    result_dir: str | None = None
    sweep_concurrency: tuple[int, ...] = ()
    base_url: str | None = None
    model: str | None = None
    num_gpus: int = 1  # 0: no GPU (the engine runs on the CPU); per-GPU numbers are then n/a
    pricing_tiers: tuple[PricingTier, ...] = DEFAULT_TIERS
    usd_per_kwh: float | None = DEFAULT_USD_PER_KWH
    label: str | None = None
    max_model_len: int | None = None
    # "random" (vLLM's) or "multi-turn" (kimitui/bench/multi_turn.py: num_prompts sessions)
    dataset_name: str = "random"
    multi_turn_turns: int = 4
    multi_turn_think_time: float = 0.0  # seconds between a reply and the next user message
    multi_turn_system_len: int = 512  # shared tools + system prompt tokens

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(self.random_input_len >= 1, f"--random-input-len must be >= 1, got {self.random_input_len}")
        need(self.random_output_len >= 1, f"--random-output-len must be >= 1, got {self.random_output_len}")
        need(
            0.0 <= self.random_range_ratio < 1.0,
            f"--random-range-ratio must be in [0, 1), got {self.random_range_ratio}",
        )
        need(self.random_prefix_len >= 0, f"--random-prefix-len must be >= 0, got {self.random_prefix_len}")
        need(self.num_prompts >= 1, f"--num-prompts must be >= 1, got {self.num_prompts}")
        need(
            self.max_concurrency is None or self.max_concurrency >= 1,
            f"--max-concurrency must be >= 1, got {self.max_concurrency}",
        )
        need(self.request_rate > 0, f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        need(self.burstiness > 0, f"--burstiness must be > 0, got {self.burstiness}")
        need(self.temperature is None or self.temperature >= 0, f"--temperature must be >= 0, got {self.temperature}")
        need(self.num_warmups >= 0, f"--num-warmups must be >= 0, got {self.num_warmups}")
        unknown = set(self.percentile_metrics) - set(METRICS)
        need(not unknown, f"--percentile-metrics: unknown {sorted(unknown)}; choose from {', '.join(METRICS)}")
        need(
            all(0 < p <= 100 for p in self.metric_percentiles),
            f"--metric-percentiles must lie in (0, 100], got {list(self.metric_percentiles)}",
        )
        need(all(c >= 1 for c in self.sweep_concurrency), "--sweep-concurrency levels must be >= 1")
        need(self.num_gpus >= 0, f"--num-gpus must be >= 0, got {self.num_gpus}")
        need(self.usd_per_kwh is None or self.usd_per_kwh >= 0, f"--usd-per-kwh must be >= 0, got {self.usd_per_kwh}")
        need(
            self.dataset_name in ("random", "multi-turn"),
            f"--dataset-name must be random or multi-turn, got {self.dataset_name!r}",
        )
        need(self.multi_turn_turns >= 1, f"--multi-turn-turns must be >= 1, got {self.multi_turn_turns}")
        need(self.multi_turn_think_time >= 0, f"--multi-turn-think-time must be >= 0, got {self.multi_turn_think_time}")
        need(self.multi_turn_system_len >= 0, f"--multi-turn-system-len must be >= 0, got {self.multi_turn_system_len}")


async def _bracket_sample(sampler: Any) -> None:
    # A sample on each side of the window lets telemetry interpolate energy at t0 and t1.
    if hasattr(sampler, "sample_now"):
        await asyncio.to_thread(sampler.sample_now)


async def _measure_energy(sampler: Any, t0: float, t1: float) -> Any:
    if sampler is None:
        return None
    from kimitui.telemetry import window_energy

    interval = float(getattr(sampler, "interval_s", 1.0))
    try:
        await _bracket_sample(sampler)
        # Without sample_now, wait (bounded) for the sampler thread's next tick past t1.
        deadline = time.monotonic() + 2 * interval
        while not any(s.t >= t1 for s in sampler.history(since_t=t1)) and time.monotonic() < deadline:
            await asyncio.sleep(min(0.05, interval))
        return window_energy(sampler.history(since_t=t0 - 3 * interval), t0, t1)
    except Exception:  # noqa: BLE001 - a telemetry failure must not lose the benchmark
        return None


def _backend_status(sampler: Any) -> list[dict[str, Any]]:
    if sampler is None:
        return []
    try:
        return [{"name": s.name, "available": s.available, "detail": s.detail} for s in sampler.backend_status()]
    except Exception as e:  # noqa: BLE001
        return [{"name": "telemetry", "available": False, "detail": f"{type(e).__name__}: {e}"}]


async def run_benchmark(
    config: BenchmarkConfig,
    client: Any,
    tokenizer: Any,
    sampler: Any = None,
    progress: ProgressFn | None = None,
    cancel_event: asyncio.Event | None = None,
) -> dict[str, Any]:
    """Run one benchmark point and return its result dict (vLLM's --save-result keys plus
    kimitui's). `client` is an InProcessClient or OpenAICompletionsClient; `sampler` a
    running TelemetrySampler (or None: power keys are then null); `progress(done, total,
    elapsed_s)` is called as requests finish; setting `cancel_event` stops issuing requests
    and aborts those in flight (the result then has "cancelled": true)."""
    if config.dataset_name == "multi-turn":
        return await run_multi_turn(config, client, tokenizer, sampler, progress, cancel_event)
    workload = sample_random(
        tokenizer,
        config.num_prompts,
        config.random_input_len,
        config.random_output_len,
        config.random_range_ratio,
        config.random_prefix_len,
        config.seed,
        max_model_len=config.max_model_len,
        text=getattr(client, "needs_text", True),
    )
    requests = workload.requests
    cancel = cancel_event or asyncio.Event()
    await run_warmups(requests[0], client, config.num_warmups, config.max_concurrency)

    spec_before = await read_spec_counters(client)
    if sampler is not None:
        await _bracket_sample(sampler)
    bench_start = time.perf_counter()
    t0 = time.monotonic()

    on_done = _progress_counter(progress, len(requests), bench_start)
    if progress is not None:
        progress(0, len(requests), 0.0)
    outputs = await dispatch(
        requests,
        client,
        max_concurrency=config.max_concurrency,
        request_rate=config.request_rate,
        burstiness=config.burstiness,
        seed=config.seed,
        cancel_event=cancel,
        on_done=on_done,
    )
    duration = time.perf_counter() - bench_start
    energy = await _measure_energy(sampler, t0, time.monotonic())
    result = _result(config, client, sampler, requests, outputs, duration, energy, config.request_rate)
    spec_after = await read_spec_counters(client)
    if spec_before is not None and spec_after is not None:
        result.update(spec_after.since(spec_before).as_json())  # vLLM bench's spec_decode_* keys
    result["random_range_ratio"] = config.random_range_ratio
    result["num_warmups"] = config.num_warmups
    return _finish(result, config, outputs, cancel, workload.note)


def _progress_counter(progress: ProgressFn | None, total: int, start: float) -> Callable[[Any], None]:
    """The `on_done` callback that counts finished requests into `progress(done, total, elapsed_s)`."""
    done = 0

    def on_done(_: Any) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, time.perf_counter() - start)

    return on_done


def _result(
    config: BenchmarkConfig,
    client: Any,
    sampler: Any,
    requests: list,
    outputs: list,
    duration: float,
    energy: Any,
    request_rate: float,
) -> dict[str, Any]:
    """vLLM's --save-result keys for the requests of one run."""
    metrics = calculate_metrics(requests, outputs, duration, config.percentile_metrics, config.metric_percentiles)
    model = getattr(client, "model", None) or config.model or "unknown"
    return result_json(
        metrics,
        duration_s=duration,
        selected_percentile_metrics=config.percentile_metrics,
        backend=getattr(client, "backend", "openai"),
        model_id=model,
        tokenizer_id=model,
        num_prompts=config.num_prompts,
        request_rate=request_rate,
        burstiness=config.burstiness,
        max_concurrency=config.max_concurrency,
        label=config.label,
        num_gpus=config.num_gpus,
        energy=energy,
        pricing_tiers=config.pricing_tiers,
        usd_per_kwh=config.usd_per_kwh,
        telemetry_backends=_backend_status(sampler),
        http_client=getattr(client, "http_client", None),
    )


def _finish(
    result: dict[str, Any], config: BenchmarkConfig, outputs: list, cancel: asyncio.Event, notes: Any
) -> dict[str, Any]:
    """The keys every run ends with, and the saved file when asked."""
    result["random_input_len"] = config.random_input_len
    result["random_output_len"] = config.random_output_len
    result["notes"] = notes
    result["cancelled"] = cancel.is_set()
    result["errors_sample"] = [o.error for o in outputs if not o.success][:10]
    if config.save_result:
        result["result_file"] = str(save_result(result, config.result_dir, config.result_filename))
    return result


async def run_multi_turn(
    config: BenchmarkConfig,
    client: Any,
    tokenizer: Any,
    sampler: Any = None,
    progress: ProgressFn | None = None,
    cancel_event: asyncio.Event | None = None,
) -> dict[str, Any]:
    """`--dataset-name multi-turn`: `num_prompts` sessions of `multi_turn_turns` turns
    (kimitui/bench/multi_turn.py); the usual metrics over every turn, plus per-turn TTFT and the
    prefix-cache hit rate from the requests and from the engine's counters."""
    from kimitui.bench.multi_turn import multi_turn_keys, read_prefix_counters, run_sessions, sample_sessions

    sessions = sample_sessions(
        tokenizer,
        config.num_prompts,
        config.multi_turn_turns,
        config.multi_turn_system_len,
        config.random_input_len,
        config.random_output_len,
        config.random_range_ratio,
        config.seed,
    )
    longest = max(len(s.prefix_ids) + sum(map(len, s.user_ids)) + sum(s.output_lens) for s in sessions)
    if config.max_model_len is not None and longest > config.max_model_len:
        raise ValueError(
            f"a multi-turn session reaches {longest} tokens, more than max_model_len "
            f"{config.max_model_len}; lower --multi-turn-turns, --random-input-len or --random-output-len"
        )
    if hasattr(client, "return_token_ids"):
        client.return_token_ids = True
    cancel = cancel_event or asyncio.Event()
    total = config.num_prompts * config.multi_turn_turns
    before = await read_prefix_counters(client)
    if sampler is not None:
        await _bracket_sample(sampler)
    bench_start = time.perf_counter()
    t0 = time.monotonic()

    on_done = _progress_counter(progress, total, bench_start)
    turns = await run_sessions(sessions, client, config.max_concurrency, config.multi_turn_think_time, cancel, on_done)
    duration = time.perf_counter() - bench_start
    energy = await _measure_energy(sampler, t0, time.monotonic())
    after = await read_prefix_counters(client)
    requests, outputs = [t.request for t in turns], [t.output for t in turns]
    result = _result(config, client, sampler, requests, outputs, duration, energy, math.inf)
    result.update(multi_turn_keys(turns, config.multi_turn_turns, before, after, config.metric_percentiles))
    result["multi_turn_think_time"] = config.multi_turn_think_time
    result["multi_turn_system_len"] = len(sessions[0].prefix_ids)
    return _finish(result, config, outputs, cancel, None)


async def run_sweep(
    config: BenchmarkConfig,
    client: Any,
    tokenizer: Any,
    sampler: Any = None,
    progress: ProgressFn | None = None,
    cancel_event: asyncio.Event | None = None,
) -> dict[str, Any]:
    """One `run_benchmark` per `config.sweep_concurrency` level, then the frontier and the
    ladder (tok/s per GPU at 30..200 tok/s per user, None where not reached)."""
    cancel = cancel_event or asyncio.Event()
    points: list[dict[str, Any]] = []
    for c in config.sweep_concurrency:
        if cancel.is_set():
            break
        filename = config.result_filename
        if filename:
            p = Path(filename)
            filename = str(p.with_name(f"{p.stem}-concurrency{c}{p.suffix or '.json'}"))  # keeps its folder
        point_cfg = replace(config, max_concurrency=c, sweep_concurrency=(), result_filename=filename)
        points.append(await run_benchmark(point_cfg, client, tokenizer, sampler, progress, cancel))
    return sweep_summary(points, config, cancel.is_set())


def sweep_summary(points: list[dict[str, Any]], config: BenchmarkConfig, cancelled: bool) -> dict[str, Any]:
    """The sweep's summary (frontier, ladder, ladder $/M tokens) over the points measured;
    a point cut short by Cancel measured too little to sit on the frontier."""
    whole = [p for p in points if not p.get("cancelled")]
    front = frontier(p for p in map(point_from_result, whole) if p is not None)
    values = ladder(front)
    return {
        "points": points,
        "frontier": [asdict(p) for p in front],
        "ladder": values,
        "ladder_cost_per_mtok": {
            target: None
            if tput is None
            else {t.name: usd_per_mtok(t.usd_per_gpu_hour, tput) for t in config.pricing_tiers}
            for target, tput in values.items()
        },
        "cancelled": cancelled,
    }


def default_result_filename(result: dict[str, Any]) -> str:
    """vLLM's `{label|backend}-{rate}qps[-concurrency{N}]-{model}-{YYYYmmdd-HHMMSS}.json`."""
    rate = result.get("request_rate", "inf")
    rate = "inf" if rate == "inf" else str(float(rate))
    conc = result.get("max_concurrency")
    conc_part = f"-concurrency{conc}" if conc is not None else ""
    model = str(result.get("model_id") or "model").rstrip("/").split("/")[-1]
    date = result.get("date") or datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{result.get('label') or result.get('backend', 'openai')}-{rate}qps{conc_part}-{model}-{date}.json"


def sweep_result_filename(sweep: dict[str, Any], result_filename: str | None = None) -> str:
    """The sweep summary's file: `--result-filename` exactly as given (each point then goes to
    `{stem}-concurrency{N}{suffix}`, so none collides with it), else
    `{label|backend}-sweep-{model}-{date of the first point}.json`."""
    if result_filename:
        return result_filename
    first = sweep["points"][0]
    model = str(first.get("model_id") or "model").rstrip("/").split("/")[-1]
    return f"{first.get('label') or first.get('backend', 'openai')}-sweep-{model}-{first['date']}.json"


def save_result(result: dict[str, Any], result_dir: str | None = None, filename: str | None = None) -> Path:
    """Write `result` as JSON (vLLM's default name unless `filename`); returns the path."""
    path = Path(filename or default_result_filename(result))
    if result_dir:
        path = Path(result_dir) / path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str), encoding="utf-8")
    return path
