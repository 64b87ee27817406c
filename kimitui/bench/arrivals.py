"""When requests are issued: open-loop arrivals, closed-loop concurrency caps, warm-ups.

Arrival times are a pure function of (n, rate, burstiness, seed) so they can be tested
without a clock; `dispatch` only sleeps until each precomputed offset.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from kimitui.bench.clients import RequestFuncOutput
from kimitui.bench.workload import SampleRequest

SendFn = Callable[[SampleRequest, str], Awaitable[RequestFuncOutput]]
DoneFn = Callable[[RequestFuncOutput], None]


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds after the start at which each of `n` requests is issued.

    vLLM's get_request: rate inf -> all at 0; else gaps ~ Gamma(shape=burstiness,
    scale=1/(rate*burstiness)) (exponential, i.e. Poisson arrivals, at burstiness 1),
    cumulated, then rescaled so the last arrival lands exactly at n/rate. vLLM draws from
    the global numpy RandomState seeded with --seed; a private RandomState(seed) gives the
    same stream without touching global state.
    """
    if n < 1:
        return []
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = [1.0 / request_rate] * n
    else:
        rs = np.random.RandomState(seed)
        theta = 1.0 / (request_rate * burstiness)
        gaps = [float(rs.gamma(shape=burstiness, scale=theta)) for _ in range(n)]
    offsets = np.cumsum(gaps).tolist()
    if offsets[-1] != 0:
        # vLLM closes the 1-2 % gap between the random sum and n/rate so throughput is
        # stable across seeds.
        scale = (n / request_rate) / offsets[-1]
        offsets = [t * scale for t in offsets]
    return offsets


def _cancelled_output(request: SampleRequest, start_time: float) -> RequestFuncOutput:
    return RequestFuncOutput(success=False, prompt_len=request.prompt_len, start_time=start_time, error="cancelled")


async def dispatch(
    requests: Sequence[SampleRequest],
    send: SendFn,
    *,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    seed: int = 0,
    cancel_event: asyncio.Event | None = None,
    on_done: DoneFn | None = None,
    request_id_prefix: str = "bench-",
) -> list[RequestFuncOutput]:
    """Issue `requests` on their arrival schedule, at most `max_concurrency` in flight.

    With `cancel_event` set, no new request is issued and in-flight ones are cancelled
    (clients abort them); those come back as failed with error "cancelled", and requests
    never started are left out of the returned list.
    """
    offsets = arrival_offsets(len(requests), request_rate, burstiness, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    cancel = cancel_event or asyncio.Event()

    async def one(i: int, request: SampleRequest) -> RequestFuncOutput | None:
        started = False
        try:
            async with limit:
                # Time in the semaphore queue is not request latency (vLLM starts its
                # clock after acquiring), so the client takes its own start time.
                if cancel.is_set():
                    return None
                started = True
                out = await send(request, f"{request_id_prefix}{i}")
        except asyncio.CancelledError:
            return _cancelled_output(request, time.perf_counter()) if started else None
        if on_done is not None:
            on_done(out)
        return out

    tasks: list[asyncio.Task] = []
    start = time.monotonic()
    for i, (request, offset) in enumerate(zip(requests, offsets)):
        delay = start + offset - time.monotonic()
        if delay > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(cancel.wait(), timeout=delay)
        if cancel.is_set():
            break
        tasks.append(asyncio.create_task(one(i, request)))

    if tasks:
        watcher = asyncio.create_task(cancel.wait())
        pending = set(tasks)
        while pending and not cancel.is_set():
            _, pending = await asyncio.wait(pending | {watcher}, return_when=asyncio.FIRST_COMPLETED)
            pending.discard(watcher)
        watcher.cancel()
        for t in pending:
            t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    return [r for r in results if isinstance(r, RequestFuncOutput)]


async def run_warmups(
    request: SampleRequest, send: SendFn, num_warmups: int, max_concurrency: int | None = None
) -> list[RequestFuncOutput]:
    """Send `num_warmups` copies of `request` (vLLM warms up with the first prompt), capped
    by the same concurrency; their timings are not part of any metric."""
    if num_warmups <= 0:
        return []
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

    async def one(i: int) -> RequestFuncOutput:
        async with limit:
            return await send(request, f"warmup-{i}")

    return list(await asyncio.gather(*(one(i) for i in range(num_warmups))))
