"""Prometheus text exposition for /metrics (vLLM's metric names, ``kimitui:`` prefix).

Gauges and token counters are read from the engine's latest stats snapshot at scrape time;
latency histograms are fed by the request handlers as requests finish. Written by hand (the
format is small) so the server needs no extra dependency.
"""

from __future__ import annotations

import bisect
from collections import Counter

from kimitui.engine.metrics import EngineStats
from kimitui.engine.outputs import RequestMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets, so dashboards built for vLLM read ours unchanged.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
TPOT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last slot: above every bucket (+Inf only)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1


class ServerMetrics:
    """Per-request measurements kept by the server (engine-wide ones come from EngineStats)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.finished = Counter()  # finish_reason -> requests

    def observe_finished(self, metrics: RequestMetrics | None, finish_reason: str | None) -> None:
        self.finished[finish_reason or "unknown"] += 1
        if metrics is None:
            return
        for hist, value in ((self.ttft, metrics.ttft), (self.tpot, metrics.tpot), (self.e2e, metrics.e2e_latency)):
            if value is not None:
                hist.observe(value)

    def observe_aborted(self, n: int = 1) -> None:
        if n:
            self.finished["abort"] += n

    def render(self, stats: EngineStats) -> str:
        lab = f'model_name="{_escape(self.model_name)}"'
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, value: float, labels: str = lab) -> None:
            out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name}{{{labels}}} {_num(value)}"])

        metric("kimitui:num_requests_running", "gauge", "Requests in the running batch.", stats.num_running)
        metric("kimitui:num_requests_waiting", "gauge", "Requests waiting to be scheduled.", stats.num_waiting)
        metric(
            "kimitui:kv_cache_usage_perc",
            "gauge",
            "Fraction of KV cache blocks in use (1 = full).",
            stats.kv_cache_usage,
        )
        metric(
            "kimitui:kv_cache_capacity_tokens", "gauge", "Tokens the KV cache holds.", stats.kv_cache_capacity_tokens
        )
        metric(
            "kimitui:prefix_cache_hit_rate",
            "gauge",
            "Prompt tokens found in the prefix cache / looked up.",
            stats.prefix_cache_hit_rate,
        )
        # vLLM's counters: prompt tokens looked up in / found in the prefix cache at admission
        metric(
            "kimitui:prefix_cache_queries_total",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            getattr(stats, "prefix_cache_queries", 0),
        )
        metric(
            "kimitui:prefix_cache_hits_total",
            "counter",
            "Prompt tokens found in the prefix cache.",
            getattr(stats, "prefix_cache_hits", 0),
        )
        metric(
            "kimitui:prefill_tokens_per_second",
            "gauge",
            "Prefill throughput over the last seconds.",
            stats.prefill_tokens_per_s,
        )
        metric(
            "kimitui:decode_tokens_per_second",
            "gauge",
            "Decode throughput over the last seconds.",
            stats.decode_tokens_per_s,
        )
        metric("kimitui:prompt_tokens_total", "counter", "Prompt tokens admitted.", stats.total_prompt_tokens)
        # what the model ran of them: prefix-cache hits and the samples of an n > 1 request forked
        # from the one that computed the prompt are not computed again
        metric(
            "kimitui:prompt_tokens_computed_total",
            "counter",
            "Prompt tokens the model computed.",
            getattr(stats, "computed_prompt_tokens", 0),
        )
        metric("kimitui:generation_tokens_total", "counter", "Tokens generated.", stats.total_generation_tokens)
        metric(
            "kimitui:num_preemptions_total",
            "counter",
            "Requests preempted for lack of KV blocks.",
            stats.num_preemptions,
        )
        spec = getattr(stats, "spec_decode", None)
        if spec is not None:  # vLLM's spec_decode_* counters, under our prefix
            metric("kimitui:spec_decode_num_drafts", "counter", "Sequences' drafts verified.", spec.num_drafts)
            metric("kimitui:spec_decode_num_draft_tokens", "counter", "Draft tokens verified.", spec.num_draft_tokens)
            metric(
                "kimitui:spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted.", spec.num_accepted_tokens
            )
            pname = "kimitui:spec_decode_num_accepted_tokens_per_pos"
            out += [f"# HELP {pname} Draft tokens accepted, by position in the draft.", f"# TYPE {pname} counter"]
            for j, n in enumerate(spec.accepted_per_pos):
                out.append(f'{pname}{{{lab},position="{j}"}} {n}')
        name = "kimitui:request_success_total"
        out += [
            f"# HELP {name} Requests finished, by finish reason (abort: client went away).",
            f"# TYPE {name} counter",
        ]
        for reason in sorted(set(self.finished) | {"stop", "length"}):
            out.append(f'{name}{{{lab},finished_reason="{_escape(reason)}"}} {self.finished[reason]}')
        for hname, help_, hist in (
            ("kimitui:time_to_first_token_seconds", "Time to first token.", self.ttft),
            ("kimitui:time_per_output_token_seconds", "Mean time per output token after the first.", self.tpot),
            ("kimitui:e2e_request_latency_seconds", "Request latency from arrival to the last token.", self.e2e),
        ):
            out += [f"# HELP {hname} {help_}", f"# TYPE {hname} histogram"]
            running = 0
            for le, n in zip((*hist.buckets, float("inf")), hist.counts):
                running += n
                out.append(f'{hname}_bucket{{{lab},le="{_num(le)}"}} {running}')
            out.append(f"{hname}_sum{{{lab}}} {_num(hist.sum)}")
            out.append(f"{hname}_count{{{lab}}} {hist.count}")
        return "\n".join(out) + "\n"


def _num(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    if isinstance(v, int) or float(v).is_integer():
        return str(int(v)) if abs(v) < 1e15 else repr(float(v))
    return repr(float(v))


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
