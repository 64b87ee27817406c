"""Long-context recall: plant codes in a haystack, ask for each one, score the replies by exact match.

The test the Kimi K3 serving articles ran by hand (a stack that misread one attention parameter
found 31 of 48 planted codes past ~100K tokens, 72 of 72 after the fix), as a command: the same
haystack (kimitui/eval/haystack.py) at each context length the user names, one question per code,
greedy replies, and the result per depth and per length. The prompts are the model's own chat
format with thinking off: in this process through the checkpoint's ChatFormat, against a server
through /v1/chat/completions (the server renders the same format; its ``usage.prompt_tokens`` says
how long the prompt really was).
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

from kimitui.eval.haystack import Haystack, Needle, build_haystack, make_needles

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_MAX_TOKENS = 24

FOUND, MISSING, WRONG, AMBIGUOUS = "found", "missing", "wrong", "ambiguous"


def _code_pattern(code: str) -> re.Pattern:
    # The code as a whole word: "7XKQ-42QM." and "**7XKQ-42QM**" match, "7XKQ-42QMZ" and
    # "A7XKQ-42QM" do not (that is a different code).
    return re.compile(r"(?<![A-Za-z0-9-])" + re.escape(code) + r"(?![A-Za-z0-9]|-[A-Za-z0-9])")


def score_reply(reply: str, code: str, planted: list[str] | tuple[str, ...] = ()) -> str:
    """Exact-match verdict on one reply: ``found`` (the asked code and no other planted code),
    ``ambiguous`` (the asked code among other planted ones: a list of every code scores nothing),
    ``wrong`` (only other planted codes) or ``missing`` (no planted code at all)."""
    has = bool(_code_pattern(code).search(reply))
    others = any(_code_pattern(c).search(reply) for c in planted if c != code)
    if has:
        return AMBIGUOUS if others else FOUND
    return WRONG if others else MISSING


@dataclass
class RecallTarget:
    """What the harness talks to: a chat encoder for sizing prompts, a token counter, the model's
    context limit (None: unknown, the server will say), and ``answer(haystack) -> [(reply, prompt_tokens)]``."""

    describe: str
    encode_messages: Callable[[list[dict]], list[int]]
    count_tokens: Callable[[str], int]
    max_model_len: int | None
    answer: Callable[[Haystack, int], list[tuple[str, int]]]
    close: Callable[[], None] = lambda: None


def parse_context_lengths(text: str) -> list[int]:
    """``"4096,32k,128K"`` -> [4096, 32768, 131072]; one-line ValueError on anything else."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        m = re.fullmatch(r"(\d+)([kK]?)", part)
        if not m:
            raise ValueError(f"--context-lengths: expected numbers like 4096 or 32k separated by commas, got {part!r}")
        n = int(m.group(1)) * (1024 if m.group(2) else 1)
        if n < 1:
            raise ValueError(f"--context-lengths: a context length must be positive, got {part!r}")
        out.append(n)
    if not out:
        raise ValueError("--context-lengths: give at least one length")
    return out


def parse_depths(text: str) -> list[float]:
    try:
        depths = [float(p) for p in text.split(",")]
    except ValueError:
        raise ValueError(f"--depths: expected fractions like 0,0.5,1 separated by commas, got {text!r}") from None
    bad = [d for d in depths if not 0.0 <= d <= 1.0]
    if bad or not depths:
        raise ValueError(f"--depths: each depth is a fraction of the document between 0 and 1, got {text!r}")
    return depths


def check_lengths(lengths: list[int], max_model_len: int | None, max_tokens: int) -> None:
    """Every context length plus the reply must fit the model's maximum: one line naming the limit."""
    if max_model_len is None:
        return
    limit = max_model_len - max_tokens
    for n in lengths:
        if n > limit:
            raise ValueError(
                f"context length {n} is above this model's maximum: max_model_len is {max_model_len} "
                f"tokens, so prompts can have at most {limit} with {max_tokens} reply tokens"
            )


def run_recall(
    target: RecallTarget,
    lengths: list[int],
    depths: list[float] = DEFAULT_DEPTHS,
    codes_per_depth: int = 1,
    seed: int = 0,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the recall test at every length; the JSON-able result (per length, per depth, per code)."""
    check_lengths(lengths, target.max_model_len, max_tokens)
    needles = make_needles(list(depths), codes_per_depth, seed)
    planted = [n.code for n in needles]
    per_length = []
    for length in lengths:
        if progress:
            progress(f"context length {length}: building the haystack")
        hay = build_haystack(length, needles, target.encode_messages, target.count_tokens, seed)
        if progress:
            progress(f"context length {length}: asking for {len(needles)} codes")
        t0 = time.monotonic()
        replies = target.answer(hay, max_tokens)
        items = []
        for needle, local_ids, (reply, prompt_tokens) in zip(needles, hay.prompts, replies):
            items.append(
                {
                    "depth": needle.depth,
                    "key": needle.key,
                    "code": needle.code,
                    "reply": reply,
                    "verdict": score_reply(reply, needle.code, planted),
                    "prompt_tokens": prompt_tokens if prompt_tokens is not None else len(local_ids),
                }
            )
        per_length.append(_summarise_length(length, items, time.monotonic() - t0))
    found = sum(r["found"] for r in per_length)
    total = sum(r["total"] for r in per_length)
    return {
        "target": target.describe,
        "context_lengths": list(lengths),
        "depths": list(depths),
        "codes_per_depth": codes_per_depth,
        "seed": seed,
        "max_tokens": max_tokens,
        "max_model_len": target.max_model_len,
        "found": found,
        "total": total,
        "recall": found / total if total else 0.0,
        "results": per_length,
    }


def _summarise_length(length: int, items: list[dict], seconds: float) -> dict[str, Any]:
    by_depth: dict[float, list[dict]] = {}
    for it in items:
        by_depth.setdefault(it["depth"], []).append(it)
    depths = [
        {
            "depth": d,
            "found": sum(i["verdict"] == FOUND for i in its),
            "total": len(its),
            "recall": sum(i["verdict"] == FOUND for i in its) / len(its),
        }
        for d, its in by_depth.items()
    ]
    found = sum(i["verdict"] == FOUND for i in items)
    tokens = [i["prompt_tokens"] for i in items]
    return {
        "context_length": length,
        "prompt_tokens_min": min(tokens),
        "prompt_tokens_max": max(tokens),
        "found": found,
        "total": len(items),
        "recall": found / len(items),
        "seconds": round(seconds, 3),
        "verdicts": {v: sum(i["verdict"] == v for i in items) for v in (FOUND, MISSING, WRONG, AMBIGUOUS)},
        "depths": depths,
        "items": items,
    }


def format_table(result: dict[str, Any]) -> str:
    """Found/total per context length (rows) and depth (columns), with the row's recall."""
    depths = result["depths"]
    head = (
        f"{'context':>9} {'prompt':>8} " + " ".join(f"{'d=' + format(d, 'g'):>7}" for d in depths) + f" {'recall':>7}"
    )
    lines = [
        "=" * len(head),
        "Long-context recall (planted codes, exact match)".center(len(head)),
        "-" * len(head),
        head,
    ]
    for r in result["results"]:
        cells = {d["depth"]: f"{d['found']}/{d['total']}" for d in r["depths"]}
        lines.append(
            f"{r['context_length']:>9} {r['prompt_tokens_max']:>8} "
            + " ".join(f"{cells.get(d, '-'):>7}" for d in depths)
            + f" {r['recall']:>7.1%}"
        )
    lines.append("-" * len(head))
    lines.append(
        f"{'total':>9} {'':>8} "
        + " ".join(f"{'':>7}" for _ in depths)
        + f" {result['recall']:>7.1%}  ({result['found']}/{result['total']} codes, {result['target']})"
    )
    lines.append("=" * len(head))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Targets


def in_process_target(llm: Any, name: str) -> RecallTarget:
    """An ``engine.LLM`` in this process: prompts in its checkpoint's chat format, thinking off, greedy."""
    from kimitui.engine.sampling_params import SamplingParams
    from kimitui.engine.text.chat_format import chat_format_for

    tok = llm.get_tokenizer()
    if tok is None:
        raise ValueError(f"{name}: the checkpoint has no tokenizer; the recall prompts need one")
    fmt = chat_format_for(tok)

    def encode(messages: list[dict]) -> list[int]:
        return fmt.encode(messages, thinking=False).ids

    started_in_thinking = fmt.encode([{"role": "user", "content": "x"}], thinking=False).started_in_thinking

    def answer(hay: Haystack, max_tokens: int) -> list[tuple[str, int]]:
        params = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            stop_token_ids=fmt.stop_token_ids(),
            keep_special_token_ids=fmt.keep_special_ids(),
        )
        outs = llm.generate([{"prompt_token_ids": ids} for ids in hay.prompts], params)
        replies = []
        for ids, out in zip(hay.prompts, outs):
            parser = fmt.reply_parser(started_in_thinking)
            parser.feed(out.outputs[0].text)
            parser.finish()
            replies.append((parser.result().content, len(ids)))
        return replies

    return RecallTarget(
        f"{name} in-process ({fmt.name} chat format)",
        encode,
        lambda s: len(tok.encode(s)),
        getattr(llm.engine, "max_model_len", None),
        answer,
        llm.shutdown,
    )


def http_target(
    base_url: str,
    model: str | None,
    tokenizer_for: Callable[[str], Any],
    api_key: str | None = None,
    max_concurrency: int = 8,
    timeout_s: float = 3600.0,
) -> RecallTarget:
    """An OpenAI-compatible server: /v1/chat/completions with the server's chat template (thinking
    off through ``chat_template_kwargs``), greedy. ``tokenizer_for(served_model_name)`` returns a
    local copy of the served checkpoint's tokenizer, which sizes the haystack; the server's
    ``usage.prompt_tokens`` is what gets reported."""
    import httpx

    from kimitui.client.http import server_root
    from kimitui.engine.text.chat_format import chat_format_for

    root = server_root(base_url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{root}/v1/models", headers=headers, timeout=30)
        resp.raise_for_status()
        cards = resp.json().get("data", [])
    except (httpx.HTTPError, ValueError) as e:
        raise ConnectionError(f"could not list models at {root}/v1/models: {type(e).__name__}: {e}") from e
    if not cards:
        raise ConnectionError(f"no models are served at {root}/v1/models")
    card = next((c for c in cards if c.get("id") == model), None) if model else cards[0]
    if card is None:
        served = ", ".join(c.get("id", "?") for c in cards)
        raise ValueError(f"model {model!r} is not served at {root} (served: {served})")
    model = card["id"]
    tokenizer = tokenizer_for(model)
    fmt = chat_format_for(tokenizer)

    def encode(messages: list[dict]) -> list[int]:
        return fmt.encode(messages, thinking=False).ids

    async def ask_all(hay: Haystack, max_tokens: int) -> list[tuple[str, int]]:
        gate = asyncio.Semaphore(max_concurrency)
        async with httpx.AsyncClient(timeout=timeout_s, headers=headers) as http:

            async def ask(i: int) -> tuple[str, int]:
                body = {
                    "model": model,
                    "messages": hay.messages(i),
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "chat_template_kwargs": {"thinking": False},
                }
                async with gate:
                    try:
                        r = await http.post(f"{root}/v1/chat/completions", json=body)
                    except httpx.HTTPError as e:
                        raise ConnectionError(f"{root}/v1/chat/completions: {type(e).__name__}: {e}") from e
                if r.status_code != 200:
                    raise ValueError(
                        f"{root} refused a {hay.context_length}-token recall prompt: HTTP "
                        f"{r.status_code} {_error_message(r)}"
                    )
                data = r.json()
                content = data["choices"][0]["message"].get("content") or ""
                return content, data.get("usage", {}).get("prompt_tokens")

            return list(await asyncio.gather(*(ask(i) for i in range(len(hay.needles)))))

    def answer(hay: Haystack, max_tokens: int) -> list[tuple[str, int]]:
        return asyncio.run(ask_all(hay, max_tokens))

    return RecallTarget(
        f"{root} (model {model})", encode, lambda s: len(tokenizer.encode(s)), card.get("max_model_len"), answer
    )


def _error_message(resp: Any) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:200]


__all__ = [
    "score_reply",
    "run_recall",
    "format_table",
    "in_process_target",
    "http_target",
    "RecallTarget",
    "parse_context_lengths",
    "parse_depths",
    "check_lengths",
    "Needle",
    "FOUND",
    "MISSING",
    "WRONG",
    "AMBIGUOUS",
]
