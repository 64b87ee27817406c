"""One evaluation run (KL, recall, or both one after the other) off the UI thread.

KL loads a float32 reference and the path under test from the app's engine flags (as
`kimitui eval kl` does) and frees both when done; recall asks the app's own model (see
targets.py). Progress travels as coalescing messages; Cancel is checked between prompts
(KL) and between context lengths (recall), so a run stops at the next step, not mid-forward.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from textual.message_pump import MessagePump

from kimitui.tui.evaluation.store import save_result
from kimitui.tui.jobs import JobFinished, JobProgressed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalSettings:
    kinds: tuple[str, ...]  # "kl", "recall", in run order
    context_lengths: tuple[int, ...] = (256, 512)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    num_prompts: int = 4
    prompt_len: int = 64
    decode_tokens: int = 8
    seed: int = 0


@dataclass
class EvalProgressed(JobProgressed):
    kind: str
    done: int
    total: int
    label: str


@dataclass
class EvalFinished(JobFinished):
    """The run ended (tui/jobs.py): ``results`` holds one result per evaluation that finished;
    ``notes`` lines to show (an evaluation skipped, and why)."""

    notes: list[str] = field(default_factory=list)


class Cancelled(Exception):
    pass


class EvalJob:
    def __init__(
        self,
        settings: EvalSettings,
        bridge: Any,
        notify: MessagePump,
        save_dir: Path | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.bridge = bridge
        self.notify = notify
        self.save_dir = save_dir
        self.clock = clock
        self._cancel = threading.Event()

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancel_requested(self) -> bool:
        return self._cancel.is_set()

    def run(self) -> None:
        """Run to the end on the calling (worker) thread; always posts one EvalFinished."""
        out = EvalFinished()
        try:
            for kind in self.settings.kinds:
                if self._cancel.is_set():
                    raise Cancelled
                result = self._kl() if kind == "kl" else self._recall()
                if isinstance(result, str):
                    out.notes.append(result)
                    continue
                result.update(
                    kind=kind,
                    date=time.strftime("%Y%m%d-%H%M%S", time.localtime(self.clock())),
                    model=self._model_name(),
                )
                out.results.append(result)
                out.saved.append(save_result(result, self.save_dir))
        except Cancelled:
            out.cancelled = True
        except Exception as e:  # noqa: BLE001 - shown on the screen; the traceback goes to the log
            log.exception("evaluation failed")
            out.error = f"{type(e).__name__}: {e}"
        self.notify.post_message(out)

    # -- pieces ----------------------------------------------------------------------------
    def _model_name(self) -> str:
        args = getattr(self.bridge, "engine_args", None)
        if args is not None:
            return str(args.model or "demo")
        return str(getattr(self.bridge, "model", None) or "remote")

    def _post(self, kind: str, done: int, total: int, label: str, check: bool = True) -> None:
        """Report progress; this is also where a requested cancel stops the run (``check``)."""
        if check and self._cancel.is_set():
            raise Cancelled
        self.notify.post_message(EvalProgressed(kind, done, total, label))

    def _kl(self) -> dict[str, Any] | str:
        from kimitui.engine import LLM
        from kimitui.eval.kl_run import generated_prompts, measure
        from kimitui.eval.kl_setup import checkpoint_tokenizer, describe_engine, model_dir, plain_path
        from kimitui.eval.kl_sources import LocalSource
        from kimitui.tui.evaluation.targets import KL_REMOTE_NOTE, is_remote, kl_engine_args

        if is_remote(self.bridge):
            return KL_REMOTE_NOTE
        s = self.settings
        ref_args, test_args = kl_engine_args(self.bridge.engine_args, s.prompt_len)
        self._post("kl", 0, s.num_prompts, "KL: loading the float32 reference")
        llms = []
        try:
            with plain_path():
                ref = LLM(**{f: getattr(ref_args, f) for f in ref_args.__dataclass_fields__})
            llms.append(ref)
            self._post("kl", 0, s.num_prompts, f"KL: loading the path under test ({describe_engine(test_args)})")
            test = LLM(**{f: getattr(test_args, f) for f in test_args.__dataclass_fields__})
            llms.append(test)
            tok = checkpoint_tokenizer(model_dir(test_args.model))
            vocab = ref.engine.config.vocab_size if tok is None else min(ref.engine.config.vocab_size, tok.vocab_size)
            prompts = generated_prompts(
                vocab, s.num_prompts, s.prompt_len, s.seed, tok.special_ids if tok is not None else frozenset()
            )
            self._post("kl", 0, s.num_prompts, "KL: comparing")
            report = measure(
                prompts,
                LocalSource(ref),
                LocalSource(test),
                s.decode_tokens,
                lambda done, total: self._post("kl", done, total, "KL: comparing"),
            )
        finally:
            for llm in llms:
                llm.shutdown()
        summary = report.summary()
        summary.update(
            reference=f"float32 in this process ({test_args.model or 'demo'})",
            tested=describe_engine(test_args),
            num_prompts=s.num_prompts,
            prompt_len=s.prompt_len,
            decode_tokens=s.decode_tokens,
        )
        return summary

    def _recall(self) -> dict[str, Any]:
        from kimitui.eval.recall import run_recall
        from kimitui.tui.evaluation.targets import recall_target

        s = self.settings
        total = 2 * len(s.context_lengths)  # per length: build the haystack, ask for the codes
        steps = [0]

        def progress(line: str) -> None:
            self._post("recall", steps[0], total, f"recall: {line}")
            steps[0] += 1

        self._post("recall", 0, total, "recall: preparing")
        target = recall_target(self.bridge)
        try:
            result = run_recall(target, list(s.context_lengths), list(s.depths), seed=s.seed, progress=progress)
        finally:
            target.close()
        self._post("recall", total, total, "recall: done", check=False)  # finished: keep it
        return result
