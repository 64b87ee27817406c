"""What a decode graph's padding rows and capture warm-ups may touch: nothing.

A graph step runs a bucket of ``b`` rows for ``n <= b`` sequences; rows ``n..b-1`` repeat row 0's
token, block table and context length (engine/runner/graphs.py), and before a bucket is captured the
forward pass runs twice more to warm up. None of those rows is a token, so none may leave a trace:

- Caches. Padding rows and warm-ups carry ``PAD_SLOT`` (-1) as their MLA cache slot and as their KDA
  state slot, as vLLM's kernels take ``PAD_SLOT_ID``: the cache write (kernels/triton/mla_cache_write.py)
  and the fused KDA decode (kernels/triton/kda_decode.py) skip such a row, and the PyTorch and C++ CPU
  paths drop those rows (kernels/backend.py, kernels/cpu/backend.py). A padding row's attention
  still reads row 0's valid blocks, so its (discarded) output is finite. Writing row 0's slot
  instead was not harmless: padding rows shared one spare KDA slot, so under an ordering where one
  read the state another had just written (the Triton interpreter runs programs in order; a GPU may)
  its hidden state diverged from row 0's and its latent overwrote row 0's newest cache slot for the
  rest of that sequence's life; with tensor parallel the all-reduce's order can differ per row
  and do the same in the last bits (issue 38, finding 1).
- Routing statistics (tokens per expert, which drive hottest-first expert placement at the next
  start). The routed experts count by a row mask while a graph runs (``RoutedExperts.count_rows``):
  1 for the step's real rows, 0 for padding rows and for every row during warm-ups. A replay reads
  the mask's current values, so one captured graph counts exactly the ``n`` rows of whichever step
  replays it. The same mask turns the padding rows' cache slots into ``PAD_SLOT`` on the device.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from kimitui.engine.layers.moe import RoutedExperts

PAD_SLOT = -1  # the cache / state slot of a row that writes nothing


class RoutingRows:
    """The row mask [max_rows] (int32) of the step's real rows: the routed experts count by it while a
    graph runs, and rows where it is 0 get ``PAD_SLOT`` as their cache slot."""

    def __init__(self, model, max_rows: int, device: torch.device):
        self.experts = [m for m in model.modules() if isinstance(m, RoutedExperts)] if model is not None else []
        self.rows = torch.zeros(max_rows, dtype=torch.int32, device=device)
        # row n: n ones, then zeros (the mask of a step of n sequences), so a step sets it in one copy
        ar = torch.arange(max_rows)
        self._table = (ar[None, :] < torch.arange(max_rows + 1)[:, None]).to(torch.int32).to(device)

    def set(self, n: int) -> None:
        """Count the first ``n`` rows only (0: none, as in warm-ups)."""
        self.rows.copy_(self._table[n])

    @contextmanager
    def installed(self):
        """The routed experts count by ``rows`` inside the block (eager steps count every row)."""
        for m in self.experts:
            m.count_rows = self.rows
        try:
            yield
        finally:
            for m in self.experts:
                m.count_rows = None
