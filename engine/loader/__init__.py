"""Build a model for a config and fill it from a safetensors checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.loader.checkpoint import CheckpointError, CheckpointReader, TensorInfo
from engine.loader.weights import LoadProgress, LoadReport, load_weights

__all__ = ["CheckpointError", "CheckpointReader", "LoadProgress", "LoadReport", "TensorInfo", "build_model",
           "load_model"]


def build_model(config: ModelConfig, device: torch.device, dtype: torch.dtype, max_position: int | None = None):
    """Allocate the model on ``device``: dense weights in ``dtype``, packed weights in their own dtypes."""
    from engine.models.deepseek_v3 import DeepseekV3ForCausalLM

    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DeepseekV3ForCausalLM(config, max_position)
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


def load_model(config: ModelConfig, model_dir: str | Path, device: torch.device, dtype: torch.dtype,
               max_position: int | None = None, progress: Callable[[LoadProgress], None] | None = None):
    """Build and load a model; returns (model, LoadReport)."""
    reader = CheckpointReader(model_dir)
    model = build_model(config, device, dtype, max_position)
    with torch.no_grad():
        report = load_weights(model, reader, config.weight_prefix, progress)
        model.post_load()
    return model, report
