"""$ per million tokens (GPU rental tiers and electricity) and energy per token.

Formulas are InferenceX's (github.com/SemiAnalysisAI/InferenceX-app, docs/tco-calculator.md and
utils/process_result.py in SemiAnalysisAI/InferenceX) and Paiton's (its Kimi-K3.1-Pro article):
  $/1M total tokens = ($/GPU/h) / (tok/s/GPU * 3600 / 1e6)
  electricity $/1M  = kW * $/kWh * 1e6 / (tok/s * 3600)
Throughput per GPU is *total* (input + output) tokens/s divided by GPUs, as InferenceX's
process_result.py `tput_per_gpu` and the published pages' "tokens/s per GPU" are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import tomllib

from kimitui.paths import settings_file


@dataclass(frozen=True)
class PricingTier:
    """A GPU rental price: `usd_per_gpu_hour` dollars per GPU per hour."""

    name: str
    usd_per_gpu_hour: float

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a pricing tier needs a name")
        if not (self.usd_per_gpu_hour >= 0 and math.isfinite(self.usd_per_gpu_hour)):
            raise ValueError(f"pricing tier {self.name!r}: $/GPU/hour must be >= 0, got {self.usd_per_gpu_hour!r}")


# SemiAnalysis AI Cloud TCO tiers for MI355X as published on InferenceX's Kimi K2.6 page
# ("Running Kimi K2.6 on MI355X"). Its K3.1 Pro page lists Retail at $2.90; edit
# settings.toml or pass --pricing-tier for your hardware and contract.
DEFAULT_TIERS: tuple[PricingTier, ...] = (
    PricingTier("hyperscaler", 1.50),
    PricingTier("neocloud", 2.09),
    PricingTier("retail", 2.10),
)
# Paiton's assumed electricity price (its Kimi-K3.1-Pro on six MI355X article, "GPU electricity").
DEFAULT_USD_PER_KWH = 0.10


@dataclass(frozen=True)
class CostSettings:
    """Pricing tiers and electricity price used for the cost keys of a result."""

    tiers: tuple[PricingTier, ...] = DEFAULT_TIERS
    usd_per_kwh: float | None = DEFAULT_USD_PER_KWH

    def __post_init__(self) -> None:
        if self.usd_per_kwh is not None and not self.usd_per_kwh >= 0:
            raise ValueError(f"usd_per_kwh must be >= 0, got {self.usd_per_kwh!r}")
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"pricing tier names must be unique, got {names}")


def load_cost_settings(path: str | Path | None = None) -> CostSettings:
    """Read `[cost]` (`usd_per_kwh`, `[[cost.tiers]] name, usd_per_gpu_hour`) from the
    settings file; a missing file or section gives the defaults, tiers given replace them."""
    p = Path(path) if path is not None else settings_file()
    if not p.is_file():
        return CostSettings()
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: not valid TOML: {e}") from e
    cost = data.get("cost", {})
    if not isinstance(cost, dict):
        raise ValueError(f"{p}: [cost] must be a table")
    settings = CostSettings()
    if "usd_per_kwh" in cost:
        settings = replace(settings, usd_per_kwh=_number(cost["usd_per_kwh"], f"{p}: cost.usd_per_kwh"))
    if "tiers" in cost:
        tiers = []
        for i, t in enumerate(cost["tiers"]):
            where = f"{p}: cost.tiers[{i}]"
            if not isinstance(t, dict) or "name" not in t or "usd_per_gpu_hour" not in t:
                raise ValueError(f'{where} needs name = "..." and usd_per_gpu_hour = <number>')
            tiers.append(PricingTier(str(t["name"]), _number(t["usd_per_gpu_hour"], where)))
        settings = replace(settings, tiers=tuple(tiers))
    return settings


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} must be a number, got {value!r}")
    return float(value)


def parse_pricing_tier(text: str) -> PricingTier:
    """Parse the `--pricing-tier NAME=USD` flag value."""
    name, sep, usd = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return PricingTier(name.strip(), float(usd))
    except ValueError as e:
        raise ValueError(f"--pricing-tier expects NAME=USD_PER_GPU_HOUR (e.g. retail=2.10), got {text!r}") from e


def with_overrides(
    settings: CostSettings, tiers: Sequence[PricingTier] = (), usd_per_kwh: float | None = None
) -> CostSettings:
    """CLI flags win: a tier with an existing name replaces it, a new name is appended."""
    merged = {t.name: t for t in settings.tiers}
    for t in tiers:
        merged[t.name] = t
    return CostSettings(tuple(merged.values()), settings.usd_per_kwh if usd_per_kwh is None else usd_per_kwh)


def usd_per_mtok(usd_per_gpu_hour: float, tok_s_per_gpu: float) -> float | None:
    """Rental $ per 1M tokens; None when nothing was produced."""
    if not tok_s_per_gpu > 0:
        return None
    return usd_per_gpu_hour / (tok_s_per_gpu * 3600 / 1e6)


def electricity_usd_per_mtok(power_kw: float | None, usd_per_kwh: float | None, tok_s: float) -> float | None:
    """Electricity $ per 1M tokens at `power_kw` of measured draw; None if unmeasured."""
    if power_kw is None or usd_per_kwh is None or not tok_s > 0:
        return None
    return power_kw * usd_per_kwh * 1e6 / (tok_s * 3600)


@dataclass(frozen=True)
class _Energy:
    joules: float | None
    scope: str | None  # which sources the joules include: "gpu+cpu", "gpu", "cpu"
    per_gpu_w: tuple[float | None, ...] = field(default_factory=tuple)


def _measured_energy(energy: Any) -> _Energy:
    if energy is None:
        return _Energy(None, None)
    gpu, cpu = getattr(energy, "gpu_energy_j", None), getattr(energy, "cpu_energy_j", None)
    parts = [(n, j) for n, j in (("gpu", gpu), ("cpu", cpu)) if j is not None]
    per_gpu = tuple(getattr(energy, "per_gpu_avg_power_w", ()) or ())
    if not parts:
        return _Energy(None, None, per_gpu)
    return _Energy(sum(j for _, j in parts), "+".join(n for n, _ in parts), per_gpu)


def efficiency_keys(
    *,
    total_token_throughput: float,
    total_output_tokens: int,
    total_tokens: int,
    duration_s: float,
    num_gpus: int,
    energy: Any,
    pricing_tiers: Sequence[PricingTier],
    usd_per_kwh: float | None,
) -> dict[str, Any]:
    """kimitui's result keys beyond vLLM's. `energy` is a telemetry EnergyWindow over the
    benchmark window (or None). energy_j counts GPU plus CPU package energy where each is
    measured (`energy_scope` says which); InferenceX counts GPU board power only, which
    flatters CPU-offload engines."""
    # No GPU (an in-process run on the CPU): per-GPU throughput and GPU-hour prices mean nothing.
    tput_per_gpu = total_token_throughput / num_gpus if num_gpus else None
    e = _measured_energy(energy)
    window_s = getattr(energy, "duration_s", None) or duration_s
    power_kw = None if e.joules is None else e.joules / window_s / 1000
    return {
        "num_gpus": num_gpus,
        "tput_per_gpu": tput_per_gpu,
        "output_tput_per_gpu": (total_output_tokens / duration_s) / num_gpus if num_gpus else None,
        "avg_gpu_power_w": getattr(energy, "avg_gpu_power_w", None),
        "avg_cpu_power_w": getattr(energy, "avg_cpu_power_w", None),
        "per_gpu_avg_power_w": list(e.per_gpu_w),
        "energy_j": e.joules,
        "energy_scope": e.scope,
        "tokens_per_kwh": (total_tokens / (e.joules / 3.6e6)) if e.joules else None,
        "joules_per_output_token": (e.joules / total_output_tokens)
        if e.joules is not None and total_output_tokens
        else None,
        "cost_per_mtok": {
            t.name: usd_per_mtok(t.usd_per_gpu_hour, tput_per_gpu) if num_gpus else None for t in pricing_tiers
        },
        "pricing_tiers": {t.name: t.usd_per_gpu_hour for t in pricing_tiers},
        "usd_per_kwh": usd_per_kwh,
        "electricity_cost_per_mtok": electricity_usd_per_mtok(power_kw, usd_per_kwh, total_token_throughput),
    }


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_efficiency_block(result: dict[str, Any]) -> str:
    """kimitui's block printed under vLLM's: per-GPU throughput, power, energy, cost."""
    row = "{:<40} {:<10}".format
    lines = ["{s:{c}^{n}}".format(s=" Efficiency and Cost ", n=50, c="=")]
    lines.append(row("GPUs:", result["num_gpus"] or "0 (CPU only)"))
    lines.append(row("Total tok/s per GPU:", _fmt(result["tput_per_gpu"], ".2f")))
    lines.append(row("Avg GPU power, all GPUs (W):", _fmt(result.get("avg_gpu_power_w"), ".1f")))
    lines.append(row("Avg CPU package power (W):", _fmt(result.get("avg_cpu_power_w"), ".1f")))
    scope = result.get("energy_scope")
    lines.append(row(f"Energy{f' ({scope})' if scope else ''} (J):", _fmt(result.get("energy_j"), ".1f")))
    lines.append(row("Tokens per kWh:", _fmt(result.get("tokens_per_kwh"), ",.0f")))
    lines.append(row("Joules per output token:", _fmt(result.get("joules_per_output_token"), ".3f")))
    for name, usd in (result.get("cost_per_mtok") or {}).items():
        lines.append(row(f"$/1M tokens, {name}:", _fmt(usd, ".4f")))
    lines.append(row("$/1M tokens, electricity:", _fmt(result.get("electricity_cost_per_mtok"), ".4f")))
    lines.append("=" * 50)
    return "\n".join(lines)
