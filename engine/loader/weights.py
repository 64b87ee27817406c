"""Copy a checkpoint's tensors into a built model, one tensor at a time, by the model's own
declarations: its checkpoint name mapping and its layers' ``load_weight`` (see
``engine.registry``). This file knows no model's weight names."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from kimitui.engine.loader.checkpoint import CheckpointError, CheckpointReader
from kimitui.engine.loader.source import TensorSource, copy_into
from kimitui.engine.registry import WeightTarget

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadProgress:
    bytes_done: int
    bytes_total: int
    tensors_done: int
    tensors_total: int


@dataclass(frozen=True)
class LoadReport:
    tensors_loaded: int
    tensors_skipped: int
    bytes_read: int
    skipped_examples: tuple[str, ...]


def load_weights(
    model: nn.Module, reader: CheckpointReader, prefix: str = "", progress: Callable[[LoadProgress], None] | None = None
) -> LoadReport:
    """Fill every parameter of ``model`` from ``reader``; raise CheckpointError on any mismatch.

    ``prefix``: the family's prefix on text-model tensors (``language_model.``); tensors without it
    (a vision tower) are skipped and counted.
    """
    modules = dict(model.named_modules())
    filled: dict[str, set] = {}  # parameter name -> shard ids filled
    loaded = skipped = done_bytes = done = 0
    skipped_examples: list[str] = []
    total_bytes, total = reader.total_bytes, len(reader.tensors)
    for info in reader:
        if prefix and not info.name.startswith(prefix):
            target: WeightTarget | str = "outside the text model"
        else:
            target = model.checkpoint_target(info.name[len(prefix) :])
        if isinstance(target, WeightTarget):
            got = _load_one(modules.get(target.module), target, TensorSource(reader, info))
            if got is None:
                target = "unknown to the model"
            else:
                for param, shard_id in got:
                    filled.setdefault(f"{target.module}.{param}", set()).add(shard_id)
        if isinstance(target, str):
            skipped += 1
            if len(skipped_examples) < 8:
                skipped_examples.append(f"{info.name} ({target})")
        else:
            loaded += 1
        done += 1
        done_bytes += info.nbytes
        if progress is not None:
            progress(LoadProgress(done_bytes, total_bytes, done, total))
    _check_complete(model, filled, reader, prefix)
    if skipped:
        log.info("skipped %d checkpoint tensors, e.g. %s", skipped, ", ".join(skipped_examples[:3]))
    return LoadReport(loaded, skipped, done_bytes, tuple(skipped_examples))


def _load_one(module: nn.Module | None, target: WeightTarget, src: TensorSource) -> list | None:
    """The (parameter, shard id) pairs filled, or None when the model has no such weight."""
    if module is None:
        return None
    load = getattr(module, "load_weight", None)
    if load is not None:
        return load(target.name, target.shard_id, src)
    param = module._parameters.get(target.name)
    if param is None or target.shard_id is not None:
        return None
    copy_into(param, src)  # honours a parameter's weight_loader (KDA A_log: [1,1,H,1] or [128])
    return [(target.name, None)]


def _check_complete(model: nn.Module, filled: dict[str, set], reader: CheckpointReader, prefix: str) -> None:
    for name, p in model.named_parameters():
        have = filled.get(name, set())
        if len(have) >= getattr(p, "num_sources", 1) or getattr(p, "optional", False):
            continue
        sources = p.sources() if hasattr(p, "sources") else {None: name}
        missing = [prefix + ckpt for shard_id, ckpt in sources.items() if shard_id not in have]
        if missing:
            more = f" and {len(missing) - 1} more for {name}" if len(missing) > 1 else ""
            raise CheckpointError(
                f"{reader.dir}: tensor {missing[0]} missing (expected for parameter {name} {list(p.shape)}){more}"
            )
