"""Where each routed expert of a running engine lives, decided once when the model is built."""

from __future__ import annotations

import logging

import torch

from kimitui.engine.config import ModelConfig
from kimitui.engine.plan.activation_reserve import activation_reserve
from kimitui.engine.plan.planner import PlacementError, plan_placement
from kimitui.engine.plan.routing_stats import load_routing_stats
from kimitui.engine.units import GiB

log = logging.getLogger(__name__)


def device_reserve_bytes(
    config: ModelConfig,
    device: torch.device,
    world_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    decode_graphs: bool,
) -> int:
    """Memory each device keeps back for activations and workspace: the planner's estimate for the
    engine's step sizes (engine.offload.activation_reserve), the one number both the expert placement
    and the KV cache budget subtract. None when the device is the host: activations then come out of
    host RAM like everything else, and a ``gpu_memory_gb`` budget on the CPU is a test of the split."""
    if device.type == "cpu":
        return 0
    return activation_reserve(
        config, world_size, max_num_batched_tokens, max_num_seqs, max_model_len, decode_graphs
    ).total


def expert_placement_for(
    config: ModelConfig,
    cpu_offload: str | int,
    device: torch.device,
    world_size: int,
    max_model_len: int,
    max_num_seqs: int,
    gpu_memory_gb: float | None = None,
    routing_stats_path: str | None = None,
    reserve_bytes: int = 0,
):
    """``expert_placement[layer][expert]`` (rank, or -1 for host RAM), or None for an even spread.

    On a GPU (or whenever ``gpu_memory_gb`` sets a device budget), "auto" asks the planner what fits
    in each device's memory and "none" refuses (with the shortfall) when it does not; an integer N
    keeps N experts of every MoE layer in host RAM, the coldest ones when routing statistics from a
    previous run are given. On the CPU without a budget the host is the device: nothing moves.
    ``reserve_bytes``: kept back per device (``device_reserve_bytes``).
    """
    if not config.n_routed_experts:
        return None
    if isinstance(cpu_offload, str) and cpu_offload.isdigit():
        cpu_offload = int(cpu_offload)
    stats = None
    if routing_stats_path:
        try:
            stats = load_routing_stats(routing_stats_path)
        except FileNotFoundError:
            log.info("no routing statistics at %s yet; experts spread evenly", routing_stats_path)
    if isinstance(cpu_offload, int):
        if cpu_offload > config.n_routed_experts:
            raise ValueError(f"cpu_offload={cpu_offload} exceeds n_routed_experts={config.n_routed_experts}")
        memory = 1 << 60  # only the count matters: N per layer on the host, the rest on the devices
    elif gpu_memory_gb is not None:
        memory = int(gpu_memory_gb * GiB)
    elif device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        return None  # on the CPU the host is the device: nothing to offload
    plan = plan_placement(
        config,
        world_size,
        memory,
        max_model_len,
        max_num_seqs,
        cpu_offload,
        reserve_bytes_per_device=reserve_bytes,
        routing_stats=stats,
    )
    if not plan.fits and cpu_offload != "none":
        raise PlacementError("; ".join(plan.problems) or "the model does not fit")
    rows = [list(r) for r in plan.expert_device]
    on_host = sum(r.count(-1) for r in rows)
    if on_host:
        log.info("expert placement: %d routed experts in host RAM (computed by the CPU)", on_host)
    return rows
