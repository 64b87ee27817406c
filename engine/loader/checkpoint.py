"""A safetensors checkpoint on disk: the index, its shards, and lazy tensor access."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and tensor."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str  # shard file name relative to the checkpoint dir
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string, e.g. "BF16", "F8_E4M3", "I32"
    nbytes: int


class CheckpointReader:
    """Lists every tensor of a checkpoint without reading data; reads one tensor at a time.

    Shards are memory-mapped by safetensors, so only the tensor being copied is touched.
    """

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        self.tensors: dict[str, TensorInfo] = {}
        self._handles: dict[str, object] = {}
        index = self.dir / INDEX_FILE
        if index.is_file():
            files = self._read_index(index)
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.dir}: no {INDEX_FILE} and no *.safetensors files")
        for f in files:
            self._scan(f)
        if index.is_file():
            self._check_index_matches(index)

    def _read_index(self, index: Path) -> list[str]:
        try:
            data = json.loads(index.read_text())
            weight_map = data["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(
                f"{index}: field 'weight_map' must be an object of tensor name -> shard file, "
                f"got a {type(weight_map).__name__}"
            )
        self._weight_map: dict[str, str] = dict(weight_map)
        files = sorted(set(self._weight_map.values()))
        for f in files:
            if not (self.dir / f).is_file():
                example = next(n for n, s in self._weight_map.items() if s == f)
                raise CheckpointError(
                    f"{self.dir / f}: missing shard (listed in {INDEX_FILE}, e.g. for tensor {example})"
                )
        return files

    def _scan(self, file: str) -> None:
        path = self.dir / file
        size = os.path.getsize(path)
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
            names = list(handle.keys())
        except Exception as e:  # safetensors raises SafetensorError / OSError on truncation and corruption
            raise CheckpointError(
                f"{path}: cannot read safetensors header ({_short(e)}); truncated or corrupt?"
            ) from None
        # The header parses even when the data section was cut short: check the byte extent too.
        end = 0
        for name in names:
            sl = handle.get_slice(name)
            shape = tuple(sl.get_shape())
            dtype = sl.get_dtype()
            nbytes = _nbytes(shape, dtype)
            self.tensors[name] = TensorInfo(name, file, shape, dtype, nbytes)
            end += nbytes
        header_len = _header_len(path)
        if header_len + 8 + end > size:
            raise CheckpointError(f"{path}: file is truncated ({size} bytes, header promises {header_len + 8 + end})")
        self._handles[file] = handle

    def _check_index_matches(self, index: Path) -> None:
        for name, file in self._weight_map.items():
            info = self.tensors.get(name)
            if info is None or info.file != file:
                raise CheckpointError(
                    f"{self.dir / file}: tensor {name} is listed in {INDEX_FILE} but not in this shard"
                )

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def __iter__(self) -> Iterator[TensorInfo]:
        # Shard by shard so each file's pages are read sequentially.
        return iter(sorted(self.tensors.values(), key=lambda t: (t.file, t.name)))

    def get(self, name: str, shard: tuple[int, int, int] | None = None) -> torch.Tensor:
        """The tensor, or only rows/columns ``[start, end)`` of axis 0/1 when ``shard`` is given."""
        info = self.tensors[name]
        try:
            handle = self._handles[info.file]
            if shard is None:
                return handle.get_tensor(name)
            axis, start, end = shard
            sl = handle.get_slice(name)
            return sl[start:end] if axis == 0 else sl[:, start:end]
        except Exception as e:
            raise CheckpointError(f"{self.dir / info.file}: tensor {name}: cannot read data ({_short(e)})") from None


_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "F8_E8M0": 1,
}


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * _DTYPE_BYTES.get(dtype, 1)


def _header_len(path: Path) -> int:
    with open(path, "rb") as f:
        return int.from_bytes(f.read(8), "little")


def _short(e: Exception) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__
