"""One rank's model runner: build batch tensors for a scheduled step, run the model, sample.

A step is split so that tensor-parallel workers can mirror it: rank 0 turns the scheduler's
output into plain-Python ``StepInputs`` (``prepare``), every rank runs ``forward_step`` on the
same inputs (the model's collectives pair up), and rank 0 alone samples.

Hybrid models (KDA layers) also keep per-sequence recurrent state in slots of ``KDAState``
tensors. The scheduler decides the slots and the snapshot copies (plain ints in ``StepInputs``, so
every rank applies the same ones); the runner zeroes the slots of sequences starting at position
0, restores prefix snapshots into slots before the forward pass and saves slots into snapshots
after it.

Speculative decoding: a decode that carries draft tokens becomes ``1 + k`` decode rows of the same
sequence at consecutive positions (each row its own context length over the same block table), so
verification runs through exactly the decode path a plain decode takes and greedy output is the
same token for token. KDA layers then step those rows position by position and save the state after
each position into scratch slots; after acceptance the state after the last accepted position is
copied back into the sequence's slot at the start of its next step (every rank applies the same copy).

Forks (``n > 1``, scheduler module doc): a forked child's ``ScheduledSeq`` computes no row; its
first token is sampled from a copy of its leader's last logits row, with the child's own sampling
parameters, generator and grammar. After the forward pass every rank copies the blocks and state
slots the scheduler names, so the child's cache holds exactly the leader's prompt.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kimitui.engine.kv_cache.pool import copy_blocks
from kimitui.engine.kv_cache.state import KDAState, copy_state_slots
from kimitui.engine.layers.attn_metadata import AttentionMetadata, PrefillChunk
from kimitui.engine.outputs import LogprobRows
from kimitui.engine.runner.block_tables import DeviceTables, TableRows
from kimitui.engine.runner.buffers import StepBuffers
from kimitui.engine.runner.graphs import DecodeGraphRunner, GraphConfig, default_decode_graphs
from kimitui.engine.runner.step_io import PromptLogprobSpan, StepInputs, StepResult, output_rows
from kimitui.engine.runner.verify_graphs import VerifyGraphRunner
from kimitui.engine.sampling.penalties import has_penalties
from kimitui.engine.sampling.rows import forced_rows, fork_rows, penalty_rows
from kimitui.engine.sampling.sampler import SamplingBatch, logprob_dicts, prompt_logprob_dicts, sample
from kimitui.engine.scheduler.output import ScheduledSeq, SchedulerOutput
from kimitui.engine.spec_decode.proposer import StepHidden
from kimitui.engine.spec_decode.rejection import draft_probs
from kimitui.engine.spec_decode.verify import kda_spec_layout, kda_spec_steps, verify_and_logprobs


class ModelRunner:
    """``max_num_seqs`` / ``max_model_len``: the decode block tables' fixed capacity
    [max_num_seqs, ceil(max_model_len / block_size)] (None: sized by each step, growing).
    ``decode_graphs``: run decode-only steps through ``DecodeGraphRunner`` (needs the capacity);
    None = on a cuda/rocm device, where the graphs are captured (every rank of a tensor-parallel
    group alike), or on an emulated one; True on a CPU runs the same static-buffer path with direct
    calls."""

    def __init__(
        self,
        model,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        workers=None,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
        decode_graphs: bool | None = None,
        num_spec_tokens: int = 0,
        spec_scratch_base: int = 0,
        keep_hidden: bool = False,
        emulate_graphs: bool = False,
    ):
        """``num_spec_tokens``: the most drafts a decode verifies (0: no speculation); KDA scratch
        slot ``spec_scratch_base + slot * num_spec_tokens + j`` holds sequence slot ``slot``'s state
        after its verified position ``j``. ``keep_hidden``: return the target's aux hidden states
        (``StepResult.hidden``) for a model drafter. ``emulate_graphs``: on a CPU, the decode graphs
        are recorded and replayed (engine/runner/emulated_graph.py) instead of called directly."""
        self.model = model
        self.num_spec_tokens = num_spec_tokens
        self.spec_scratch_base = spec_scratch_base
        self.keep_hidden = keep_hidden
        self._rollbacks: dict[str, tuple[int, int]] = {}  # seq_id -> (scratch slot, its slot) for its next step
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.workers = workers  # WorkerGroup mirroring each step on ranks 1..N-1, or None
        self._generators: dict[str, torch.Generator] = {}
        # grammar masks of constrained requests (engine/structured); the engine sets it on the first one
        self.structured = None
        self.rejection_method = "standard"  # how drafts are verified: the engine sets the speculative config's
        self.buffers = StepBuffers(device)  # step inputs, reused across steps
        self.states = [c for c in kv_caches if isinstance(c, KDAState)]  # the KDA layers' slots
        self.table_shape = None  # (max_num_seqs, max_blocks_per_seq) of the fixed decode tables
        if max_num_seqs is not None and max_model_len is not None:
            # a decode that verifies k drafts takes 1 + k rows of the decode tables
            self.table_shape = (max_num_seqs * (1 + num_spec_tokens), -(-max_model_len // block_size))
        # persistent decode tables: rank 0 tracks the rows, every rank keeps the tables on its device
        self.table_rows = TableRows(*self.table_shape) if self.table_shape is not None else None
        self.device_tables = DeviceTables(*self.table_shape, device) if self.table_shape is not None else None
        if decode_graphs is None:
            decode_graphs = default_decode_graphs(device)
        self.graphs = None
        self.verify_graphs = None
        if decode_graphs:
            if self.table_shape is None:
                raise ValueError("decode graphs need max_num_seqs and max_model_len (the static buffers' capacity)")
            cfg = GraphConfig(
                *self.table_shape,
                block_size,
                capture=device.type == "cuda",
                emulate=emulate_graphs and device.type == "cpu",
            )
            self.graphs = DecodeGraphRunner(model, kv_caches, cfg, device)
            if self.states and num_spec_tokens > 0 and not self.graphs.host_experts:
                # a hybrid model's verification steps: their own fixed-layout graphs
                # (engine/runner/verify_graphs.py; with host experts they stay eager)
                self.verify_graphs = VerifyGraphRunner(
                    model, kv_caches, cfg, device, max_num_seqs, num_spec_tokens, spec_scratch_base
                )

    def release(self, seq_id: str) -> None:
        self._generators.pop(seq_id, None)
        self._rollbacks.pop(seq_id, None)
        if self.table_rows is not None:
            self.table_rows.release(seq_id)
        if self.structured is not None:
            self.structured.release(seq_id)

    def execute(self, out: SchedulerOutput) -> StepResult:
        # Decodes first (one row each, batched absorbed attention), then prefill chunks.
        order = [s for s in out.scheduled if not s.is_prefill and s.fork_of is None]
        order += [s for s in out.scheduled if s.is_prefill]
        inputs = self.prepare(order)
        inputs.block_copies = out.block_copies
        # KDA state rollbacks of last step's verified decodes, for the sequences that run on (a
        # preempted or finished one restarts from a zero state or a snapshot instead).
        rollbacks = [
            self._rollbacks[s.seq.seq_id]
            for s in order
            if not s.is_prefill and s.start > 0 and s.seq.seq_id in self._rollbacks
        ]
        self._rollbacks.clear()
        inputs.state_restores = rollbacks + out.state_restores
        inputs.state_saves = out.state_saves + out.state_forks  # (from, to) after the forward pass alike
        if self.workers is not None:
            self.workers.broadcast(inputs)
        sample_logits, prompt_logits = self.forward_step(inputs)
        return self._sample(order, out.scheduled, inputs, sample_logits, prompt_logits)

    def prepare(self, order: list[ScheduledSeq]) -> StepInputs:
        inp = StepInputs([], 0, [], [], [], [])
        inp.keep_all_rows = self.keep_hidden
        verifying = any(s.spec_token_ids for s in order)
        rows = self.table_rows
        if rows is not None:
            rows.begin_step()
        for s in order:
            seq = s.seq
            row = len(inp.ids)
            table = seq.block_table
            if s.spec_token_ids:  # the last sampled token, then the drafts, one decode row each
                n = s.num_new_tokens
                inp.ids.append(seq.token_id(s.start))
                inp.ids.extend(s.spec_token_ids)
                inp.num_decodes += n
                if rows is not None:
                    inp.decode_rows.extend([rows.row(seq.seq_id, table, inp.table_writes)] * n)
                else:
                    inp.decode_tables.extend([list(table)] * n)
                inp.decode_lens.extend(range(s.start + 1, s.end + 1))
                inp.sample_rows.extend(range(row, row + n))
                inp.spec_lens.append(n)
                if seq.state_slot is not None:
                    inp.state_slots.extend([seq.state_slot] * n)
                continue
            inp.ids.extend(seq.tokens_in_range(s.start, s.end))
            if s.is_prefill:
                inp.prefills.append((row, row + s.num_new_tokens, s.end, list(table)))
                k = getattr(seq.sampling_params, "prompt_logprobs", None)
                full = getattr(seq.sampling_params, "logprob_rows", False)
                last = min(s.end, seq.num_prompt_tokens - 1)
                if (k is not None or full) and last > s.start:
                    # Row i (position start+i) predicts the token at start+i+1; only prompt tokens count.
                    inp.prompt_spans.append(
                        PromptLogprobSpan(
                            seq.seq_id,
                            row,
                            last - s.start,
                            s.start + 1,
                            seq.tokens_in_range(s.start + 1, last + 1),
                            k,
                            full,
                        )
                    )
            else:
                inp.num_decodes += 1
                if rows is not None:
                    inp.decode_rows.append(rows.row(seq.seq_id, table, inp.table_writes))
                else:
                    inp.decode_tables.append(list(table))
                inp.decode_lens.append(s.end)
                if verifying:
                    inp.spec_lens.append(1)
            if s.do_sample:
                inp.sample_rows.append(row + s.num_new_tokens - 1)
            if seq.state_slot is not None:
                inp.state_slots.append(seq.state_slot)
                if s.start == 0:
                    inp.state_resets.append(seq.state_slot)
        return inp

    @torch.inference_mode()
    def forward_step(self, inp: StepInputs) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Run the model on ``inp``; every rank calls this with the same inputs. Returns fp32 logits
        of the rows to sample and of each prompt-logprob span."""
        bs = self.block_size
        buf = self.buffers
        buf.begin_step()
        # Every prefill chunk's block table in one buffer; each chunk views its own span.
        flat = [b for *_, t in inp.prefills for b in t]
        tables = buf.put("prefill_tables", flat, torch.int32) if flat else None
        chunks, at = [], 0
        for a, b, n, t in inp.prefills:
            chunks.append(PrefillChunk(a, b, n, tables[at : at + len(t)]))
            at += len(t)
        positions, slots = [], []  # built on the device from block tables: no per-token Python
        meta = AttentionMetadata(
            positions=None, slot_mapping=None, block_size=bs, num_decode_tokens=inp.num_decodes, prefills=chunks
        )
        # a hybrid model's verifying decodes share a slot over several rows: stepped position by
        # position (KDA layers), which the graphs' one-row-per-slot replay does not do
        kda_verify = bool(inp.state_slots) and any(n > 1 for n in inp.spec_lens)
        # (a decode-only step computes every row anyway: a model drafter's aux states come out of the
        # graph's static memory, and a verification step is decode rows, so both replay graphs)
        graphed = (
            self.graphs is not None
            and not kda_verify
            and self.graphs.accepts(inp.num_decodes, len(inp.ids), bool(inp.prefills), bool(inp.state_slots))
        )
        verify_graphed = (
            kda_verify
            and self.verify_graphs is not None
            and self.verify_graphs.accepts_verify(inp.spec_lens, len(inp.ids), bool(inp.prefills))
        )
        if inp.num_decodes:
            self._decode_inputs(inp, meta)
        if verify_graphed:
            ids = buf.put("ids", inp.ids, torch.int64)
            layout = buf.put("verify_layout", self.verify_graphs.layout(inp.spec_lens, inp.state_slots), torch.int64)
            sample_rows = buf.put("sample_rows", inp.sample_rows, torch.int64) if inp.sample_rows else None
            saves = self._state_indices(inp, meta, fixed_layout=True)
            copies = buf.put("block_copies", inp.block_copies, torch.int64) if inp.block_copies else None
            buf.end_step()
            hidden = self.verify_graphs.run_verify(
                ids, meta.decode_block_tables, meta.decode_context_lens, layout, len(inp.spec_lens)
            )
            return self._after_forward(hidden, saves, copies, sample_rows, [])
        if graphed:
            ids = buf.put("ids", inp.ids, torch.int64)
            sample_rows = buf.put("sample_rows", inp.sample_rows, torch.int64) if inp.sample_rows else None
            saves = self._state_indices(inp, meta)
            copies = buf.put("block_copies", inp.block_copies, torch.int64) if inp.block_copies else None
            buf.end_step()
            hidden = self.graphs.run(ids, meta.decode_block_tables, meta.decode_context_lens, meta.state_slots)
            return self._after_forward(hidden, saves, copies, sample_rows, [])
        if inp.num_decodes:
            pos = meta.decode_context_lens.long() - 1  # [D] each decode writes its newest token
            rows = torch.arange(inp.num_decodes, device=self.device)
            positions.append(pos)
            slots.append(meta.decode_block_tables[rows, pos // bs].long() * bs + pos % bs)
        for c in chunks:
            pos = torch.arange(c.context_len - (c.end - c.start), c.context_len, device=self.device)
            positions.append(pos)
            slots.append(c.block_table[pos // bs].long() * bs + pos % bs)
        meta.positions, meta.slot_mapping = torch.cat(positions), torch.cat(slots)
        ids = buf.put("ids", inp.ids, torch.int64)
        keep, bounds = (None, []) if inp.keep_all_rows else output_rows(inp)
        row = {r: i for i, r in enumerate(keep)} if keep is not None else None  # batch row -> hidden row
        if keep is not None:
            meta.out_rows = buf.put("out_rows", keep, torch.int64)
        sample_rows = [row[r] for r in inp.sample_rows] if row is not None else inp.sample_rows
        sample_rows = buf.put("sample_rows", sample_rows, torch.int64) if sample_rows else None
        saves = self._state_indices(inp, meta)
        copies = buf.put("block_copies", inp.block_copies, torch.int64) if inp.block_copies else None
        buf.end_step()
        if keep is not None:
            meta.out_meta = replace(
                meta,
                positions=meta.positions[meta.out_rows],
                slot_mapping=None,
                prefills=[PrefillChunk(a, b, c.context_len, c.block_table) for c, (a, b) in zip(chunks, bounds)],
            )
        hidden = self.model(ids, meta, self.kv_caches)
        spans = [(row[sp.row] if row is not None else sp.row, sp.num_rows) for sp in inp.prompt_spans]
        return self._after_forward(hidden, saves, copies, sample_rows, spans)

    def _after_forward(
        self, hidden: torch.Tensor, saves, copies, sample_rows: torch.Tensor | None, spans: list[tuple[int, int]]
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """What every forward (graphed or eager) ends with: the step's KDA state saves and block
        copies, then fp32 logits of the rows to sample and of each prompt-logprob span of ``hidden``."""
        if saves is not None:
            copy_state_slots(self.states, *saves)
        if copies is not None:
            copy_blocks(self.kv_caches, copies[:, 0], copies[:, 1])
        prompt_logits = [self.model.compute_logits(hidden[r : r + n]) for r, n in spans]
        logits = self.model.compute_logits(hidden[sample_rows]) if sample_rows is not None else None
        return logits, prompt_logits

    def _decode_inputs(self, inp: StepInputs, meta: AttentionMetadata) -> None:
        """Decode block tables and context lengths into their persistent buffers, and the attention
        kernel's bound. Steps from ``prepare`` carry table rows: the persistent tables get the step's
        appended blocks and the step's rows are gathered on the device (engine/runner/block_tables.py).
        Explicit tables (``decode_tables``) with a fixed capacity are [D, max_blocks_per_seq] views
        of one buffer. On an accelerator, the bound is the capacity (the kernel's grid then does not
        follow the host's longest context). On the CPU the bound stays the step's longest context:
        the reference path gathers [D, bound] cache rows, so there the bound is work, not a launch
        shape."""
        buf = self.buffers
        on_device = self.device.type != "cpu"
        if inp.decode_rows:  # the persistent tables, brought up to date by this step's appended blocks
            self.device_tables.apply(buf, inp.table_writes)
            # on the CPU only the columns the longest context needs (the work follows the bound there)
            width = (
                self.table_shape[1]
                if on_device
                else min(self.table_shape[1], -(-max(inp.decode_lens) // self.block_size))
            )
            meta.decode_block_tables = self.device_tables.gather(buf, inp.decode_rows, width)
            meta.decode_context_lens = buf.put(
                "decode_lens", inp.decode_lens, torch.int32, capacity=self.table_shape[0]
            )
            meta.decode_max_context_len = self.table_shape[1] * self.block_size if on_device else max(inp.decode_lens)
        elif self.table_shape is not None:
            meta.decode_block_tables = buf.put_table("decode_tables", inp.decode_tables, self.table_shape)
            meta.decode_context_lens = buf.put(
                "decode_lens", inp.decode_lens, torch.int32, capacity=self.table_shape[0]
            )
            meta.decode_max_context_len = self.table_shape[1] * self.block_size if on_device else max(inp.decode_lens)
        else:
            meta.decode_block_tables = buf.put_rows("decode_tables", inp.decode_tables, torch.int32)
            meta.decode_context_lens = buf.put("decode_lens", inp.decode_lens, torch.int32)
            meta.decode_max_context_len = max(inp.decode_lens)

    def _state_indices(self, inp: StepInputs, meta: AttentionMetadata, fixed_layout: bool = False):
        """Fill ``meta.state_slots``, apply the resets and restores; return the saves' (from, to)
        index tensors for after the forward pass, or None. ``fixed_layout``: a verification step the
        verify graphs run (their layout replaces the per-position KDA steps)."""
        if not inp.state_slots:
            return None
        if not self.states:
            raise ValueError("the step carries state slots but the KV cache has no KDA state (KDAState) layer")
        buf = self.buffers
        meta.state_slots = buf.put("state_slots", inp.state_slots, torch.int64)
        if inp.spec_lens and any(n > 1 for n in inp.spec_lens) and not fixed_layout:
            meta.kda_spec = kda_spec_steps(
                inp.spec_lens, inp.state_slots, self.spec_scratch_base, self.num_spec_tokens, self.device
            )
            meta.kda_spec_layout = kda_spec_layout(
                inp.spec_lens, inp.state_slots, self.spec_scratch_base, self.num_spec_tokens, self.device
            )
        if inp.state_resets:
            resets = buf.put("state_resets", inp.state_resets, torch.int64)
            for state in self.states:
                state.reset(resets)
        if inp.state_restores:
            pairs = buf.put("state_restores", inp.state_restores, torch.int64)  # [N, 2] (from, to)
            copy_state_slots(self.states, pairs[:, 0], pairs[:, 1])
        if not inp.state_saves:
            return None
        pairs = buf.put("state_saves", inp.state_saves, torch.int64)
        return pairs[:, 0], pairs[:, 1]

    def _sample(self, order, scheduled, inp: StepInputs, logits, prompt_logits) -> StepResult:
        forks = [s for s in scheduled if s.fork_of is not None]
        pos = {id(s): i for i, s in enumerate(order + forks)}
        result = StepResult(sampled=[None] * len(pos), logprobs=[None] * len(pos))
        for sp, lg in zip(inp.prompt_spans, prompt_logits):
            if sp.k is not None:
                result.prompt_logprobs[sp.seq_id] = (sp.first_pos, prompt_logprob_dicts(lg, sp.next_ids, sp.k))
            if sp.full:
                rows = lg.log_softmax(dim=-1).float().cpu()
                result.rows.setdefault(sp.seq_id, []).append(LogprobRows(sp.first_pos, rows, "prefill"))
        if logits is not None:
            sample_seqs = [s for s in order if s.do_sample]
            if forks:
                logits = fork_rows(logits, sample_seqs, forks)
                sample_seqs += forks
            params = [s.seq.sampling_params for s in sample_seqs]
            gens = [self._generator(s.seq.seq_id, p.seed) for s, p in zip(sample_seqs, params)]
            batch = SamplingBatch.build(params, gens, self.device, self.buffers, forced_rows(sample_seqs))
            self.buffers.end_step()  # the next step's inputs wait for these pinned copies
            drafts = [list(s.spec_token_ids) for s in sample_seqs] if inp.spec_lens else None
            if self.structured is not None and self.structured.requests:
                # grammar masks before penalties, temperature, top-k / top-p; a verified decode's rows
                # are masked position by position
                logits = self.structured.mask_logits(logits, [s.seq for s in sample_seqs], drafts)
            if any(has_penalties(p) for p in params):
                batch.penalties = penalty_rows(sample_seqs, drafts, logits.shape[-1], self.device)
            if drafts is not None:  # some decode verifies drafts: one row per position, the rule decides
                outs, lp_lists = verify_and_logprobs(
                    logits,
                    drafts,
                    batch,
                    params,  # the one host sync
                    draft_probs(sample_seqs, drafts, logits.shape[-1]),
                    self.rejection_method,
                )
                for j, s in enumerate(sample_seqs):
                    spec = bool(s.spec_token_ids)
                    result.sampled[pos[id(s)]] = outs[j] if spec else outs[j][0]
                    lp = lp_lists[j]
                    result.logprobs[pos[id(s)]] = lp if spec or lp is None else lp[0]
                    if spec:
                        self._note_rollback(s, len(outs[j]) - 1)
                self._sample_rows(result, sample_seqs, logits, [len(o) for o in outs])
            else:
                sampled = sample(logits, batch)
                tokens, *lps = sampled.to_host()  # the one host sync of the step
                lp_rows = logprob_dicts(params, tokens, *lps)
                for j, s in enumerate(sample_seqs):
                    result.sampled[pos[id(s)]] = tokens[j]
                    result.logprobs[pos[id(s)]] = lp_rows[j]
                self._sample_rows(result, sample_seqs, logits, [1] * len(sample_seqs))
        if self.keep_hidden:
            result.hidden = self._hidden(order, result.sampled, pos)
        # The scheduler expects results in its own order.
        result.sampled = [result.sampled[pos[id(s)]] for s in scheduled]
        result.logprobs = [result.logprobs[pos[id(s)]] for s in scheduled]
        return result

    @staticmethod
    def _sample_rows(
        result: StepResult, sample_seqs: list[ScheduledSeq], logits: torch.Tensor, kept: list[int]
    ) -> None:
        """Full-vocabulary rows of the sampled positions of sequences that ask for them: ``kept[j]``
        rows of sequence j (its verified token and accepted drafts), out of ``len(drafts) + 1``."""
        idx, spans, row = [], [], 0
        for s, n in zip(sample_seqs, kept):
            if getattr(s.seq.sampling_params, "logprob_rows", False):
                spans.append((s, len(idx), n))
                idx.extend(range(row, row + n))
            row += len(s.spec_token_ids) + 1
        if not idx:
            return
        rows = logits[torch.tensor(idx, device=logits.device)].log_softmax(dim=-1).float().cpu()
        for s, at, n in spans:
            # a decode's first row predicts the token after the sequence's last one; a prefill's too
            path = "prefill" if s.is_prefill else "decode"
            result.rows.setdefault(s.seq.seq_id, []).append(LogprobRows(s.seq.num_tokens, rows[at : at + n], path))

    def _note_rollback(self, s: ScheduledSeq, accepted: int) -> None:
        """KDA state: after ``accepted`` of its drafts, the sequence continues from the state after
        verified position ``accepted``; the last position's state is already in its slot."""
        slot = s.seq.state_slot
        if slot is not None and accepted < len(s.spec_token_ids):
            scratch = self.spec_scratch_base + slot * self.num_spec_tokens + accepted
            self._rollbacks[s.seq.seq_id] = (scratch, slot)

    def _hidden(self, order, sampled, pos) -> StepHidden | None:
        """The model's aux hidden states of this step, with each sequence's valid rows: a prefill
        chunk's rows, a decode's verified token and its accepted drafts."""
        aux = getattr(self.model, "aux_hidden", None)
        if aux is None:
            return None
        hidden = StepHidden(aux)
        row = 0
        for s in order:
            seq, out = s.seq, sampled[pos[id(s)]]
            if s.is_prefill:
                n = s.num_new_tokens
                nxt = seq.tokens_in_range(s.start + 1, min(s.end + 1, seq.num_tokens))
                if out is not None:
                    nxt.append(out)
            else:
                out = out if isinstance(out, list) else [out]
                n, nxt = len(out), list(out)
            if len(nxt) == n:  # rows whose next token is known (all, unless the prompt was cut mid-step)
                hidden.spans[seq.seq_id] = (row, n, s.start)
                hidden.next_tokens[seq.seq_id] = nxt
                hidden.seqs[seq.seq_id] = seq
            row += s.num_new_tokens
        return hidden

    def _generator(self, seq_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self._generators.get(seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._generators[seq_id] = gen
        return gen
