"""Back-off: how many drafts each request gets next, from how its recent drafts fared.

Verifying ``k`` drafts runs ``1 + k`` rows through the target; when they are rejected the step
still costs those rows (29% at batch 1 and 72% at batch 16 for an always-wrong proposer on the CPU,
benchmarks/README.md). So each request keeps a draft length that follows its acceptance:

- all drafts accepted: the length grows by one (up to ``num_speculative_tokens``);
- some rejected: it becomes what was accepted plus one (a prefix that holds is likely to hold again);
- none accepted at length one: drafting stops for that request, and it is probed again (one draft)
  after 1, 2, 4 ... up to ``MAX_WAIT`` decode steps while probes keep failing, so a drafter that
  never helps costs one verified row per ``MAX_WAIT`` steps, and one that starts helping is back
  within that many steps.

A new request starts from what recent requests saw (an exponential average of the fraction of
drafts accepted, over all requests): the full length while that is high, a shorter one as it drops,
and below ``PRIOR_MIN`` no drafts and a first probe after ``PRIOR_WAIT`` steps. Without this every
request would pay the full-length first guesses again, which at batch 16 is most of the cost of a
drafter that never helps (16 x (1 + k) rows in its first step). While recent acceptance is that low,
a rejection stops a request at once (no length-one step first) and probes are rationed over the
whole batch: one request probes, then none for 1, 2, 4 ... ``MAX_WAIT`` steps while probes fail. A
batch of 16 then pays one extra row now and then, not sixteen in most steps (which matters beyond
the rows themselves: on the CPU a step of 17 rows leaves the few-row kernels, kernels/cpu/few_rows.py).

Independently, a step whose batch holds more than ``disable_by_batch_size`` sequences drafts nothing
(vLLM's meaning of the key), and a sequence longer than ``speculative_config``'s ``max_model_len``
drafts nothing. ``backoff: false`` keeps the full length always (the two limits still apply).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_WAIT = 32
PRIOR_MIN = 0.1  # recent acceptance below this: new requests start without drafts
PRIOR_WAIT = 4  # ... and probe first after this many decode steps
_ALPHA = 0.25  # weight of one verified decode in the recent-acceptance average


@dataclass
class _State:
    length: int
    wait: int = 0  # decode steps to skip before the next probe
    next_wait: int = 1


class DraftBackoff:
    def __init__(
        self,
        num_speculative_tokens: int,
        enabled: bool = True,
        disable_by_batch_size: int | None = None,
        max_model_len: int | None = None,
    ):
        self.k = num_speculative_tokens
        self.enabled = enabled
        self.disable_by_batch_size = disable_by_batch_size
        self.max_model_len = max_model_len
        self._state: dict[str, _State] = {}
        self._probes = 0  # probes still allowed in the step being budgeted
        self._gate_wait, self._gate_next = 0, 1  # the batch-wide probe ration while acceptance is low
        self.recent = 1.0  # the exponential average of accepted / drafted over verified decodes

    @classmethod
    def from_config(cls, config) -> DraftBackoff:
        return cls(config.num_speculative_tokens, config.backoff, config.disable_by_batch_size, config.max_model_len)

    def budgets(self, seqs, caps: list[int]) -> list[int]:
        """Drafts each of ``seqs`` (all decoding next step) may get, at most ``caps[i]``."""
        if self.disable_by_batch_size is not None and len(seqs) > self.disable_by_batch_size:
            return [0] * len(seqs)
        out = []
        self._probes = len(seqs)
        if self.recent < PRIOR_MIN:
            self._probes = 1 if self._gate_wait == 0 else 0
            self._gate_wait = max(0, self._gate_wait - 1)
        for seq, cap in zip(seqs, caps):
            if self.max_model_len is not None and seq.num_tokens > self.max_model_len:
                out.append(0)
                continue
            out.append(min(cap, self._length(seq.seq_id)) if self.enabled else cap)
        return out

    def _length(self, seq_id: str) -> int:
        s = self._state.get(seq_id)
        if s is None:
            s = self._state[seq_id] = self._new_state()
        if s.length > 0:
            return s.length
        if s.wait > 0:
            s.wait -= 1
            return 0
        if self._probes < 1:
            return 0  # another request probes this step; this one stays due
        self._probes -= 1
        if self.recent < PRIOR_MIN:
            self._gate_wait, self._gate_next = self._gate_next, min(MAX_WAIT, 2 * self._gate_next)
        return 1  # the probe

    def _new_state(self) -> _State:
        if self.recent >= PRIOR_MIN:
            return _State(max(1, min(self.k, round(2 * self.recent * self.k))))
        return _State(0, wait=PRIOR_WAIT, next_wait=2 * PRIOR_WAIT)

    def observe(self, seq_id: str, drafted: int, accepted: int) -> None:
        """A verified decode of ``seq_id``: ``accepted`` of its ``drafted`` drafts held."""
        if not self.enabled or drafted < 1:
            return
        self.recent += _ALPHA * (min(accepted, drafted) / drafted - self.recent)
        if accepted > 0:
            self._gate_wait, self._gate_next = 0, 1
        s = self._state.setdefault(seq_id, _State(self.k))
        if accepted >= drafted:
            s.length, s.next_wait = min(self.k, drafted + 1), 1
        elif accepted > 0:
            s.length, s.next_wait = min(self.k, accepted + 1), 1
        elif drafted > 1 and self.recent >= PRIOR_MIN:
            s.length = 1
        else:  # a single draft rejected: stop, probe later, later each time it fails
            s.length, s.wait = 0, s.next_wait
            s.next_wait = min(MAX_WAIT, 2 * s.next_wait)

    def observe_step(self, scheduled, sampled) -> None:
        """The step's verified decodes (as ``SpecDecodeStats.observe_step`` reads them)."""
        for item, out in zip(scheduled, sampled):
            if item.spec_token_ids and isinstance(out, list):
                self.observe(item.seq.seq_id, len(item.spec_token_ids), len(out) - 1)

    def finish(self, seq_id: str) -> None:
        self._state.pop(seq_id, None)
