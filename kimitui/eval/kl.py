"""KL divergence of a serving path against a reference path, position by position.

What is measured follows llama.cpp's ``--kl-divergence`` (tools/perplexity/perplexity.cpp): at each
scored position the reference distribution P and the tested one Q over the whole vocabulary give

- KL(P || Q) = sum_v P(v) (log P(v) - log Q(v)); its mean, percentiles and maximum over positions;
- "same top p": the share of positions where argmax P == argmax Q (llama.cpp's name for top-1
  agreement; both keys are reported and are the same number);
- Δp = Q(t) - P(t) of the actual next token t, and the perplexities of both paths on the tokens.

Each term is summed as p (log p - log q) - p + q, which adds sum q - sum p (zero for two normalised
distributions, so the value is the same KL) and makes every term >= 0: float32 rows that agree to
rounding give 0 to rounding, never a negative KL.

When only the top-k of one side is known (a reference file saved with ``--base-top-k``, or a remote
server's top-k log-probs) the sum runs over the tokens both sides know plus one bucket holding the
rest of each distribution's mass. Merging tokens never increases KL, so this is a lower bound of the
full-vocabulary KL, exact when the rest carries no mass; the report says it is an approximation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class Dist:
    """Log-probs of ``n`` consecutive positions. Dense: ``values`` [n, V] and ``ids`` None. Sparse:
    ``values`` / ``ids`` [n, k], each row's top-k (any order). ``token_logprobs`` [n]: log-prob of
    the actual next token; ``top1`` [n]: the most likely token."""

    values: torch.Tensor
    ids: torch.Tensor | None
    token_logprobs: torch.Tensor
    top1: torch.Tensor

    @classmethod
    def dense(cls, logprobs: torch.Tensor, next_tokens: torch.Tensor) -> Dist:
        logprobs = logprobs.float()
        tok = logprobs.gather(1, next_tokens.long()[:, None])[:, 0]
        return cls(logprobs, None, tok, logprobs.argmax(dim=-1))

    @property
    def is_dense(self) -> bool:
        return self.ids is None

    def __len__(self) -> int:
        return self.values.shape[0]

    def slice(self, a: int, b: int) -> Dist:
        ids = None if self.ids is None else self.ids[a:b]
        return Dist(self.values[a:b], ids, self.token_logprobs[a:b], self.top1[a:b])

    def top_k(self, k: int) -> Dist:
        """The same positions keeping each row's ``k`` most likely tokens (``k`` >= V: unchanged)."""
        if not self.is_dense or k >= self.values.shape[1]:
            return self
        top = self.values.topk(k, dim=-1)
        return Dist(top.values, top.indices, self.token_logprobs, self.top1)


def kl_per_position(p: Dist, q: Dist) -> tuple[torch.Tensor, bool]:
    """KL(P || Q) [n] float64 and whether it is the top-k approximation (see the module doc)."""
    if len(p) != len(q):
        raise ValueError(f"the reference has {len(p)} positions and the tested path {len(q)}")
    if p.is_dense and q.is_dense:
        if p.values.shape != q.values.shape:
            raise ValueError(f"vocabulary sizes differ: reference {p.values.shape[1]}, tested {q.values.shape[1]}")
        return _kl_terms(p.values.double(), q.values.double()).sum(dim=-1), False
    if q.is_dense:  # sparse reference: both known on its top-k
        lp, lq, known = p.values.double(), q.values.gather(1, p.ids.long()).double(), None
    elif p.is_dense:  # sparse tested path (a remote server): both known on its top-k
        lp, lq, known = p.values.gather(1, q.ids.long()).double(), q.values.double(), None
    else:  # both sparse: the tokens in both top-k lists
        match = p.ids.long()[:, :, None] == q.ids.long()[:, None, :]  # [n, kp, kq]
        known = match.any(dim=2)
        lp = p.values.double()
        lq = torch.where(known, (match.double() * q.values.double()[:, None, :]).sum(dim=2), 0.0)
    mask = torch.ones_like(lp, dtype=torch.bool) if known is None else known
    terms = torch.where(mask, _kl_terms(lp, lq), 0.0).sum(dim=-1)
    p_rest = (1 - torch.where(mask, lp.exp(), 0.0).sum(dim=-1)).clamp(min=0.0)
    q_rest = (1 - torch.where(mask, lq.exp(), 0.0).sum(dim=-1)).clamp(min=0.0)
    # the bucket of everything else: p_rest log(p_rest / q_rest), 0 when p_rest is 0
    safe_q = q_rest.clamp(min=1e-30)
    bucket = torch.where(p_rest > 0, p_rest * (p_rest.clamp(min=1e-30).log() - safe_q.log()), 0.0) - p_rest + q_rest
    return terms + bucket, True


def _kl_terms(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """p (log p - log q) - p + q per element (>= 0); log-probs of -inf (p = 0) contribute q."""
    p, q = lp.exp(), lq.exp()
    diff = torch.where(p > 0, lp - lq, 0.0)
    return p * diff - p + q


@dataclass
class PathStats:
    """Running sums over the positions of one path (prefill or decode), as llama.cpp keeps them."""

    kl: list[torch.Tensor] = field(default_factory=list)
    p_diff: list[torch.Tensor] = field(default_factory=list)
    nll: float = 0.0
    nll_base: float = 0.0
    same_top: int = 0
    count: int = 0
    approximate: bool = False

    def add(self, p: Dist, q: Dist) -> None:
        kl, approx = kl_per_position(p, q)
        self.approximate |= approx
        self.kl.append(kl)
        self.p_diff.append(q.token_logprobs.double().exp() - p.token_logprobs.double().exp())
        self.nll -= float(q.token_logprobs.double().sum())
        self.nll_base -= float(p.token_logprobs.double().sum())
        self.same_top += int((p.top1 == q.top1).sum())
        self.count += len(p)

    def summary(self) -> dict:
        """The numbers of this path (None where there are no positions)."""
        if not self.count:
            return {
                "positions": 0,
                "mean_kl": None,
                "p99_kl": None,
                "max_kl": None,
                "top1_agreement": None,
                "same_top_p": None,
                "approximate": self.approximate,
            }
        kl = torch.cat(self.kl)
        dp = torch.cat(self.p_diff)
        n = self.count
        same = self.same_top / n
        out = {
            "positions": n,
            "mean_kl": float(kl.mean()),
            "mean_kl_uncertainty": _uncertainty(kl),
            "p99_kl": _percentile(kl, 0.99),
            "p999_kl": _percentile(kl, 0.999),
            "p90_kl": _percentile(kl, 0.90),
            "median_kl": _percentile(kl, 0.5),
            "max_kl": float(kl.max()),
            "min_kl": float(kl.min()),
            "top1_agreement": same,
            "same_top_p": same,
            "same_top_p_uncertainty": math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0,
            "mean_delta_p": float(dp.mean()),
            "rms_delta_p": float(dp.pow(2).mean().sqrt()),
            "max_abs_delta_p": float(dp.abs().max()),
            "ppl": math.exp(self.nll / n),
            "ppl_base": math.exp(self.nll_base / n),
            "approximate": self.approximate,
        }
        return out


def _percentile(values: torch.Tensor, fraction: float) -> float:
    """llama.cpp's interpolated percentile of the sorted values."""
    v = values.sort().values
    p = fraction * (len(v) - 1)
    i = int(p)
    p -= i
    return float((1 - p) * v[i] + p * v[min(i + 1, len(v) - 1)])


def _uncertainty(values: torch.Tensor) -> float:
    n = len(values)
    if n <= 10:
        return 0.0
    mean = float(values.mean())
    var = float(values.pow(2).mean()) - mean * mean
    return math.sqrt(var / (n - 1)) if var > 0 else 0.0


@dataclass
class KLReport:
    """Prefill-path and decode-path statistics, and both together."""

    prefill: PathStats = field(default_factory=PathStats)
    decode: PathStats = field(default_factory=PathStats)

    def add(self, path: str, p: Dist, q: Dist) -> None:
        if path not in ("prefill", "decode"):
            raise ValueError(f"path must be prefill or decode, got {path!r}")
        (self.prefill if path == "prefill" else self.decode).add(p, q)

    def summary(self) -> dict:
        both = PathStats(
            self.prefill.kl + self.decode.kl,
            self.prefill.p_diff + self.decode.p_diff,
            self.prefill.nll + self.decode.nll,
            self.prefill.nll_base + self.decode.nll_base,
            self.prefill.same_top + self.decode.same_top,
            self.prefill.count + self.decode.count,
            self.prefill.approximate or self.decode.approximate,
        )
        out = both.summary()
        out["prefill"] = self.prefill.summary()
        out["decode"] = self.decode.summary()
        return out


def format_report(summary: dict, title: str) -> str:
    """The statistics as llama.cpp prints them, one block per path that has positions."""
    lines = [title]
    if summary.get("approximate"):
        lines.append(
            "note: top-k log-probs on one side: KL over the known tokens plus one bucket for the rest "
            "(an approximation, a lower bound of the full-vocabulary KL)"
        )
    for name, s in (("prefill path", summary["prefill"]), ("decode path", summary["decode"]), ("all", summary)):
        if not s["positions"]:
            lines += ["", f"====== {name}: no positions ======"]
            continue
        pct = 100.0
        lines += [
            "",
            f"====== KL divergence statistics: {name}, {s['positions']} positions ======",
            f"Mean    KLD: {s['mean_kl']:10.6f} ± {s['mean_kl_uncertainty']:10.6f}",
            f"Maximum KLD: {s['max_kl']:10.6f}",
            f"99.9%   KLD: {s['p999_kl']:10.6f}",
            f"99.0%   KLD: {s['p99_kl']:10.6f}",
            f"90.0%   KLD: {s['p90_kl']:10.6f}",
            f"Median  KLD: {s['median_kl']:10.6f}",
            f"Minimum KLD: {s['min_kl']:10.6f}",
            f"Mean PPL(Q)   : {s['ppl']:10.6f}",
            f"Mean PPL(base): {s['ppl_base']:10.6f}",
            f"Mean    Δp: {pct * s['mean_delta_p']:6.3f} %",
            f"Maximum |Δp|: {pct * s['max_abs_delta_p']:6.3f} %",
            f"RMS Δp    : {pct * s['rms_delta_p']:6.3f} %",
            f"Same top p: {pct * s['same_top_p']:6.3f} ± {pct * s['same_top_p_uncertainty']:5.3f} %",
        ]
    return "\n".join(lines)
