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

Host syncs: one per ``propose`` (the drafts, read back together); the chain stays on the device.
"""

from __future__ import annotations

import torch

from kimitui.engine.layers.attn_metadata import PrefillChunk
from kimitui.engine.sequence import Sequence
from kimitui.engine.spec_decode.eagle3 import Eagle3Drafter
from kimitui.engine.spec_decode.eagle3_loader import load_eagle3
from kimitui.engine.spec_decode.proposer import StepHidden
from kimitui.engine.layers.embedding import VocabEmbedding
from kimitui.engine.loader.checkpoint import CheckpointReader
from kimitui.kernels.select import attach_backends
from kimitui.kernels.settings import KernelSettings


class Eagle3Proposer:
    needs_hidden = True

    def __init__(self, config, target, settings=None, model_dir=None):
        """``config``: the SpeculativeConfig (``model`` = drafter directory); ``target``: the loaded
        Kimi K2.x model, whose aux layers are switched on here and whose embedding is shared when
        the drafter ships none."""
        if not hasattr(target, "set_aux_hidden_layers"):
            raise ValueError(f"speculative_config: eagle3 needs a Kimi K2.x (DeepSeek-V3) target, got "
                             f"{type(target).__name__}")
        weight = target.model.norm.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.num_speculative_tokens = config.num_speculative_tokens
        embedding, lm_head = target.model.embed_tokens, target.lm_head
        par = getattr(target, "par", None)
        if par is not None and par.is_parallel:
            lm_head = None  # split by vocabulary over the ranks: a drafter without its own is refused at load
            # Tensor parallel: the drafter runs on rank 0 alone (replicated there, the other ranks never
            # call it); the target's embedding is split by vocabulary over the ranks and its lookup is a
            # collective, so rank 0 keeps a whole copy for the drafter (checkpoints without embed_tokens).
            embedding = _whole_embedding(model_dir, target.config, self.device, self.dtype)
        self.drafter: Eagle3Drafter = load_eagle3(
            config.model, target.config, self.device, self.dtype, target_embedding=embedding,
            target_lm_head=lm_head, aux_override=config.eagle_aux_hidden_state_layer_ids,
            aux_convention=config.eagle_aux_hidden_state_layer_convention)
        if self.drafter.lm_head is None and lm_head is None:
            raise ValueError("speculative_config: an eagle3 drafter without its own lm_head needs tensor_parallel_size 1")
        self.cache_dtype = None if config.kv_cache_dtype == "auto" else getattr(torch, config.kv_cache_dtype)
        self._attach_backend(settings)
        target.set_aux_hidden_layers(self.drafter.config.aux_layer_ids)
        self.cache: torch.Tensor | None = None
        self.block_size = 0
        # seq_id -> (pre-norm output, normed output, position) of the drafter's row at the sequence's
        # last verified position: draft 1 for a sequence the last step did not touch
        self._last: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._finished: set[str] = set()

    def _attach_backend(self, settings) -> None:

        attach_backends(self.drafter, self.device, self.dtype,
                        KernelSettings.from_env() if settings is None else settings)

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
        self._finished.add(seq_id)  # its rows of the step just run are not worth a drafter pass

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], max_drafts: list[int], hidden: StepHidden | None = None
                ) -> list[list[int]]:
        if self.cache is None:
            raise RuntimeError("Eagle3Proposer: bind_cache was not called (the engine does it after the KV cache)")
        if hidden is not None and hidden.spans:
            self._absorb(hidden)
        self._finished.clear()
        return self._chain(seqs, max_drafts)

    def _table(self, seq: Sequence) -> torch.Tensor:
        return torch.tensor(seq.block_table, dtype=torch.int32, device=self.device)

    def _absorb(self, hidden: StepHidden) -> None:
        """The drafter pass over the step's verified rows (all sequences in one batch)."""
        ids, chunks, picks, ends = [], [], [], []
        for sid, (first, n, pos0) in hidden.spans.items():
            seq = hidden.seqs.get(sid)
            if sid in self._finished or seq is None or len(seq.block_table) * self.block_size < pos0 + n:
                continue  # finished (its blocks may be gone) or never given the slots
            row = len(ids)
            ids.extend(hidden.next_tokens[sid])
            chunks.append(PrefillChunk(row, row + n, pos0 + n, self._table(seq)))
            picks.append(torch.arange(first, first + n))
            ends.append((sid, row + n - 1, pos0 + n - 1))
        if not ids:
            return
        rows = torch.cat(picks).to(self.device)
        aux = hidden.aux.index_select(0, rows)
        pre, normed = self.drafter(torch.tensor(ids, dtype=torch.int64, device=self.device),
                                   self.drafter.combine(aux), chunks, self.cache)
        for sid, r, pos in ends:
            self._last[sid] = (pre[r].clone(), normed[r].clone(), pos)  # not views holding the whole pass

    def _chain(self, seqs: list[Sequence], max_drafts: list[int]) -> list[list[int]]:
        """Greedy chains: draft 1 from each sequence's last verified row, then one drafter pass per
        further draft, every sequence that still drafts in the same pass."""
        live, ks, tables = [], [], []  # index into seqs, drafts wanted, block table tensor
        pre_rows, normed_rows = [], []
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
        out: list[list[int]] = [[] for _ in seqs]
        if not live:
            return out
        tokens = self.drafter.greedy(torch.stack(normed_rows))  # [S] draft 1 of each
        drafts = [tokens]
        pre = torch.stack(pre_rows)
        active = list(range(len(live)))  # positions in ``live`` still drafting
        for j in range(1, max(ks)):
            keep = [a for a in active if ks[a] > j]
            if keep != active:
                sel = torch.tensor([active.index(a) for a in keep], device=self.device)
                tokens, pre = tokens.index_select(0, sel), pre.index_select(0, sel)
                active = keep
            chunks = []
            for r, a in enumerate(active):
                pos = seqs[live[a]].num_tokens - 1 + j - 1  # this pass's row position
                chunks.append(PrefillChunk(r, r + 1, pos + 1, tables[a]))
            pre, normed = self.drafter(tokens, pre, chunks, self.cache)
            tokens = self.drafter.greedy(normed)
            drafts.append((tokens, list(active)))
        flat = torch.cat([drafts[0]] + [t for t, _ in drafts[1:]]).tolist()  # the one host sync
        for a, i in enumerate(live):
            out[i].append(flat[a])
        at = len(live)
        for t, act in drafts[1:]:
            for r, a in enumerate(act):
                out[live[a]].append(flat[at + r])
            at += len(act)
        return out


def _whole_embedding(model_dir, config, device: torch.device, dtype: torch.dtype):
    """The target's whole token embedding read from its checkpoint (``model.embed_tokens.weight`` under
    the family's prefix), on ``device``: what a drafter on rank 0 shares under tensor parallel."""

    if model_dir is None:
        raise ValueError("speculative_config: eagle3 with tensor parallel needs the target's checkpoint directory")
    emb = VocabEmbedding(config.vocab_size, config.hidden_size, dtype=dtype).to(device)
    weight = CheckpointReader(model_dir).get(f"{config.weight_prefix}model.embed_tokens.weight")
    emb.weight.data.copy_(weight.to(device=device, dtype=dtype))
    return emb
