"""Drive an ``LLMEngine`` step by step until one request finishes."""

from __future__ import annotations


def run_to_finish(engine, rid: str, prompt: list[int], params):
    """Add request ``rid`` (token ids ``prompt``) and step the engine until nothing is left; the
    request's finished ``RequestOutput``."""
    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final = o
    return final
