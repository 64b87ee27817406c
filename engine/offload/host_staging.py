"""Staging buffers between a device and the CPU threads that compute its host-RAM experts.

Per MoE layer with host experts, a device run moves two things: the step's hidden states plus routing
(device -> host) and the host experts' summed output (host -> device). Each is ONE copy of one
contiguous block, from or into page-locked (pinned) host memory, issued ``non_blocking``:

* in: ``x [T, D]``, ``topk_ids [T, k]`` (as int32) and ``weights [T, k]`` are concatenated as bytes on
  the device (one small kernel), copied into ``pinned_in``, and an event is recorded after the copy.
  The CPU worker waits on that event; the thread that drives the device does not, so it goes on to
  enqueue the device's own experts while the copy and the CPU work run.
* out: the worker writes its result into ``pinned_out``; the driving thread enqueues the copy to the
  device on its current stream (what follows on that stream is ordered after it, no host sync) and
  records an event that the next layer's worker waits on before it overwrites ``pinned_out``.

Before this, a layer made three blocking ``.to("cpu")`` copies (each a host sync that drained the
device queue before the device experts were even enqueued) and one blocking copy back from pageable
memory: four copies, four host syncs. Now: two copies, no host sync on the driving thread, one small
device kernel (the concatenation).

The buffers are reused by every layer and step that shares this object (layers run one after
another) and grow, never shrink, to the largest token count seen (``reserve`` sizes them up
front). Page-locking needs an accelerator build of torch; a CPU-only torch has no ``pin_memory``
and a CPU-only run needs no staging at all: the executor calls this only for device tensors.
The class itself also runs on CPU tensors (plain memory, no events), which is how its buffer logic
is tested on machines without a device.

Piecewise decode graphs (engine/runner/piecewise.py) capture the two copies inside their segments, so
the blocks must never move: the graph runner gives the executors a staging object of their own,
``frozen`` once it is reserved for the largest bucket (a later reservation that would reallocate
raises instead), stages with ``record=False`` and records the events between replays (``mark_sent``).
"""

from __future__ import annotations

import torch


class HostStaging:
    """Reusable input and output staging for one device, dtype and hidden width at a time."""

    def __init__(self):
        self.capacity = 0  # tokens both buffers hold
        self.allocations = 0  # times the buffers were (re)allocated, for tests and reports
        self._key = None  # (device, dtype, hidden, top_k) the buffers are laid out for
        self._in = self._out = None  # uint8 [capacity * in_row_bytes], dtype [capacity * hidden]
        self._in_ready = self._out_free = None  # events on the device (None for CPU tensors)
        self.frozen = False  # captured by graphs: the blocks may not be reallocated any more
        # graphs: the replayed step's real rows (the bucket's padding rows after them are not computed
        # on the host; their output rows are discarded); None: every staged row
        self.live_rows: int | None = None

    @staticmethod
    def in_row_bytes(hidden: int, top_k: int, dtype: torch.dtype) -> int:
        """Bytes per token of the input block: the hidden state, k int32 ids and k weights in ``dtype``."""
        return hidden * dtype.itemsize + top_k * (4 + dtype.itemsize)

    def reserve(self, tokens: int, device: torch.device, dtype: torch.dtype, hidden: int, top_k: int) -> None:
        """Make both buffers hold ``tokens`` tokens of this layout (no-op when they already do)."""
        key = (torch.device(device), dtype, hidden, top_k)
        if key == self._key and tokens <= self.capacity:
            return
        if (hidden * dtype.itemsize) % 4:
            # the int32 ids follow the hidden states in one byte block: their offset must be 4-aligned
            raise ValueError(f"host staging: hidden size {hidden} x {dtype} is not a multiple of 4 bytes")
        if self.frozen:
            raise ValueError(
                f"host staging is captured by decode graphs for {self.capacity} tokens of "
                f"{self._key}; {tokens} tokens of {key} would move it"
            )
        cap = max(tokens, self.capacity if key == self._key else 0)
        cap = 1 << (cap - 1).bit_length()  # powers of two: a growing prefill reallocates a few times at most
        pin = key[0].type != "cpu"
        # plain tensors even when a step (under inference mode) reserves: the worker thread, outside
        # inference mode, writes the output block in place, which an inference tensor refuses
        with torch.inference_mode(False):
            self._in = torch.empty(cap * self.in_row_bytes(hidden, top_k, dtype), dtype=torch.uint8, pin_memory=pin)
            self._out = torch.empty(cap * hidden, dtype=dtype, pin_memory=pin)
        if self._in_ready is None and pin:
            self._in_ready, self._out_free = torch.Event(key[0].type), torch.Event(key[0].type)
        self._key, self.capacity = key, cap
        self.allocations += 1

    def stage_inputs(self, x: torch.Tensor, topk_ids: torch.Tensor, weights: torch.Tensor, record: bool = True):
        """Start the one device -> host copy; -> (x, ids int32, weights) as views of the pinned block,
        valid once ``wait_inputs`` returns. ``record=False`` (inside a graph capture): the caller
        records the event after the segment's replay (``mark_sent``)."""
        t, d = x.shape
        k = topk_ids.shape[1]
        self.reserve(t, x.device, x.dtype, d, k)
        block = torch.cat(
            [
                x.reshape(-1).view(torch.uint8),
                topk_ids.to(torch.int32).reshape(-1).view(torch.uint8),
                weights.to(x.dtype).reshape(-1).view(torch.uint8),
            ]
        )
        host = self._in[: block.numel()]
        host.copy_(block, non_blocking=True)
        if self._in_ready is not None and record:
            self._in_ready.record()
        a, b = t * d * x.dtype.itemsize, t * k * 4
        return (
            host[:a].view(x.dtype).view(t, d),
            host[a : a + b].view(torch.int32).view(t, k),
            host[a + b :].view(x.dtype).view(t, k),
        )

    def wait_inputs(self) -> None:
        """Block the calling (worker) thread until the staged inputs have arrived."""
        if self._in_ready is not None:
            self._in_ready.synchronize()

    def output(self, tokens: int, wait: bool = True) -> torch.Tensor:
        """The pinned [tokens, D] block the worker writes its result into; waits (the worker thread)
        until the previous layer's copy out of it has run on the device (``wait=False``: the block
        only, as a graph capture takes it)."""
        if self._out_free is not None and wait:
            self._out_free.synchronize()
        return self._out[: tokens * self._key[2]].view(tokens, self._key[2])

    def to_device(self, host_out: torch.Tensor, device: torch.device, record: bool = True) -> torch.Tensor:
        """The one host -> device copy of the result, ordered on the current stream, no host sync.
        ``record=False`` (inside a graph capture): ``mark_sent`` records it between replays."""
        dev = torch.empty(host_out.shape, dtype=host_out.dtype, device=device)
        dev.copy_(host_out, non_blocking=True)
        if self._out_free is not None and record:
            self._out_free.record()
        return dev

    def clear_output(self) -> None:
        """Zero the whole output block: a graph capture reads it before any worker has written it (the
        host actions do not run at capture), and on the emulated device the captured ops really run,
        so uninitialised memory there would send NaN rows to the next layer's router."""
        if self._out is not None:
            self._out.zero_()

    def mark_sent(self) -> None:
        """Between graph replays, on the current stream after the segment that staged a layer's inputs
        (and, earlier in it, copied the previous layer's output out): the worker may read the inputs
        and overwrite the output block once the device gets here."""
        if self._in_ready is not None:
            self._in_ready.record()
            self._out_free.record()
