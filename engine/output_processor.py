"""OutputProcessor: what happens to a step's sampled tokens once the scheduler has applied them.

It owns every request's user-facing state: incremental detokenising, stop strings, log-probs,
timestamps (``RequestMetrics``), the engine's token counters and throughput window, and the
``RequestOutput`` each step returns. It never touches tensors, blocks or the model: a stop string
is reported back as a request to finish, which the engine hands to the scheduler (as vLLM's
``OutputProcessor`` returns ``reqs_to_abort`` to its engine core).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kimitui.engine.metrics import ThroughputWindow
from kimitui.engine.outputs import CompletionOutput, LogprobRows, RequestMetrics, RequestOutput
from kimitui.engine.sampling_params import SamplingParams
from kimitui.engine.sequence import Sequence
from kimitui.engine.text.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from kimitui.engine.runner.model_runner import StepResult
    from kimitui.engine.scheduler.scheduler import SchedulerOutput


@dataclass
class RequestState:
    """One live request as the user sees it; ``seq`` is the scheduler's view of the same request."""

    seq: Sequence
    params: SamplingParams
    prompt: str | None
    metrics: RequestMetrics
    detok: object | None  # IncrementalDetokenizer, or None when the checkpoint has no tokenizer
    text: str = ""
    logprobs: list[dict[int, float]] | None = None  # one dict per output token, when asked for
    prompt_logprobs: list[dict[int, float] | None] | None = None  # None for the first prompt token
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    stopped_by_string: bool = False
    cumulative_logprob: float = 0.0
    finished: bool = False
    num_seen: int = 0  # output tokens already turned into text (a verified decode brings several)
    next_row_pos: int = 1  # logprob_rows: the next position to hand out (a recomputed one is dropped)
    new_rows: list[LogprobRows] | None = None  # logprob_rows: this step's, handed out once


@dataclass
class ProcessedStep:
    """``outputs``: one RequestOutput per request that produced something this step.
    ``stop``: ids that hit a stop string; the scheduler has yet to finish them.
    ``finished``: every id that finished this step (including ``stop``), whose runner state can go."""

    outputs: list[RequestOutput] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.throughput = ThroughputWindow()
        self.total_prompt_tokens = self.total_generation_tokens = self.num_finished = 0
        self.total_computed_prompt_tokens = 0  # prompt positions the model computed (hits excluded)

    def add_request(self, seq: Sequence, params: SamplingParams, prompt: str | None, count_prompt: bool = True) -> None:
        """``count_prompt``: False for the children of an ``n > 1`` request after the first, whose
        prompt is the same request's (usage counts it once)."""
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                seq.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                keep_special_ids=params.keep_special_token_ids or (),
            )
        req = RequestState(seq, params, prompt, RequestMetrics(arrival_time=seq.arrival_time), detok)
        if params.logprobs is not None:
            req.logprobs = []
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]  # the first prompt token has no context to score it
        self.requests[seq.seq_id] = req
        if count_prompt:
            self.total_prompt_tokens += seq.num_prompt_tokens

    def abort_request(self, request_id: str) -> bool:
        return self.requests.pop(request_id, None) is not None

    def on_scheduled(self, sched: SchedulerOutput, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for s in sched.scheduled:
            req = self.requests.get(s.seq.seq_id)
            if req is not None and req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now

    def process_outputs(
        self, sched: SchedulerOutput, result: StepResult, finished: list[Sequence], now: float | None = None
    ) -> ProcessedStep:
        """Turn one step's samples into outputs; ``finished`` are the sequences the scheduler
        finished while applying them (EOS, stop token id, max_tokens, context limit)."""
        now = time.monotonic() if now is None else now
        prefill_tokens = sum(s.num_new_tokens for s in sched.scheduled if s.is_prefill)
        decode_tokens = sum(len(t) if isinstance(t, list) else 1 for t in result.sampled if t is not None)
        self.throughput.record(prefill_tokens, decode_tokens, now)
        self.total_computed_prompt_tokens += sum(
            max(0, min(s.end, s.seq.num_prompt_tokens) - s.start) for s in sched.scheduled
        )
        finished_ids = {s.seq_id for s in finished}
        step = ProcessedStep()
        for s, token, lp in zip(sched.scheduled, result.sampled, result.logprobs):
            rid = s.seq.seq_id
            req = self.requests.get(rid)
            if req is None:
                continue  # aborted: the processor no longer tracks it
            if rid in result.prompt_logprobs and req.prompt_logprobs is not None:
                start, entries = result.prompt_logprobs[rid]
                if len(req.prompt_logprobs) == start:  # skip recomputed chunks after preemption
                    req.prompt_logprobs.extend(entries)
            if req.params.logprob_rows:
                req.new_rows = self._new_rows(req, result.rows.get(rid, []))
            if token is None and rid not in finished_ids and not req.new_rows:
                continue  # a prefill chunk short of the prompt's end: nothing to show yet
            if token is not None:
                # what the scheduler appended: one token, or a verified decode's accepted drafts and
                # its sampled token, cut at the first stop condition
                new = req.seq.output_token_ids[req.num_seen :]
                lps = lp if isinstance(lp, list) else [lp]
                for j, t in enumerate(new):
                    self._on_token(req, t, lps[j] if j < len(lps) else None, now, last=j == len(new) - 1)
                    if req.stopped_by_string:  # the rest never happened, as one token at a time
                        del req.seq.output_token_ids[req.num_seen :]
                        break
            if req.stopped_by_string:
                step.stop.append(rid)
            if rid in finished_ids or req.seq.is_finished or req.stopped_by_string:
                self._finish(req, now)
                step.finished.append(rid)
                del self.requests[rid]
            step.outputs.append(self._output(req))
        return step

    @staticmethod
    def _new_rows(req: RequestState, rows: list[LogprobRows]) -> list[LogprobRows]:
        """The rows of positions not handed out yet, in order: a sequence preempted and recomputed
        computes some positions twice."""
        out = []
        for r in rows:
            skip = req.next_row_pos - r.first_pos
            if skip >= r.num_rows or skip < 0:
                continue  # already handed out (or, never expected, a gap: dropped rather than misplaced)
            out.append(LogprobRows(req.next_row_pos, r.values[skip:], r.path) if skip else r)
            req.next_row_pos = r.first_pos + r.num_rows
        return out

    def _on_token(self, req: RequestState, token: int, lp: dict | None, now: float, last: bool = True) -> None:
        req.num_seen += 1
        m = req.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.token_times.append(now)
        self.total_generation_tokens += 1
        if lp is not None and req.logprobs is not None:
            req.logprobs.append(lp)
            req.cumulative_logprob += lp[token]
        if req.detok is None:
            return
        before = len(req.text)
        req.text += req.detok.add([token])
        if req.seq.is_finished and last:
            req.text += req.detok.flush()  # the last token may have held back a partial character
        elif req.params.stop_strings:
            self._check_stop_strings(req, req.params.stop_strings, before)

    def _check_stop_strings(self, req: RequestState, stops: tuple[str, ...], before: int) -> None:
        # Only text that could contain a new match: the tail of the old text plus the new text.
        start = max(0, before - max(len(s) for s in stops) + 1)
        hit = None
        for stop in stops:
            i = req.text.find(stop, start)
            if i >= 0 and (hit is None or i < hit[0]):
                hit = (i, stop)
        if hit is None:
            return
        i, stop = hit
        req.text = req.text[: i + (len(stop) if req.params.include_stop_str_in_output else 0)]
        req.stop_reason = stop
        req.stopped_by_string = True

    def _finish(self, req: RequestState, now: float) -> None:
        req.finished = True
        req.metrics.finished_time = now
        req.metrics.num_cached_tokens = req.seq.num_cached_tokens
        if req.stop_reason is None and req.seq.finish_reason == "stop" and req.seq.output_token_ids:
            req.stop_reason = req.seq.output_token_ids[-1]  # EOS or a stop token id
        self.num_finished += 1

    def _output(self, req: RequestState) -> RequestOutput:
        seq = req.seq
        finish_reason = None
        if req.finished:
            finish_reason = "stop" if req.stopped_by_string else seq.finish_reason
        comp = CompletionOutput(
            index=0,
            text=req.text,
            token_ids=list(seq.output_token_ids),
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
            finish_reason=finish_reason,
            cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
            stop_reason=req.stop_reason,
        )
        return RequestOutput(
            request_id=seq.seq_id,
            prompt=req.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
            outputs=[comp],
            finished=req.finished,
            metrics=req.metrics,
            logprob_rows=self._take_rows(req),
        )

    @staticmethod
    def _take_rows(req: RequestState) -> list[LogprobRows] | None:
        if not req.params.logprob_rows:
            return None
        rows, req.new_rows = req.new_rows or [], None
        return rows
