"""Where log-probs come from: an in-process engine (any path its flags choose) or a remote
OpenAI-compatible server (top-k log-probs of the prompt through /v1/completions ``echo``).

Every source yields, for one prompt of token ids, ``(path, first_pos, Dist)`` pieces in position
order: row i of a piece is the distribution of the token at ``first_pos + i``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from kimitui.eval.kl import Dist

BREAK_ENV = "KIMITUI_EVAL_BREAK"


class LocalSource:
    """An in-process ``engine.LLM``; ``decode_from`` sends the positions after it through the decode path."""

    exact = True

    def __init__(self, llm, chunk: int = 256):
        self.llm = llm
        self.chunk = chunk

    @property
    def vocab_size(self) -> int:
        return self.llm.engine.config.vocab_size

    def score(self, tokens: list[int], decode_from: int | None = None) -> Iterator[tuple[str, int, Dist]]:
        nxt = torch.tensor(tokens, dtype=torch.int64)
        for rows in self.llm.score_logits(tokens, decode_from=decode_from, chunk=self.chunk):
            n = rows.num_rows
            yield rows.path, rows.first_pos, Dist.dense(rows.values, nxt[rows.first_pos : rows.first_pos + n])


class RemoteSource:
    """A server's top-k log-probs of a token-id prompt (``echo`` + ``logprobs`` + ``max_tokens: 1``),
    with ``return_tokens_as_token_ids`` (vLLM's field; kimitui serve has it too) so every entry names
    its token id. Only the prefill path: a server cannot be made to decode given tokens."""

    exact = False

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str | None = None,
        top_k: int = 20,
        timeout: float = 600.0,
    ):
        import httpx

        if not 1 <= top_k <= 20:
            raise ValueError(f"--remote-top-k must be in 1..20 (servers cap log-probs at 20), got {top_k}")
        base = base_url.rstrip("/")
        self.url = base if base.endswith("/v1") else base + "/v1"
        self.top_k = top_k
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(headers=headers, timeout=timeout)
        self.model = model or self._first_model()

    def _first_model(self) -> str:
        r = self.client.get(f"{self.url}/models")
        r.raise_for_status()
        data = r.json().get("data") or []
        if not data:
            raise ValueError(f"{self.url}/models lists no model")
        return data[0]["id"]

    def score(self, tokens: list[int], decode_from: int | None = None) -> Iterator[tuple[str, int, Dist]]:
        body = {
            "model": self.model,
            "prompt": tokens,
            "max_tokens": 1,
            "temperature": 0,
            "echo": True,
            "logprobs": self.top_k,
            "return_tokens_as_token_ids": True,
        }
        r = self.client.post(f"{self.url}/completions", json=body)
        if r.status_code != 200:
            raise ValueError(f"{self.url}/completions answered {r.status_code}: {r.text[:300]}")
        lp = r.json()["choices"][0]["logprobs"]
        tops = lp["top_logprobs"][1 : len(tokens)]  # position 0 has no context; the last entry is the sample
        tok_lps = lp["token_logprobs"][1 : len(tokens)]
        if len(tops) != len(tokens) - 1 or any(t is None for t in tops):
            raise ValueError("the server did not return log-probs for every prompt position (echo + logprobs)")
        ids = torch.full((len(tops), self.top_k), 0, dtype=torch.int64)
        vals = torch.full((len(tops), self.top_k), float("-inf"), dtype=torch.float32)
        for i, top in enumerate(tops):
            for j, (name, v) in enumerate(sorted(top.items(), key=lambda kv: -kv[1])[: self.top_k]):
                if not name.startswith("token_id:"):
                    raise ValueError(
                        "the server ignores return_tokens_as_token_ids: its top log-probs name token "
                        f"text ({name!r}), not ids"
                    )
                ids[i, j] = int(name.removeprefix("token_id:"))
                vals[i, j] = v
        top1 = ids.gather(1, vals.argmax(dim=1, keepdim=True))[:, 0]
        yield "prefill", 1, Dist(vals, ids, torch.tensor(tok_lps, dtype=torch.float32), top1)

    def close(self) -> None:
        self.client.close()


def apply_break(llm, spec: str | None = None) -> str | None:
    """Test hook: deliberately break a loaded one-process engine, as a misread checkpoint parameter
    would (the kind of bug KL exists to catch). ``spec`` (default ``$KIMITUI_EVAL_BREAK``):
    ``norm_eps=X`` sets the final RMSNorm's epsilon; ``rope_scale=S`` rotates every rotary
    embedding as if positions were S times larger. Returns what was done, or None."""
    spec = os.environ.get(BREAK_ENV, "") if spec is None else spec
    if not spec.strip():
        return None
    name, _, value = spec.partition("=")
    try:
        x = float(value)
    except ValueError:
        raise ValueError(f"{BREAK_ENV}={spec!r}: expected norm_eps=X or rope_scale=S") from None
    if llm.engine.workers is not None:
        raise ValueError(f"{BREAK_ENV} breaks a one-process engine only (tensor-parallel ranks load their own weights)")
    model = llm.engine.model
    if name == "norm_eps":
        model.model.norm.eps = x
    elif name == "rope_scale":
        from kimitui.engine.layers.rope import YarnRotaryEmbedding

        ropes = [m for m in model.modules() if isinstance(m, YarnRotaryEmbedding)]
        if not ropes:
            raise ValueError(f"{BREAK_ENV}: this model has no rotary embedding to break")
        for rope in ropes:  # in place: every kernel holding these buffers sees the change
            amp = torch.sqrt(rope.cos[0] ** 2 + rope.sin[0] ** 2)  # the YaRN amplitude per pair
            step = torch.atan2(rope.sin[1], rope.cos[1])  # the angle per position of each pair (< pi)
            pos = torch.arange(rope.cos.shape[0], dtype=torch.float32, device=rope.cos.device)[:, None]
            angle = pos * x * step[None, :]
            rope.cos.copy_(angle.cos() * amp)
            rope.sin.copy_(angle.sin() * amp)
            rope.cis.copy_(torch.complex(rope.cos, rope.sin))
    else:
        raise ValueError(f"{BREAK_ENV}={spec!r}: expected norm_eps=X or rope_scale=S")
    return f"{name}={x:g} (deliberately broken: {BREAK_ENV})"
