"""What a request asks its output to match: the constraint a ``SamplingParams`` carries.

Named after vLLM's ``StructuredOutputsParams`` (``SamplingParams.structured_outputs``). It is plain
data with no dependency on the grammar library, so the engine, the server and tests can build and
compare constraints without it; ``engine.structured.grammar`` compiles one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of ``json`` (a JSON schema, as a dict or its JSON text), ``json_object`` (any
    JSON object, OpenAI's ``{"type": "json_object"}``) or ``grammar`` (a Lark grammar in
    llguidance's dialect, which may embed JSON schemas with ``%json`` and name tokens by id with
    ``<[id]>``; the chat tool-call grammars are written in it).

    ``any_whitespace``: JSON may carry free whitespace between tokens. Off by default, as vLLM's
    ``disable-any-whitespace``: a model that keeps choosing spaces or newlines (any random-weight
    model does) would otherwise never finish the object.
    ``reasoning_end``: the text that ends the reply's reasoning section (``</think>`` for Kimi K2,
    ``<|close|>think<|sep|>`` for K3); the constraint applies only to the tokens after it. None:
    from the first generated token.
    """

    json: str | None = None
    json_object: bool = False
    grammar: str | None = None
    any_whitespace: bool = False
    reasoning_end: str | None = None

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            if not isinstance(self.json, dict):
                raise ValueError(
                    f"structured_outputs.json must be a JSON schema object, got {type(self.json).__name__}"
                )
            # as text (the cache key); keys keep their order, which is the order the output writes them in
            object.__setattr__(self, "json", json.dumps(self.json, ensure_ascii=False))
        kinds = [
            k
            for k, v in (("json", self.json), ("json_object", self.json_object or None), ("grammar", self.grammar))
            if v is not None
        ]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object or grammar, "
                f"got {', '.join(kinds) or 'none'}"
            )
        if self.grammar is not None and not self.grammar.strip():
            raise ValueError("structured_outputs.grammar is empty")
        if self.reasoning_end is not None and not self.reasoning_end:
            raise ValueError("structured_outputs.reasoning_end must be None or a non-empty string")

    @property
    def key(self) -> tuple[Any, ...]:
        """What the compiled grammar depends on (``reasoning_end`` is applied outside it)."""
        return (self.json, self.json_object, self.grammar, self.any_whitespace)
