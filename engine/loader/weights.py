"""Copy a checkpoint's tensors into a built model, by name, one tensor at a time."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.loader.checkpoint import CheckpointError, CheckpointReader

log = logging.getLogger(__name__)

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")
# transformers 5.x may save experts already fused: experts.gate_up_proj [E, 2I, D], experts.down_proj [E, D, I]
_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


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


def skip_reason(name: str, num_layers: int) -> str | None:
    """Why a checkpoint tensor is not used by the model, or None when it is."""
    if name.endswith("rotary_emb.inv_freq"):
        return "rotary inv_freq"
    m = _LAYER.match(name)
    if m and int(m.group(1)) >= num_layers:
        return "MTP layer"
    if not (name.startswith("model.") or name.startswith("lm_head.")):
        return "not part of the text model"
    return None


def load_weights(model: nn.Module, reader: CheckpointReader, prefix: str = "",
                 progress: Callable[[LoadProgress], None] | None = None) -> LoadReport:
    """Fill every parameter of ``model`` from ``reader``; raise CheckpointError on any mismatch."""
    params = dict(model.named_parameters(remove_duplicate=False))
    # A model whose checkpoint spells some names differently maps them (Kimi Linear / K3's MoE names).
    rename = getattr(model, "checkpoint_name", None)
    num_layers = model.config.num_hidden_layers
    filled: set[str] = set()
    expert_filled: dict[str, int] = {}
    loaded = skipped = done_bytes = done = 0
    skipped_examples: list[str] = []
    total_bytes, total = reader.total_bytes, len(reader.tensors)
    for info in reader:
        name = info.name[len(prefix):] if prefix and info.name.startswith(prefix) else info.name
        reason = "outside the text model" if prefix and not info.name.startswith(prefix) else skip_reason(name, num_layers)
        where = f"{reader.dir / info.file}: tensor {info.name}"
        if reason is None and rename is not None:
            name = rename(name)
        if reason is None:
            m = _EXPERT.match(name)
            fused = _FUSED_EXPERTS.match(name)
            if m:
                layer, expert, proj, suffix = int(m[1]), int(m[2]), m[3], m[4]
                experts = model.model.layers[layer].mlp.experts
                if expert >= experts.num_experts:
                    raise CheckpointError(f"{where}: expert {expert} out of range (n_routed_experts={experts.num_experts})")
                slot = experts.slot(expert)
                if slot is not None and suffix != "weight_shape":  # else another rank holds it
                    stack, index = slot
                    err = stack.load(index, proj, suffix, _read(reader, info, stack.param_dtype(proj, suffix)))
                    if err:
                        raise CheckpointError(f"{where}: {err}")
                    where_key = "local" if stack is experts.local else "host"
                    key = f"model.layers.{layer}.mlp.experts.{where_key}.{'w2' if proj == 'down_proj' else 'w13'}_{suffix}"
                    expert_filled[key] = expert_filled.get(key, 0) + 1
            elif fused:
                _load_fused_experts(model, reader, info, fused, where, expert_filled)
            elif name.endswith(".weight_shape"):
                pass  # compressed-tensors bookkeeping; the packed tensor's shape is checked instead
            elif name in params:
                _copy(params, name, reader, info, where)
                filled.add(name)
            else:
                reason = "unknown to the model"
        if reason is not None:
            skipped += 1
            if len(skipped_examples) < 8:
                skipped_examples.append(f"{info.name} ({reason})")
        else:
            loaded += 1
        done += 1
        done_bytes += info.nbytes
        if progress is not None:
            progress(LoadProgress(done_bytes, total_bytes, done, total))
    _check_complete(model, params, filled, expert_filled, reader)
    if skipped:
        log.info("skipped %d checkpoint tensors, e.g. %s", skipped, ", ".join(skipped_examples[:3]))
    return LoadReport(loaded, skipped, done_bytes, tuple(skipped_examples))


def _load_fused_experts(model, reader, info, fused, where, expert_filled) -> None:
    # [E, 2I, D] gate_up or [E, D, I] down, all experts in one tensor (transformers 5.x layout)
    layer = int(fused[1].split(".")[2])
    experts = model.model.layers[layer].mlp.experts
    full = reader.get(info.name)
    if full.shape[0] != experts.num_experts:
        raise CheckpointError(f"{where}: {full.shape[0]} experts, expected {experts.num_experts}")
    for e in range(experts.num_experts):
        slot = experts.slot(e)
        if slot is None:
            continue
        stack, index = slot
        where_key = "local" if stack is experts.local else "host"
        parts = [("down_proj", full[e])] if fused[2] == "down_proj" else list(zip(("gate_proj", "up_proj"), full[e].chunk(2)))
        for proj, t in parts:
            dtype = stack.param_dtype(proj, "weight")
            _check_dtype(t.dtype, dtype, where)
            err = stack.load(index, proj, "weight", t.to(dtype))
            if err:
                raise CheckpointError(f"{where}: {err}")
            key = f"{fused[1]}.{where_key}.{'w2' if proj == 'down_proj' else 'w13'}_weight"
            expert_filled[key] = expert_filled.get(key, 0) + 1


def _read(reader: CheckpointReader, info, dtype: torch.dtype | None, shard=None) -> torch.Tensor:
    t = reader.get(info.name, shard)
    if dtype is None:
        return t
    _check_dtype(t.dtype, dtype, f"{reader.dir / info.file}: tensor {info.name}")
    return t if t.dtype == dtype else t.to(dtype)


def _check_dtype(src: torch.dtype, dst: torch.dtype, where: str) -> None:
    # Floating tensors convert to the compute dtype; packed/fp8 storage must match bit for bit.
    exact = dst in (torch.int32, torch.uint8, torch.float8_e4m3fn, torch.int8)
    if exact and src != dst:
        raise CheckpointError(f"{where}: dtype {str(src).removeprefix('torch.')}, expected {str(dst).removeprefix('torch.')}")
    if not exact and not src.is_floating_point:
        raise CheckpointError(f"{where}: dtype {str(src).removeprefix('torch.')}, expected a floating-point tensor")
    if not exact and src in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise CheckpointError(f"{where}: dtype {str(src).removeprefix('torch.')}, expected {str(dst).removeprefix('torch.')} "
                              "(fp8 weight without a quantization_config?)")


def _copy(params: dict[str, torch.Tensor], key: str, reader: CheckpointReader, info, where: str) -> None:
    param = params[key]
    loader = getattr(param, "weight_loader", None)
    if loader is not None:  # the parameter reads a layout unlike its own (KDA A_log: [1,1,H,1] or [128])
        try:
            loader(param, reader.get(info.name))
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from None
        return
    full = getattr(param, "full_shape", None) or tuple(param.shape)
    if tuple(info.shape) != tuple(full):
        raise CheckpointError(f"{where}: shape {list(info.shape)}, expected {list(full)}")
    # A sharded parameter reads only this rank's rows or columns from the mmapped file.
    param.data.copy_(_read(reader, info, param.dtype, getattr(param, "shard", None)))


def _check_complete(model, params, filled, expert_filled, reader) -> None:
    for name, p in params.items():
        if ".mlp.experts.local.w" in name or ".mlp.experts.host.w" in name:
            base = name
            need = p.shape[0] * (2 if ".w13_" in name else 1)
            if expert_filled.get(base, 0) < need:
                got = expert_filled.get(base, 0)
                raise CheckpointError(f"{reader.dir}: tensor {_expert_example(name)} missing "
                                      f"({got} of {need} expert tensors for {name})")
        elif name not in filled and not _optional(model, name):
            raise CheckpointError(f"{reader.dir}: tensor {name} missing (expected shape {list(p.shape)})")


def _expert_example(stacked: str) -> str:
    layer_part, kind = stacked.split(".experts.")
    kind = kind.split(".", 1)[1]  # drop "local." / "host."
    proj = "down_proj" if kind.startswith("w2_") else "gate_proj"
    return f"{layer_part}.experts.N.{proj}.{kind.split('_', 1)[1]}"


def _optional(model, name: str) -> bool:
    # A tied lm_head shares the embedding; a zero correction bias may be absent from old checkpoints.
    if name == "lm_head.weight" and model.config.tie_word_embeddings:
        return True
    return name.endswith("e_score_correction_bias")
