"""One rank's model runner: build batch tensors for a scheduled step, run the model, sample."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.layers.attn_metadata import AttentionMetadata, PrefillChunk
from engine.layers.sampler import SamplingBatch, prompt_logprobs, sample
from engine.scheduler import ScheduledSeq, SchedulerOutput

Logprobs = dict[int, float]


@dataclass
class StepResult:
    sampled: list[int | None]  # per scheduled seq; None when the chunk did not reach the end
    logprobs: list[Logprobs | None]  # per scheduled seq, for requests that asked
    # seq_id -> (position of the first token covered, log-probs of prompt tokens from there on)
    prompt_logprobs: dict[str, tuple[int, list[Logprobs]]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def release(self, seq_id: str) -> None:
        self._generators.pop(seq_id, None)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        # Decodes first (one row each, batched absorbed attention), then prefill chunks.
        decodes = [s for s in out.scheduled if not s.is_prefill]
        prefills = [s for s in out.scheduled if s.is_prefill]
        order = decodes + prefills
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        chunks: list[PrefillChunk] = []
        for s in order:
            seq = s.seq
            row = len(ids)
            ids.extend(seq.tokens_in_range(s.start, s.end))
            positions.extend(range(s.start, s.end))
            slots.extend(self._slots(seq.block_table, s.start, s.end))
            if s.is_prefill:
                chunks.append(PrefillChunk(row, row + s.num_new_tokens, s.end, self._tensor(seq.block_table, torch.int32)))
        dev = self.device
        meta = AttentionMetadata(
            positions=self._tensor(positions, torch.int64),
            slot_mapping=self._tensor(slots, torch.int64),
            block_size=self.block_size,
            num_decode_tokens=len(decodes),
            prefills=chunks,
        )
        if decodes:
            width = max(len(s.seq.block_table) for s in decodes)
            table = [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in decodes]
            meta.decode_block_tables = torch.tensor(table, dtype=torch.int32).to(dev, non_blocking=True)
            lens = [s.end for s in decodes]
            meta.decode_context_lens = self._tensor(lens, torch.int32)
            meta.decode_max_context_len = max(lens)
        hidden = self.model(self._tensor(ids, torch.int64), meta, self.kv_caches)

        # Rows whose logits are sampled: the last row of each scheduled seq that reaches its end.
        sample_rows, sample_seqs, row = [], [], 0
        prompt_lp: dict[str, tuple[int, list[Logprobs]]] = {}
        for s in order:
            if s.do_sample:
                sample_rows.append(row + s.num_new_tokens - 1)
                sample_seqs.append(s)
            if s.is_prefill and getattr(s.seq.sampling_params, "prompt_logprobs", None) is not None:
                prompt_lp[s.seq.seq_id] = (s.start + 1, self._prompt_logprobs(hidden[row: row + s.num_new_tokens], s))
            row += s.num_new_tokens
        result = StepResult(sampled=[None] * len(order), logprobs=[None] * len(order), prompt_logprobs=prompt_lp)
        if not sample_rows:
            return self._reorder(result, order, out.scheduled)
        logits = self.model.compute_logits(hidden[self._tensor(sample_rows, torch.int64)])
        params = [s.seq.sampling_params for s in sample_seqs]
        gens = [self._generator(s.seq.seq_id, p.seed) for s, p in zip(sample_seqs, params)]
        sampled = sample(logits, SamplingBatch.build(params, gens, dev))
        tokens = sampled.token_ids.tolist()  # the one host sync of the step
        lp_rows = self._logprob_dicts(sampled, params, tokens)
        pos = {id(s): i for i, s in enumerate(order)}
        for j, s in enumerate(sample_seqs):
            result.sampled[pos[id(s)]] = tokens[j]
            result.logprobs[pos[id(s)]] = lp_rows[j]
        return self._reorder(result, order, out.scheduled)

    def _reorder(self, result: StepResult, order: list[ScheduledSeq], scheduled: list[ScheduledSeq]) -> StepResult:
        # The scheduler expects results in its own order.
        index = {id(s): i for i, s in enumerate(order)}
        result.sampled = [result.sampled[index[id(s)]] for s in scheduled]
        result.logprobs = [result.logprobs[index[id(s)]] for s in scheduled]
        return result

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[i // bs] * bs + i % bs for i in range(start, end)]

    def _tensor(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _generator(self, seq_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self._generators.get(seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._generators[seq_id] = gen
        return gen

    def _logprob_dicts(self, sampled, params, tokens: list[int]) -> list[Logprobs | None]:
        if sampled.sampled_logprobs is None:
            return [None] * len(params)
        chosen = sampled.sampled_logprobs.tolist()
        top_ids = sampled.logprob_token_ids.tolist() if sampled.logprob_token_ids is not None else None
        top_vals = sampled.logprob_values.tolist() if sampled.logprob_values is not None else None
        rows: list[Logprobs | None] = []
        for j, p in enumerate(params):
            if p.logprobs is None:
                rows.append(None)
                continue
            d = {}
            if top_ids is not None:
                d = dict(zip(top_ids[j][: p.logprobs], top_vals[j][: p.logprobs]))
            d[tokens[j]] = chosen[j]
            rows.append(d)
        return rows

    def _prompt_logprobs(self, hidden: torch.Tensor, s: ScheduledSeq) -> list[Logprobs]:
        # Row i (position start+i) predicts the token at start+i+1; only prompt tokens count.
        seq = s.seq
        k = seq.sampling_params.prompt_logprobs
        last = min(s.end, seq.num_prompt_tokens - 1)
        n = last - s.start
        if n <= 0:
            return []
        nxt = self._tensor(seq.tokens_in_range(s.start + 1, last + 1), torch.int64)
        logits = self.model.compute_logits(hidden[:n])
        actual, top_ids, top_vals = prompt_logprobs(logits, nxt, k)
        actual_l, nxt_l = actual.tolist(), nxt.tolist()
        ids_l = top_ids.tolist() if top_ids is not None else [[]] * n
        vals_l = top_vals.tolist() if top_vals is not None else [[]] * n
        return [{**dict(zip(ids_l[i], vals_l[i])), nxt_l[i]: actual_l[i]} for i in range(n)]
