"""What generation returns: vLLM's RequestOutput / CompletionOutput shapes."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RequestMetrics:
    """Monotonic timestamps (time.monotonic()) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    num_cached_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None


@dataclass
class LogprobRows:
    """Full-vocabulary log-probs of consecutive positions of one request (``logprob_rows``).

    Row ``i`` is the model's distribution of the token at position ``first_pos + i`` given the
    tokens before it. ``path`` says which forward pass computed the rows: "prefill" (a prompt
    chunk, including the row that picks the first output token) or "decode" (one decode row per
    position, the path generation runs token by token)."""

    first_pos: int
    values: torch.Tensor  # [n, V] float32, on the host
    path: str

    @property
    def num_rows(self) -> int:
        return self.values.shape[0]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # rows computed by this step only (``SamplingParams.logprob_rows``); None when not asked for
    logprob_rows: list[LogprobRows] | None = None
