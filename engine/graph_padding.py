"""What a decode graph's padding rows and capture warm-ups may touch: a spare KDA state slot, and
no routing statistics.

A graph step runs a bucket of ``b`` rows for ``n <= b`` sequences; rows ``n..b-1`` repeat row 0
(engine/graph_runner.py), and before a bucket is captured the forward pass runs twice more to warm
up. Repeating row 0 is harmless for the paged MLA cache (the same value lands in the same slot), but
not for two other things a row touches:

- KDA state. A decode reads its slot's state and writes the updated state back in place (fla-core's
  ``fused_recurrent_kda`` with ``ssm_state_indices`` on a GPU; the gather/scatter of kernels/kda.py
  elsewhere). A padding row naming row 0's slot would race with row 0: a program that starts after
  row 0's program stored reads the updated state and stores it updated twice. Warm-ups would advance
  every real slot twice. So every KDA state gets one spare slot past the scheduler's, which padding
  rows and warm-ups address. (vLLM's own copies of these kernels skip a ``PAD_SLOT_ID`` of -1;
  fla-core 0.6 has no such skip, so the padding rows need a real row of the pool.) Each graph step
  first copies row 0's state into the spare slot: a padding row must compute exactly what row 0
  computes, since its MLA layers write row 0's cache slot (a padding row with another state would
  write another latent there). Warm-ups write those MLA slots with other values, which the replay
  rewrites before any layer reads them (each layer writes its latents, then attends).
- Routing statistics (tokens per expert, which drive hottest-first expert placement at the next
  start). Padding rows and warm-ups are not tokens. The routed experts count by a row mask while a
  graph runs (``RoutedExperts.count_rows``): 1 for the step's real rows, 0 for padding rows and for
  every row during warm-ups. A replay reads the mask's current values, so one captured graph counts
  exactly the ``n`` rows of whichever step replays it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from kimitui.engine.kv_cache.state import KDAState
from kimitui.engine.layers.moe import RoutedExperts


def add_padding_slot(states: list[KDAState]) -> int | None:
    """Give every KDA state one spare slot (once; later calls reuse it) and return its id, or None
    without KDA layers. Call before any graph is captured: the state tensors are reallocated, one
    layer at a time (so the transient cost is one layer's state, not the cache's)."""
    if not states:
        return None
    pads = {getattr(s, "pad_slot", None) for s in states}
    if len(pads) == 1 and None not in pads:
        return pads.pop()
    if pads != {None} or len({s.num_slots for s in states}) != 1:
        raise ValueError(f"KDA states disagree on their slots ({sorted({s.num_slots for s in states})} slots, "
                         f"padding slots {pads}): every layer must index the same slot ids")
    pad = states[0].num_slots
    for s in states:
        s.recurrent, s.conv = _grow(s.recurrent), _grow(s.conv)
        s.pad_slot = pad
    return pad


def _grow(t: torch.Tensor) -> torch.Tensor:
    out = t.new_zeros((t.shape[0] + 1, *t.shape[1:]))
    out[:-1].copy_(t)
    return out


class RoutingRows:
    """The row mask [max_rows] (int32) the routed experts count by while a graph runs."""

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
