"""The runner's side of structured outputs: per-request grammar state and each step's masks.

Lives with the sampler (rank 0 of a tensor-parallel group, engine/runner/model_runner.py). ``mask_logits`` is
called with the logits of the rows the step samples, before temperature / top-k / top-p: for a
plain row the mask of its request's next token; for a decode that verifies drafts one mask per
verified position, position ``j`` masked with the grammar state after ``drafts[:j]`` (a draft the
grammar refuses then has probability zero and verification rejects it). The masks are computed on
the CPU (llguidance, the plain rows in parallel) while the device may still be busy with the
forward pass, then sent over in one copy.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from kimitui.engine.structured.bitmask import apply_bitmask
from kimitui.engine.structured.grammar import compiler_for, require_llguidance, token_bytes_of
from kimitui.engine.structured.matcher import RequestGrammar
from kimitui.engine.structured.params import StructuredOutputs
from kimitui.engine.structured.reasoning import ReasoningGate

_PARALLEL_ROWS = 8  # plain rows from which the masks are filled by llguidance's thread pool


class StructuredOutputManager:
    """``tokenizer``: the engine's; ``vocab_size``: the width of the model's logits."""

    def __init__(self, tokenizer, vocab_size: int, device: torch.device, num_threads: int | None = None):
        llg = require_llguidance()
        self.compiler = compiler_for(tokenizer, vocab_size)
        self.device = device
        self.width = (self.compiler.vocab_size + 31) // 32  # int32 words per mask row
        self._token_bytes = token_bytes_of(tokenizer)
        self._executor = llg.LLExecutor(num_threads) if num_threads else llg.LLExecutor()
        self._cores = num_threads or os.cpu_count() or 1
        self.requests: dict[str, RequestGrammar] = {}

    def add(self, request_id: str, spec: StructuredOutputs, stop_ids) -> None:
        """Compile (cached) and keep a matcher for the request; GrammarError for a bad constraint."""
        matcher = self.compiler.new_matcher(spec)
        gate = ReasoningGate(spec.reasoning_end, self._token_bytes) if spec.reasoning_end else None
        self.requests[request_id] = RequestGrammar(request_id, matcher, stop_ids, self.compiler.eos_id, gate)

    def release(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    @torch.inference_mode()  # the logits are inference tensors, masked in place
    def mask_logits(self, logits: torch.Tensor, seqs: list, drafts: list[list[int]] | None = None) -> torch.Tensor:
        """Mask ``logits`` [R, V] in place: ``seqs[i]`` owns ``len(drafts[i]) + 1`` consecutive rows
        (one when ``drafts`` is None). Rows of unconstrained requests are left alone."""
        plan, row = [], 0
        for i, seq in enumerate(seqs):
            d = drafts[i] if drafts is not None else []
            g = self.requests.get(seq.seq_id)
            if g is not None:
                g.advance(seq.output_token_ids)
                if g.active or (d and not g.failed):  # drafts may end the reasoning section
                    plan.append((row, g, d))
            row += len(d) + 1
        if not plan:
            return logits
        n = sum(len(d) + 1 for _, _, d in plan)
        bits = np.full((n, self.width), -1, dtype=np.int32)
        words = bits.view(np.uint32)
        masked: list[tuple[int, int]] = []  # (bitmask row, logits row)
        parallel: list[tuple[RequestGrammar, int]] = []
        at = 0
        for row, g, d in plan:
            if d:
                filled = g.fill_drafts(words[at : at + len(d) + 1], d)
                masked += [(at + j, row + j) for j, f in enumerate(filled) if f]
            else:
                parallel.append((g, at))
                masked.append((at, row))
            at += len(d) + 1
        if len(parallel) >= _PARALLEL_ROWS and self._cores > 4:
            self._executor.unsafe_compute_mask_ptr(
                [(g.matcher, b) for g, b in parallel], bits.ctypes.data, self.width * 4, n
            )
            for g, b in parallel:
                g.fixup(words[b])
        else:  # a thread pool costs more than it saves on a few rows or cores (a JSON mask is ~10 us)
            for g, b in parallel:
                g.fill(words[b])
        # a row with nothing allowed (a matcher in error) is left unmasked rather than sampled from -inf
        masked = [(b, r) for b, r in masked if words[b].any()]
        if not masked:
            return logits
        sel = torch.from_numpy(bits[[b for b, _ in masked]])
        rows = torch.tensor([r for _, r in masked], dtype=torch.int64)
        if self.device.type == "cuda":  # pinned: the copies do not block the host
            sel, rows = sel.pin_memory(), rows.pin_memory()
        return apply_bitmask(
            logits, rows.to(logits.device, non_blocking=True), sel.to(logits.device, non_blocking=True)
        )
