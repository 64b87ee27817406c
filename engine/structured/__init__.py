"""Structured outputs: grammar-constrained decoding (JSON schemas, JSON objects, tool calls).

``StructuredOutputs`` (params.py) is what a request asks for; ``grammar.py`` compiles it with
llguidance (an optional dependency, the ``structured`` extra); ``manager.py`` keeps each request's
matcher and masks the sampler's logits; ``chat_constraints.py`` builds the constraints of OpenAI's
``response_format`` and ``tool_choice`` in the Kimi K2 and K3 reply formats.
"""

from kimitui.engine.structured.params import StructuredOutputs

__all__ = ["StructuredOutputs"]
