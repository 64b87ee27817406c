"""One scrape of a serving engine's Prometheus ``/metrics``, read into the numbers the throughput
panel shows, whichever server it is: vLLM (``vllm:``), SGLang (``sglang:``) or ``kimitui serve``
(``kimitui:``). The flavour is detected from the names the server exposes.

The text is parsed by ``prometheus_client``'s parser, never by hand. Samples are looked up by
their exposed name (``vllm:prompt_tokens_total``, ``..._bucket``), so a scrape reads the same
whether or not the server sent ``# TYPE`` lines. A metric with several label sets (data-parallel
engines, tensor-parallel ranks, several models) is summed when it counts things and averaged
when it is a fraction.

Names, from the servers' documentation:
- vLLM, https://docs.vllm.ai/en/stable/usage/metrics/ and docs/design/metrics.md: V1 names
  ``kv_cache_usage_perc``, ``prefix_cache_{hits,queries}`` counters; earlier releases
  ``gpu_cache_usage_perc``, ``gpu_prefix_cache_{hits,queries}`` and the ``gpu_prefix_cache_hit_rate``
  gauge; ``cache_config_info`` carries ``num_gpu_blocks`` and ``block_size`` as labels.
- SGLang, https://docs.sglang.io/references/production_metrics.html (``--enable-metrics``).
- kimitui: kimitui/server/metrics.py (vLLM's names under our prefix).
"""

from __future__ import annotations

from dataclasses import dataclass, field

FLAVOURS = ("vllm", "sglang", "kimitui")

# role -> candidate sample names per flavour, the first present wins (newest name first).
_NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {
        "prompt_tokens": ("vllm:prompt_tokens_total",),
        "generation_tokens": ("vllm:generation_tokens_total",),
        "running": ("vllm:num_requests_running",),
        "waiting": ("vllm:num_requests_waiting",),
        "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "prefix_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
        "prefix_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
        "prefix_hit_rate": ("vllm:gpu_prefix_cache_hit_rate",),
        "ttft": ("vllm:time_to_first_token_seconds",),
        "tpot": (
            "vllm:request_time_per_output_token_seconds",
            "vllm:time_per_output_token_seconds",
            "vllm:inter_token_latency_seconds",
        ),
    },
    "sglang": {
        "prompt_tokens": ("sglang:prompt_tokens_total",),
        "generation_tokens": ("sglang:generation_tokens_total",),
        "running": ("sglang:num_running_reqs",),
        "waiting": ("sglang:num_queue_reqs",),
        "kv_usage": ("sglang:token_usage",),
        "kv_capacity": ("sglang:max_total_num_tokens",),
        "prefix_hit_rate": ("sglang:cache_hit_rate",),
        "ttft": ("sglang:time_to_first_token_seconds",),
        "tpot": ("sglang:time_per_output_token_seconds", "sglang:inter_token_latency_seconds"),
    },
    "kimitui": {
        "prompt_tokens": ("kimitui:prompt_tokens_total",),
        "generation_tokens": ("kimitui:generation_tokens_total",),
        "running": ("kimitui:num_requests_running",),
        "waiting": ("kimitui:num_requests_waiting",),
        "kv_usage": ("kimitui:kv_cache_usage_perc",),
        "kv_capacity": ("kimitui:kv_cache_capacity_tokens",),
        "prefix_hit_rate": ("kimitui:prefix_cache_hit_rate",),
        "ttft": ("kimitui:time_to_first_token_seconds",),
        "tpot": ("kimitui:time_per_output_token_seconds",),
    },
}
_FRACTIONS = {"kv_usage", "prefix_hit_rate"}  # averaged over label sets; everything else is summed


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts (``le`` upper bounds, ascending, +Inf last), sum and count."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    sum: float
    count: float

    def since(self, before: Histogram | None) -> Histogram:
        """What was observed after ``before`` (the whole histogram when there is no earlier one,
        or when the server restarted and its counters went back)."""
        if before is None or before.bounds != self.bounds or before.count > self.count:
            return self
        return Histogram(
            self.bounds,
            tuple(a - b for a, b in zip(self.counts, before.counts)),
            self.sum - before.sum,
            self.count - before.count,
        )

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """Prometheus' ``histogram_quantile``: linear inside the bucket holding rank ``q * count``;
        a rank in the +Inf bucket answers the largest finite bound."""
        if self.count <= 0 or not self.bounds:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for bound, cum in zip(self.bounds, self.counts):
            if cum >= rank:
                if bound == float("inf"):
                    return lower_bound
                width = cum - lower_count
                return lower_bound + (bound - lower_bound) * ((rank - lower_count) / width if width else 1.0)
            lower_bound, lower_count = bound, cum
        return lower_bound


@dataclass(frozen=True)
class ServerSnapshot:
    """One scrape. Every number is None when the server does not expose it."""

    flavour: str | None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # fraction of the KV cache in use
    kv_capacity_tokens: float | None = None
    prefix_hits: float | None = None  # cumulative tokens (vLLM V1 counters)
    prefix_queries: float | None = None
    prefix_hit_rate: float | None = None  # the server's own gauge where it has one
    ttft: Histogram | None = None
    tpot: Histogram | None = None
    spec_decode: object | None = None  # engine.spec_decode.stats.SpecDecodeStats, cumulative
    names: frozenset[str] = field(default_factory=frozenset)  # every sample name seen

    @property
    def cumulative_prefix_hit_rate(self) -> float | None:
        if self.prefix_hits is not None and self.prefix_queries:
            return self.prefix_hits / self.prefix_queries
        return self.prefix_hit_rate


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_created"):  # creation timestamps of counters, not values
                continue
            out.setdefault(s.name, []).append((s.labels, float(s.value)))
    return out


def detect_flavour(names) -> str | None:
    """The server whose prefix most exposed names carry (None: none of ours)."""
    counts = {f: sum(1 for n in names if n.startswith(f + ":")) for f in FLAVOURS}
    best = max(counts, key=counts.get)
    return best if counts[best] else None


def _first(samples: dict, candidates: tuple[str, ...], role: str) -> float | None:
    for name in candidates:
        rows = samples.get(name)
        if rows:
            values = [v for _, v in rows if v == v]  # NaN: a gauge with nothing to say yet
            if not values:
                return None
            return sum(values) / len(values) if role in _FRACTIONS else sum(values)
    return None


def _histogram(samples: dict, candidates: tuple[str, ...]) -> Histogram | None:
    for name in candidates:
        buckets = samples.get(name + "_bucket")
        if not buckets:
            continue
        by_le: dict[float, float] = {}
        for labels, value in buckets:
            le = float(labels.get("le", "inf").replace("+Inf", "inf"))
            by_le[le] = by_le.get(le, 0.0) + value
        bounds = tuple(sorted(by_le))
        total = sum(v for _, v in samples.get(name + "_sum", ()))
        count = sum(v for _, v in samples.get(name + "_count", ())) or by_le.get(float("inf"), 0.0)
        return Histogram(bounds, tuple(by_le[b] for b in bounds), total, count)
    return None


def _vllm_capacity(samples: dict) -> float | None:
    """vLLM publishes its KV pool as labels of ``vllm:cache_config_info`` (blocks x block size)."""
    total = None
    for labels, _ in samples.get("vllm:cache_config_info", ()):
        try:
            tokens = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
        except (KeyError, ValueError):
            continue
        total = (total or 0) + tokens
    return total


def parse_server_metrics(text: str) -> ServerSnapshot:
    """Read one exposition text; ValueError (one line) when it is not Prometheus text."""
    try:
        samples = _samples(text)
    except Exception as e:  # the parser raises ValueError, IndexError... on garbage
        raise ValueError(f"not Prometheus text: {type(e).__name__}: {e}") from None
    flavour = detect_flavour(samples)
    names = frozenset(samples)
    if flavour is None:
        return ServerSnapshot(None, names=names)
    table = _NAMES[flavour]
    values = {role: _first(samples, table[role], role) for role in table if role not in ("ttft", "tpot")}
    capacity = values.pop("kv_capacity", None)
    if flavour == "vllm":
        capacity = _vllm_capacity(samples)
    from kimitui.bench.spec_counters import parse_spec_counters

    return ServerSnapshot(
        flavour,
        prompt_tokens=values.get("prompt_tokens"),
        generation_tokens=values.get("generation_tokens"),
        running=values.get("running"),
        waiting=values.get("waiting"),
        kv_usage=values.get("kv_usage"),
        kv_capacity_tokens=capacity,
        prefix_hits=values.get("prefix_hits"),
        prefix_queries=values.get("prefix_queries"),
        prefix_hit_rate=values.get("prefix_hit_rate"),
        ttft=_histogram(samples, table["ttft"]),
        tpot=_histogram(samples, table["tpot"]),
        spec_decode=parse_spec_counters(text),
        names=names,
    )
