"""Build a model for a config and fill it from a safetensors checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from kimitui.engine.config import ModelConfig
from kimitui.engine.loader.checkpoint import CheckpointError, CheckpointReader, TensorInfo
from kimitui.engine.loader.weights import LoadProgress, LoadReport, load_weights
from kimitui.engine.parallel.state import SINGLE
from kimitui.engine.registry import model_class
from kimitui.kernels.backend import Backend
from kimitui.kernels.select import attach_backends
from kimitui.kernels.settings import KernelSettings

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "LoadProgress",
    "LoadReport",
    "TensorInfo",
    "build_model",
    "finish_load",
    "load_model",
]


def build_model(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_position: int | None = None,
    par=None,
    expert_placement=None,
):
    """Allocate this rank's model on ``device`` (``torch.device("meta")``: shapes only): dense
    weights in ``dtype``, packed weights and fp32-by-contract tensors in their own dtypes, experts
    placed as ``expert_placement`` says (host-RAM experts on the CPU)."""

    with torch.device(device):
        model = model_class(config.model_type)(config, dtype, max_position, par or SINGLE, expert_placement)
    return model.eval()


def load_model(
    config: ModelConfig,
    model_dir: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    max_position: int | None = None,
    progress: Callable[[LoadProgress], None] | None = None,
    par=None,
    expert_placement=None,
):
    """Build and load a model (this rank's shard of it); returns (model, LoadReport)."""
    reader = CheckpointReader(model_dir)
    model = build_model(config, device, dtype, max_position, par, expert_placement)
    with torch.no_grad():
        report = load_weights(model, reader, config.weight_prefix, progress)
        finish_load(model)
    return model, report


def finish_load(model, settings: KernelSettings | None = None) -> Backend:
    """After the weights are in: the kernel backend, chosen once from the weights' device and dtype and
    ``settings`` (default: the environment, read now) and handed to every module, then the model's
    derived weights and layouts. -> the model's backend"""
    weight = model.model.norm.weight
    ops = attach_backends(
        model, weight.device, weight.dtype, KernelSettings.from_env() if settings is None else settings
    )
    model.post_load(ops)
    return ops
