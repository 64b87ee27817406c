"""Speculative decoding: proposers draft tokens, the target model verifies them in one step.

- ``config.py``: ``SpeculativeConfig``, vLLM's ``speculative_config`` dict, validated once.
- ``proposer.py``: the proposer interface the engine calls after every step; ``select.py`` picks one.
- ``ngram.py`` / ``suffix.py`` (+ ``suffix_global.py``, ``history.py``): draft-model-free proposers
  (prompt lookup, suffix decoding) over per-request token arrays.
- ``eagle3*.py``: EAGLE-3 drafters over a Kimi K2.x target's hidden states.
- ``dspark*.py``: DSpark block drafters over a Kimi K3 / Kimi Linear target's tapped hidden states
  (drafter and memory footprint, checkpoint loader, proposer).
- ``rejection.py``: the verification rule (greedy, and standard rejection sampling otherwise);
  ``verify.py``: the verification step's logits -> tokens and log-probs, and the KDA per-position layout.
- ``footprint.py``: what speculation adds to the memory plan.
- ``stats.py``: acceptance counters (vLLM's ``spec_decode_*``).
"""

from kimitui.engine.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
