"""Decode steps replayed from CUDA/HIP graphs, one graph per batch-size bucket.

A decode step of a large MoE model launches thousands of small kernels; on a GPU the host's launch
time dominates. As in vLLM (``vllm/worker/model_runner.py``, ``CUDAGraphRunner``), the decode
forward pass is captured once per batch-size bucket (1, 2, 4, 8, ... up to ``max_num_seqs``) into
a ``torch.cuda.CUDAGraph`` that reads its inputs from static buffers; a step copies its inputs into
those buffers, pads the batch to the next bucket, replays the graph and slices the output.
``EngineArgs(enforce_eager=True)`` / ``--enforce-eager`` turns this off.

Every bucket is captured at start-up (``capture_all``, largest first so the one memory pool all
graphs share is sized by the largest, as vLLM's ``capture_model`` does), on inputs made of padding
rows only, which write nothing. ``EngineArgs(lazy_graph_capture=True)`` / ``--lazy-graph-capture``
skips that (faster start, each bucket captured by the first step that needs it). A bucket whose
capture fails (an op the graph cannot hold) runs its steps with direct calls; the other buckets keep
their graphs.

Everything a captured graph reads must have a fixed address and shape, and nothing inside it may
ask the host for a value, so the decode metadata is built *inside* the captured region from the
static tensors: positions = context_len - 1, slots from the block table, and the attention
kernel's bound is the capacity ``max_blocks_per_seq * block_size`` (not the step's longest
context, which would need the host).

Padding rows repeat row 0's token, block table and context length (so attention reads only valid
blocks), but write nothing: their cache slot (``slot_mapping``) and KDA state slot are -1, which
every cache write skips (vLLM's ``PAD_SLOT_ID``). They used to write row 0's cache slot and share
one spare KDA slot; under an ordering where one padding row read the state another had just
written, its latent differed from row 0's and overwrote row 0's newest cache slot (engine/runner/graph_padding.py).

On a device other than cuda (ROCm reports cuda too) the same static-buffer / bucket / padding path
runs, with the graph replaced by a direct call of the model: that is the path tests exercise on a
CPU, and the one device emulation (``KIMITUI_EMULATE_DEVICE=1``) takes by default, as a GPU run would.

Hybrid models (Kimi Linear / K3): each row's KDA state slot is one more static buffer the graph reads
(``slots``), so a replay updates whichever slots the step's sequences hold. Padding rows and capture
warm-ups address slot -1 and count no routing statistics (engine/runner/graph_padding.py).

Host-RAM experts (``--cpu-offload``): the step is captured piecewise, cut at each MoE layer's host
join, and the host hands the rows to the CPU workers and waits for them between the segments'
replays (engine/runner/piecewise.py). A model without host experts is one segment, as before.

Emulated capture (``GraphConfig.emulate``): on the CPU, the graphs are ``EmulatedGraph`` recordings
(engine/runner/emulated_graph.py) instead of direct calls: a replay re-issues the captured launches on the
same tensors without the Python, as a GPU does, and counts as one launch in ``kernels.launch_count``.
Tests and benchmarks ask for it; the default emulated device path keeps the direct calls (a capture
runs the model three times, slow under the Triton interpreter).

Tensor parallel: every rank runs this runner on the same inputs (the workers mirror each step), so
every rank pads to the same bucket, captures the same bucket at the same step and replays the same
graph; the collectives are captured inside it, as vLLM does with NCCL. On gloo (CPU ranks, and the
emulated device) the direct calls make the same collectives in the same order.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kimitui.engine.kv_cache.state import KDAState
from kimitui.engine.layers.attn_metadata import AttentionMetadata
from kimitui.engine.layers.moe import RoutedExperts
from kimitui.engine.offload.host_staging import HostStaging
from kimitui.engine.runner.emulated_graph import EmulatedGraph
from kimitui.engine.runner.graph_padding import PAD_SLOT, RoutingRows
from kimitui.engine.runner.piecewise import SegmentedGraph, segmented_capture
from kimitui.kernels import launch_count
from kimitui.kernels.settings import KernelSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphConfig:
    max_num_seqs: int
    max_blocks_per_seq: int
    block_size: int
    capture: bool  # True: torch.cuda.CUDAGraph; False: direct calls on the same static buffers
    emulate: bool = False  # with capture False: EmulatedGraph recordings on the CPU (engine/runner/emulated_graph.py)

    def __post_init__(self) -> None:
        if self.capture and self.emulate:
            raise ValueError("GraphConfig: capture (CUDA/HIP graphs) and emulate (CPU recordings) exclude each other")
        if self.max_num_seqs < 1 or self.max_blocks_per_seq < 1 or self.block_size < 1:
            raise ValueError(
                f"GraphConfig: max_num_seqs ({self.max_num_seqs}), max_blocks_per_seq "
                f"({self.max_blocks_per_seq}) and block_size ({self.block_size}) must be >= 1"
            )

    @property
    def max_context_len(self) -> int:
        """The attention bound every captured step uses: what a full block table holds."""
        return self.max_blocks_per_seq * self.block_size


def default_decode_graphs(device: torch.device) -> bool:
    """Whether decode-only steps go through ``DecodeGraphRunner`` unless told: on a cuda/rocm device
    (captured), and on a CPU that emulates one (``KIMITUI_EMULATE_DEVICE=1``: the same static-buffer
    path with direct calls, so the emulation takes the branch a GPU run takes)."""
    return device.type == "cuda" or (device.type == "cpu" and KernelSettings.from_env().emulate_device)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Powers of two below ``max_num_seqs``, then ``max_num_seqs`` itself: 1, 2, 4, ..., 48 for 48."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return out + [max_num_seqs]


def bucket_for(n: int, buckets: list[int]) -> int:
    """The smallest bucket holding ``n`` rows."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"a decode batch of {n} sequences exceeds the largest graph bucket ({buckets[-1]})")


class DecodeGraphRunner:
    """The decode forward pass on static buffers [max_num_seqs, ...], per bucket."""

    def __init__(self, model, kv_caches: list, cfg: GraphConfig, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.cfg = cfg
        self.device = device
        if cfg.capture and device.type != "cuda":
            raise ValueError(f"graph capture needs a cuda/rocm device, got {device}")
        if cfg.emulate and (device.type != "cpu" or not KernelSettings.from_env().emulate_device):
            # the C++ CPU kernels are pybind calls a recording does not see: only the emulated device
            # path (Triton kernels and ATen ops, all recorded) can be replayed faithfully
            raise ValueError(
                f"emulated graph capture needs the emulated device path (KIMITUI_EMULATE_DEVICE=1) "
                f"on the CPU, got {device}"
            )
        self.buckets = batch_buckets(cfg.max_num_seqs)
        s, w = cfg.max_num_seqs, cfg.max_blocks_per_seq
        # Static inputs, written in place each step (addresses captured by the graphs).
        self.ids = torch.zeros(s, dtype=torch.int64, device=device)  # [S]
        self.tables = torch.zeros(s, w, dtype=torch.int32, device=device)  # [S, W]
        self.lens = torch.ones(s, dtype=torch.int32, device=device)  # [S], >= 1 for every row
        # Hybrid models: each row's KDA state slot; rows past the step's carry PAD_SLOT (no state).
        self.states = [c for c in kv_caches if isinstance(c, KDAState)]
        self.slots = torch.full((s,), PAD_SLOT, dtype=torch.int64, device=device) if self.states else None  # [S]
        # the step's real rows (1) and padding rows (0): which rows count routing and write a cache slot
        self.routing = RoutingRows(model, s, device)
        # MoE layers with host experts: the step is captured piecewise, cut at their joins, and their
        # copies use one pinned staging pair of the graphs' own (never reallocated once captured)
        self.host_experts = [
            m
            for m in (model.modules() if model is not None else [])
            if isinstance(m, RoutedExperts) and m.executor is not None
        ]
        self.staging = HostStaging() if self.host_experts else None
        for m in self.host_experts:
            m.graph_staging = self.staging
        self._graphs: dict[int, tuple[object, torch.Tensor]] = {}
        self.failed: dict[int, str] = {}  # bucket -> why its capture failed: its steps run direct calls
        self._pool = None  # memory pool shared by all buckets' graphs (largest captured first)
        # a model that keeps aux hidden states for an EAGLE-3 drafter (``aux_layers`` set before
        # capture): each bucket's aux buffer, which the forward allocates inside the graph's pool
        self._aux_owner = getattr(model, "model", model)
        self._aux: dict[int, torch.Tensor] = {}

    def accepts(self, num_decodes: int, num_rows: int, has_prefills: bool, stateful: bool) -> bool:
        """Whether a step can run here: decodes only, within capacity, every row kept, KDA slots only
        where the cache has KDA states."""
        return (
            not has_prefills
            and (not stateful or self.slots is not None)
            and 0 < num_decodes == num_rows
            and num_decodes <= self.cfg.max_num_seqs
        )

    def _metadata(self, b: int) -> AttentionMetadata:
        """Decode metadata for the first ``b`` static rows, computed on the device (capturable)."""
        bs = self.cfg.block_size
        lens, tables = self.lens[:b], self.tables[:b]
        pos = lens.long() - 1  # [b]: each decode writes its newest token
        rows = torch.arange(b, device=self.device)
        slots = tables[rows, pos // bs].long() * bs + pos % bs  # [b]
        slots = torch.where(self.routing.rows[:b] > 0, slots, PAD_SLOT)  # padding rows write no cache slot
        return AttentionMetadata(
            positions=pos,
            slot_mapping=slots,
            block_size=bs,
            num_decode_tokens=b,
            decode_block_tables=tables,
            decode_context_lens=lens,
            decode_max_context_len=self.cfg.max_context_len,
            state_slots=None if self.slots is None else self.slots[:b],
        )

    def _forward(self, b: int) -> torch.Tensor:
        with self.routing.installed():
            return self.model(self.ids[:b], self._metadata(b), self.kv_caches)

    def _fill(
        self, ids: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, state_slots: torch.Tensor | None, b: int
    ) -> None:
        """Copy the step's device tensors ids [n], tables [n, W'] (W' <= W), lens [n] and state_slots [n]
        (hybrid models) into the static buffers; pad rows n..b-1 with row 0's inputs and PAD_SLOT for
        their state, and mark rows 0..n-1 as the step's (routing counts, cache writes)."""
        n = ids.shape[0]
        if (state_slots is None) != (self.slots is None):
            raise ValueError(
                "a decode graph step of a hybrid model needs its state slots, and only such a step "
                f"has them (got {'none' if state_slots is None else 'slots'})"
            )
        if self.slots is not None:
            self.slots[:n].copy_(state_slots)
            if b > n:
                self.slots[n:b].fill_(PAD_SLOT)
        self.routing.set(n)
        w = tables.shape[1]
        if w > self.cfg.max_blocks_per_seq:
            raise ValueError(
                f"decode block tables are {w} blocks wide, above the graph capacity {self.cfg.max_blocks_per_seq}"
            )
        self.ids[:n].copy_(ids)
        self.tables[:n, :w].copy_(tables)
        self.lens[:n].copy_(lens)
        if b > n:
            self.ids[n:b].copy_(self.ids[:1].expand(b - n))
            self.tables[n:b].copy_(self.tables[:1].expand(b - n, -1))
            self.lens[n:b].copy_(self.lens[:1].expand(b - n))

    @torch.inference_mode()
    def run(
        self, ids: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, state_slots: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Hidden states [n, D] of a decode-only step of n rows (inputs already on the device;
        ``state_slots`` [n]: each row's KDA slot, hybrid models only)."""
        n = ids.shape[0]
        b = bucket_for(n, self.buckets)
        self._fill(ids, tables, lens, state_slots, b)
        out, aux = self._execute(n, b)
        if aux is not None:  # an EAGLE-3 drafter's aux hidden states, in the graph's static memory
            self._aux_owner.aux_hidden = aux[:n]
        return out[:n]

    def _execute(self, n: int, b: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Bucket ``b``'s forward on the filled static buffers (``n`` real rows): replayed, captured
        first if it is not yet, or called directly. -> (hidden [b, D], aux hidden states [b, ...] in
        the graph's memory when a drafter keeps them and the step replayed, else None)"""
        if not self.captures:
            return self._forward(b), None
        entry = self._graphs.get(b)
        if entry is None and b not in self.failed:
            # Not captured at start-up (``lazy_graph_capture``): captured now, on this step's own
            # (already filled) inputs; the warm-ups write nothing and count nothing (``_parked``),
            # the replay below then does.
            entry = self._try_capture(n, b)
        if entry is None:
            return self._forward(b), None
        graph, out = entry
        if isinstance(graph, SegmentedGraph):
            if self.staging is not None:
                self.staging.live_rows = n  # the host experts compute the step's rows, not the padding
            graph.replay()  # counts its own launches
        else:
            with launch_count.graph_launch("cuda"):
                graph.replay()
        return out, self._aux.get(b)

    @property
    def captures(self) -> bool:
        """Whether buckets are captured (CUDA/HIP graphs, or CPU recordings), not direct calls."""
        return self.cfg.capture or self.cfg.emulate

    def segments(self, b: int) -> int:
        """Graph segments bucket ``b`` replays (0: not captured, direct calls)."""
        entry = self._graphs.get(b)
        if entry is None:
            return 0
        return entry[0].num_segments if isinstance(entry[0], SegmentedGraph) else 1

    def capture_all(self) -> None:
        """Capture every bucket not yet captured, largest first, on padding rows only (no cache or
        state written, nothing counted). No-op without capture (CPU, emulated device unless
        ``emulate``). Every rank of a tensor-parallel group calls this at the same point: the
        collectives inside pair up."""
        if not self.captures:
            return
        self._fill_padding()
        for b in sorted(self.buckets, reverse=True):
            if b not in self._graphs and b not in self.failed:
                self._try_capture(0, b)
        log.info(
            "decode graphs captured for batch buckets %s%s",
            sorted(self._graphs),
            f"; direct calls for {sorted(self.failed)}" if self.failed else "",
        )

    def _fill_padding(self) -> None:
        """Static inputs of a step with no sequence: every row a padding row reading block 0."""
        self.ids.zero_()
        self.tables.zero_()
        self.lens.fill_(1)
        if self.slots is not None:
            self.slots.fill_(PAD_SLOT)
        self.routing.set(0)

    def _try_capture(self, n: int, b: int):
        """Capture bucket ``b`` (the step's ``n`` real rows parked meanwhile); on failure the bucket
        is marked to run direct calls and None is returned."""
        try:
            with self._parked(n, b):
                return self._capture(b)
        except Exception as e:  # an op the graph cannot hold (a host sync, a staging layout that would move)
            self.failed[b] = f"{type(e).__name__}: {e}"
            log.warning("decode graph capture of batch bucket %d failed (%s); that bucket runs eagerly", b, e)
            return None

    @contextmanager
    def _parked(self, n: int, b: int):
        """Inside: every row is a padding row (no KDA slot, no cache slot, no routing count: warm-ups
        run the model for real); after, even if the capture failed, the step's own values are back."""
        real = self.slots[:b].clone() if self.slots is not None else None
        rows = self.routing.rows.clone()  # the step's row mask (a prefix of n rows, or a verify layout's)
        if real is not None:
            self.slots[:b].fill_(PAD_SLOT)
        self.routing.set(0)
        try:
            yield
        finally:
            if real is not None:
                self.slots[:b].copy_(real)
            self.routing.rows.copy_(rows)

    def _capture(self, b: int) -> tuple[object, torch.Tensor]:
        if self.host_experts or self.cfg.emulate:
            return self._capture_segmented(b)
        # Warm-up on a side stream (lazy inits, Triton autotuning, cuBLAS workspaces) before capture.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(b)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(b)
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[b] = (graph, out)
        if getattr(self._aux_owner, "aux_layers", None) is not None:
            self._aux[b] = self._aux_owner.aux_hidden  # written by every replay, like ``out``
        log.debug("captured the decode graph of batch bucket %d", b)
        return graph, out

    def _capture_segmented(self, b: int) -> tuple[SegmentedGraph, torch.Tensor]:
        """Capture bucket ``b`` as segments cut at the host joins (one segment without host experts):
        CUDA/HIP graphs sharing the pool, or EmulatedGraph recordings on the CPU."""
        for m in self.host_experts:  # page-locked blocks are allocated before, never inside, a capture
            m.reserve_graph_staging(self.staging, self.cfg.max_num_seqs, self.device)
        if self.staging is not None:
            self.staging.frozen = True
            self.staging.clear_output()  # what the capture reads in place of the host experts' result
        if self.cfg.emulate:
            for _ in range(2):  # as on a GPU: lazy initialisations run before the capture
                self._forward(b)
            graph, out = segmented_capture(
                EmulatedGraph,
                lambda: self._forward(b),
                self.host_experts,
                kind="emulated",
                max_rows=self.cfg.max_num_seqs,
            )
        else:
            current = torch.cuda.current_stream(self.device)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(b)
            stream.synchronize()  # the warm-ups' host experts and copies are done before capturing
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with torch.cuda.stream(stream):
                graph, out = segmented_capture(
                    torch.cuda.CUDAGraph,
                    lambda: self._forward(b),
                    self.host_experts,
                    pool=self._pool,
                    kind="cuda",
                    max_rows=self.cfg.max_num_seqs,
                )
            current.wait_stream(stream)
        self._graphs[b] = (graph, out)
        if getattr(self._aux_owner, "aux_layers", None) is not None:
            self._aux[b] = self._aux_owner.aux_hidden  # written by every replay, like ``out``
        log.debug("captured the decode graph of batch bucket %d in %d segment(s)", b, graph.num_segments)
        return graph, out
