"""One checkpoint tensor as a layer's loader sees it, and the default way a parameter takes it.

Layers that store a checkpoint tensor differently from its on-disk layout (stacked experts, fused
layouts, re-blocked FP8 scales) define ``load_weight(name, shard_id, src)``; every other parameter
is filled by ``copy_into``, which reads only this rank's slice as recorded on the parameter:

``param.full_shape``   the checkpoint tensor's shape (default: the parameter's own shape)
``param.shard``        ``(axis, start, end)`` in storage units of the checkpoint tensor, or None
``param.shard_index``  int64 index [n] into the slice along ``axis`` (FP8 scale rows repeated for a
                       finer local block, see ``engine.layers.linear``), or None
``param.optional``     True when a checkpoint may leave the tensor out (the default value stands)
``param.weight_loader`` ``(param, tensor)`` for one parameter whose checkpoint layout differs from its own
                       (KDA's ``A_log``: [1, 1, H, 1] or [128]); a ``ValueError`` names the problem
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kimitui.engine.loader.checkpoint import CheckpointError, CheckpointReader, TensorInfo

# Storage that must match the checkpoint bit for bit; floating tensors convert to the parameter's dtype.
EXACT_DTYPES = (torch.int32, torch.uint8, torch.float8_e4m3fn, torch.int8)


@dataclass(frozen=True)
class TensorSource:
    """A checkpoint tensor not read yet: ``read`` touches only the requested rows or columns."""

    reader: CheckpointReader
    info: TensorInfo

    @property
    def where(self) -> str:
        """``<shard file>: tensor <name>``: the prefix of every error about this tensor."""
        return f"{self.reader.dir / self.info.file}: tensor {self.info.name}"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.info.shape)

    def error(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.where}: {message}")

    def read(self, dtype: torch.dtype | None = None, shard: tuple[int, int, int] | None = None) -> torch.Tensor:
        """The tensor (or its ``shard`` = (axis, start, end) slice), converted to ``dtype`` when given."""
        t = self.reader.get(self.info.name, shard)
        if dtype is None:
            return t
        check_dtype(t.dtype, dtype, self.where)
        return t if t.dtype == dtype else t.to(dtype)


def check_dtype(src: torch.dtype, dst: torch.dtype, where: str) -> None:
    """Packed/fp8 storage must match exactly; floating tensors convert, fp8 never silently."""

    def name(d: torch.dtype) -> str:
        return str(d).removeprefix("torch.")

    exact = dst in EXACT_DTYPES
    if exact and src != dst:
        raise CheckpointError(f"{where}: dtype {name(src)}, expected {name(dst)}")
    if not exact and not src.is_floating_point:
        raise CheckpointError(f"{where}: dtype {name(src)}, expected a floating-point tensor")
    if not exact and src in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise CheckpointError(
            f"{where}: dtype {name(src)}, expected {name(dst)} (fp8 weight without a quantization_config?)"
        )


def copy_into(param: torch.Tensor, src: TensorSource) -> None:
    """Fill ``param`` with this rank's slice of ``src``; shape and dtype are checked first."""
    loader = getattr(param, "weight_loader", None)
    if loader is not None:
        try:
            loader(param, src.read())
        except ValueError as e:
            raise src.error(str(e)) from None
        return
    full = getattr(param, "full_shape", None) or tuple(param.shape)
    if src.shape != tuple(full):
        raise src.error(f"shape {list(src.shape)}, expected {list(full)}")
    shard = getattr(param, "shard", None)
    t = src.read(param.dtype, shard)
    index = getattr(param, "shard_index", None)
    if index is not None:
        t = t.index_select(shard[0], index)
    param.data.copy_(t)
