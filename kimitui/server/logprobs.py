"""Engine log-probabilities (``list[dict[token_id, logprob]]``) in OpenAI's two response shapes."""

from __future__ import annotations

import codecs
import math

# JSON has no -inf; vLLM sends this floor for tokens the sampler masked out.
_FLOOR = -9999.0


def _safe(lp: float) -> float:
    return _FLOOR if math.isnan(lp) or lp < _FLOOR else lp


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


class TokenText:
    """Printable text and raw bytes of single tokens (a token may hold half a UTF-8 character)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def bytes(self, token_id: int) -> bytes:
        tok = self.tokenizer
        if tok is None:
            return f"token_id:{token_id}".encode()
        raw = tok.id_to_bytes(token_id) if token_id < tok.vocab_size else b""
        return raw if raw is not None else tok.decode([token_id]).encode()

    def text(self, token_id: int) -> str:
        raw = self.bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            # vLLM's convention for partial characters, so clients can still rebuild the bytes.
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TokenIdText(TokenText):
    """Tokens named by id, ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids``): two tokens
    with the same text stay apart, and a client can score by id."""

    def text(self, token_id: int) -> str:
        return f"token_id:{token_id}"


class TextOffsets:
    """Character offset of each token in the returned text, across streamed chunks.

    Follows the detokenizer: skipped special tokens add nothing and a character split over
    several tokens is counted once it completes.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool):
        self.names = TokenText(tokenizer)
        self.skip = tokenizer.special_ids if (tokenizer is not None and skip_special_tokens) else frozenset()
        self.offset = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, token_id: int) -> int:
        start = self.offset
        if token_id not in self.skip:
            self.offset += len(self._utf8.decode(self.names.bytes(token_id)))
        return start


def completion_logprobs(
    names: TokenText, token_ids: list[int], entries: list[dict[int, float] | None], k: int, offsets: TextOffsets
) -> dict:
    """``{tokens, token_logprobs, top_logprobs, text_offset}`` for OpenAI's completions API.

    ``entries[i]`` None (the first prompt token under ``echo``) gives null log-probs.
    """
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, entry in zip(token_ids, entries):
        out["tokens"].append(names.text(tid))
        out["text_offset"].append(offsets.advance(tid))
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_safe(entry.get(tid, _FLOOR)))
        out["top_logprobs"].append({names.text(t): _safe(lp) for t, lp in _top(entry, k)})
    return out


def chat_logprobs(names: TokenText, token_ids: list[int], entries: list[dict[int, float]], k: int) -> dict:
    """``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``."""
    content = []
    for tid, entry in zip(token_ids, entries):
        content.append(
            {
                "token": names.text(tid),
                "logprob": _safe(entry.get(tid, _FLOOR)),
                "bytes": list(names.bytes(tid)),
                "top_logprobs": [
                    {"token": names.text(t), "logprob": _safe(lp), "bytes": list(names.bytes(t))}
                    for t, lp in _top(entry, k)
                ],
            }
        )
    return {"content": content}
