"""Shared fakes for the kimitui.bench tests: a round-trip tokenizer and synthetic outputs."""

from __future__ import annotations

from kimitui.bench.clients import RequestFuncOutput


class WordTokenizer:
    """Token i <-> word "w{i}"; decode/encode round-trips exactly. Ids 0-2 are special."""

    def __init__(self, vocab_size: int = 500, special_ids: frozenset[int] = frozenset({0, 1, 2})):
        self.vocab_size = vocab_size
        self.special_ids = set(special_ids)

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)

    def encode(self, text):
        return [int(w[1:]) for w in text.split()]


class SplittingTokenizer(WordTokenizer):
    """Ids >= 450 decode to two words, so a decoded prompt re-encodes longer (like BPE
    merges drifting); the re-encoded ids are stable, so vLLM's loop converges."""

    def decode(self, ids):
        return " ".join("w3 w4" if i >= 450 else f"w{i}" for i in ids)


class ExpandingTokenizer(WordTokenizer):
    """Every id divisible by 7 re-encodes as two tokens, forever: the loop never converges."""

    def encode(self, text):
        out = []
        for i in super().encode(text):
            out.extend([i, 3] if i % 7 == 0 else [i])
        return out


def synthetic_outputs() -> list[RequestFuncOutput]:
    """Three successes and one failure with hand-computable metrics (see test_bench_metrics)."""
    return [
        RequestFuncOutput(True, "a", 10, 5, 0.1, [0.05, 0.05, 0.1, 0.1], 0.4, 0.0),
        RequestFuncOutput(True, "b", 20, 3, 0.2, [0.1, 0.2], 0.5, 0.3),
        RequestFuncOutput(True, "c", 30, 1, 0.3, [], 0.3, 1.0),
        RequestFuncOutput(False, "", 40, 0, 0.0, [], 0.0, 1.1, "HTTP 500"),
    ]
