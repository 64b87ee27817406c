"""The reference's log-probs in a file, as llama.cpp's ``--kl-divergence-base``: compute them once
(a float32 run, or the best path a bigger machine can run), measure other paths against the file.

One safetensors file: per prompt ``{i}.tokens`` [n] int64, and for its positions 1..n-1
``{i}.values`` (log-probs: [n-1, V] when full, else each row's top-k [n-1, k] with ``{i}.ids``
[n-1, k] int32), ``{i}.token_logprobs`` [n-1] (of the actual next token) and ``{i}.top1`` [n-1].
Top-k keeps the file compact (k * 8 bytes a position instead of V * 4); KL against it is the
top-k approximation of ``kimitui.eval.kl``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kimitui.eval.kl import Dist

FORMAT = "kimitui-kl-base"
VERSION = "1"


@dataclass
class BaseRecord:
    tokens: list[int]
    dist: Dist  # positions 1..n-1


class BaseWriter:
    """Collects one record per prompt; ``save`` writes them (top-k rows stay small in memory)."""

    def __init__(self, top_k: int, info: dict | None = None):
        if top_k < 0:
            raise ValueError(f"--base-top-k must be >= 0 (0 keeps full rows), got {top_k}")
        self.top_k = top_k
        self.info = dict(info or {})
        self.records: list[BaseRecord] = []

    def reduce(self, dist: Dist) -> Dist:
        """What the file keeps of ``dist``: its rows' top-k, or all of it."""
        return dist.top_k(self.top_k) if self.top_k else dist

    def add(self, tokens: list[int], dist: Dist) -> None:
        self.records.append(BaseRecord(list(tokens), self.reduce(dist)))

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        tensors = {}
        vocab = None
        for i, r in enumerate(self.records):
            tensors[f"{i}.tokens"] = torch.tensor(r.tokens, dtype=torch.int64)
            tensors[f"{i}.values"] = r.dist.values.float().contiguous()
            tensors[f"{i}.token_logprobs"] = r.dist.token_logprobs.float().contiguous()
            tensors[f"{i}.top1"] = r.dist.top1.long().contiguous()
            if r.dist.ids is not None:
                tensors[f"{i}.ids"] = r.dist.ids.to(torch.int32).contiguous()
            elif vocab is None:
                vocab = r.dist.values.shape[1]
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "num_prompts": str(len(self.records)),
            "top_k": str(self.top_k),
            "info": json.dumps(self.info),
        }
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata=meta)


def load_base(path: str | Path) -> tuple[list[BaseRecord], dict]:
    """The records of a file ``BaseWriter`` saved, and its info (model, dtype, ...)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"reference log-probs file {path} does not exist")
    try:
        f = safe_open(str(path), framework="pt")
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same one-line error
        raise ValueError(f"{path} is not a safetensors file ({e})") from None
    meta = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} does not hold reference log-probs (saved by kimitui eval kl --save-base)")
    if meta.get("version") != VERSION:
        raise ValueError(f"{path}: version {meta.get('version')} of the format, this kimitui reads {VERSION}")
    keys = set(f.keys())
    records = []
    for i in range(int(meta["num_prompts"])):
        ids = f.get_tensor(f"{i}.ids").long() if f"{i}.ids" in keys else None
        dist = Dist(f.get_tensor(f"{i}.values"), ids, f.get_tensor(f"{i}.token_logprobs"), f.get_tensor(f"{i}.top1"))
        records.append(BaseRecord(f.get_tensor(f"{i}.tokens").tolist(), dist))
    info = json.loads(meta.get("info") or "{}")
    info["top_k"] = int(meta.get("top_k", 0))
    return records, info
