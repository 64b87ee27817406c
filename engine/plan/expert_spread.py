"""How ``planner.plan_placement`` spreads the routed experts that stay on the GPUs: as many per MoE layer
(one more where routing statistics say the next expert is hottest), over the GPUs in proportion to
their free room, interleaved so every layer's experts reach every GPU."""

from __future__ import annotations

from kimitui.engine.config import ModelConfig
from kimitui.engine.parallel.state import split_sizes
from kimitui.engine.plan.param_count import moe_layers


def normalize_stats(stats: dict | list, config: ModelConfig) -> dict[int, tuple[float, ...]]:
    layers = moe_layers(config)
    if isinstance(stats, dict) and "tokens_per_expert" in stats:
        stats = stats["tokens_per_expert"]
    if isinstance(stats, dict):
        items = {int(k): v for k, v in stats.items()}
    elif isinstance(stats, (list, tuple)):
        if len(stats) == config.num_hidden_layers:
            items = {i: v for i, v in enumerate(stats) if v}
        elif len(stats) == len(layers):
            items = dict(zip(layers, stats))
        else:
            raise ValueError(
                f"routing statistics have {len(stats)} layers; expected {config.num_hidden_layers} "
                f"(all layers) or {len(layers)} (MoE layers)"
            )
    else:
        raise ValueError("routing statistics must be a dict of layer -> counts or a nested list")
    out = {}
    for layer, counts in items.items():
        if layer not in layers:
            if counts:
                raise ValueError(f"routing statistics given for layer {layer}, which is not a MoE layer")
            continue
        if len(counts) != config.n_routed_experts or any(not isinstance(x, (int, float)) or x < 0 for x in counts):
            raise ValueError(
                f"routing statistics for layer {layer} must be {config.n_routed_experts} non-negative counts"
            )
        out[layer] = tuple(float(x) for x in counts)
    return out


def layer_counts(g_total: int, layers: list[int], n: int, stats: dict[int, tuple[float, ...]]) -> list[int]:
    # Same number of GPU experts in every layer, +1 for the layers whose next expert is hottest.
    base, extra = divmod(g_total, len(layers))
    if base >= n:
        return [n] * len(layers)

    def marginal(li: int) -> float:
        counts = stats.get(layers[li])
        if not counts:
            return 0.0
        return sorted(counts, reverse=True)[base] / (sum(counts) or 1.0)

    bonus = set(sorted(range(len(layers)), key=lambda li: (-marginal(li), li))[:extra])
    return [base + (li in bonus) for li in range(len(layers))]


def device_targets(g_total: int, slots: list[int]) -> list[int]:
    n, cap = len(slots), sum(slots)
    by_room = sorted(range(n), key=lambda d: (-slots[d], d))
    even = [0] * n
    for d, share in zip(by_room, split_sizes(g_total, n)):
        even[d] = share
    if all(e <= s for e, s in zip(even, slots)):
        return even
    if g_total > cap:  # does not fit: fill every GPU, spread the excess so the overflow shows
        return [s + x for s, x in zip(slots, split_sizes(g_total - cap, n))]
    exact = [g_total * s / cap for s in slots]
    out = [int(x) for x in exact]
    for d in sorted(range(n), key=lambda d: (out[d] - exact[d], d))[: g_total - sum(out)]:
        out[d] += 1
    return out


def deal(targets: list[int]):
    # Smooth weighted round robin: device d comes up targets[d] times in sum(targets) picks, evenly
    # interleaved, so every layer's GPU experts spread over all GPUs in proportion.
    total, current = sum(targets), [0] * len(targets)
    for _ in range(total):
        for d, t in enumerate(targets):
            current[d] += t
        best = max(range(len(targets)), key=lambda d: current[d])
        current[best] -= total
        yield best
