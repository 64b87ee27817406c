"""Generation settings the user edits in the settings modal, and their SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kimitui.engine import SamplingParams
from kimitui.engine.text.xtml.render import DEFAULT_THINKING_EFFORT, THINKING_EFFORTS


@dataclass(frozen=True)
class GenerationSettings:
    """What one reply is sampled with. ``system_prompt`` empty = the model's default system prompt.
    ``thinking_effort`` is a Kimi K3 option; K2-format models do not use it."""

    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    thinking: bool = True
    thinking_effort: str = DEFAULT_THINKING_EFFORT
    system_prompt: str = ""

    def __post_init__(self) -> None:
        self.sampling_params([])  # SamplingParams owns the range checks and their messages
        if self.thinking_effort not in THINKING_EFFORTS:
            raise ValueError(
                f"thinking effort must be one of {', '.join(THINKING_EFFORTS)}, got {self.thinking_effort!r}"
            )

    def sampling_params(self, stop_token_ids: list[int], keep_special_ids: list[int] = ()) -> SamplingParams:
        # Only the tags ReplyStreamParser needs (<think>, tool calls) stay in the text.
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_tokens,
            skip_special_tokens=True,
            keep_special_token_ids=list(keep_special_ids),
            stop_token_ids=list(stop_token_ids),
        )

    def with_(self, **changes) -> "GenerationSettings":
        return replace(self, **changes)
