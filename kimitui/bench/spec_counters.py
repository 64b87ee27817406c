"""Speculative-decoding counters of the server under test, read before and after a run, for vLLM's
``spec_decode_*`` keys in the result JSON (as ``vllm bench serve`` reads them from ``/metrics``).

In process they come from the engine's stats; over HTTP from the server's Prometheus text: vLLM's
``vllm:spec_decode_*`` or kimitui's ``kimitui:spec_decode_*`` counters (SGLang exposes none of these;
the keys are then absent)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kimitui.bench.clients import target_metrics

if TYPE_CHECKING:  # importing the engine package loads torch: only where the counters are built
    from kimitui.engine.spec_decode.stats import SpecDecodeStats

_NAMES = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")


async def read_spec_counters(client: Any) -> SpecDecodeStats | None:
    """The cumulative counters now, or None when the target has no speculative decoding."""
    engine = getattr(client, "engine", None)
    if engine is not None:
        stats = getattr(engine, "stats", None)
        spec = getattr(stats(), "spec_decode", None) if callable(stats) else None
        return spec.copy() if spec is not None else None
    text = await target_metrics(client)
    try:
        return parse_spec_counters(text) if text is not None else None
    except Exception:  # noqa: BLE001 - unreadable /metrics: no keys, never a failed benchmark
        return None


def parse_spec_counters(text: str) -> SpecDecodeStats | None:
    """``SpecDecodeStats`` from Prometheus exposition text (``prometheus_client``'s parser), summing
    over label sets (a server may label by model or engine); per-position counters by ``position``."""
    from prometheus_client.parser import text_string_to_metric_families

    from kimitui.engine.spec_decode.stats import SpecDecodeStats

    found: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for prefix in ("vllm:spec_decode_", "kimitui:spec_decode_"):
            if not family.name.startswith(prefix):
                continue
            key = family.name[len(prefix) :]
            if key not in _NAMES:
                continue
            for sample in family.samples:
                if not sample.name.endswith("_total") and family.type == "counter" and sample.name != family.name:
                    continue  # _created samples
                if key == "num_accepted_tokens_per_pos":
                    pos = int(sample.labels.get("position", 0))
                    per_pos[pos] = per_pos.get(pos, 0) + sample.value
                else:
                    found[key] = found.get(key, 0) + sample.value
    if "num_drafts" not in found:
        return None
    return SpecDecodeStats(
        int(found.get("num_drafts", 0)),
        int(found.get("num_draft_tokens", 0)),
        int(found.get("num_accepted_tokens", 0)),
        [int(per_pos[j]) for j in sorted(per_pos)],
    )
