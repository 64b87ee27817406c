"""LLMEngine: requests in, one scheduled step at a time, outputs out.

``step()`` reads: schedule, execute, postprocess, detokenize, report. The scheduler never sees
tensors and the runner makes no policy; this file owns request state (text, stop strings,
log-probs, timestamps).
"""

from __future__ import annotations

import itertools
import json
import logging
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.args import EngineArgs
from engine.config import ModelConfig
from engine.kv_cache.block_manager import BlockManager
from engine.kv_cache.pool import KVCachePool, MLACacheSpec, num_blocks_for_budget
from engine.loader import LoadProgress, load_model
from engine.metrics import EngineStats, ThroughputWindow
from engine.offload.placement import device_reserve_bytes, expert_placement_for
from engine.parallel.state import SINGLE
from engine.parallel.workers import WorkerGroup, WorkerSpec, free_port
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence

log = logging.getLogger(__name__)


class PromptError(ValueError):
    """A prompt the engine cannot take (empty, too long, text without a tokenizer, bad token id)."""


@dataclass
class _Request:
    seq: Sequence
    params: SamplingParams
    prompt: str | None
    metrics: RequestMetrics
    detok: object | None
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    stop_reason: str | int | None = None
    emitted_tokens: int = 0
    cumulative_logprob: float = 0.0
    finished: bool = False
    extra: dict = field(default_factory=dict)


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
        self.dtype = args.resolve_dtype(self.device, self.config.torch_dtype)
        self.max_model_len = min(args.max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        self.tokenizer = _load_tokenizer(self.model_dir)
        self.eos_token_ids = _eos_ids(self.config, self.model_dir)
        torch.manual_seed(args.seed)
        self.expert_placement = expert_placement_for(
            self.config, args.cpu_offload, self.device, args.tensor_parallel_size, self.max_model_len,
            args.max_num_seqs, args.gpu_memory_gb, args.routing_stats)
        self.workers = None
        par = SINGLE
        try:
            if args.tensor_parallel_size > 1:
                spec = WorkerSpec(str(self.model_dir), args.tensor_parallel_size, free_port(), self.device.type,
                                  str(self.dtype).removeprefix("torch."), self.max_model_len, args.block_size,
                                  self.expert_placement, max(1, torch.get_num_threads() // args.tensor_parallel_size))
                self.workers = WorkerGroup(spec)
                par = self.workers.join_as_rank0()
            t0 = time.monotonic()
            self.model, self.load_report = load_model(self.config, self.model_dir, self.device, self.dtype,
                                                      self.max_model_len, progress, par, self.expert_placement)
            self.load_seconds = time.monotonic() - t0
            self.cache_pool = self._allocate_cache()
            if self.workers is not None:
                self.workers.broadcast(self.cache_pool.num_blocks)  # workers allocate the same cache
        except BaseException:
            self.shutdown()
            raise
        self._finalizer = weakref.finalize(self, _shutdown_workers, self.workers)
        log.info("%s", self.cache_pool.describe())
        self.block_manager = BlockManager(self.cache_pool.num_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=max(args.max_num_batched_tokens, args.max_num_seqs),
            max_model_len=self.max_model_len,
            block_size=args.block_size,
            enable_chunked_prefill=args.enable_chunked_prefill,
        ), self.block_manager)
        self.runner = ModelRunner(self.model, self.cache_pool.caches, args.block_size, self.device, self.workers)
        self.requests: dict[str, _Request] = {}
        self.throughput = ThroughputWindow()
        self._ids = itertools.count()
        self.total_prompt_tokens = self.total_generation_tokens = self.num_finished = 0

    # -- capacity --------------------------------------------------------------------------
    def _allocate_cache(self) -> KVCachePool:
        a = self.args
        specs = [MLACacheSpec(dim=d, dtype=self.dtype) for d in self.model.cache_dims()]
        per_token = sum(s.bytes_per_block(1) for s in specs)
        wanted_tokens = a.kv_cache_tokens or (self.max_model_len * a.max_num_seqs + a.block_size)
        budget = wanted_tokens * per_token
        if a.gpu_memory_gb is not None or self.device.type == "cuda":
            budget = min(budget, self._device_kv_budget())
        elif a.kv_cache_tokens is None:
            # Host RAM is shared with everything else: at most 1 GiB or a tenth of what is free.
            import psutil

            budget = min(budget, 1 << 30, psutil.virtual_memory().available // 10)
        num_blocks = num_blocks_for_budget(specs, a.block_size, int(budget), a.max_num_seqs)
        min_blocks = -(-self.max_model_len // a.block_size)
        if num_blocks < 1:
            raise MemoryError(f"no memory left for the KV cache on {self.device} after loading the weights")
        if num_blocks < min_blocks:
            log.warning("KV cache holds %d tokens, less than max_model_len %d", num_blocks * a.block_size,
                        self.max_model_len)
        return KVCachePool(specs, num_blocks, a.block_size, a.max_num_seqs, self.device)

    def _device_kv_budget(self) -> int:
        # Experts kept in host RAM do not use the device budget.
        weights = sum(p.numel() * p.element_size() for n, p in self.model.named_parameters() if ".experts.host." not in n)
        reserve = device_reserve_bytes(self.device)
        if self.args.gpu_memory_gb is not None:
            left = int(self.args.gpu_memory_gb * 2**30) - weights - reserve
            if left <= 0:
                raise MemoryError(f"gpu_memory_gb={self.args.gpu_memory_gb} does not hold the weights "
                                  f"({weights / 2**30:.2f} GiB) plus a {reserve / 2**30:.0f} GiB reserve")
            return left
        free, _total = torch.cuda.mem_get_info(self.device)
        return max(0, int(free * 0.9) - reserve)

    # -- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> str:
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise PromptError(f"request id {request_id!r} is already in use")
        text, ids = self._prompt_ids(prompt)
        if len(ids) >= self.max_model_len:
            raise PromptError(f"prompt has {len(ids)} tokens; the context limit is max_model_len={self.max_model_len}")
        bad = next((t for t in ids if not 0 <= t < self.config.vocab_size), None)
        if bad is not None:
            raise PromptError(f"token id {bad} is outside the vocabulary (vocab_size={self.config.vocab_size})")
        seq = Sequence(request_id, ids, params, () if params.ignore_eos else self.eos_token_ids, arrival_time)
        self.scheduler.add(seq)
        detok = None
        if self.tokenizer is not None:
            from engine.tokenizer import IncrementalDetokenizer

            detok = IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens,
                                           keep_special_ids=params.keep_special_token_ids or ())
        req = _Request(seq, params, text, RequestMetrics(arrival_time=seq.arrival_time), detok)
        if params.logprobs is not None:
            req.logprobs = []
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        self.requests[request_id] = req
        self.total_prompt_tokens += len(ids)
        return request_id

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise PromptError("a dict prompt needs the key 'prompt_token_ids'")
            ids = prompt["prompt_token_ids"]
            text = prompt.get("prompt")
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise PromptError(f"text prompt given, but {self.model_dir} has no tokenizer files "
                                  "(tokenizer.json or tiktoken.model); pass token ids instead")
            return prompt, self.tokenizer.encode(prompt)
        else:
            ids, text = prompt, None
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise PromptError("prompt must be a str, a list of int token ids or {'prompt_token_ids': [...]}")
        if not ids:
            raise PromptError("prompt is empty: at least one token is needed")
        return text, list(ids)

    def abort_request(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.abort(request_id)
        self.runner.release(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def shutdown(self) -> None:
        """Stop tensor-parallel workers (if any); the engine is unusable afterwards."""
        _shutdown_workers(self.workers)
        self.workers = None

    def routing_stats(self) -> dict[int, list[int]]:
        return self.model.routing_stats()

    def save_routing_stats(self, path: str) -> None:
        """Tokens per expert per layer so far, for hottest-first placement at the next start."""
        from engine.offload.planner import save_routing_stats

        save_routing_stats(path, self.routing_stats())

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        now = time.monotonic()
        for s in sched.scheduled:
            m = self.requests[s.seq.seq_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
        result = self.runner.execute(sched)
        finished = self.scheduler.postprocess(sched, result.sampled)
        now = time.monotonic()
        prefill_tokens = sum(s.num_new_tokens for s in sched.scheduled if s.is_prefill)
        decode_tokens = sum(1 for s, t in zip(sched.scheduled, result.sampled) if t is not None)
        self.throughput.record(prefill_tokens, decode_tokens, now)
        outputs = []
        finished_ids = {s.seq_id for s in finished}
        for s, token, lp in zip(sched.scheduled, result.sampled, result.logprobs):
            req = self.requests.get(s.seq.seq_id)
            if req is None:
                continue
            if s.seq.seq_id in result.prompt_logprobs and req.prompt_logprobs is not None:
                start, entries = result.prompt_logprobs[s.seq.seq_id]
                if len(req.prompt_logprobs) == start:  # skip recomputed chunks after preemption
                    req.prompt_logprobs.extend(entries)
            if token is None and s.seq.seq_id not in finished_ids:
                continue
            if token is not None:
                self._on_token(req, token, lp, now)
            if s.seq.seq_id in finished_ids or req.seq.is_finished:
                self._finish(req, now)
            outputs.append(self._output(req))
        for rid in [r for r, q in self.requests.items() if q.finished]:
            del self.requests[rid]
        return outputs

    def _on_token(self, req: _Request, token: int, lp: dict | None, now: float) -> None:
        m = req.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.token_times.append(now)
        self.total_generation_tokens += 1
        if lp is not None and req.logprobs is not None:
            req.logprobs.append(lp)
            req.cumulative_logprob += lp[token]
        if req.detok is None or req.finished:
            return
        before = len(req.text)
        req.text += req.detok.add([token])
        if req.seq.is_finished:
            req.text += req.detok.flush()
        stops = req.params.stop_strings
        if stops and not req.seq.is_finished:
            self._check_stop_strings(req, stops, before)

    def _check_stop_strings(self, req: _Request, stops: tuple[str, ...], before: int) -> None:
        # Only text that could contain a new match: the tail of the old text plus the new text.
        start = max(0, before - max(len(s) for s in stops) + 1)
        hit = None
        for stop in stops:
            i = req.text.find(stop, start)
            if i >= 0 and (hit is None or i < hit[0]):
                hit = (i, stop)
        if hit is None:
            return
        i, stop = hit
        req.text = req.text[: i + (len(stop) if req.params.include_stop_str_in_output else 0)]
        req.stop_reason = stop
        self.scheduler.finish(req.seq.seq_id, "stop")

    def _finish(self, req: _Request, now: float) -> None:
        req.finished = True
        req.metrics.finished_time = now
        req.metrics.num_cached_tokens = req.seq.num_cached_tokens
        if req.stop_reason is None and req.seq.finish_reason == "stop" and req.seq.output_token_ids:
            req.stop_reason = req.seq.output_token_ids[-1]
        self.num_finished += 1
        self.runner.release(req.seq.seq_id)

    def _output(self, req: _Request) -> RequestOutput:
        seq = req.seq
        comp = CompletionOutput(
            index=0,
            text=req.text,
            token_ids=list(seq.output_token_ids),
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
            finish_reason=seq.finish_reason if req.finished else None,
            cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
            stop_reason=req.stop_reason,
        )
        return RequestOutput(
            request_id=seq.seq_id,
            prompt=req.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
            outputs=[comp],
            finished=req.finished,
            metrics=req.metrics,
        )

    # -- observability ---------------------------------------------------------------------
    def stats(self) -> EngineStats:
        prefill, decode = self.throughput.rates()
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
            total_prompt_tokens=self.total_prompt_tokens,
            total_generation_tokens=self.total_generation_tokens,
            num_finished=self.num_finished,
        )


def _shutdown_workers(workers) -> None:
    if workers is not None:
        workers.shutdown()


def _resolve_model(model: str | None) -> str:
    if model in (None, "", "demo"):
        from engine.demo import ensure_demo_checkpoint

        return str(ensure_demo_checkpoint())
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    return str(path)


def _load_tokenizer(model_dir: Path):
    from engine.tokenizer import Tokenizer, TokenizerError

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


def __getattr__(name: str):
    # DESIGN.md places AsyncLLM in this module; it lives in async_llm.py, which imports LLMEngine
    # from here, so it is resolved on first access: both import paths give the same class.
    if name == "AsyncLLM":
        from engine.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LLMEngine", "AsyncLLM", "PromptError", "LoadProgress"]
