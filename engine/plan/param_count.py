"""Parameters and bytes of a model, whole and per tensor-parallel rank, counted on the model itself.

The model is built on the meta device (shapes and dtypes, no storage) exactly as the engine builds
it for (config, world_size, rank), and its parameters are summed by the planner class each one
declares (``engine.registry.parameter_classes``). So the planner counts the tensors the
engine allocates, in their formats, shards and dtypes: a split the engine cannot make fails here
with the engine's own message, naming the tensor. Sizes use the checkpoint's dtype for dense
weights, the dtype a GPU run computes in.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from kimitui.engine.config import ModelConfig
from kimitui.engine.layers.linear import linear_format
from kimitui.engine.loader import build_model
from kimitui.engine.parallel.state import ParallelState, split_sizes
from kimitui.engine.registry import PARAM_CLASSES, parameter_classes

_TORCH_DTYPE = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "float": torch.float32,
}


def compute_dtype(config: ModelConfig) -> torch.dtype:
    """The dtype of dense weights, activations and the KV cache on a GPU: the checkpoint's."""
    return _TORCH_DTYPE.get(config.torch_dtype.removeprefix("torch."), torch.bfloat16)


def meta_model(config: ModelConfig, world_size: int = 1, rank: int = 0, par: ParallelState | None = None) -> nn.Module:
    """Rank ``rank``'s model on the meta device, experts spread evenly over the ranks (``par``: the
    parallel state to build with, default ``ParallelState(rank, world_size)``)."""
    par = ParallelState(rank=rank, world_size=world_size) if par is None else par
    return build_model(config, torch.device("meta"), compute_dtype(config), par=par)


@dataclass(frozen=True)
class _RecordingState(ParallelState):
    """A ParallelState that notes every split the model asks it for: (total, unit)."""

    calls: list = field(default_factory=list, compare=False, hash=False)

    def range(self, total: int, unit: int = 1) -> tuple[int, int]:
        self.calls.append((total, unit))
        return super().range(total, unit)


@dataclass(frozen=True)
class PartSize:
    """Parameters (logical weight values, quantisation scales not counted) and bytes (scales included)."""

    params: int = 0
    nbytes: int = 0

    def __add__(self, other: "PartSize") -> "PartSize":
        return PartSize(self.params + other.params, self.nbytes + other.nbytes)

    def __mul__(self, k: int) -> "PartSize":
        return PartSize(self.params * k, self.nbytes * k)


@dataclass(frozen=True)
class ModelSize:
    """Sizes of every part of the text model; ``parts`` sums over all layers."""

    parts: dict[str, PartSize]
    routed_expert: PartSize  # one expert (gate + up + down) of one MoE layer
    num_moe_layers: int
    n_routed_experts: int
    storage: dict[str, int] = field(default_factory=dict)  # bytes by stored format (storage_format)

    @property
    def total(self) -> PartSize:
        out = PartSize()
        for p in self.parts.values():
            out = out + p
        return out

    @property
    def non_expert(self) -> PartSize:
        return self.total + PartSize(-self.parts["routed_experts"].params, -self.parts["routed_experts"].nbytes)


def _size(p: torch.Tensor) -> PartSize:
    # INT4 packs 8 values per int32, MXFP4 2 per byte; scales declare 0 (see engine.layers.linear)
    return PartSize(p.numel() * getattr(p, "values_per_element", 1), p.numel() * p.element_size())


# (dtype, logical values per element) -> the format's name; packed formats declare how many values
# one stored element holds (engine.layers.linear), quantisation scales declare 0.
_FORMATS = {
    (torch.uint8, 2): "mxfp4",
    (torch.int32, 8): "int4",
    (torch.float8_e4m3fn, 1): "fp8",
    (torch.bfloat16, 1): "bf16",
    (torch.float16, 1): "fp16",
    (torch.float32, 1): "f32",
}


def storage_format(p: torch.Tensor) -> str:
    """``mxfp4``, ``int4``, ``fp8``, ``bf16``, ``fp16``, ``f32`` or ``scales`` (any dtype)."""
    vpe = getattr(p, "values_per_element", 1)
    if vpe == 0:
        return "scales"
    return _FORMATS.get((p.dtype, vpe), str(p.dtype).removeprefix("torch."))


def storage_bytes(model: nn.Module) -> dict[str, int]:
    """{format: bytes} over the parameters of ``model``, largest first."""
    out: dict[str, int] = {}
    for p in model.parameters():
        out[storage_format(p)] = out.get(storage_format(p), 0) + p.numel() * p.element_size()
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def part_sizes(model: nn.Module) -> dict[str, PartSize]:
    """{planner class: size} over the parameters of ``model`` (tied parameters once)."""
    classes = parameter_classes(model)
    parts = {name: PartSize() for name in PARAM_CLASSES}
    for name, p in model.named_parameters():
        parts[classes[name]] = parts[classes[name]] + _size(p)
    return parts


def moe_layers(config: ModelConfig) -> list[int]:
    """Indices of the MoE decoder layers (the MTP layer, which loaders skip, is not counted)."""
    return [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]


def count_params(config: ModelConfig, model: nn.Module | None = None) -> ModelSize:
    """Parameters and bytes per part of the whole text model in its checkpoint format (``model``:
    its one-rank meta build, when the caller has it already).

    Rotary ``inv_freq`` buffers and the MTP layer (``num_nextn_predict_layers``) are left out:
    loaders skip them.
    """
    model = model if model is not None else meta_model(config)
    parts = part_sizes(model)
    layers = moe_layers(config)
    n = config.n_routed_experts
    routed = parts["routed_experts"]
    one = PartSize(routed.params // (len(layers) * n), routed.nbytes // (len(layers) * n)) if layers else PartSize()
    return ModelSize(
        parts=parts, routed_expert=one, num_moe_layers=len(layers), n_routed_experts=n, storage=storage_bytes(model)
    )


def kv_bytes_per_token(config: ModelConfig, model: nn.Module | None = None) -> int:
    """Paged cache bytes per token over all layers, from the model's own cache specs."""
    model = model if model is not None else meta_model(config)
    return sum(spec.bytes_per_block(1) for spec in model.cache_specs(compute_dtype(config)))


def state_bytes_per_seq(config: ModelConfig, model: nn.Module | None = None) -> int:
    """Fixed per-sequence state bytes over all layers (KDA recurrent + conv state; 0 for pure MLA),
    on the rank ``model`` was built for: KDA heads are split over ranks, so each holds its share."""
    model = model if model is not None else meta_model(config)
    return sum(spec.bytes_per_seq() for spec in model.cache_specs(compute_dtype(config)))


@dataclass(frozen=True)
class CacheLayout:
    """What one sequence costs the cache, over all layers of one rank's build."""

    num_state_layers: int  # layers with a fixed per-sequence state (KDA)
    num_paged_layers: int  # layers with a paged per-token cache (MLA latent)
    state_bytes_per_seq: int
    kv_bytes_per_token: int


def cache_layout(config: ModelConfig, model: nn.Module | None = None) -> CacheLayout:
    """Layer counts and per-sequence / per-token cache bytes from the model's own cache specs."""
    model = model if model is not None else meta_model(config)
    specs = model.cache_specs(compute_dtype(config))
    return CacheLayout(
        sum(1 for s in specs if s.bytes_per_seq() > 0),
        sum(1 for s in specs if s.bytes_per_block(1) > 0),
        sum(s.bytes_per_seq() for s in specs),
        sum(s.bytes_per_block(1) for s in specs),
    )


@dataclass(frozen=True)
class Footprint:
    """What the planner needs to know about a model on ``len(non_expert_per_device)`` GPUs.

    The MLA latent (``kv_bytes_per_token``) is per token and the same on every rank (the latent is
    not split by head); the KDA state is per sequence and split by head, so it is per rank."""

    size: ModelSize
    non_expert_per_device: tuple[int, ...]  # bytes of all but the routed experts, per rank
    kv_bytes_per_token: int
    state_bytes_per_seq_per_device: tuple[int, ...] = ()
    state_bytes_per_seq: int = 0  # whole model (one rank's build)
    num_state_layers: int = 0  # KDA layers
    num_paged_layers: int = 0  # MLA layers


def _alignment(config: ModelConfig) -> int:
    """The modulus a shard's start matters under: 1 when no tensor-parallel Linear is quantised (the
    split is then just a size), else the FP8 block / INT4 and MXFP4 group, whose scales a shard starting
    inside a block or group counts differently (engine.layers.linear)."""
    q = config.quantization
    if q is None:
        return 1
    names = [
        "lm_head",
        *(
            f"model.layers.{config.num_hidden_layers - 1}.self_attn.{p}"
            for p in ("q_proj", "q_b_proj", "kv_b_proj", "o_proj", "g_proj", "k_proj", "v_proj")
        ),
    ]
    if config.layer_types:
        kda = next((i for i in range(config.num_hidden_layers) if config.is_kda_layer(i)), 0)
        names += [
            f"model.layers.{kda}.self_attn.{p}"
            for p in ("q_proj", "k_proj", "v_proj", "f_b_proj", "b_proj", "g_proj", "g_b_proj", "o_proj")
        ]
    if all(linear_format(q, n) == "dense" for n in names):
        return 1
    return math.lcm(*q.weight_block_size, q.group_size, 32)


def _rank_keys(config: ModelConfig, num_devices: int, calls: list[tuple[int, int]]) -> list[tuple]:
    """Per rank, what its build depends on: the size (and start, modulo ``_alignment``) of each split
    the model makes, and its share of routed experts (spread by split_sizes, engine.layers.moe).
    Ranks with equal keys build tensors of equal shapes and bytes."""
    align = _alignment(config)
    keys = []
    splits = [split_sizes(total, num_devices, unit) for total, unit in sorted(set(calls))]
    experts = split_sizes(config.n_routed_experts, num_devices) if config.n_routed_experts else [0] * num_devices
    for r in range(num_devices):
        keys.append((experts[r], *((sizes[r], sum(sizes[:r]) % align) for sizes in splits)))
    return keys


@functools.lru_cache(maxsize=16)
def footprint(config: ModelConfig, num_devices: int, exact: bool = False) -> Footprint:
    """Sizes of the whole model and of each rank's share of it, from meta builds: one build per class
    of ranks that split alike (``_rank_keys``), or with ``exact`` one per rank (the oracle). Cached per
    (config, num_devices): the planner asks again for every context length and policy."""
    whole = meta_model(config)
    size = count_params(config, whole)
    per_device, state = [], []
    built: dict[tuple, tuple[int, int]] = {}
    keys: list[tuple] = [()] * num_devices
    for rank in range(num_devices):
        if num_devices == 1:
            model, parts = whole, size.parts
        elif rank == 0 or exact or keys[rank] not in built:
            par = _RecordingState(rank=rank, world_size=num_devices)
            model = meta_model(config, par=par)
            parts = part_sizes(model)
            if rank == 0 and not exact:
                keys = _rank_keys(config, num_devices, par.calls)
        else:
            model = None
        if model is not None:
            built[keys[rank]] = (
                sum(v.nbytes for k, v in parts.items() if k != "routed_experts"),
                state_bytes_per_seq(config, model),
            )
        per_device.append(built[keys[rank]][0])
        state.append(built[keys[rank]][1])
    cache = cache_layout(config, whole)
    return Footprint(
        size,
        tuple(per_device),
        cache.kv_bytes_per_token,
        tuple(state),
        cache.state_bytes_per_seq,
        cache.num_state_layers,
        cache.num_paged_layers,
    )
