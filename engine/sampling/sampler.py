"""Vectorised per-request sampling: greedy, temperature, top-k, top-p, per-request seeds.

Sampling uses the exponential race (argmax of p / Exp(1) noise), equivalent to drawing from p,
so every row is handled in one batched op; only seeded rows draw their noise from their own
generator, which makes a seeded request's output independent of what it is batched with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kimitui.engine.sampling.penalties import PenaltyBatch


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [B] fp32; 0 = greedy
    top_p: torch.Tensor  # [B] fp32
    top_k: torch.Tensor  # [B] int64; 0 = disabled
    generators: list[torch.Generator | None]
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    max_logprobs: int  # largest k asked for by any row, -1 when none asked
    # presence / frequency / repetition penalties of the logits rows (set by the caller, which
    # knows each row's history: ``PenaltyBatch.build``); None when no row has one
    penalties: PenaltyBatch | None = None
    # [R] int64 per logits row: the token teacher forcing puts there (-1: the sampler's choice);
    # None when no row is forced
    forced: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        params: list,
        generators: list[torch.Generator | None],
        device: torch.device,
        buffers=None,
        forced: list[int] | None = None,
    ) -> "SamplingBatch":
        """``buffers``: a ``StepBuffers`` whose persistent (pinned on an accelerator) buffers carry
        the per-row values to the device without a blocking copy; None allocates fresh tensors.
        ``forced``: one entry per logits row (``SamplingParams.forced_token_ids``), -1 where free."""
        temps = [p.temperature for p in params]
        top_ks = [p.top_k for p in params]
        top_ps = [p.top_p for p in params]
        lps = [p.logprobs for p in params if p.logprobs is not None]
        if buffers is not None:
            temperature = buffers.put("temperature", temps, torch.float32)
            top_p = buffers.put("top_p", top_ps, torch.float32)
            top_k = buffers.put("top_k", top_ks, torch.int64)
        else:
            temperature = torch.tensor(temps, dtype=torch.float32, device=device)
            top_p = torch.tensor(top_ps, dtype=torch.float32, device=device)
            top_k = torch.tensor(top_ks, dtype=torch.int64, device=device)
        return cls(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            generators=generators,
            all_greedy=all(t == 0.0 for t in temps),
            use_top_k=any(k > 0 for k in top_ks),
            use_top_p=any(p < 1.0 for p in top_ps),
            max_logprobs=max(lps) if lps else -1,
            forced=(
                torch.tensor(forced, dtype=torch.int64).to(device, non_blocking=True)
                if forced is not None and any(t >= 0 for t in forced)
                else None
            ),
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprob_token_ids: torch.Tensor | None = None  # [B, k] top-k ids of the temperature-1 softmax
    logprob_values: torch.Tensor | None = None  # [B, k]
    sampled_logprobs: torch.Tensor | None = None  # [B] log-prob of the sampled token

    def to_host(self) -> tuple[list[int], list[float] | None, list[list[int]] | None, list[list[float]] | None]:
        """(token ids, sampled log-probs, top ids, top values) as Python lists, in one
        device->host copy: the step's single host sync. Everything is packed into one float64
        tensor [B, 1 (+1 +2k)]; float64 holds token ids (< 2**53) and fp32 log-probs exactly."""
        cols = [self.token_ids[:, None].double()]
        if self.sampled_logprobs is not None:
            cols.append(self.sampled_logprobs[:, None].double())
        k = 0
        if self.logprob_token_ids is not None:
            k = self.logprob_token_ids.shape[1]
            cols += [self.logprob_token_ids.double(), self.logprob_values.double()]
        rows = torch.cat(cols, dim=1).tolist()  # the one sync
        tokens = [int(r[0]) for r in rows]
        if self.sampled_logprobs is None:
            return tokens, None, None, None
        chosen = [r[1] for r in rows]
        if not k:
            return tokens, chosen, None, None
        return tokens, chosen, [[int(v) for v in r[2 : 2 + k]] for r in rows], [r[2 + k :] for r in rows]


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a [B, V] float tensor. On a CPU through numpy, whose argmax is SIMD
    vectorised: 16 us against ATen's 450 us for one Kimi-sized row (163840 logits) on a 2-core Xeon,
    1% of a decode step. Both take the first of equal maxima and count NaN as the largest."""
    if x.dim() == 2 and x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and not x.requires_grad:
        return torch.from_numpy(np.argmax(x.numpy(), axis=-1))
    return x.argmax(dim=-1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask logits outside each row's top-k / nucleus with -inf. [B, V] -> [B, V]"""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        kth = sorted_logits.gather(1, (vocab - k)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= (1 - top_p)[:, None]
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """logits: [B, V] fp32 -> sampled ids (and log-probs when any row asks for them). Penalties
    shape the draw; the log-probs are the model's own (of ``logits`` as given)."""
    raw = logits
    if batch.penalties is not None:
        logits = batch.penalties.apply(logits)
    greedy = row_argmax(logits)
    if batch.all_greedy:
        tokens = greedy
    else:
        temp = torch.where(batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature))
        scaled = logits / temp[:, None]
        if batch.use_top_k or batch.use_top_p:
            scaled = apply_top_k_top_p(
                scaled, batch.top_k if batch.use_top_k else None, batch.top_p if batch.use_top_p else None
            )
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for row, gen in enumerate(batch.generators):
            if gen is not None:
                noise[row].exponential_(generator=gen)
        sampled = row_argmax(probs / noise)
        tokens = torch.where(batch.temperature > 0, sampled, greedy)
    if batch.forced is not None:  # teacher forcing: the given token, scored by the model's own row
        tokens = torch.where(batch.forced >= 0, batch.forced, tokens)
    out = SamplerOutput(token_ids=tokens)
    if batch.max_logprobs >= 0:
        logp = raw.log_softmax(dim=-1)
        out.sampled_logprobs = logp.gather(1, tokens[:, None])[:, 0]
        if batch.max_logprobs > 0:
            top = logp.topk(batch.max_logprobs, dim=-1)
            out.logprob_values, out.logprob_token_ids = top.values, top.indices
    return out


def prompt_logprobs(logits: torch.Tensor, next_ids: torch.Tensor, k: int):
    """Log-probs of the actual next tokens [N] plus the top-k [N, k] for prompt rows."""
    logp = logits.log_softmax(dim=-1)
    actual = logp.gather(1, next_ids[:, None])[:, 0]
    if k > 0:
        top = logp.topk(k, dim=-1)
        return actual, top.indices, top.values
    return actual, None, None


def logprob_dicts(params, tokens: list[int], chosen, top_ids, top_vals) -> list[dict[int, float] | None]:
    """Per sampled row, {token id: log-prob} of its top ``p.logprobs`` plus the sampled token, from
    ``SamplerOutput.to_host``'s lists; None for rows that did not ask."""
    if chosen is None:
        return [None] * len(params)
    rows: list[dict[int, float] | None] = []
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


def prompt_logprob_dicts(logits: torch.Tensor, next_ids: list[int], k: int) -> list[dict[int, float]]:
    """{token id: log-prob} per prompt row (its top ``k`` plus the actual next token) from logits
    [N, V], read back in one device->host copy (packed as float64 [N, 1 + 2k])."""
    nxt = torch.tensor(next_ids, dtype=torch.int64).to(logits.device, non_blocking=True)
    actual, top_ids, top_vals = prompt_logprobs(logits, nxt, k)
    cols = [actual[:, None].double()] + ([top_ids.double(), top_vals.double()] if top_ids is not None else [])
    rows = torch.cat(cols, dim=1).tolist()
    return [{**{int(i): v for i, v in zip(r[1 : 1 + k], r[1 + k :])}, next_ids[n]: r[0]} for n, r in enumerate(rows)]
