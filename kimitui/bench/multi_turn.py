"""The `multi-turn` workload: agentic sessions that resend the whole conversation every turn.

Kimi K3's headline workload is agentic coding: long sessions where each turn repeats the
conversation so far, so the prefix cache (and on hybrid models the KDA state snapshot at the end
of the previous turn) decides the time to first token. Each of `--num-prompts` sessions runs
`--multi-turn-turns` turns one after another, waiting `--multi-turn-think-time` seconds between a
reply and the next user message; sessions start together and run side by side (`--max-concurrency`
caps how many; `--request-rate` does not apply).
All sessions share one prefix: tool definitions (JSON, as an agent declares them) and a system
prompt, `--multi-turn-system-len` tokens together. Turn k's prompt is that prefix, then every
earlier user message and reply (the reply's token ids exactly as generated), then a new user
message of about `--random-input-len` tokens; replies are `--random-output-len` tokens long.

Prompts are token ids, in process and over HTTP (`/v1/completions` takes id lists; the reply's
ids come back with vLLM's `return_token_ids`), so a turn repeats the previous one token for token
and the cache hit is the engine's to find, not the tokenizer's round trip to lose.

Reported on top of the usual metrics: TTFT per turn index, and the prefix-cache hit rate twice:
from the requests (usage `cached_tokens` / prompt tokens) and from the engine's own counters over
the run (in process: its stats; over HTTP: /metrics `prefix_cache_hits` / `prefix_cache_queries`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kimitui.bench.clients import RequestFuncOutput, target_metrics
from kimitui.bench.workload import SampleRequest, allowed_token_ids, length_bounds

_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test suite, return failures.",
            "parameters": {"type": "object", "properties": {"filter": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "apply_patch",
            "description": "Apply a unified diff.",
            "parameters": {"type": "object", "properties": {"diff": {"type": "string"}}, "required": ["diff"]},
        },
    },
]


@dataclass(frozen=True)
class Session:
    """One conversation: the shared prefix, then a user message and a reply length per turn."""

    prefix_ids: list[int]
    user_ids: list[list[int]]
    output_lens: list[int]


def sample_sessions(
    tokenizer: Any,
    num_sessions: int,
    turns: int,
    system_len: int,
    user_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[Session]:
    """Sessions with a shared tools + system prefix of exactly `system_len` tokens (the tools' JSON
    and a system line, cut or padded with random tokens) and random user messages and reply lengths
    (vLLM's `random` length ranges)."""
    if num_sessions < 1:
        raise ValueError(f"--num-prompts (sessions) must be >= 1, got {num_sessions}")
    if turns < 1:
        raise ValueError(f"--multi-turn-turns must be >= 1, got {turns}")
    rng = np.random.default_rng(seed)
    allowed = allowed_token_ids(tokenizer)
    prefix = list(tokenizer.encode("# Tools\n" + json.dumps(_TOOLS) + "\n# System\nYou are a coding agent.\n"))
    prefix = prefix[:system_len]  # exactly system_len tokens: cut, or padded with random text
    if len(prefix) < system_len:
        prefix += allowed[rng.integers(0, len(allowed), size=system_len - len(prefix))].tolist()
    u_low, u_high = length_bounds(user_len, range_ratio, low_min=1)
    o_low, o_high = length_bounds(output_len, range_ratio, low_min=1)
    sessions = []
    for _ in range(num_sessions):
        users = [
            allowed[rng.integers(0, len(allowed), size=int(rng.integers(u_low, u_high + 1)))].tolist()
            for _ in range(turns)
        ]
        outs = [int(x) for x in rng.integers(o_low, o_high + 1, size=turns)]
        sessions.append(Session(prefix, users, outs))
    return sessions


async def read_prefix_counters(client: Any) -> tuple[int, int] | None:
    """(tokens looked up, tokens hit) of the target's prefix cache so far, or None if unknown."""
    engine = getattr(client, "engine", None)
    if engine is not None:
        s = engine.stats()
        return int(s.prefix_cache_queries), int(s.prefix_cache_hits)
    text = await target_metrics(client)
    try:
        return parse_prefix_counters(text) if text is not None else None
    except Exception:  # noqa: BLE001 - unreadable /metrics: no engine-side rate, never a failure
        return None


def parse_prefix_counters(text: str) -> tuple[int, int] | None:
    """vLLM's `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` counters (or kimitui's), summed
    over label sets, from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for prefix in ("vllm:", "kimitui:"):
            key = family.name.removeprefix(prefix)
            if family.name.startswith(prefix) and key in ("prefix_cache_queries", "prefix_cache_hits"):
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        found[key] = found.get(key, 0) + sample.value
    if "prefix_cache_queries" not in found:
        return None
    return int(found["prefix_cache_queries"]), int(found.get("prefix_cache_hits", 0))


@dataclass
class TurnResult:
    session: int
    turn: int
    request: SampleRequest
    output: RequestFuncOutput


async def run_sessions(
    sessions: list[Session],
    client: Any,
    max_concurrency: int | None,
    think_time_s: float,
    cancel: asyncio.Event,
    on_done=None,
) -> list[TurnResult]:
    """Every session's turns in order (a failed turn ends its session), sessions concurrently."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    results: list[TurnResult] = []

    async def session(si: int, s: Session) -> None:
        async with limit:
            history = list(s.prefix_ids)
            for k, (user, out_len) in enumerate(zip(s.user_ids, s.output_lens)):
                if cancel.is_set():
                    return
                if k and think_time_s > 0:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(cancel.wait(), timeout=think_time_s)
                    if cancel.is_set():
                        return
                ids = history + user
                req = SampleRequest(None, ids, len(ids), out_len)
                out = await client(req, f"mt-{si}-{k}-{time.monotonic_ns()}")
                results.append(TurnResult(si, k, req, out))
                if on_done is not None:
                    on_done(out)
                if not out.success:
                    return
                history = ids + list(out.output_token_ids)

    await asyncio.gather(*(session(i, s) for i, s in enumerate(sessions)))
    return results


def multi_turn_keys(
    results: list[TurnResult], turns: int, counters_before, counters_after, percentiles: tuple[float, ...]
) -> dict[str, Any]:
    """Per-turn TTFT and the two prefix-cache hit rates (module doc)."""
    ok = [r for r in results if r.output.success]
    per_turn = []
    for k in range(turns):
        ttfts = [r.output.ttft for r in ok if r.turn == k]
        prompt = sum(r.output.prompt_len for r in ok if r.turn == k)
        cached = sum(r.output.cached_tokens or 0 for r in ok if r.turn == k)
        row = {
            "turn": k + 1,
            "completed": len(ttfts),
            "mean_prompt_len": prompt / len(ttfts) if ttfts else 0.0,
            "mean_ttft_ms": float(np.mean(ttfts)) * 1000 if ttfts else 0.0,
            "median_ttft_ms": float(np.median(ttfts)) * 1000 if ttfts else 0.0,
            "prefix_cache_hit_rate": cached / prompt if prompt else 0.0,
        }
        for p in percentiles:
            row[f"p{p:g}_ttft_ms"] = float(np.percentile(ttfts, p)) * 1000 if ttfts else 0.0
        per_turn.append(row)
    prompt = sum(r.output.prompt_len for r in ok)
    known = all(r.output.cached_tokens is not None for r in ok)
    cached = sum(r.output.cached_tokens or 0 for r in ok)
    engine_rate = None
    if counters_before is not None and counters_after is not None:
        queries = counters_after[0] - counters_before[0]
        hits = counters_after[1] - counters_before[1]
        engine_rate = hits / queries if queries else None
    return {
        "dataset_name": "multi-turn",
        "multi_turn_turns": turns,
        "per_turn": per_turn,
        "prefix_cache_hit_rate": cached / prompt if prompt and known else None,
        "total_cached_tokens": cached if known else None,
        "engine_prefix_cache_hit_rate": engine_rate,
    }


def format_multi_turn_block(result: dict[str, Any]) -> str:
    lines = ["{s:{c}^{n}}".format(s=" Multi-turn ", n=50, c="-")]

    def rate(v) -> str:
        return "n/a" if v is None else f"{100 * v:.1f}%"

    lines.append("{:<40} {:<10}".format("Prefix cache hit rate (requests):", rate(result.get("prefix_cache_hit_rate"))))
    lines.append(
        "{:<40} {:<10}".format("Prefix cache hit rate (engine):", rate(result.get("engine_prefix_cache_hit_rate")))
    )
    lines.append("{:<6} {:>10} {:>12} {:>12} {:>8}".format("turn", "prompt", "mean TTFT", "median TTFT", "hit"))
    for row in result.get("per_turn", []):
        lines.append(
            "{:<6} {:>10.0f} {:>10.2f}ms {:>10.2f}ms {:>8}".format(
                row["turn"],
                row["mean_prompt_len"],
                row["mean_ttft_ms"],
                row["median_ttft_ms"],
                rate(row["prefix_cache_hit_rate"]),
            )
        )
    lines.append("=" * 50)
    return "\n".join(lines)
