"""``SpeculativeConfig``: the ``speculative_config`` dict users pass (vLLM's keys), checked once.

Keys (vLLM's ``vllm/config/speculative.py`` names and defaults): ``method`` (``ngram``, ``suffix``,
``eagle3``), ``num_speculative_tokens``, ``model`` (the drafter checkpoint, eagle3), ``prompt_lookup_min``
/ ``prompt_lookup_max`` (ngram; one given sets the other, none gives 5 and 5), and the suffix tree's
``suffix_decoding_max_tree_depth`` (24), ``suffix_decoding_max_cached_requests`` (10000),
``suffix_decoding_max_spec_factor`` (1.0), ``suffix_decoding_min_token_prob`` (0.1). Unknown keys are an
error naming the key, so a typo never silently turns speculation off.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "suffix", "eagle3")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int | None = None
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    draft_tensor_parallel_size: int | None = None  # accepted for vLLM compatibility; the drafter runs on rank 0
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    rejection_sample_method: str = "standard"

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.method == "suffix" and self.num_speculative_tokens is None:
            set_("num_speculative_tokens", self.suffix_decoding_max_tree_depth)  # as vLLM
        if self.num_speculative_tokens is None:
            raise ValueError(f"speculative_config: method {self.method!r} needs num_speculative_tokens")
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError(f"speculative_config: num_speculative_tokens must be in 1..64, "
                             f"got {self.num_speculative_tokens}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo, hi = (5, 5) if lo is None and hi is None else (lo if lo is not None else hi, hi if hi is not None else lo)
            if not 1 <= lo <= hi:
                raise ValueError(f"speculative_config: need 1 <= prompt_lookup_min ({lo}) <= prompt_lookup_max ({hi})")
            set_("prompt_lookup_min", lo)
            set_("prompt_lookup_max", hi)
        if self.method == "eagle3" and not self.model:
            raise ValueError("speculative_config: method 'eagle3' needs model (the drafter checkpoint directory)")
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("speculative_config: suffix_decoding_max_tree_depth must be >= 1 and "
                             "suffix_decoding_max_cached_requests >= 0")
        if self.rejection_sample_method != "standard":
            raise ValueError(f"speculative_config: rejection_sample_method must be 'standard', "
                             f"got {self.rejection_sample_method!r}")

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """From a dict, a JSON string (the CLI's ``--speculative-config``), a SpeculativeConfig or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        if "method" not in value:
            raise ValueError("speculative_config: 'method' is required (ngram, suffix or eagle3)")
        return cls(**value)

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots a drafter may write past the verified tokens (model drafters chain through them)."""
        return self.num_speculative_tokens if self.method == "eagle3" else 0
