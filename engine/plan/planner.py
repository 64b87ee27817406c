"""Placement planner: memory budget -> where every weight, the KV cache and each routed expert lives.

Order of filling each GPU: non-expert weights (tensor parallel, uneven splits), the MLA latent KV
cache for ``max_model_len x max_num_seqs`` tokens, the fixed per-sequence state of linear-attention
layers (Kimi K3's KDA: ``max_num_seqs`` slots, this rank's heads), a reserve for activations and
workspace (by default the worst step ``max_num_batched_tokens`` and ``max_num_seqs`` allow,
engine.offload.activation_reserve); then
routed experts (expert parallel) while they fit; the rest live in host RAM and run on the CPU
(KTransformers' split; llama.cpp's ``-ot exps=CPU`` offloads all of them). Sizes are bytes; the
text renderer prints GiB (2^30), the unit the published checkpoint sizes and ``rocm-smi`` use.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from kimitui.engine.config import ModelConfig
from kimitui.engine.parallel.state import split_sizes
from kimitui.engine.plan.activation_reserve import ActivationReserve, activation_reserve
from kimitui.engine.plan.budget import Budget, parse_policy
from kimitui.engine.plan.expert_spread import deal, device_targets, layer_counts, normalize_stats
from kimitui.engine.plan.param_count import ModelSize, footprint, moe_layers
from kimitui.engine.spec_decode.drafter_memory import DrafterFootprint, drafter_memory
from kimitui.engine.units import GiB

DEFAULT_BLOCK_SIZE = 64  # FlashMLA / vLLM MLA page size
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # the engine's default (engine.args.EngineArgs)


class PlacementError(ValueError):
    """The model does not fit under the requested policy; ``placement`` holds the attempted plan."""

    def __init__(self, message: str, placement: "Placement | None" = None):
        super().__init__(message)
        self.placement = placement


@dataclass(frozen=True)
class DevicePlan:
    """What one GPU holds, in bytes."""

    index: int
    heads: int
    vocab_rows: int
    non_expert_bytes: int
    num_experts: int
    expert_bytes: int
    kv_bytes: int
    reserve_bytes: int
    capacity_bytes: int
    state_bytes: int = 0  # KDA state slots (max_num_seqs x this rank's heads), 0 for pure MLA

    @property
    def weight_bytes(self) -> int:
        return self.non_expert_bytes + self.expert_bytes

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.state_bytes + self.reserve_bytes

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.total_bytes


@dataclass(frozen=True)
class Placement:
    """A complete plan. ``expert_device[layer][expert]`` is a GPU index or -1 (host RAM, CPU compute);
    dense layers have an empty row.

    ``max_model_len_by_memory``: the largest context (a multiple of ``block_size``) for which
    ``max_num_seqs`` full-length sequences fit under the same ``cpu_offload`` policy, the experts
    re-placed for that length ("auto" may move every routed expert to host RAM, an int N keeps N per
    layer there, "none" keeps all on GPU). ``max_model_len_that_fits`` caps it at the model's
    ``max_position_embeddings``. ``max_model_len_with_placement``: the largest such context that
    fits with the routed experts left where this plan put them (0 if the plan does not fit).
    """

    model: str
    num_devices: int
    max_model_len: int
    max_num_seqs: int
    block_size: int
    cpu_offload: str | int
    devices: tuple[DevicePlan, ...]
    host_bytes: int
    host_capacity_bytes: int | None
    expert_bytes: int
    kv_bytes_per_token: int
    expert_device: tuple[tuple[int, ...], ...]
    fits: bool
    problems: tuple[str, ...]
    notes: tuple[str, ...]
    max_model_len_by_memory: int
    max_model_len_that_fits: int
    max_model_len_with_placement: int
    max_position_embeddings: int
    model_size: ModelSize
    state_bytes_per_seq: int = 0  # KDA state of one sequence, all layers, all ranks together
    num_state_layers: int = 0  # KDA layers
    num_paged_layers: int = 0  # MLA layers
    max_num_seqs_with_placement: int = 0  # sequences of max_model_len that fit beside these weights
    activation: ActivationReserve | None = None  # what the reserve is made of (None: given explicitly)
    drafter: DrafterFootprint | None = None  # a model drafter's weights and KV per token (GPU 0)

    @property
    def num_cpu_experts(self) -> int:
        return sum(row.count(-1) for row in self.expert_device)

    @property
    def fits_on_gpus(self) -> bool:
        """The plan fits with every routed expert on a GPU (no CPU expert compute)."""
        return self.fits and self.num_cpu_experts == 0

    def seq_bytes(self, model_len: int) -> int:
        """GPU bytes one sequence of ``model_len`` tokens costs over all GPUs: its MLA latent on every
        GPU (replicated) plus its KDA state (split by head)."""
        blocks = math.ceil(model_len / self.block_size) * self.block_size
        return self.num_devices * blocks * self.kv_bytes_per_token + self.state_bytes_per_seq

    @property
    def shortfall_bytes(self) -> int:
        """GPU bytes missing over all devices (0 when the GPUs fit)."""
        return sum(max(0, -d.free_bytes) for d in self.devices)

    @property
    def host_shortfall_bytes(self) -> int:
        if self.host_capacity_bytes is None:
            return 0
        return max(0, self.host_bytes - self.host_capacity_bytes)

    def experts_per_layer(self) -> dict[int, tuple[int, int]]:
        """{MoE layer: (experts on GPU, experts on CPU)}."""
        return {i: (len(r) - r.count(-1), r.count(-1)) for i, r in enumerate(self.expert_device) if r}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (bytes as integers)."""
        return {
            "model": self.model,
            "num_devices": self.num_devices,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "block_size": self.block_size,
            "cpu_offload": self.cpu_offload,
            "fits": self.fits,
            "fits_on_gpus": self.fits_on_gpus,
            "problems": list(self.problems),
            "notes": list(self.notes),
            "devices": [
                asdict(d) | {"weight_bytes": d.weight_bytes, "total_bytes": d.total_bytes, "free_bytes": d.free_bytes}
                for d in self.devices
            ],
            "host": {
                "num_experts": self.num_cpu_experts,
                "bytes": self.host_bytes,
                "capacity_bytes": self.host_capacity_bytes,
            },
            "shortfall_bytes": self.shortfall_bytes,
            "host_shortfall_bytes": self.host_shortfall_bytes,
            "expert_bytes": self.expert_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "drafter": asdict(self.drafter) if self.drafter else None,
            "state_bytes_per_seq": self.state_bytes_per_seq,
            "num_kda_layers": self.num_state_layers,
            "num_mla_layers": self.num_paged_layers,
            "max_num_seqs_with_placement": self.max_num_seqs_with_placement,
            "max_model_len_by_memory": self.max_model_len_by_memory,
            "max_model_len_that_fits": self.max_model_len_that_fits,
            "max_model_len_with_placement": self.max_model_len_with_placement,
            "max_position_embeddings": self.max_position_embeddings,
            "experts_per_layer": {str(k): {"gpu": g, "cpu": c} for k, (g, c) in self.experts_per_layer().items()},
            "expert_device": [list(r) for r in self.expert_device],
            "model_size": {k: {"params": v.params, "bytes": v.nbytes} for k, v in self.model_size.parts.items()},
            "storage_bytes": dict(self.model_size.storage),
            "reserve": self.activation.to_dict()
            if self.activation is not None
            else {"bytes": self.devices[0].reserve_bytes, "given": True},
        }


# -- planning ---------------------------------------------------------------------------------------


def plan_placement(
    config: ModelConfig,
    num_devices: int,
    memory_per_device_bytes: int,
    max_model_len: int,
    max_num_seqs: int,
    cpu_offload: str | int = "auto",
    reserve_bytes_per_device: int | None = None,
    routing_stats: dict | list | None = None,
    host_memory_bytes: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    decode_graphs: bool | None = None,
    speculative=None,
) -> Placement:
    """Decide where every weight lives on ``num_devices`` GPUs plus host RAM.

    ``cpu_offload``: "auto" puts in host RAM only the routed experts that do not fit; an int N puts
    exactly N experts of every MoE layer there (the coldest by ``routing_stats``, else the highest
    indices); "none" raises ``PlacementError`` (with the shortfall) when the GPUs cannot hold it all.
    ``routing_stats``: tokens routed to each expert, ``{layer: [count per expert]}`` or a nested list.
    ``reserve_bytes_per_device``: kept back on every GPU for activations and workspace; None (the
    default) estimates it for steps of ``max_num_batched_tokens`` tokens and ``max_num_seqs``
    sequences (engine.offload.activation_reserve), with the decode graphs' pool when
    ``decode_graphs`` (None: as the engine decides, on one GPU only).
    ``speculative``: a SpeculativeConfig; its verification rows, KDA scratch states and an EAGLE-3 or
    DSpark drafter's weights and KV (first GPU) are counted (engine.spec_decode.drafter_memory).
    Other plans that do not fit come back with ``fits=False`` and the reasons in ``problems``.
    """
    for name, v in (
        ("num_devices", num_devices),
        ("max_model_len", max_model_len),
        ("max_num_seqs", max_num_seqs),
        ("block_size", block_size),
        ("max_num_batched_tokens", max_num_batched_tokens),
    ):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if memory_per_device_bytes <= 0 or (reserve_bytes_per_device is not None and reserve_bytes_per_device < 0):
        raise ValueError("memory_per_device_bytes must be positive and reserve_bytes_per_device non-negative")
    activation = None
    k = speculative.num_speculative_tokens if speculative is not None else 0
    if reserve_bytes_per_device is None:
        graphs = num_devices == 1 if decode_graphs is None else decode_graphs
        activation = activation_reserve(
            config,
            num_devices,
            max(max_num_batched_tokens, max_num_seqs * (1 + k)),
            max_num_seqs * (1 + k),
            max_model_len,
            graphs,
        )
        reserve_bytes_per_device = activation.total
    n_exp = config.n_routed_experts
    policy = parse_policy(cpu_offload, n_exp)
    stats = normalize_stats(routing_stats, config) if routing_stats is not None else {}
    layers = moe_layers(config)
    # the engine's own model for this many ranks, built on the meta device: a split the engine
    # cannot make raises here, naming the tensor
    fp = footprint(config, num_devices)
    e = fp.size.routed_expert.nbytes
    drafter = drafter_memory(speculative, config)  # an EAGLE-3 / DSpark drafter: weights and KV on GPU 0
    non_expert = [
        b + (drafter.weight_bytes if drafter and d == 0 else 0) for d, b in enumerate(fp.non_expert_per_device)
    ]
    budget = Budget(
        int(memory_per_device_bytes),
        tuple(non_expert),
        int(reserve_bytes_per_device),
        fp.kv_bytes_per_token,
        max_num_seqs,
        block_size,
        e,
        len(layers),
        n_exp,
        policy,
        None if host_memory_bytes is None else int(host_memory_bytes),
        fp.state_bytes_per_seq_per_device,
        1 + k,
        drafter.kv_bytes_per_token if drafter else 0,
    )

    kv = budget.kv_bytes(max_model_len)
    slots = budget.slots(kv)
    total = len(layers) * n_exp
    if policy == "auto":
        g_total = max(min(total, sum(slots)), budget.gpu_experts_needed())
        counts = layer_counts(g_total, layers, n_exp, stats) if layers else []
    else:
        counts = [n_exp - (0 if policy == "none" else policy)] * len(layers)
    dealer = deal(device_targets(sum(counts), slots))

    rows: list[tuple[int, ...]] = [()] * config.num_hidden_layers
    per_device = [0] * num_devices
    for layer, g in zip(layers, counts):
        hot = stats.get(layer)
        order = sorted(range(n_exp), key=lambda x: (-hot[x], x)) if hot else list(range(n_exp))
        devs = [next(dealer) for _ in range(g)]
        row = [-1] * n_exp
        # With stats the hottest experts go round-robin over GPUs (balanced load); without, each GPU
        # takes a contiguous block of expert ids as in plain expert parallelism.
        pairs = zip(order[:g], devs) if hot else zip(sorted(order[:g]), sorted(devs))
        for x, d in pairs:
            row[x] = d
            per_device[d] += 1
        rows[layer] = tuple(row)

    heads, vocab = split_sizes(config.num_attention_heads, num_devices), split_sizes(config.vocab_size, num_devices)
    dkv = kv * budget.drafter_kv_per_token // budget.kv_per_token if budget.kv_per_token else 0
    devices = tuple(
        DevicePlan(
            d,
            heads[d],
            vocab[d],
            budget.non_expert[d],
            per_device[d],
            per_device[d] * e,
            kv + (dkv if d == 0 else 0),
            budget.reserve,
            budget.capacity,
            budget.state(d),
        )
        for d in range(num_devices)
    )
    host_bytes = (total - sum(counts)) * e
    problems = [
        f"GPU {d.index} needs {d.total_bytes / GiB:.2f} GiB but has {d.capacity_bytes / GiB:.2f} GiB "
        f"(short by {-d.free_bytes / GiB:.2f} GiB)"
        for d in devices
        if d.free_bytes < 0
    ]
    if policy == "auto" and g_total > sum(slots) and budget.host_capacity is not None:
        problems.append(
            f"host RAM: {budget.host_capacity / GiB:.2f} GiB holds only {total - g_total} of the "
            f"{total - sum(slots)} experts that do not fit on the GPUs"
        )
    if host_memory_bytes is not None and host_bytes > host_memory_bytes:
        problems.append(
            f"host RAM: CPU experts need {host_bytes / GiB:.2f} GiB but {host_memory_bytes / GiB:.2f} GiB were given"
        )
    notes = []
    if max_model_len > config.max_position_embeddings:
        notes.append(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
            f"({config.max_position_embeddings})"
        )
    by_memory = budget.max_len_by_memory()
    placement = Placement(
        model=config.name or config.model_type,
        num_devices=num_devices,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        block_size=block_size,
        cpu_offload=policy,
        devices=devices,
        host_bytes=host_bytes,
        host_capacity_bytes=budget.host_capacity,
        expert_bytes=e,
        kv_bytes_per_token=budget.kv_per_token,
        expert_device=tuple(rows),
        fits=not problems,
        problems=tuple(problems),
        notes=tuple(notes),
        max_model_len_by_memory=by_memory,
        max_model_len_that_fits=min(by_memory, config.max_position_embeddings),
        max_model_len_with_placement=_len_with_placement(devices, budget),
        max_position_embeddings=config.max_position_embeddings,
        model_size=fp.size,
        state_bytes_per_seq=sum(fp.state_bytes_per_seq_per_device),
        num_state_layers=fp.num_state_layers,
        num_paged_layers=fp.num_paged_layers,
        max_num_seqs_with_placement=_seqs_with_placement(devices, budget, max_model_len),
        activation=activation,
        drafter=drafter,
    )
    if policy == "none" and not placement.fits:
        raise PlacementError(_none_message(placement, budget, slots), placement)
    return placement


def _len_with_placement(devices: tuple[DevicePlan, ...], budget: Budget) -> int:
    per_block = budget.max_num_seqs * budget.block_size * budget.kv_per_token
    room = min(d.capacity_bytes - d.weight_bytes - d.reserve_bytes - d.state_bytes for d in devices)
    return max(0, room // per_block) * budget.block_size if per_block else 0


def _seqs_with_placement(devices: tuple[DevicePlan, ...], budget: Budget, model_len: int) -> int:
    # One sequence costs each GPU its whole MLA latent (replicated) plus that rank's KDA state share.
    one = replace(budget, max_num_seqs=1)
    kv = one.kv_bytes(model_len)
    counts = []
    for d in devices:
        per_seq = kv + one.state(d.index)
        room = d.capacity_bytes - d.weight_bytes - d.reserve_bytes
        counts.append(max(0, room) // per_seq if per_seq else 0)
    return min(counts)


def _none_message(p: Placement, budget: Budget, slots: list[int]) -> str:
    short = p.shortfall_bytes
    msg = (
        f"{p.model} does not fit on {p.num_devices} x {budget.capacity / GiB:.1f} GiB without CPU offload: "
        f"short by {short / GiB:.1f} GiB ({short / 1e9:.1f} GB) of GPU memory at max_model_len "
        f"{p.max_model_len} x {p.max_num_seqs} seq(s)"
    )
    missing = budget.num_moe_layers * budget.n_experts - sum(slots)
    if budget.num_moe_layers and missing > 0 and all(f <= budget.capacity for f in budget.fixed(p.devices[0].kv_bytes)):
        msg += (
            f"; use cpu_offload='auto' or at least {math.ceil(missing / budget.num_moe_layers)} CPU experts per layer"
        )
    return msg
