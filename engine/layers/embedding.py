"""Vocabulary-parallel embedding and LM head (uneven splits when the vocabulary does not divide)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kimitui.engine.config import QuantConfig
from kimitui.engine.layers.linear import Linear
from kimitui.engine.parallel.state import SINGLE, ParallelState, split_sizes


class VocabEmbedding(nn.Module):
    param_class = "embedding"  # for the planner, see engine.registry

    def __init__(
        self, vocab_size: int, hidden_size: int, par: ParallelState = SINGLE, dtype: torch.dtype = torch.float32
    ):
        super().__init__()
        self.par = par
        self.start, self.end = par.range(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.end - self.start, hidden_size, dtype=dtype), requires_grad=False)
        if par.is_parallel:
            self.weight.full_shape = (vocab_size, hidden_size)
            self.weight.shard = (0, self.start, self.end)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.par.is_parallel:
            return F.embedding(ids, self.weight)
        # Each rank looks up the ids in its rows, zeros elsewhere; the sum over ranks is the embedding.
        mine = (ids >= self.start) & (ids < self.end)
        x = F.embedding((ids - self.start) * mine, self.weight) * mine[:, None].to(self.weight.dtype)
        return self.par.all_reduce(x)


class LMHead(Linear):
    """``lm_head.weight``, split over ranks by vocabulary rows; logits gathered on every rank."""

    param_class = "lm_head"

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        quant: QuantConfig | None,
        par: ParallelState = SINGLE,
        dtype: torch.dtype = torch.float32,
    ):
        shard = (0, *par.range(vocab_size)) if par.is_parallel else None
        super().__init__(hidden_size, vocab_size, quant, "lm_head", shard, dtype)
        self.par = par
        self.sizes = split_sizes(vocab_size, par.world_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary fp32 logits [N, V] on every rank."""
        return self.par.all_gather_last_dim(super().forward(hidden).float(), self.sizes)
