"""Drive a hybrid (KDA + MLA) model directly: hand-built AttentionMetadata and caches, no scheduler.

Each sequence gets a fixed state slot and a contiguous run of cache blocks. ``step`` runs one
forward over decodes (one token each, listed first) and prefill chunks, as the runner lays them out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kimitui.engine.config import ModelConfig
from kimitui.engine.layers.attn_metadata import AttentionMetadata, PrefillChunk
from kimitui.engine.loader import load_model


@dataclass
class Seq:
    slot: int
    block_table: torch.Tensor  # [max_blocks] int32
    tokens: list[int] = field(default_factory=list)  # every token fed so far
    num_computed: int = 0


class HybridDriver:
    def __init__(
        self,
        path,
        max_seqs: int = 4,
        max_len: int = 512,
        block_size: int = 16,
        par=None,
        dtype: torch.dtype = torch.float32,
    ):
        self.config = ModelConfig.from_pretrained(path)
        self.model, self.report = load_model(self.config, path, torch.device("cpu"), dtype, par=par)
        self.block_size = block_size
        self.blocks_per_seq = -(-max_len // block_size)
        specs = self.model.cache_specs(dtype)
        self.caches = [
            s.allocate(max_seqs * self.blocks_per_seq, block_size, max_seqs, torch.device("cpu")) for s in specs
        ]
        self.max_seqs = max_seqs
        self.free = list(range(max_seqs))

    def new_seq(self) -> Seq:
        slot = self.free.pop(0)
        start = slot * self.blocks_per_seq
        return Seq(slot, torch.arange(start, start + self.blocks_per_seq, dtype=torch.int32))

    def release(self, seq: Seq) -> None:
        self.free.append(seq.slot)

    @torch.no_grad()
    def step(self, items: list[tuple[Seq, list[int]]]) -> list[torch.Tensor]:
        """Feed ``items`` (decodes of one token first, then prefill chunks); returns per item the
        log-probs [len(tokens), V] of the next token after each fed token."""
        ids, pos, slots, prefills, state_slots = [], [], [], [], []
        n_dec = 0
        dec_tables, dec_lens = [], []
        for seq, toks in items:
            start = seq.num_computed
            p = list(range(start, start + len(toks)))
            is_decode = len(toks) == 1 and start > 0 and not prefills
            row = len(ids)
            ids += toks
            pos += p
            slots += [int(seq.block_table[q // self.block_size]) * self.block_size + q % self.block_size for q in p]
            state_slots.append(seq.slot)
            if is_decode:
                n_dec += 1
                dec_tables.append(seq.block_table)
                dec_lens.append(start + 1)
            else:
                prefills.append(PrefillChunk(row, row + len(toks), start + len(toks), seq.block_table))
            seq.tokens += toks
            seq.num_computed += len(toks)
        meta = AttentionMetadata(
            positions=torch.tensor(pos),
            slot_mapping=torch.tensor(slots),
            block_size=self.block_size,
            num_decode_tokens=n_dec,
            decode_block_tables=torch.stack(dec_tables) if dec_tables else None,
            decode_context_lens=torch.tensor(dec_lens, dtype=torch.int32) if dec_lens else None,
            decode_max_context_len=max(dec_lens, default=0),
            prefills=prefills,
            state_slots=torch.tensor(state_slots),
        )
        hidden = self.model(torch.tensor(ids), meta, self.caches)
        logp = torch.log_softmax(self.model.compute_logits(hidden), dim=-1)
        out, row = [], 0
        for _, toks in items:
            out.append(logp[row : row + len(toks)])
            row += len(toks)
        return out

    def _prefill(self, seqs, prompts: list[list[int]], budget: int | None):
        """Prefill ``prompts`` into ``seqs`` together, at most ``budget`` tokens per step (None: one
        step), earlier prompts first. Yields (prompt index, seq, log-probs [n, V]) per piece, after
        the step that computed it."""
        while any(s.num_computed < len(p) for s, p in zip(seqs, prompts)):
            left = budget if budget is not None else sum(map(len, prompts))
            items = []
            for i, (s, p) in enumerate(zip(seqs, prompts)):
                n = min(len(p) - s.num_computed, left)
                if n > 0:
                    items.append((i, s, p[s.num_computed : s.num_computed + n]))
                    left -= n
            for (i, s, _), lp in zip(items, self.step([(s, t) for _, s, t in items])):
                yield i, s, lp

    def prompt_logprobs(self, prompts: list[list[int]], budget: int | None = None) -> list[torch.Tensor]:
        """All prompts prefilled together, in chunks of at most ``budget`` tokens per step (None:
        one step). -> per prompt [L, V]."""
        seqs = [self.new_seq() for _ in prompts]
        parts: list[list[torch.Tensor]] = [[] for _ in prompts]
        for i, _, lp in self._prefill(seqs, prompts, budget):
            parts[i].append(lp)
        for s in seqs:
            self.release(s)
        return [torch.cat(p) for p in parts]

    def greedy(self, prompts: list[list[int]], n: int, budget: int | None = None) -> list[list[int]]:
        """Greedy continuations of ``n`` tokens, all prompts together (batched decodes)."""
        seqs = [self.new_seq() for _ in prompts]
        nxt = [None] * len(prompts)
        for i, s, lp in self._prefill(seqs, prompts, budget):
            if s.num_computed == len(prompts[i]):
                nxt[i] = int(lp[-1].argmax())
        outs = [[t] for t in nxt]
        for _ in range(n - 1):
            lps = self.step([(s, [o[-1]]) for s, o in zip(seqs, outs)])
            for o, lp in zip(outs, lps):
                o.append(int(lp[-1].argmax()))
        for s in seqs:
            self.release(s)
        return outs
