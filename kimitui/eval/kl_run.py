"""One KL measurement: prompts, a reference source and a tested source, compared position by position.

The reference always scores every position through prefill (its distribution does not depend on
the path that computed it, up to its own rounding); the tested source scores the first positions
of each prompt through prefill and, with ``decode_tokens`` > 0, the last ones through the decode
path (teacher-forced), so the two paths are reported separately. Both are streamed piece by piece
and compared as they arrive: no prompt's full-vocabulary rows are ever held at once.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

from kimitui.eval.kl import Dist, KLReport
from kimitui.eval.kl_base import BaseRecord, BaseWriter


def generated_prompts(
    vocab_size: int, num: int, length: int, seed: int = 0, special_ids: frozenset[int] = frozenset()
) -> list[list[int]]:
    """``num`` prompts of ``length`` token ids drawn uniformly (seeded) from the ordinary tokens."""
    if num < 1 or length < 2:
        raise ValueError(f"generated prompts need --num-prompts >= 1 and --prompt-len >= 2, got {num}, {length}")
    rng = random.Random(seed)
    pool = [t for t in range(vocab_size) if t not in special_ids]
    return [[rng.choice(pool) for _ in range(length)] for _ in range(num)]


def file_prompts(path: str | Path, tokenizer, num: int, length: int) -> list[list[int]]:
    """Prompts from a file. ``.jsonl``: one per line, ``{"prompt_token_ids": [...]}`` or
    ``{"text": ...}`` / ``{"prompt": ...}``. Any other file is text, tokenized whole and cut into
    ``length``-token prompts (as llama.cpp cuts its text into contexts). At most ``num`` prompts."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")

    def encode(text: str) -> list[int]:
        if tokenizer is None:
            raise ValueError(f"{path} holds text but the checkpoint has no tokenizer; use prompt_token_ids")
        return tokenizer.encode(text)

    out: list[list[int]] = []
    if path.suffix == ".jsonl":
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            if isinstance(row, dict) and isinstance(row.get("prompt_token_ids"), list):
                ids = [int(t) for t in row["prompt_token_ids"]]
            elif isinstance(row, dict) and isinstance(row.get("text", row.get("prompt")), str):
                ids = encode(row.get("text", row.get("prompt")))
            else:
                raise ValueError(f"{path}:{n}: expected an object with prompt_token_ids, text or prompt")
            if len(ids) >= 2:
                out.append(ids[:length] if length else ids)
    else:
        ids = encode(path.read_text(encoding="utf-8"))
        out = [ids[i : i + length] for i in range(0, len(ids) - 1, length) if len(ids[i : i + length]) >= 2]
    if not out:
        raise ValueError(f"{path} gives no prompt of at least 2 tokens")
    return out[:num]


def decode_start(n: int, decode_tokens: int) -> int | None:
    """Where the decode path takes over in an ``n``-token prompt (None: prefill only); at least one
    position stays on prefill."""
    if decode_tokens <= 0:
        return None
    return max(1, n - decode_tokens - 1)


class FileReference:
    """A saved reference (``kl_base``) as a source: the prompts are its own."""

    exact = True

    def __init__(self, records: list[BaseRecord]):
        self.records = records
        self.by_tokens = {tuple(r.tokens): r for r in records}

    @property
    def prompts(self) -> list[list[int]]:
        return [r.tokens for r in self.records]

    def score(self, tokens: list[int], decode_from: int | None = None) -> Iterator[tuple[str, int, Dist]]:
        rec = self.by_tokens.get(tuple(tokens))
        if rec is None:
            raise ValueError("a prompt is not in the reference file")
        yield "prefill", 1, rec.dist


def _aligned(ref: Iterator[tuple[str, int, Dist]], test: Iterator[tuple[str, int, Dist]]):
    """(path of the tested rows, reference Dist, tested Dist) over the same positions."""
    buf: list[tuple[int, Dist]] = []  # reference pieces not used up, in order
    for path, pos, q in test:
        n = len(q)
        while not buf or buf[-1][0] + len(buf[-1][1]) < pos + n:
            try:
                _, rpos, p = next(ref)
            except StopIteration:
                raise ValueError(f"the reference ends before position {pos + n - 1}") from None
            buf.append((rpos, p))
        at = 0
        while at < n:
            rpos, p = buf[0]
            lo = pos + at - rpos
            if lo < 0:
                raise ValueError(f"the reference has no row for position {pos + at}")
            take = min(n - at, len(p) - lo)
            if take <= 0:
                buf.pop(0)
                continue
            yield path, p.slice(lo, lo + take), q.slice(at, at + take)
            at += take
            if lo + take == len(p):
                buf.pop(0)


def measure(
    prompts: list[list[int]],
    reference,
    test,
    decode_tokens: int = 16,
    progress: Callable[[int, int], None] | None = None,
) -> KLReport:
    report = KLReport()
    for i, tokens in enumerate(prompts):
        d = decode_start(len(tokens), decode_tokens) if test.exact else None
        for path, p, q in _aligned(reference.score(tokens), test.score(tokens, decode_from=d)):
            report.add(path, p, q)
        if progress is not None:
            progress(i + 1, len(prompts))
    return report


def record_base(
    prompts: list[list[int]], source, writer: BaseWriter, progress: Callable[[int, int], None] | None = None
) -> None:
    """Score every prompt (all positions through prefill) and add it to ``writer``."""
    import torch

    for i, tokens in enumerate(prompts):
        pieces = [writer.reduce(p) for _path, _pos, p in source.score(tokens)]  # top-k as rows arrive
        ids = None if pieces[0].ids is None else torch.cat([p.ids for p in pieces])
        writer.add(
            tokens,
            Dist(
                torch.cat([p.values for p in pieces]),
                ids,
                torch.cat([p.token_logprobs for p in pieces]),
                torch.cat([p.top1 for p in pieces]),
            ),
        )
        if progress is not None:
            progress(i + 1, len(prompts))
