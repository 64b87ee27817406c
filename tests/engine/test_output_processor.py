"""OutputProcessor on the real scheduler with scripted samples: no model, no tokenizer files."""

import pytest

from kimitui.engine.kv_cache.block_manager import BlockManager
from kimitui.engine.output_processor import OutputProcessor
from kimitui.engine.runner.model_runner import StepResult
from kimitui.engine.sampling_params import SamplingParams
from kimitui.engine.scheduler.scheduler import Scheduler, SchedulerConfig
from kimitui.engine.sequence import Sequence

EOS = 99


class LetterDetok:
    """Token t -> the letter 'a' + t; holds a token back until the next one, as a byte-level
    detokenizer holds a partial character, so ``flush`` has something to add."""

    def __init__(self):
        self.held = ""

    def add(self, ids):
        out, self.held = self.held, "".join(chr(ord("a") + t % 26) for t in ids)
        return out

    def flush(self):
        out, self.held = self.held, ""
        return out


class Harness:
    """Drives scheduler + processor the way LLMEngine.step does, with scripted tokens."""

    def __init__(self, chunk: int = 64):
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=4,
                max_num_batched_tokens=chunk,
                max_model_len=256,
                block_size=4,
                enable_chunked_prefill=True,
            ),
            BlockManager(64, 4, False),
        )
        self.proc = OutputProcessor(tokenizer=None)
        self.script: dict[str, list[int]] = {}
        self.clock = 100.0

    def add(self, rid, prompt, params, script):
        seq = Sequence(rid, prompt, params, (EOS,), arrival_time=self.clock)
        self.scheduler.add(seq)
        self.proc.add_request(seq, params, None)
        self.proc.requests[rid].detok = LetterDetok()
        self.script[rid] = list(script)

    def step(self):
        self.clock += 1.0
        sched = self.scheduler.schedule()
        self.proc.on_scheduled(sched, now=self.clock)
        sampled, logprobs = [], []
        for s in sched.scheduled:
            tok = self.script[s.seq.seq_id].pop(0) if s.do_sample else None
            sampled.append(tok)
            logprobs.append(None if tok is None else {tok: -0.5, tok + 1: -1.5})
        finished = self.scheduler.postprocess(sched, sampled)
        self.clock += 0.5
        step = self.proc.process_outputs(sched, StepResult(sampled, logprobs), finished, now=self.clock)
        for rid in step.stop:
            self.scheduler.finish(rid, "stop")
        return step


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_truncates_and_asks_the_scheduler_to_stop(include):
    h = Harness()
    # Tokens 2, 3, 4, 5 read "cdef"; the stop string "de" spans the 2nd and 3rd token.
    params = SamplingParams(max_tokens=10, stop=["de", "zz"], ignore_eos=True, include_stop_str_in_output=include)
    h.add("r", [1, 2, 3], params, [2, 3, 4, 5, 6, 7])
    steps = [h.step() for _ in range(4)]
    last = steps[3].outputs[0]
    assert [s.outputs[0].finished for s in steps] == [False, False, False, True]
    assert steps[3].stop == ["r"] and steps[3].finished == ["r"]
    comp = last.outputs[0]
    assert comp.text == ("cde" if include else "c")
    assert comp.finish_reason == "stop" and comp.stop_reason == "de"
    assert comp.token_ids == [2, 3, 4, 5]
    assert not h.proc.requests and not h.scheduler.has_unfinished()
    assert h.proc.num_finished == 1 and h.proc.total_generation_tokens == 4


def test_eos_finishes_with_the_token_as_stop_reason_and_flushes_text():
    h = Harness()
    h.add("r", [1, 2], SamplingParams(max_tokens=10, logprobs=1), [0, 1, EOS])
    outs = [h.step().outputs[0] for _ in range(3)]
    comp = outs[-1].outputs[0]
    assert outs[-1].finished and comp.finish_reason == "stop" and comp.stop_reason == EOS
    assert comp.text == "ab" + chr(ord("a") + EOS % 26)  # the held-back last token was flushed
    assert [list(lp) for lp in comp.logprobs] == [[0, 1], [1, 2], [EOS, EOS + 1]]
    assert comp.cumulative_logprob == pytest.approx(-1.5)
    assert [o.outputs[0].finish_reason for o in outs[:2]] == [None, None]


def test_metrics_timestamps_and_counters():
    h = Harness()
    h.add("a", [1, 2, 3], SamplingParams(max_tokens=2), [4, 5])
    h.add("b", [1], SamplingParams(max_tokens=1), [6])
    first = h.step()
    assert sorted(first.finished) == ["b"]
    second = h.step()
    m = second.outputs[0].metrics
    assert m.arrival_time == 100.0 and m.first_scheduled_time == 101.0
    assert m.first_token_time == 101.5 and m.token_times == [101.5, 103.0] and m.finished_time == 103.0
    assert m.ttft == pytest.approx(1.5) and m.tpot == pytest.approx(1.5)
    assert second.outputs[0].outputs[0].finish_reason == "length"
    assert h.proc.total_prompt_tokens == 4 and h.proc.total_generation_tokens == 3
    assert h.proc.num_finished == 2
    prefill_rate, decode_rate = h.proc.throughput.rates(now=h.clock)
    assert prefill_rate > 0 and decode_rate > 0


def test_prefill_chunks_emit_nothing_until_the_first_token_and_aborts_are_skipped():
    h = Harness(chunk=4)
    h.add("long", list(range(1, 11)), SamplingParams(max_tokens=3), [7, 8, 9])
    assert h.step().outputs == [] and h.step().outputs == []  # 4 + 4 of 10 prompt tokens
    out = h.step().outputs
    assert [o.outputs[0].token_ids for o in out] == [[7]]
    assert h.proc.requests["long"].metrics.first_token_time == h.clock
    # A request the processor no longer tracks (aborted) gives no output even if scheduled.
    assert h.proc.abort_request("long") and not h.proc.abort_request("long")
    assert h.step().outputs == [] and h.proc.total_generation_tokens == 1
