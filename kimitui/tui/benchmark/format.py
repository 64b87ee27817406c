"""Result rows for the benchmark screen's tables: vLLM's metrics, then kimitui's per-GPU, power,
energy and cost keys. A missing or null value reads "n/a", never a made-up number. No Textual."""

from __future__ import annotations

from typing import Any, Callable

from kimitui.tui.formatting import NA

Row = tuple[str, str]


def _num(spec: str) -> Callable[[Any], str]:
    def fmt(value: Any) -> str:
        if value is None or isinstance(value, (dict, list)):
            return NA
        try:
            return format(float(value), spec)
        except (TypeError, ValueError):
            return str(value)

    return fmt


def _text(value: Any) -> str:
    return NA if value is None or value == "" else str(value)


# (label, key, formatter): the order of vLLM's printed block, then ours.
HEAD: list[tuple[str, str, Callable[[Any], str]]] = [
    ("successful requests", "completed", _text),
    ("failed requests", "failed", _text),
    ("max concurrency", "max_concurrency", lambda v: "no cap" if v is None else str(v)),
    ("request rate (req/s)", "request_rate", _text),
    ("duration (s)", "duration", _num(".2f")),
    ("total input tokens", "total_input_tokens", _text),
    ("total output tokens", "total_output_tokens", _text),
    ("request throughput (req/s)", "request_throughput", _num(".2f")),
    ("output throughput (tok/s)", "output_throughput", _num(",.2f")),
    ("peak output throughput (tok/s)", "max_output_tokens_per_s", _num(",.2f")),
    ("total token throughput (tok/s)", "total_token_throughput", _num(",.2f")),
]
LATENCY = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))
TAIL: list[tuple[str, str, Callable[[Any], str]]] = [
    ("GPUs", "num_gpus", lambda v: "0 (CPU only)" if v == 0 else _text(v)),
    ("tput per GPU (tok/s)", "tput_per_gpu", _num(",.2f")),
    ("avg GPU power, all GPUs (W)", "avg_gpu_power_w", _num(".1f")),
    ("avg CPU package power (W)", "avg_cpu_power_w", _num(".1f")),
    ("energy (J)", "energy_j", _num(",.1f")),
    ("tokens per kWh", "tokens_per_kwh", _num(",.0f")),
    ("J per output token", "joules_per_output_token", _num(".3f")),
]


def _percentile_keys(result: dict[str, Any], name: str) -> list[str]:
    suffix = f"_{name}_ms"
    return [
        k for k in result if k.startswith("p") and k.endswith(suffix) and k[1 : -len(suffix)].replace(".", "").isdigit()
    ]


def result_rows(result: dict[str, Any]) -> list[Row]:
    """(label, value) pairs for one run, in the order the table shows them."""
    rows = [(label, fmt(result.get(key))) for label, key, fmt in HEAD]
    ms = _num(",.2f")
    for name, short in LATENCY:
        rows.append((f"mean {short} (ms)", ms(result.get(f"mean_{name}_ms"))))
        rows.append((f"median {short} (ms)", ms(result.get(f"median_{name}_ms"))))
        pkeys = _percentile_keys(result, name) or [f"p99_{name}_ms"]
        for key in pkeys:
            rows.append((f"{key.split('_')[0].upper()} {short} (ms)", ms(result.get(key))))
    rows += [(label, fmt(result.get(key))) for label, key, fmt in TAIL]
    usd = _num(".4f")
    for tier in result.get("cost_per_mtok") or {}:
        rows.append((f"$/1M tokens, {tier}", usd((result.get("cost_per_mtok") or {}).get(tier))))
    rows.append(("$/1M tokens, electricity", usd(result.get("electricity_cost_per_mtok"))))
    return rows


def comparison_rows(results: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """One row per metric, one value column per run; a tier only one run priced shows n/a in the others."""
    tables = [dict(result_rows(r)) for r in results]
    labels: list[str] = []
    for table in tables:
        labels += [label for label in table if label not in labels]
    return [(label, *(t.get(label, NA) for t in tables)) for label in labels]


def column_title(result: dict[str, Any]) -> str:
    """A short column header for a run: its label (or date) and concurrency."""
    conc = result.get("max_concurrency")
    name = result.get("label") or result.get("date") or "run"
    return f"{name} c{'-' if conc is None else conc}"
