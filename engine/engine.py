"""LLMEngine: requests in, one scheduled step at a time, outputs out.

``step()`` reads: schedule, run, process outputs. The scheduler never sees tensors, the runner
makes no policy, and the output processor (output_processor.py) owns what the user sees of a
request (text, stop strings, log-probs, timestamps, counters). This file builds the parts and
checks prompts.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
import weakref
from dataclasses import replace
from pathlib import Path

import torch

from kimitui.engine.args import EngineArgs
from kimitui.engine.config import ModelConfig
from kimitui.engine.demo import demo_checkpoint
from kimitui.engine.kv_cache.block_manager import BlockManager
from kimitui.engine.kv_cache.pool import (
    bytes_of_state,
    bytes_per_block,
    has_state,
    num_blocks_for_budget,
    snapshots_for_budget,
)
from kimitui.engine.kv_cache.state_slots import StateSlots
from kimitui.engine.metrics import EngineStats
from kimitui.engine.offload.cpu_experts import place_host_experts
from kimitui.engine.offload.numa import NumaPolicy, read_topology
from kimitui.engine.output_processor import OutputProcessor, ProcessedStep
from kimitui.engine.outputs import RequestOutput
from kimitui.engine.parallel.state import SINGLE
from kimitui.engine.parallel.workers import WorkerGroup, WorkerSpec, free_port
from kimitui.engine.plan.placement import device_reserve_bytes, expert_placement_for
from kimitui.engine.plan.routing_stats import save_routing_stats
from kimitui.engine.runner.worker import CacheShape, RankSpec, build_rank, worker_main
from kimitui.engine.sampling.fanout import FanOut, ParentRequest, child_params, fans_out
from kimitui.engine.sampling_params import SamplingParams
from kimitui.engine.scheduler.scheduler import Scheduler, SchedulerConfig
from kimitui.engine.sequence import Sequence
from kimitui.engine.spec_decode.drafter_memory import drafter_memory
from kimitui.engine.spec_decode.select import make_proposer
from kimitui.engine.spec_decode.speculation import Speculation
from kimitui.engine.structured.manager import StructuredOutputManager
from kimitui.engine.text.tokenizer import Tokenizer, TokenizerError

log = logging.getLogger(__name__)


class PromptError(ValueError):
    """A prompt the engine cannot take (empty, too long, text without a tokenizer, bad token id)."""


class LLMEngine:
    def __init__(self, args: EngineArgs, progress=None):
        self.args = args
        self.model_dir = Path(_resolve_model(args.model))
        self.config = ModelConfig.from_pretrained(self.model_dir)
        self.device = args.resolve_device()
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", 0)  # rank 0 of a tensor-parallel group is GPU 0
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL collectives run on the current device
        self.dtype = args.resolve_dtype(self.device, self.config.torch_dtype, self.config)
        self.max_model_len = min(
            args.max_model_len or self.config.max_position_embeddings, self.config.max_position_embeddings
        )
        self.speculative = args.speculative  # SpeculativeConfig or None
        self.num_spec_tokens = self.speculative.num_speculative_tokens if self.speculative else 0
        self.tokenizer = _load_tokenizer(self.model_dir)
        self.eos_token_ids = _eos_ids(self.config, self.model_dir)
        torch.manual_seed(args.seed)
        # kept back on each device for activations: one number for the expert placement and the cache
        decode_rows = args.max_num_seqs * (1 + self.num_spec_tokens)  # a verifying decode runs 1 + k rows
        self.reserve_bytes = device_reserve_bytes(
            self.config,
            self.device,
            args.tensor_parallel_size,
            max(args.max_num_batched_tokens, decode_rows),
            decode_rows,
            self.max_model_len,
            not args.enforce_eager,
        )
        self.expert_placement = expert_placement_for(
            self.config,
            args.cpu_offload,
            self.device,
            args.tensor_parallel_size,
            self.max_model_len,
            args.max_num_seqs,
            args.gpu_memory_gb,
            args.routing_stats,
            self.reserve_bytes,
        )
        self.workers = None
        self._proposer = None  # made once the target is loaded; then Speculation owns it
        self._t0 = time.monotonic()
        try:
            par = SINGLE
            if args.tensor_parallel_size > 1:
                self.workers = WorkerGroup(
                    WorkerSpec(
                        str(self.model_dir),
                        args.tensor_parallel_size,
                        free_port(),
                        self.device.type,
                        str(self.dtype).removeprefix("torch."),
                        self.max_model_len,
                        args.block_size,
                        self.expert_placement,
                        max(1, torch.get_num_threads() // args.tensor_parallel_size),
                        decode_graphs=self._decode_graphs(),
                        capture_graphs=not args.lazy_graph_capture,
                        device_base=self.device.index or 0,
                    ),
                    target=worker_main,
                )
                par = self.workers.join_as_rank0()
            rank = build_rank(
                RankSpec(
                    self.config,
                    str(self.model_dir),
                    self.device,
                    self.dtype,
                    self.max_model_len,
                    args.block_size,
                    self.expert_placement,
                    self._decode_graphs(),
                    not args.lazy_graph_capture,
                ),
                par,
                self._after_load,
                ready=lambda: self._ready(par),
                workers=self.workers,
                progress=progress,
            )
        except BaseException:
            self.shutdown()
            raise
        self._finalizer = weakref.finalize(self, _shutdown_workers, self.workers)
        self.load_report, self.cache_pool, self.runner = rank.load_report, rank.cache_pool, rank.runner
        self.runner.rejection_method = self.speculative.rejection_sample_method if self.speculative else "standard"
        log.info("%s", self.cache_pool.describe())
        self.spec = Speculation(self.speculative, self._proposer, self.max_model_len)
        slots = StateSlots(args.max_num_seqs, self.cache_pool.num_snapshots) if self.cache_pool.is_hybrid else None
        self.block_manager = BlockManager(
            self.cache_pool.num_blocks, args.block_size, args.enable_prefix_caching, slots
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=max(args.max_num_batched_tokens, args.max_num_seqs),
                max_model_len=self.max_model_len,
                block_size=args.block_size,
                enable_chunked_prefill=args.enable_chunked_prefill,
                snapshot_every_blocks=args.state_snapshot_interval // args.block_size,
                num_lookahead_slots=self.speculative.num_lookahead_slots if self.speculative else 0,
            ),
            self.block_manager,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.fanout = FanOut()  # n > 1 / best_of: requests fanned out into child sequences

    def _after_load(self, model) -> CacheShape:
        """Rank 0, once its shard is loaded: host experts split per NUMA node, the proposer made (a model
        drafter's weights load now), the cache sized from what is left (and sent to the workers, which
        allocate the same)."""
        self.model = model
        self.load_seconds = time.monotonic() - self._t0
        # host experts split per NUMA node (no-op on one node); worker ranks (tp > 1) keep one stack
        self.numa_layers, self.numa_workers = place_host_experts(model, NumaPolicy(self.args.numa), read_topology())
        if self.speculative is not None:
            # a drafter loads before the cache is sized: its weights are in memory when the cache takes the rest
            self._proposer = make_proposer(self.speculative, model, self.model_dir)
        shape = self._cache_shape()
        if self.workers is not None:
            self.workers.broadcast(shape.message())
        if hasattr(self._proposer, "bind_cache"):  # a model drafter's own KV cache, on the target's block ids
            self._proposer.bind_cache(shape.num_blocks, self.args.block_size)
        return replace(shape, keep_hidden=bool(self._proposer is not None and self._proposer.needs_hidden))

    def _ready(self, par) -> None:
        if self.workers is not None:
            self.workers.wait_ready(par, self.device)

    # speculation's proposer and counters, as tests and benchmarks reach them
    @property
    def proposer(self):
        return self.spec.proposer

    @proposer.setter
    def proposer(self, value) -> None:
        self.spec.proposer = value

    @property
    def spec_stats(self):
        return self.spec.stats

    def _decode_graphs(self) -> bool | None:
        """False when decode steps must stay eager (asked for); None lets the runner decide. Experts
        in host RAM no longer turn graphs off: the step is captured piecewise around their joins
        (engine/runner/piecewise.py)."""
        return False if self.args.enforce_eager else None

    # -- capacity --------------------------------------------------------------------------
    def _cache_shape(self) -> CacheShape:
        """How many blocks, state slots and snapshots the cache holds on every rank, from the budget
        left after loading (host RAM on the CPU)."""
        a = self.args
        specs = self.model.cache_specs(self.dtype)
        # Hybrid models: a state slot per sequence, and as many prefix snapshots again if they fit.
        wanted_snapshots = a.max_num_seqs if has_state(specs) and a.enable_prefix_caching else 0
        wanted_tokens = a.kv_cache_tokens or (self.max_model_len * a.max_num_seqs + a.block_size)
        # speculative decoding on a hybrid model: a scratch state per sequence and draft position
        spec_slots = a.max_num_seqs * self.num_spec_tokens if has_state(specs) else 0
        budget = wanted_tokens * bytes_per_block(specs, 1) + bytes_of_state(
            specs, a.max_num_seqs + wanted_snapshots + spec_slots
        )
        drafter = self._drafter_footprint()
        if a.gpu_memory_gb is not None or self.device.type == "cuda":
            # an EAGLE-3 drafter is loaded by now: on a device the free memory already lacks its weights;
            # under gpu_memory_gb its own (not the target's shared embedding / LM head) come off the budget
            budget = min(
                budget, self._device_kv_budget() - (self._drafter_weight_bytes() if a.gpu_memory_gb is not None else 0)
            )
        elif a.kv_cache_tokens is None:
            # Host RAM is shared with everything else: at most 1 GiB or a tenth of what is free.
            import psutil  # optional dependency here: the lean GPU images gpu_check runs on may lack it

            budget = min(budget, 1 << 30, psutil.virtual_memory().available // 10)
        if drafter is not None and a.kv_cache_tokens is None:
            # the drafter's KV lives on the same block ids: every block costs the target's and its bytes
            # (the state slots of a hybrid target are not blocks: they keep their share)
            per_token = bytes_per_block(specs, 1)
            state = min(budget, bytes_of_state(specs, a.max_num_seqs + wanted_snapshots + spec_slots))
            budget = state + (budget - state) * per_token // (per_token + drafter.kv_bytes_per_token)
        min_blocks = -(-self.max_model_len // a.block_size)
        # Snapshots only where they leave a max_model_len sequence its blocks (or all blocks asked for).
        snapshots = snapshots_for_budget(
            specs,
            a.block_size,
            int(budget),
            a.max_num_seqs,
            min(min_blocks, wanted_tokens // a.block_size),
            wanted_snapshots,
        )
        num_blocks = num_blocks_for_budget(specs, a.block_size, int(budget), a.max_num_seqs, snapshots + spec_slots)
        if num_blocks < 1:
            state = bytes_of_state(specs, a.max_num_seqs) / 2**30
            raise MemoryError(
                f"no memory left for the KV cache on {self.device} after loading the weights"
                + (f" (the state slots of max_num_seqs={a.max_num_seqs} take {state:.2f} GiB)" if state else "")
            )
        if num_blocks < min_blocks:
            log.warning(
                "KV cache holds %d tokens, less than max_model_len %d", num_blocks * a.block_size, self.max_model_len
            )
        return CacheShape(num_blocks, a.max_num_seqs, snapshots, spec_slots, self.num_spec_tokens)

    def _drafter_weight_bytes(self) -> int:
        """The loaded drafter's own weights (the target's shared embedding / LM head not counted)."""
        drafter = getattr(self._proposer, "drafter", None)
        return sum(p.numel() * p.element_size() for p in drafter.parameters()) if drafter is not None else 0

    def _drafter_footprint(self):
        """A model drafter's weights and KV per token (engine.spec_decode.drafter_memory, as the plan
        counts them), or None."""
        return drafter_memory(self.speculative, self.config, self.dtype.itemsize)

    def _device_kv_budget(self) -> int:
        # Experts kept in host RAM do not use the device budget.
        weights = sum(
            p.numel() * p.element_size() for n, p in self.model.named_parameters() if ".experts.host." not in n
        )
        reserve = self.reserve_bytes
        if self.args.gpu_memory_gb is not None:
            left = int(self.args.gpu_memory_gb * 2**30) - weights - reserve
            if left <= 0:
                raise MemoryError(
                    f"gpu_memory_gb={self.args.gpu_memory_gb} does not hold the weights "
                    f"({weights / 2**30:.2f} GiB) plus a {reserve / 2**30:.2f} GiB activation reserve"
                )
            return left
        free, _total = torch.cuda.mem_get_info(self.device)
        return max(0, int(free * 0.9) - reserve)

    # -- requests --------------------------------------------------------------------------
    def add_request(
        self, request_id: str | None, prompt, params: SamplingParams | None = None, arrival_time: float | None = None
    ) -> str:
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.output_processor.requests:
            raise PromptError(f"request id {request_id!r} is already in use")
        text, ids = self._prompt_ids(prompt)
        if len(ids) >= self.max_model_len:
            raise PromptError(f"prompt has {len(ids)} tokens; the context limit is max_model_len={self.max_model_len}")
        bad = next((t for t in ids if not 0 <= t < self.config.vocab_size), None)
        if bad is not None:
            raise PromptError(f"token id {bad} is outside the vocabulary (vocab_size={self.config.vocab_size})")
        eos = () if params.ignore_eos else self.eos_token_ids
        if fans_out(params):
            self._add_parent(request_id, text, ids, params, eos, arrival_time)
            return request_id
        if self.fanout.in_use(request_id):
            raise PromptError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, ids, params, eos, arrival_time)
        self._add_grammars([seq])  # compiled here, so a bad schema fails this request only
        try:
            self.scheduler.add(seq)
            self.output_processor.add_request(seq, params, text)
        except BaseException:
            self.runner.release(request_id)
            raise
        return request_id

    def _add_grammars(self, seqs: list[Sequence]) -> None:
        """A grammar matcher for each constrained sequence (each sample of a request its own)."""
        for seq in seqs:
            spec = seq.sampling_params.structured_outputs
            if spec is not None:
                try:
                    self._structured().add(seq.seq_id, spec, [*seq.eos_token_ids, *seq.sampling_params.stop_token_ids])
                except BaseException:
                    for s in seqs:
                        self.runner.release(s.seq_id)
                    raise

    def _structured(self):
        """The runner's grammar masks (engine/structured), made on the first constrained request."""
        if self.runner.structured is None:
            if self.tokenizer is None:
                raise PromptError(f"structured outputs need tokenizer files, and {self.model_dir} has none")

            self.runner.structured = StructuredOutputManager(self.tokenizer, self.config.vocab_size, self.device)
        return self.runner.structured

    def _add_parent(self, request_id: str, text, ids: list[int], params: SamplingParams, eos, arrival_time) -> None:
        """Fan a request for several samples out into child sequences (engine/sampling/fanout.py)."""
        parent = ParentRequest(request_id, params, params.best_of or params.n)
        if self.fanout.in_use(request_id) or any(c in self.output_processor.requests for c in parent.child_ids):
            raise PromptError(f"request id {request_id!r} is already in use")
        seqs = [Sequence(c, ids, child_params(params, i), eos, arrival_time) for i, c in enumerate(parent.child_ids)]
        self._add_grammars(seqs)
        try:
            self.scheduler.add(seqs[0])
            self.scheduler.add_forks(seqs[0], seqs[1:])  # forked when child 0 has computed the prompt
        except BaseException:
            for seq in seqs:
                self.scheduler.abort(seq.seq_id)
                self.runner.release(seq.seq_id)
            raise
        for i, seq in enumerate(seqs):
            self.output_processor.add_request(seq, seq.sampling_params, text, count_prompt=i == 0)
        self.fanout.add(parent)

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise PromptError("a dict prompt needs the key 'prompt_token_ids'")
            ids = prompt["prompt_token_ids"]
            text = prompt.get("prompt")
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise PromptError(
                    f"text prompt given, but {self.model_dir} has no tokenizer files "
                    "(tokenizer.json or tiktoken.model); pass token ids instead"
                )
            return prompt, self.tokenizer.encode(prompt)
        else:
            ids, text = prompt, None
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise PromptError("prompt must be a str, a list of int token ids or {'prompt_token_ids': [...]}")
        if not ids:
            raise PromptError("prompt is empty: at least one token is needed")
        return text, list(ids)

    def abort_request(self, request_id: str) -> bool:
        parent = self.fanout.parent(request_id)
        if parent is not None:
            for c in reversed(parent.child_ids):  # the parked children before their leader
                self.abort_request(c)
            self.fanout.forget(parent)
            return True
        if not self.output_processor.abort_request(request_id):
            return False
        self.scheduler.abort(request_id)
        self.runner.release(request_id)
        self.spec.finish(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def request_ids(self) -> list[str]:
        """Ids of the requests added and neither finished nor aborted yet (a request fanned out
        for ``n > 1`` under its own id, not its children's)."""
        return list(dict.fromkeys(self.fanout.request_id(r) for r in self.output_processor.requests))

    def shutdown(self) -> None:
        """Stop tensor-parallel workers (if any); the engine is unusable afterwards."""
        _shutdown_workers(self.workers)
        self.workers = None

    def routing_stats(self) -> dict[int, list[int]]:
        return self.model.routing_stats()

    def save_routing_stats(self, path: str) -> None:
        """Tokens per expert per layer so far, for hottest-first placement at the next start."""
        save_routing_stats(path, self.routing_stats())

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        self.output_processor.on_scheduled(sched)
        result = self.runner.execute(sched)
        finished = self.scheduler.postprocess(sched, result.sampled)
        processed = self.output_processor.process_outputs(sched, result, finished)
        self._retire(processed)
        self.spec.after_step(sched, result, processed.finished, self.scheduler.running)
        return self.fanout.join(processed.outputs)

    def _retire(self, processed: ProcessedStep) -> None:
        for rid in processed.stop:  # stop strings are found in text, after the scheduler's checks
            self.scheduler.finish(rid, "stop")
        for rid in processed.finished:
            self.runner.release(rid)

    # -- observability ---------------------------------------------------------------------
    def stats(self) -> EngineStats:
        out = self.output_processor
        prefill, decode = out.throughput.rates()
        bm = self.block_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=bm.usage,
            prefix_cache_hit_rate=bm.prefix_cache_hit_rate,
            prefill_tokens_per_s=prefill,
            decode_tokens_per_s=decode,
            num_preemptions=self.scheduler.num_preemptions,
            kv_cache_capacity_tokens=self.cache_pool.capacity_tokens(),
            total_prompt_tokens=out.total_prompt_tokens,
            total_generation_tokens=out.total_generation_tokens,
            num_finished=out.num_finished,
            computed_prompt_tokens=out.total_computed_prompt_tokens,
            prefix_cache_queries=bm.num_prefix_query_tokens,
            prefix_cache_hits=bm.num_prefix_hit_tokens,
            spec_decode=self.spec.stats.copy() if self.spec.enabled else None,
        )


def _shutdown_workers(workers) -> None:
    if workers is not None:
        workers.shutdown()


def _resolve_model(model: str | None) -> str:
    if model in (None, "", "demo", "demo-k3"):
        return str(demo_checkpoint(model))
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    return str(path)


def _load_tokenizer(model_dir: Path):
    if not ((model_dir / "tokenizer.json").is_file() or (model_dir / "tiktoken.model").is_file()):
        return None
    try:
        return Tokenizer.from_pretrained(model_dir)
    except TokenizerError as e:
        log.warning("tokenizer not loaded: %s", e)
        return None


def _eos_ids(config: ModelConfig, model_dir: Path) -> tuple[int, ...]:
    ids = list(config.eos_token_ids)
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError:
            eos = None
        for t in eos if isinstance(eos, list) else [eos]:
            if isinstance(t, int) and t not in ids:
                ids.append(t)
    return tuple(ids)


__all__ = ["LLMEngine", "PromptError"]
