"""What the benchmark screen runs: presets, clipping them to the model's context, and the form's
text fields turned into a validated ``BenchmarkConfig``. No Textual here, so it tests on its own.

The form is a flat ``dict[str, str]`` (field name -> what the user typed): presets fill it, the
screen shows it, ``config_from_form`` validates it once with messages that name the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kimitui.bench.cost import CostSettings, PricingTier, load_cost_settings, parse_pricing_tier
from kimitui.bench.runner import BenchmarkConfig
from kimitui.bench.sweep import parse_concurrency_list

# Every latency metric vLLM knows: the result table shows TTFT/TPOT/ITL/E2EL percentiles.
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class Preset:
    """A named workload; ``sweep`` is "" for a single point or "1,2,4" for a concurrency sweep."""

    key: str
    title: str
    input_len: int
    output_len: int
    num_prompts: int
    max_concurrency: int | None
    num_warmups: int = 0
    range_ratio: float = 0.0
    sweep: str = ""
    temperature: str = ""


# InferenceX (github.com/SemiAnalysisAI/InferenceX, benchmarks/benchmark_lib.sh and
# configs/CONFIGS.md): 1k/1k and 8k/1k, ignore-eos, rate inf, 10 x concurrency
# prompts and 2 x concurrency warm-ups; shown here at concurrency 16. Its --random-range-ratio 0.8
# means 80-100 % of L in InferenceX's fork but [0.2L, 1.8L] in vLLM's, so we keep fixed lengths.
# The 8K/1K and 128K/100 presets are the workloads of Paiton's published Kimi-K3.1-Pro runs on
# MI355X (the "seed" results this tool was built to reproduce): 64 prompts, at most 16 in flight,
# temperature 0.
PRESETS: tuple[Preset, ...] = (
    Preset("quick", "Quick check (32 in / 8 out, 4 prompts)", 32, 8, 4, 2),
    Preset("ix-1k1k", "InferenceX 1k/1k", 1024, 1024, 160, 16, num_warmups=32),
    Preset("ix-8k1k", "InferenceX 8k/1k", 8192, 1024, 160, 16, num_warmups=32),
    Preset("seed-8k1k", "8K/1K, 64 prompts at concurrency 16 (seeds)", 8192, 1024, 64, 16, temperature="0"),
    Preset("seed-128k100", "128K/100, 64 prompts at concurrency 16 (seeds)", 131072, 100, 64, 16, temperature="0"),
)

FIELD_NAMES = (
    "input_len",
    "output_len",
    "range_ratio",
    "num_prompts",
    "max_concurrency",
    "request_rate",
    "ignore_eos",
    "temperature",
    "seed",
    "num_warmups",
    "sweep",
    "pricing_tiers",
    "usd_per_kwh",
    "label",
)


def preset(key: str) -> Preset:
    for p in PRESETS:
        if p.key == key:
            return p
    raise KeyError(f"no benchmark preset {key!r}")


def clip_lengths(
    input_len: int, output_len: int, range_ratio: float, max_model_len: int | None
) -> tuple[int, int, str | None]:
    """Fit the longest sampled request (lengths times 1+r) into ``max_model_len``. The output keeps
    its length when it takes at most half the context (128K/100 stays a prefill test), else both
    get half. Returns the lengths and a note saying what changed, or None."""
    if max_model_len is None:
        return input_len, output_len, None
    budget = math.floor(max_model_len / (1 + range_ratio))
    if math.ceil(input_len * (1 + range_ratio)) + math.ceil(output_len * (1 + range_ratio)) <= max_model_len:
        return input_len, output_len, None
    out = min(output_len, budget // 2)
    inp = max(1, min(input_len, budget - out))
    parts = []
    if inp != input_len:
        parts.append(f"input {input_len:,} -> {inp:,}")
    if out != output_len:
        parts.append(f"output {output_len:,} -> {out:,}")
    return inp, out, f"clipped to max_model_len={max_model_len:,}: " + ", ".join(parts)


def tiers_text(tiers: tuple[PricingTier, ...]) -> str:
    return ", ".join(f"{t.name}={t.usd_per_gpu_hour:g}" for t in tiers)


def default_form(cost: CostSettings | None = None) -> dict[str, str]:
    """The form before any preset: the quick check, with cost settings from settings.toml."""
    try:
        cost = cost or load_cost_settings()
    except ValueError:  # a broken settings.toml must not keep the screen from opening
        cost = CostSettings()
    form = {
        "preset": PRESETS[0].key,
        "request_rate": "inf",
        "ignore_eos": "true",
        "seed": "0",
        "label": "",
        "pricing_tiers": tiers_text(cost.tiers),
        "usd_per_kwh": "" if cost.usd_per_kwh is None else f"{cost.usd_per_kwh:g}",
    }
    form.update(preset_form(PRESETS[0], None)[0])
    return form


def preset_form(p: Preset, max_model_len: int | None) -> tuple[dict[str, str], str | None]:
    """The fields a preset sets (clipped to the context) and the clipping note."""
    inp, out, note = clip_lengths(p.input_len, p.output_len, p.range_ratio, max_model_len)
    return {
        "input_len": str(inp),
        "output_len": str(out),
        "range_ratio": f"{p.range_ratio:g}",
        "num_prompts": str(p.num_prompts),
        "max_concurrency": "" if p.max_concurrency is None else str(p.max_concurrency),
        "num_warmups": str(p.num_warmups),
        "sweep": p.sweep,
        "temperature": p.temperature,
    }, note


def _parse(form: dict[str, str], name: str, label: str, kind, *, blank=None):
    raw = form.get(name, "").strip()
    if raw == "" and blank is not None:
        return blank[0]
    try:
        if kind is float and raw.lower() in ("inf", "infinity"):
            return math.inf
        return kind(raw)
    except ValueError:
        wanted = "a whole number" if kind is int else "a number"
        raise ValueError(f"{label}: {raw!r} is not {wanted}") from None


def config_from_form(
    form: dict[str, str], *, max_model_len: int | None, num_gpus: int = 1, model: str | None = None
) -> BenchmarkConfig:
    """Validate the form once; ValueError says which field is wrong and why."""
    tiers_raw = [t for t in form.get("pricing_tiers", "").split(",") if t.strip()]
    tiers = tuple(parse_pricing_tier(t.strip()) for t in tiers_raw)
    if len({t.name for t in tiers}) != len(tiers):
        raise ValueError(f"pricing tiers: names must be unique, got {tiers_text(tiers)}")
    sweep = form.get("sweep", "").strip()
    return BenchmarkConfig(
        random_input_len=_parse(form, "input_len", "input len", int),
        random_output_len=_parse(form, "output_len", "output len", int),
        random_range_ratio=_parse(form, "range_ratio", "range ratio", float, blank=(0.0,)),
        num_prompts=_parse(form, "num_prompts", "num prompts", int),
        max_concurrency=_parse(form, "max_concurrency", "max concurrency", int, blank=(None,)),
        request_rate=_parse(form, "request_rate", "request rate", float, blank=(math.inf,)),
        ignore_eos=form.get("ignore_eos", "true") == "true",
        temperature=_parse(form, "temperature", "temperature", float, blank=(None,)),
        seed=_parse(form, "seed", "seed", int, blank=(0,)),
        num_warmups=_parse(form, "num_warmups", "warm-ups", int, blank=(0,)),
        percentile_metrics=PERCENTILE_METRICS,
        sweep_concurrency=parse_concurrency_list(sweep) if sweep else (),
        model=model,
        num_gpus=max(0, num_gpus),
        pricing_tiers=tiers,
        usd_per_kwh=_parse(form, "usd_per_kwh", "$ per kWh", float, blank=(None,)),
        label=form.get("label", "").strip() or None,
        max_model_len=max_model_len,
    )


def describe(config: BenchmarkConfig) -> str:
    """One line naming a run, for the progress panel and notifications."""
    conc = "no cap" if config.max_concurrency is None else f"concurrency {config.max_concurrency}"
    if config.sweep_concurrency:
        conc = "sweep " + ",".join(map(str, config.sweep_concurrency))
    return f"{config.random_input_len:,} in / {config.random_output_len:,} out, {config.num_prompts} prompts, {conc}"
