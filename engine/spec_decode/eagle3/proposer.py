"""EAGLE-3 chain drafting over a Kimi K2.x target (vLLM's ``v1/spec_decode/eagle.py``, greedy).

After every step the engine hands over the target's aux hidden states of the rows the step made
part of a sequence (``StepHidden``). The drafter runs over those rows first, EAGLE's shift: the row
at position p takes the target's hidden state at p and the token at p + 1, and writes the drafter's
KV at p. That pass overwrites whatever a previous chain wrote at those positions (guesses, some
rejected), so the drafter's cache below a sequence's verified length always holds the same values a
drafter that had never guessed would hold. The last row of a sequence that decodes next predicts
the token after the one just sampled: draft 1. Each further draft is one drafter pass for all
those sequences together, one row each, fed with the previous pass's pre-norm output instead of
target states, writing KV at the next position (slots the scheduler reserves past the step,
``SpeculativeConfig.num_lookahead_slots``).

Deferred absorb: a sequence that gets no drafts this step (back-off, ``disable_by_batch_size``)
costs no drafter pass. Its verified rows (aux states, a copy of a few rows, and their next tokens)
wait in ``_pending`` and are absorbed together, in one pass, the next time it drafts, so the
drafter's KV and its last row are exactly what absorbing them step by step would have made. A
prefill chunk's rows, or pending rows past ``DEFER_ROWS``, are absorbed at once (bounded memory).

Host syncs: one per ``propose`` (the drafts, read back together); the chain stays on the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kimitui.engine.layers.attn_metadata import PrefillChunk
from kimitui.engine.layers.embedding import VocabEmbedding
from kimitui.engine.loader.checkpoint import CheckpointReader
from kimitui.engine.sequence import Sequence
from kimitui.engine.spec_decode.eagle3.loader import load_eagle3
from kimitui.engine.spec_decode.eagle3.model import Eagle3Drafter
from kimitui.engine.spec_decode.proposer import StepHidden
from kimitui.kernels.select import attach_backends
from kimitui.kernels.settings import KernelSettings

DEFER_ROWS = 64  # a sequence's rows waiting for a drafter pass before they are absorbed anyway


class Eagle3Proposer:
    needs_hidden = True

    def __init__(self, config, target, settings=None, model_dir=None):
        """``config``: the SpeculativeConfig (``model`` = drafter directory); ``target``: the loaded
        Kimi K2.x model, whose aux layers are switched on here and whose embedding is shared when
        the drafter ships none."""
        if not hasattr(target, "set_aux_hidden_layers"):
            raise ValueError(
                f"speculative_config: eagle3 needs a Kimi K2.x (DeepSeek-V3) target, got {type(target).__name__}"
            )
        weight = target.model.norm.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.num_speculative_tokens = config.num_speculative_tokens
        self.sampled = getattr(config, "draft_sample_method", "greedy") == "probabilistic"
        self.draft_probs: dict[str, torch.Tensor] = {}  # seq_id -> [k, V] of the last proposal's sampled drafts
        embedding, lm_head = target.model.embed_tokens, target.lm_head
        par = getattr(target, "par", None)
        if par is not None and par.is_parallel:
            lm_head = None  # split by vocabulary over the ranks: a drafter without its own is refused at load
            # Tensor parallel: the drafter runs on rank 0 alone (replicated there, the other ranks never
            # call it); the target's embedding is split by vocabulary over the ranks and its lookup is a
            # collective, so rank 0 keeps a whole copy for the drafter (checkpoints without embed_tokens).
            embedding = _whole_embedding(model_dir, target.config, self.device, self.dtype)
        self.drafter: Eagle3Drafter = load_eagle3(
            config.model,
            target.config,
            self.device,
            self.dtype,
            target_embedding=embedding,
            target_lm_head=lm_head,
            aux_override=config.eagle_aux_hidden_state_layer_ids,
            aux_convention=config.eagle_aux_hidden_state_layer_convention,
        )
        if self.drafter.lm_head is None and lm_head is None:
            raise ValueError(
                "speculative_config: an eagle3 drafter without its own lm_head needs tensor_parallel_size 1"
            )
        self.cache_dtype = None if config.kv_cache_dtype == "auto" else getattr(torch, config.kv_cache_dtype)
        self._attach_backend(settings)
        target.set_aux_hidden_layers(self.drafter.config.aux_layer_ids)
        self.cache: torch.Tensor | None = None
        self.block_size = 0
        # seq_id -> (pre-norm output, normed output, position) of the drafter's row at the sequence's
        # last verified position: draft 1 for a sequence the last step did not touch
        self._last: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._finished: set[str] = set()
        # seq_id -> verified rows not yet absorbed: ([n, n_aux * hidden] aux rows, next tokens, first position)
        self._pending: dict[str, tuple[torch.Tensor, list[int], int]] = {}
        self.absorbed_rows = self.drafter_passes = 0  # counters (tests, benchmarks)

    def _attach_backend(self, settings) -> None:

        attach_backends(
            self.drafter, self.device, self.dtype, KernelSettings.from_env() if settings is None else settings
        )

    def bind_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate the drafter's KV cache for the target's ``num_blocks`` blocks of ``block_size``."""
        self.cache = self.drafter.allocate_cache(num_blocks, block_size, self.device, self.cache_dtype)
        self.block_size = block_size

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """(source, destination) block copies of the target's cache (an ``n > 1`` sample forked from
        the one that computed the prompt, engine/scheduler/scheduler.py): the drafter's KV follows the blocks.
        The drafter row at the prompt's last position keeps the leader's sampled token as its next
        token (a drafter-quality approximation; verification stays exact); the child drafts from its
        second decode on, once its own first row is absorbed."""
        if self.cache is None or not pairs:
            return
        idx = torch.tensor(pairs, dtype=torch.int64, device=self.device)
        self.cache.index_copy_(0, idx[:, 1], self.cache.index_select(0, idx[:, 0]))

    def finish(self, seq_id: str) -> None:
        self._last.pop(seq_id, None)
        self._pending.pop(seq_id, None)
        self._finished.add(seq_id)  # its rows of the step just run are not worth a drafter pass

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], max_drafts: list[int], hidden: StepHidden | None = None) -> list[list[int]]:
        if self.cache is None:
            raise RuntimeError("Eagle3Proposer: bind_cache was not called (the engine does it after the KV cache)")
        drafting = {seq.seq_id for seq, k in zip(seqs, max_drafts) if k > 0}
        if hidden is not None and hidden.spans:
            self._collect(hidden, drafting)
        due = [sid for sid in drafting if sid in self._pending]
        if due:
            self._absorb([(sid, self._pending.pop(sid)) for sid in due], {s.seq_id: s for s in seqs})
        self._finished.clear()
        return self._chain(seqs, max_drafts)

    def _table(self, seq: Sequence) -> torch.Tensor:
        return torch.tensor(seq.block_table, dtype=torch.int32, device=self.device)

    def _collect(self, hidden: StepHidden, drafting: set[str]) -> None:
        """The step's verified rows: absorbed now (a sequence drafting next step, a prefill chunk, or
        too many rows waiting), else kept for later."""
        now = []
        for sid, (first, n, pos0) in hidden.spans.items():
            seq = hidden.seqs.get(sid)
            if sid in self._finished or seq is None or len(seq.block_table) * self.block_size < pos0 + n:
                self._pending.pop(sid, None)
                continue  # finished (its blocks may be gone) or never given the slots
            rows = hidden.aux[first : first + n]
            old = self._pending.pop(sid, None)
            if old is not None and old[2] + old[0].shape[0] == pos0:  # contiguous: append
                rows, tokens, pos0 = torch.cat((old[0], rows)), old[1] + hidden.next_tokens[sid], old[2]
            else:  # nothing waiting (or a gap: a preemption recomputed it; the older rows are stale)
                tokens = list(hidden.next_tokens[sid])
            if sid in drafting or pos0 < seq.num_prompt_tokens or rows.shape[0] > DEFER_ROWS:
                now.append((sid, (rows, tokens, pos0)))  # prompt rows at once: they may be many
            else:  # a copy: the step's aux buffer is the next step's
                self._pending[sid] = (rows if old is not None else rows.clone(), tokens, pos0)
        if now:
            self._absorb(now, hidden.seqs)

    def _absorb(self, items, seqs) -> None:
        """One drafter pass over the given sequences' rows (all sequences in one batch)."""
        ids, chunks, parts, ends = [], [], [], []
        for sid, (aux, tokens, pos0) in items:
            seq = seqs.get(sid)
            n = aux.shape[0]
            if seq is None:
                continue
            row = len(ids)
            ids.extend(tokens)
            chunks.append(PrefillChunk(row, row + n, pos0 + n, self._table(seq)))
            parts.append(aux)
            ends.append((sid, row + n - 1, pos0 + n - 1))
        if not ids:
            return
        aux = parts[0] if len(parts) == 1 else torch.cat(parts)
        pre, normed = self.drafter(
            torch.tensor(ids, dtype=torch.int64, device=self.device), self.drafter.combine(aux), chunks, self.cache
        )
        self.absorbed_rows += len(ids)
        self.drafter_passes += 1
        for sid, r, pos in ends:
            self._last[sid] = (pre[r].clone(), normed[r].clone(), pos)  # not views holding the whole pass

    def _chain(self, seqs: list[Sequence], max_drafts: list[int]) -> list[list[int]]:
        """Chains: draft 1 from each sequence's last verified row, then one drafter pass per further
        draft, every sequence that still drafts in the same pass. Greedy, or under
        ``draft_sample_method: probabilistic`` each draft of a sampled request drawn from the
        drafter's distribution at the request's temperature (kept in ``draft_probs`` for the
        rejection rule, which then stays exact)."""
        self.draft_probs = {}
        live, ks, tables = [], [], []  # index into seqs, drafts wanted, block table tensor
        pre_rows, normed_rows, temps = [], [], []
        for i, (seq, k) in enumerate(zip(seqs, max_drafts)):
            last = self._last.get(seq.seq_id)
            p = seq.num_tokens - 1  # the position of the token just sampled, not yet computed
            if k < 1 or last is None or last[2] != p - 1:
                continue  # nothing drafted at the last verified position (e.g. preempted since)
            # chain pass j (1..k-1) writes position p - 1 + j: inside the slots the sequence holds
            k = min(k, len(seq.block_table) * self.block_size - p + 1)
            if k < 1:
                continue
            live.append(i)
            ks.append(k)
            tables.append(self._table(seq))
            pre_rows.append(last[0])
            normed_rows.append(last[1])
            temps.append(float(getattr(seq.sampling_params, "temperature", 0.0) or 0.0) if self.sampled else 0.0)
        out: list[list[int]] = [[] for _ in seqs]
        if not live:
            return out
        temp = torch.tensor(temps, device=self.device) if any(t > 0 for t in temps) else None
        tokens, q = self._pick(torch.stack(normed_rows), temp)  # [S] draft 1 of each
        drafts, probs = [tokens], [q]
        pre = torch.stack(pre_rows)
        active = list(range(len(live)))  # positions in ``live`` still drafting
        for j in range(1, max(ks)):
            keep = [a for a in active if ks[a] > j]
            if keep != active:
                sel = torch.tensor([active.index(a) for a in keep], device=self.device)
                tokens, pre = tokens.index_select(0, sel), pre.index_select(0, sel)
                temp = None if temp is None else temp.index_select(0, sel)
                active = keep
            chunks = []
            for r, a in enumerate(active):
                pos = seqs[live[a]].num_tokens - 1 + j - 1  # this pass's row position
                chunks.append(PrefillChunk(r, r + 1, pos + 1, tables[a]))
            pre, normed = self.drafter(tokens, pre, chunks, self.cache)
            self.drafter_passes += 1
            tokens, q = self._pick(normed, temp)
            drafts.append((tokens, list(active)))
            probs.append(q)
        flat = torch.cat([drafts[0]] + [t for t, _ in drafts[1:]]).tolist()  # the one host sync
        for a, i in enumerate(live):
            out[i].append(flat[a])
        at = len(live)
        for t, act in drafts[1:]:
            for r, a in enumerate(act):
                out[live[a]].append(flat[at + r])
            at += len(act)
        if probs[0] is not None:
            acts = [list(range(len(live)))] + [act for _, act in drafts[1:]]
            for a, i in enumerate(live):
                if temps[a] > 0:
                    self.draft_probs[seqs[i].seq_id] = torch.stack(
                        [q[act.index(a)] for q, act in zip(probs, acts) if a in act]
                    )
        return out

    def _pick(self, normed: torch.Tensor, temp: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's draft (target ids [S]) and, when some row samples (``temp`` [S], 0 = greedy),
        the distribution it was drawn from over the target vocabulary [S, V] (one-hot for greedy rows)."""
        if temp is None:
            return self.drafter.greedy(normed), None
        logits = self.drafter.compute_logits(normed)  # [S, V] fp32, -inf outside the draft vocabulary
        greedy = temp <= 0
        q = (logits / torch.where(greedy, torch.ones_like(temp), temp)[:, None]).softmax(-1)
        tokens = torch.where(greedy, logits.argmax(-1), torch.multinomial(q, 1)[:, 0])
        q = torch.where(greedy[:, None], F.one_hot(tokens, q.shape[-1]).to(q.dtype), q)
        return tokens, q


def _whole_embedding(model_dir, config, device: torch.device, dtype: torch.dtype):
    """The target's whole token embedding read from its checkpoint (``model.embed_tokens.weight`` under
    the family's prefix), on ``device``: what a drafter on rank 0 shares under tensor parallel."""

    if model_dir is None:
        raise ValueError("speculative_config: eagle3 with tensor parallel needs the target's checkpoint directory")
    emb = VocabEmbedding(config.vocab_size, config.hidden_size, dtype=dtype).to(device)
    weight = CheckpointReader(model_dir).get(f"{config.weight_prefix}model.embed_tokens.weight")
    emb.weight.data.copy_(weight.to(device=device, dtype=dtype))
    return emb
