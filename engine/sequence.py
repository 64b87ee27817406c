"""Request state: the tokens of one sequence and how far its KV cache has been computed."""

from __future__ import annotations

import enum
import time
from typing import Any


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style reason for a finished status ("stop", "length", "abort"), else None."""
        return _FINISH_REASON.get(self)


_FINISHED = frozenset(
    (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED)
)
_FINISH_REASON = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}
FINISH_STATUS = {reason: status for status, reason in _FINISH_REASON.items()}


class Sequence:
    """One request as the scheduler and runner see it.

    ``token_ids`` = prompt + output. Tokens ``[0, num_computed_tokens)`` have their KV in the
    blocks of ``block_table``; the rest are computed by the next scheduled steps. In decode exactly
    one token (the last sampled one) is uncomputed. ``num_cached_tokens`` is how many of those came
    from the prefix cache at the latest admission. ``state_slot`` is its row in every KDA layer's
    state (hybrid models only), held from admission to finish, abort or preemption.
    """

    __slots__ = (
        "seq_id",
        "prompt_token_ids",
        "output_token_ids",
        "sampling_params",
        "eos_token_ids",
        "num_computed_tokens",
        "num_cached_tokens",
        "block_table",
        "state_slot",
        "spec_token_ids",
        "spec_draft_probs",
        "status",
        "finish_reason",
        "arrival_time",
    )

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        sampling_params: Any = None,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {seq_id!r}: the prompt is empty; at least one token is needed")
        self.seq_id = seq_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        # Hybrid (KDA) models: this sequence's recurrent-state slot while it runs, else None.
        self.state_slot: int | None = None
        # Speculative decoding: tokens a proposer guessed follow ``token_ids``; the next step
        # verifies them. They are not part of the sequence until accepted.
        self.spec_token_ids: list[int] = []
        # [>= len(spec_token_ids), V] the distributions sampled drafts were drawn from (None: one-hot)
        self.spec_draft_probs = None
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_id(self, i: int) -> int:
        """Token at position ``i`` without building the concatenated list."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens_in_range(self, start: int, end: int) -> list[int]:
        """Tokens at positions ``[start, end)`` (what a prefill chunk feeds the model)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def spec_budget(self, max_model_len: int) -> int:
        """How many draft tokens may follow the next decode: a step that verifies ``k`` drafts
        yields up to ``k + 1`` tokens, which must fit both ``max_tokens`` and the context limit."""
        left = max_model_len - self.num_tokens
        max_tokens = getattr(self.sampling_params, "max_tokens", None)
        if max_tokens is not None:
            left = min(left, max_tokens - self.num_output_tokens)
        return max(0, left - 1)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_table)})"
        )
