"""``n > 1`` and ``best_of``: one request fanned out into child sequences sharing the prompt's cache.

vLLM v1's design (``vllm/v1/engine/parallel_sampling.py``, ``ParentRequest``): the engine turns a
request for ``n`` samples (``best_of`` of them when that is larger) into that many child sequences,
and joins their outputs back into one ``RequestOutput`` whose ``outputs`` are the choices, indexed
0..n-1. The scheduler knows only which children fork from which (below), not the joined request.

The prompt is computed once, to the token: child 0 (the leader) is queued alone and the others are
parked beside it in the scheduler; in the step where the leader samples its first token they are
forked from it (engine/scheduler/forks.py): each shares the leader's full prompt blocks, gets a private copy of
the partial last block and, on a hybrid model, of the leader's KDA and short-conv state, and samples
its own first token from a copy of the leader's last logits row. A child that cannot fork then (no
free block, state slot or ``max_num_seqs`` room) is queued the step after and recomputes only the
prompt's partial last block after a prefix hit (all of it without prefix caching). So on a cold cache an ``n: 4`` request computes
``len(prompt)`` prompt tokens (``EngineStats.computed_prompt_tokens``, ``/metrics``
``kimitui:prompt_tokens_computed_total``) and looks the prompt up in the prefix cache once.

Seeds: child ``i`` samples with ``seed + i`` when the request has a seed (so child 0 of an ``n: 4``
request reproduces the ``n: 1`` request with the same seed), from the global generator otherwise.
``best_of``: every child computes the sampled token's log-prob (``logprobs=0`` if the request asked
for none), and the finished request returns the ``n`` children with the highest cumulative
log-prob, best first, as vLLM v0 did; such a request yields no output before it finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kimitui.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kimitui.engine.sampling_params import SamplingParams


def child_id(parent_id: str, index: int) -> str:
    return f"{parent_id}#{index}"


def fans_out(params: SamplingParams) -> bool:
    return params.n > 1 or (params.best_of or 1) > 1


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """What child ``index`` samples with: one sample, its own seed, log-probs for ranking, and
    prompt log-probs only on child 0 (they are the same for all)."""
    best_of = params.best_of or params.n
    logprobs = params.logprobs
    if best_of > params.n and logprobs is None:
        logprobs = 0  # the sampled token's log-prob, for the cumulative ranking
    return replace(
        params,
        n=1,
        best_of=None,
        logprobs=logprobs,
        seed=None if params.seed is None else params.seed + index,
        prompt_logprobs=params.prompt_logprobs if index == 0 else None,
    )


@dataclass
class ParentRequest:
    """The children of one request and the latest output of each."""

    request_id: str
    params: SamplingParams
    num_children: int
    latest: dict[int, RequestOutput] = field(default_factory=dict)

    @property
    def child_ids(self) -> list[str]:
        return [child_id(self.request_id, i) for i in range(self.num_children)]

    def collect(self, index: int, out: RequestOutput) -> RequestOutput | None:
        """Record child ``index``'s latest output; the joined output, or None while a ``best_of``
        request still runs (its choices are not known before every child has finished)."""
        self.latest[index] = out
        finished = len(self.latest) == self.num_children and all(o.finished for o in self.latest.values())
        n = self.params.n
        if self.num_children > n and not finished:
            return None
        comps = [self._completion(i) for i in range(self.num_children)]
        if self.num_children > n:
            comps.sort(key=lambda c: -(c.cumulative_logprob or 0.0))  # stable: ties keep child order
            comps = [replace(c, index=j) for j, c in enumerate(comps[:n])]
            if self.params.logprobs is None:
                comps = [replace(c, logprobs=None) for c in comps]
        first = self.latest.get(0) or out
        return RequestOutput(
            request_id=self.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            prompt_logprobs=first.prompt_logprobs,
            outputs=comps,
            finished=finished,
            metrics=self._metrics(),
        )

    def _completion(self, i: int) -> CompletionOutput:
        out = self.latest.get(i)
        if out is None:
            return CompletionOutput(index=i, text="", token_ids=[])
        return replace(out.outputs[0], index=i)

    def _metrics(self) -> RequestMetrics | None:
        """Child 0's timestamps, with the last finish time; cached tokens are the leader's (the
        prompt's own hit), as the usage of one request reports them once."""
        ms = [o.metrics for o in self.latest.values() if o.metrics is not None]
        lead = self.latest.get(0)
        if lead is None or lead.metrics is None:
            return None
        m = lead.metrics
        done = all(x.finished_time is not None for x in ms) and len(ms) == self.num_children
        firsts = [x.first_token_time for x in ms if x.first_token_time is not None]
        return replace(
            m,
            token_times=list(m.token_times),
            first_token_time=min(firsts) if firsts else None,
            finished_time=max(x.finished_time for x in ms) if done else None,
        )


class FanOut:
    """The engine's fanned-out requests: which child belongs to which request, and their outputs
    joined back into one per request and step (identity when nothing fans out)."""

    def __init__(self):
        self._parents: dict[str, ParentRequest] = {}
        self._child_of: dict[str, tuple[ParentRequest, int]] = {}

    def in_use(self, request_id: str) -> bool:
        return request_id in self._parents

    def parent(self, request_id: str) -> ParentRequest | None:
        return self._parents.get(request_id)

    def add(self, parent: ParentRequest) -> None:
        for i, c in enumerate(parent.child_ids):
            self._child_of[c] = (parent, i)
        self._parents[parent.request_id] = parent

    def forget(self, parent: ParentRequest) -> None:
        self._parents.pop(parent.request_id, None)
        for c in parent.child_ids:
            self._child_of.pop(c, None)

    def request_id(self, seq_id: str) -> str:
        """The request ``seq_id`` serves (itself unless it is a child)."""
        link = self._child_of.get(seq_id)
        return link[0].request_id if link is not None else seq_id

    def join(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Children's outputs joined into their request's (one per request and step)."""
        if not self._child_of:
            return outputs
        joined: dict[str, RequestOutput] = {}
        plain = []
        for out in outputs:
            link = self._child_of.get(out.request_id)
            if link is None:
                plain.append(out)
                continue
            parent, i = link
            j = parent.collect(i, out)
            if j is not None:
                joined[parent.request_id] = j
            if j is not None and j.finished:
                self.forget(parent)
        return plain + list(joined.values())
