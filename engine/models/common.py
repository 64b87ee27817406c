"""What both model families do alike once declared: which checkpoint names are not theirs, the
derived weights and expert layouts made after loading, and the routing statistics."""

from __future__ import annotations

import torch
from torch import nn

from kimitui.engine.layers.mlp import MLP


def skip_reason(name: str, num_hidden_layers: int) -> str | None:
    """Why checkpoint tensor ``name`` (prefix removed) is not loaded, or None: only ``model.`` and
    ``lm_head.`` belong to the text model, and layers past ``num_hidden_layers`` are multi-token
    prediction (MTP) heads, which the engine does not run."""
    if not (name.startswith("model.") or name.startswith("lm_head.")):
        return "not part of the text model"
    parts = name.split(".")
    if parts[1] == "layers" and parts[2].isdigit() and int(parts[2]) >= num_hidden_layers:
        return "MTP layer"
    return None


def derive_weights(layers: nn.ModuleList) -> None:
    """Once the weights are in: each attention's and dense MLP's fused or absorbed weights."""
    for layer in layers:
        post = getattr(layer.self_attn, "post_load", None)
        if post is not None:
            post()
        for mlp in (layer.mlp, getattr(layer.mlp, "shared_experts", None)):
            if isinstance(mlp, MLP):
                mlp.post_load()


def prepare_experts(layers: nn.ModuleList, dtype: torch.dtype) -> None:
    """Once every module has its backend: the routed experts in the layout their backend reads."""
    for layer in layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            experts.post_load(dtype)


def routing_stats(layers: nn.ModuleList) -> dict[int, list[int]]:
    """Tokens routed to each expert so far, per MoE layer (for hottest-first placement)."""
    return {
        i: layer.mlp.experts.routing_counts.tolist() for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")
    }
