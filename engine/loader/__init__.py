"""Build a model for a config and fill it from a safetensors checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from kimitui.engine.config import ModelConfig
from kimitui.engine.loader.checkpoint import CheckpointError, CheckpointReader, TensorInfo
from kimitui.engine.loader.weights import LoadProgress, LoadReport, load_weights

__all__ = ["CheckpointError", "CheckpointReader", "LoadProgress", "LoadReport", "TensorInfo", "build_model",
           "load_model"]


def build_model(config: ModelConfig, device: torch.device, dtype: torch.dtype, max_position: int | None = None,
                par=None, expert_placement=None):
    """Allocate this rank's model on ``device`` (``torch.device("meta")``: shapes only): dense
    weights in ``dtype``, packed weights and fp32-by-contract tensors in their own dtypes, experts
    placed as ``expert_placement`` says (host-RAM experts on the CPU)."""
    from kimitui.engine.models.registry import model_class
    from kimitui.engine.parallel.state import SINGLE

    with torch.device(device):
        model = model_class(config)(config, dtype, max_position, par or SINGLE, expert_placement)
    return model.eval()


def load_model(config: ModelConfig, model_dir: str | Path, device: torch.device, dtype: torch.dtype,
               max_position: int | None = None, progress: Callable[[LoadProgress], None] | None = None,
               par=None, expert_placement=None):
    """Build and load a model (this rank's shard of it); returns (model, LoadReport)."""
    reader = CheckpointReader(model_dir)
    model = build_model(config, device, dtype, max_position, par, expert_placement)
    with torch.no_grad():
        report = load_weights(model, reader, config.weight_prefix, progress)
        model.post_load()
    return model, report
