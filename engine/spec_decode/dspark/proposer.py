"""DSpark block drafting over a Kimi K3 / Kimi Linear target (vLLM's ``v1/spec_decode/dspark.py``).

After every step the engine hands over the target's tapped hidden states of the rows that became
part of a sequence (``StepHidden``: a prefill chunk's rows; a verified decode's token and its
accepted drafts). The drafter folds them into its per-layer latent context at those positions, in
its own paged cache on the target's block ids (rows at positions a rejected draft once held are
simply overwritten when the accepted token's row arrives). Then one block pass per step drafts for
every sequence that decodes next: the anchor (the token just sampled, position p + 1) and
``num_speculative_tokens - 1`` mask rows, non-causal over the block and the context 0..p; the Markov
head picks the drafts left to right, greedily or, under ``draft_sample_method: "probabilistic"``, by
sampling each from the request's own distribution (temperature, top-k, top-p).

Verification is the engine's usual step: drafts are verified as the chain they are; sampled drafts
come with the distributions q they were drawn from (``draft_probs``, which the engine passes to the
rejection sampler: accept x with min(1, p(x) / q(x)), else draw from max(0, p - q)). With
``backoff`` on (the default) the confidence head also cuts each block where the expected gain of the
next draft falls under ``dspark.MIN_PREDICTED_GAIN``. KDA state rollback is the runner's, as for
every proposer.

Host syncs: one per ``propose`` (the drafts and their lengths, read back together).
"""

from __future__ import annotations

import torch

from kimitui.engine.sequence import Sequence
from kimitui.engine.spec_decode.dspark.attention import PagedContext
from kimitui.engine.spec_decode.dspark.loader import load_dspark
from kimitui.engine.spec_decode.dspark.model import DSparkDrafter, confident_length
from kimitui.engine.spec_decode.proposer import StepHidden
from kimitui.kernels.select import attach_backends
from kimitui.kernels.settings import KernelSettings


class DSparkProposer:
    needs_hidden = True

    def __init__(self, config, target, model_dir=None, settings=None):
        """``config``: the SpeculativeConfig (``model`` = drafter directory); ``target``: the loaded Kimi
        K3 / Kimi Linear model, whose taps are switched on here; its embedding and LM head are shared."""
        if not hasattr(target, "set_aux_hidden_layers") or not hasattr(target.config, "attn_res_block_size"):
            raise ValueError(
                f"speculative_config: dspark needs a Kimi K3 / Kimi Linear target, got {type(target).__name__}"
            )
        par = getattr(target, "par", None)
        if par is not None and par.is_parallel:
            raise ValueError("speculative_config: method 'dspark' needs tensor_parallel_size 1 here")
        weight = target.model.norm.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.block = config.num_speculative_tokens
        self.probabilistic = config.draft_sample_method == "probabilistic"
        self.drafter: DSparkDrafter = load_dspark(config.model, target.config, self.device, self.dtype)
        self.drafter.share(target.model.embed_tokens, target.lm_head)
        self.use_confidence = bool(config.backoff) and self.drafter.confidence_head is not None
        attach_backends(
            self.drafter, self.device, self.dtype, KernelSettings.from_env() if settings is None else settings
        )
        # the block pass reads the context cache in place (False: a gathered copy, the fallback; tests
        # and benchmarks/spec/dspark_context.py compare the two)
        self.paged_context = True
        self.cache_dtype = None if config.kv_cache_dtype == "auto" else getattr(torch, config.kv_cache_dtype)
        cfg = self.drafter.config
        target.set_aux_hidden_layers(cfg.capture_ids, cfg.aux_hidden_stream)
        self.cache: torch.Tensor | None = None
        self.block_size = 0
        self._filled: dict[str, int] = {}  # seq_id -> positions 0..n-1 hold context KV
        self._finished: set[str] = set()
        self._generators: dict[str, torch.Generator] = {}
        # seq_id -> [block, V]: the distributions this step's sampled drafts were drawn from; the
        # engine hands them to the verification (taken by the engine after each propose)
        self.draft_probs: dict[str, torch.Tensor] = {}

    def bind_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate the drafter's context cache for the target's ``num_blocks`` blocks of ``block_size``."""
        self.cache = self.drafter.allocate_cache(num_blocks, block_size, self.device, self.cache_dtype)
        self.block_size = block_size
        # [layers, slots, width]: each layer's latents as the paged attention reads them
        self._flat = self.cache.view(self.cache.shape[0], -1, self.cache.shape[-1])

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """(source, destination) block copies of the target's cache: the drafter's context follows."""
        if self.cache is None or not pairs:
            return
        idx = torch.tensor(pairs, dtype=torch.int64, device=self.device)
        self.cache.index_copy_(1, idx[:, 1], self.cache.index_select(1, idx[:, 0]))

    def finish(self, seq_id: str) -> None:
        self._filled.pop(seq_id, None)
        self._generators.pop(seq_id, None)
        self._finished.add(seq_id)

    def _slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(seq.block_table, dtype=torch.int64)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.device)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], max_drafts: list[int], hidden: StepHidden | None = None) -> list[list[int]]:
        if self.cache is None:
            raise RuntimeError("DSparkProposer: bind_cache was not called (the engine does it after the KV cache)")
        if hidden is not None and hidden.spans:
            self._absorb(hidden)
        self._finished.clear()
        return self._draft(seqs, max_drafts)

    def _absorb(self, hidden: StepHidden) -> None:
        """The context latents of the step's rows, written at their positions (all sequences at once)."""
        picks, positions, slots = [], [], []
        for sid, (first, n, pos0) in hidden.spans.items():
            seq = hidden.seqs.get(sid)
            if sid in self._finished or seq is None or len(seq.block_table) * self.block_size < pos0 + n:
                continue
            picks.append(torch.arange(first, first + n))
            positions.append(torch.arange(pos0, pos0 + n))
            slots.append(self._slots(seq, pos0, pos0 + n))
            self._filled[sid] = pos0 + n
        if not picks:
            return
        rows = torch.cat(picks).to(self.device)
        pos = torch.cat(positions).to(self.device)
        feats = self.drafter.context_features(hidden.aux.index_select(0, rows))
        lat = self.drafter.context_latents(feats, pos)  # [T, layers, width]
        self._flat.index_copy_(1, torch.cat(slots), lat.transpose(0, 1).to(self.cache.dtype))

    def _draft(self, seqs: list[Sequence], max_drafts: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in seqs]
        live, anchors, firsts = [], [], []
        for i, (seq, k) in enumerate(zip(seqs, max_drafts)):
            first = seq.num_tokens - 1  # the anchor's position: the token just sampled
            if k < 1 or first < 1 or self._filled.get(seq.seq_id) != first:
                continue  # nothing drafted from the last verified position (e.g. preempted since)
            live.append(i)
            anchors.append(seq.last_token_id)
            firsts.append(first)
        if not live:
            return out
        tables = [seqs[i].block_table for i in live]
        firsts_t = torch.tensor(firsts, device=self.device)
        anchor_t = torch.tensor(anchors, dtype=torch.int64, device=self.device)
        bs, k = self.block_size, self.block
        if self.paged_context and all(len(t) * bs >= f + k for t, f in zip(tables, firsts)):
            hidden = self.drafter.block_hidden(anchor_t, firsts_t, self._paged(tables, firsts), None, k)
        else:
            context, valid = self._gathered(tables, firsts)
            hidden = self.drafter.block_hidden(anchor_t, firsts_t, context, valid, k)
        temps = top_k = top_p = gens = None
        if self.probabilistic:
            params = [seqs[i].sampling_params for i in live]
            temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=self.device)
            if any(p.top_k > 0 for p in params):
                top_k = torch.tensor(
                    [p.top_k if p.top_k > 0 else self.drafter.config.vocab_size for p in params], device=self.device
                )
            if any(p.top_p < 1.0 for p in params):
                top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=self.device)
            gens = [self._generator(seqs[i].seq_id, p.seed) for i, p in zip(live, params)]
        blk = self.drafter.draft(hidden, anchor_t, temps, top_k, top_p, gens)
        lengths = torch.tensor([min(max_drafts[i], self.block) for i in live], device=self.device)
        if self.use_confidence and blk.confidence is not None:
            lengths = torch.minimum(lengths, confident_length(blk.confidence))
        flat_out = torch.cat((lengths, blk.tokens.reshape(-1))).tolist()  # the one host sync
        n = len(live)
        self.draft_probs.clear()
        for a, i in enumerate(live):
            out[i] = flat_out[n + a * self.block : n + a * self.block + flat_out[a]]
            if blk.probs is not None and seqs[i].sampling_params.temperature > 0:
                self.draft_probs[seqs[i].seq_id] = blk.probs[a]
        return out

    def _paged(self, tables: list[list[int]], firsts: list[int]) -> PagedContext:
        """The paged cache as the block pass reads it in place: block row j of a sequence whose anchor
        is at position f writes its latent at position f + j and sees positions 0 .. f + K - 1."""
        bs, k = self.block_size, self.block
        width = max(-(-(f + k) // bs) for f in firsts)
        blocks = torch.zeros(len(tables), width, dtype=torch.int32)
        for r, (table, f) in enumerate(zip(tables, firsts)):
            used = table[: -(-(f + k) // bs)]
            blocks[r, : len(used)] = torch.tensor(used, dtype=torch.int32)
        pos = torch.tensor(firsts)[:, None] + torch.arange(k)[None]  # [S, K]
        slots = blocks.long().gather(1, pos // bs) * bs + pos % bs
        lens = torch.tensor([f + k for f in firsts], dtype=torch.int32).repeat_interleave(k)
        host = torch.cat((slots.reshape(-1), lens.long(), blocks.repeat_interleave(k, 0).reshape(-1).long()))
        dev = host.to(self.device)  # one copy
        n = len(firsts) * k
        return PagedContext(
            self._flat,
            dev[2 * n :].view(n, width).to(torch.int32),
            dev[n : 2 * n].to(torch.int32),
            max(firsts) + k,
            bs,
            dev[:n],
        )

    def _gathered(self, tables: list[list[int]], firsts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of every sequence's context [S, C, layers, width], padded to the longest (padding
        reads slot 0, masked out by ``valid`` [S, C])."""
        width, bs = max(firsts), self.block_size
        blocks = torch.zeros(len(tables), -(-width // bs), dtype=torch.int64)
        for r, table in enumerate(tables):
            used = table[: -(-width // bs)]
            blocks[r, : len(used)] = torch.tensor(used, dtype=torch.int64)
        pos = torch.arange(width)
        slots = (blocks[:, pos // bs] * bs + pos % bs).to(self.device)  # [S, C]
        valid = pos.to(self.device)[None, :] < torch.tensor(firsts, device=self.device)[:, None]
        context = self._flat.index_select(1, slots.reshape(-1))  # [layers, S * C, width]
        return context.view(context.shape[0], len(tables), width, -1).permute(1, 2, 0, 3), valid

    def _generator(self, seq_id: str, seed: int | None) -> torch.Generator | None:
        """A seeded request's own draft stream (drafts never touch the verification's generator)."""
        if seed is None:
            return None
        gen = self._generators.get(seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed ^ 0x5D5A)
            self._generators[seq_id] = gen
        return gen
