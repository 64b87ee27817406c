"""Parameters and bytes of a model, whole and per tensor-parallel rank, counted on the model itself.

The model is built on the meta device (shapes and dtypes, no storage) exactly as the engine builds
it for (config, world_size, rank), and its parameters are summed by the planner class each one
declares (``engine.models.registry.parameter_classes``). So the planner counts the tensors the
engine allocates, in their formats, shards and dtypes: a split the engine cannot make fails here
with the engine's own message, naming the tensor. Sizes use the checkpoint's dtype for dense
weights, the dtype a GPU run computes in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.config import ModelConfig
from engine.models.registry import PARAM_CLASSES, parameter_classes
from engine.parallel.state import ParallelState

_TORCH_DTYPE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
                "float32": torch.float32, "float": torch.float32}


def compute_dtype(config: ModelConfig) -> torch.dtype:
    """The dtype of dense weights, activations and the KV cache on a GPU: the checkpoint's."""
    return _TORCH_DTYPE.get(config.torch_dtype.removeprefix("torch."), torch.bfloat16)


def meta_model(config: ModelConfig, world_size: int = 1, rank: int = 0) -> nn.Module:
    """Rank ``rank``'s model on the meta device, experts spread evenly over the ranks."""
    from engine.loader import build_model

    par = ParallelState(rank=rank, world_size=world_size)
    return build_model(config, torch.device("meta"), compute_dtype(config), par=par)


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
    routed_expert: PartSize        # one expert (gate + up + down) of one MoE layer
    num_moe_layers: int
    n_routed_experts: int

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
    parts = part_sizes(model if model is not None else meta_model(config))
    layers = moe_layers(config)
    n = config.n_routed_experts
    routed = parts["routed_experts"]
    one = PartSize(routed.params // (len(layers) * n), routed.nbytes // (len(layers) * n)) if layers else PartSize()
    return ModelSize(parts=parts, routed_expert=one, num_moe_layers=len(layers), n_routed_experts=n)


def kv_bytes_per_token(config: ModelConfig, model: nn.Module | None = None) -> int:
    """Paged cache bytes per token over all layers, from the model's own cache specs."""
    model = model if model is not None else meta_model(config)
    return sum(spec.bytes_per_block(1) for spec in model.cache_specs(compute_dtype(config)))


@dataclass(frozen=True)
class Footprint:
    """What the planner needs to know about a model on ``len(non_expert_per_device)`` GPUs."""

    size: ModelSize
    non_expert_per_device: tuple[int, ...]  # bytes of all but the routed experts, per rank
    kv_bytes_per_token: int


def footprint(config: ModelConfig, num_devices: int) -> Footprint:
    """Sizes of the whole model and of each rank's share of it, each from its own meta build."""
    whole = meta_model(config)
    size = count_params(config, whole)
    per_device = []
    for rank in range(num_devices):
        parts = size.parts if num_devices == 1 else part_sizes(meta_model(config, num_devices, rank))
        per_device.append(sum(v.nbytes for k, v in parts.items() if k != "routed_experts"))
    return Footprint(size, tuple(per_device), kv_bytes_per_token(config, whole))
