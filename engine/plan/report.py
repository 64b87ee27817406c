"""The planner's text report: the headline story, the per-sequence cache line, a table per GPU,
host RAM and experts per layer (``render``). Sizes in GiB (2^30)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kimitui.engine.units import GiB

if TYPE_CHECKING:
    from kimitui.engine.plan.planner import Placement


def _gib(b: int) -> str:
    return f"{b / GiB:.2f}"


def _layer_ranges(p: Placement) -> list[str]:
    # Consecutive MoE layers with the same GPU/CPU split share one line.
    groups: list[list] = []
    for layer, (g, c) in p.experts_per_layer().items():
        if groups and groups[-1][2:] == [g, c] and groups[-1][1] == layer - 1:
            groups[-1][1] = layer
        else:
            groups.append([layer, layer, g, c])
    return [
        f"  layers {a}-{b}: {g} on GPU, {c} on CPU" if a != b else f"  layer {a}: {g} on GPU, {c} on CPU"
        for a, b, g, c in groups
    ]


def _span(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def story_lines(p: Placement) -> list[str]:
    """The plan in a few sentences: fits or not, where the experts live, how many sequences."""
    gpus = f"{p.num_devices} x {_gib(p.devices[0].capacity_bytes)} GiB GPUs"
    seqs = f"{p.max_num_seqs_with_placement} concurrent sequence{'s' if p.max_num_seqs_with_placement != 1 else ''}"
    room = f"room for {seqs} of {p.max_model_len:,} tokens"
    if not p.fits:
        return [
            f"does NOT fit on {gpus}, even with CPU experts: short by {_gib(p.shortfall_bytes)} GiB"
            + (
                f" of GPU memory and {_gib(p.host_shortfall_bytes)} GiB of host RAM"
                if p.host_shortfall_bytes
                else " of GPU memory"
            )
        ]
    n = p.model_size.n_routed_experts
    if p.fits_on_gpus:
        where = f"all {n} routed experts of every MoE layer on GPU" if n else "all weights on GPU"
        return [f"fits on {gpus}: {where}; {room}"]
    on_cpu = [c for _, c in p.experts_per_layer().values()]
    weights = p.model_size.total.nbytes
    gpu_room = sum(d.capacity_bytes - d.kv_bytes - d.state_bytes - d.reserve_bytes for d in p.devices)
    return [
        f"weights do not fit on {gpus}: {_gib(weights)} GiB of weights, {_gib(gpu_room)} GiB of GPU room "
        "after cache and reserve",
        f"{_span(on_cpu)} of {n} routed experts per MoE layer live in host RAM ({_gib(p.host_bytes)} GiB) and "
        f"the CPUs compute them; {room}",
    ]


def cache_line(p: Placement) -> str:
    """Per-sequence memory: KDA state (fixed) plus MLA latent per token."""
    mla = f"MLA latent {p.kv_bytes_per_token / 1024:.1f} KiB/token ({p.num_paged_layers} MLA layers, on every GPU)"
    if not p.num_state_layers:
        return f"per sequence: {mla}"
    return (
        f"per sequence: KDA state {p.state_bytes_per_seq / 2**20:.1f} MiB ({p.num_state_layers} KDA layers, fp32, "
        f"split over GPUs) + {mla}; {_gib(p.seq_bytes(p.max_model_len))} GiB at {p.max_model_len:,} tokens"
    )


def drafter_lines(p: Placement) -> list[str]:
    """A model drafter's own weights and KV (on GPU 0, counted in its non-expert and KV columns)."""
    d = p.drafter
    if d is None:
        return []
    tokens = p.max_num_seqs * math.ceil(p.max_model_len / p.block_size) * p.block_size
    return [
        f"drafter ({d.method}, on GPU 0): weights {_gib(d.weight_bytes)} GiB + KV {d.kv_bytes_per_token / 1024:.2f} "
        f"KiB/token ({_gib(tokens * d.kv_bytes_per_token)} GiB at {p.max_model_len:,} tokens x {p.max_num_seqs} seq)"
    ]


def reserve_line(p: Placement) -> str:
    """The per-GPU reserve for activations and workspace, and what it is made of."""
    if p.activation is None:
        return f"reserve per GPU {_gib(p.devices[0].reserve_bytes)} GiB (given)"
    return p.activation.line()


def render(p: Placement) -> list[str]:
    s = p.model_size
    parts = ", ".join(f"{k.replace('_', ' ')} {_gib(v.nbytes)}" for k, v in s.parts.items() if v.nbytes >= GiB // 100)
    storage = ", ".join(f"{k} {_gib(v)}" for k, v in s.storage.items() if v >= GiB // 100)
    off = p.cpu_offload if isinstance(p.cpu_offload, str) else f"{p.cpu_offload} experts per layer"
    lines = [
        *story_lines(p),
        "",
        f"{p.model}: {s.total.params / 1e12:.3f}T params, {_gib(s.total.nbytes)} GiB ({parts} GiB)",
        *([f"stored as: {storage} GiB"] if storage else []),
        cache_line(p),
        *drafter_lines(p),
        reserve_line(p),
        f"{p.num_devices} GPU x {_gib(p.devices[0].capacity_bytes)} GiB; max_model_len {p.max_model_len:,} x "
        f"{p.max_num_seqs} seq (block {p.block_size}); cpu_offload {off}; "
        f"KV {p.kv_bytes_per_token / 1024:.1f} KiB/token, replicated on every GPU",
        "",
        f"{'GPU':>4} {'heads':>5} {'vocab':>6} {'non-expert':>10} {'experts':>7} {'expert GiB':>10} "
        f"{'KV':>8} {'state':>7} {'reserve':>7} {'total':>8} {'capacity':>8} {'free':>8}",
    ]
    for d in p.devices:
        lines.append(
            f"{d.index:>4} {d.heads:>5} {d.vocab_rows:>6} {_gib(d.non_expert_bytes):>10} "
            f"{d.num_experts:>7} {_gib(d.expert_bytes):>10} {_gib(d.kv_bytes):>8} {_gib(d.state_bytes):>7} "
            f"{_gib(d.reserve_bytes):>7} {_gib(d.total_bytes):>8} {_gib(d.capacity_bytes):>8} "
            f"{_gib(d.free_bytes):>8}"
        )
    cap = "not checked" if p.host_capacity_bytes is None else f"of {_gib(p.host_capacity_bytes)} GiB"
    lines += [
        "",
        f"host RAM: {p.num_cpu_experts} experts, {_gib(p.host_bytes)} GiB ({cap}); "
        f"one expert {p.expert_bytes / 2**20:.1f} MiB",
        "routed experts per MoE layer:",
        *_layer_ranges(p),
        ("fits: yes" + ("" if p.fits_on_gpus else f", with {p.num_cpu_experts} experts computed by the CPUs"))
        if p.fits
        else f"fits: NO (short by {_gib(p.shortfall_bytes)} GiB on GPUs"
        + (f", {_gib(p.host_shortfall_bytes)} GiB in host RAM)" if p.host_shortfall_bytes else ")"),
    ]
    lines += [f"  {x}" for x in p.problems] + [f"note: {x}" for x in p.notes]
    how = {"auto": "experts moved to host RAM as needed", "none": "all experts on GPU"}.get(p.cpu_offload, off)

    def capped(n: int) -> str:
        if n > p.max_position_embeddings:
            return f"{p.max_position_embeddings:,} tokens (model limit; memory allows {n:,})"
        return f"{n:,} tokens (memory limit)"

    seqs = f"x {p.max_num_seqs} seq{'s' if p.max_num_seqs > 1 else ''}"
    return lines + [
        f"largest context that fits: {capped(p.max_model_len_by_memory)} {seqs}, {how}",
        f"largest context with this expert placement: {capped(p.max_model_len_with_placement)} {seqs}",
    ]
