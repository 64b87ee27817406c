import asyncio
import math

import numpy as np

from kimitui.bench.arrivals import arrival_offsets, dispatch, run_warmups
from kimitui.bench.clients import RequestFuncOutput
from kimitui.bench.workload import SampleRequest


def test_infinite_rate_issues_everything_at_once():
    assert arrival_offsets(5, math.inf) == [0.0] * 5


def test_poisson_gaps_mean_and_shape():
    rate = 4.0
    offsets = arrival_offsets(4000, rate, burstiness=1.0, seed=0)
    gaps = np.diff([0.0] + offsets)
    assert abs(gaps.mean() - 1 / rate) < 1e-9  # rescaled so the span is exactly n / rate
    assert abs(offsets[-1] - 4000 / rate) < 1e-6
    assert 0.9 < gaps.std() / gaps.mean() < 1.1  # exponential: coefficient of variation 1
    assert arrival_offsets(4000, rate, seed=0) == offsets
    assert arrival_offsets(4000, rate, seed=1) != offsets


def test_gamma_burstiness_matches_vllm_draws():
    # vLLM: np.random.seed(seed); np.random.gamma(shape=b, scale=1/(rate*b)) per request.
    np.random.seed(5)
    raw = np.cumsum([np.random.gamma(shape=0.5, scale=1 / (2.0 * 0.5)) for _ in range(50)])
    want = raw * (50 / 2.0) / raw[-1]
    assert np.allclose(arrival_offsets(50, 2.0, burstiness=0.5, seed=5), want)
    gaps = np.diff([0.0] + arrival_offsets(4000, 2.0, burstiness=0.5, seed=5))
    assert gaps.std() / gaps.mean() > 1.2  # burstier than Poisson
    assert arrival_offsets(3, 2.0, burstiness=math.inf) == [0.5, 1.0, 1.5]


def _req(i=0):
    return SampleRequest(None, [5] * 4, 4, 3)


def test_dispatch_caps_concurrency_and_reports_progress():
    async def main():
        live = peak = 0
        done = []

        async def send(request, request_id):
            nonlocal live, peak
            live += 1
            peak = max(peak, live)
            await asyncio.sleep(0.01)
            live -= 1
            return RequestFuncOutput(True, "x", 4, 3, 0.001, [0.001], 0.01, 0.0)

        outs = await dispatch([_req()] * 10, send, max_concurrency=3, on_done=done.append)
        assert len(outs) == 10 and peak == 3 and len(done) == 10
        warm = await run_warmups(_req(), send, 4, max_concurrency=2)
        assert len(warm) == 4

    asyncio.run(main())


def test_cancel_stops_issuing_and_aborts_in_flight():
    async def main():
        cancel = asyncio.Event()
        started = []

        async def send(request, request_id):
            started.append(request_id)
            if len(started) == 2:
                cancel.set()
            await asyncio.sleep(10)
            return RequestFuncOutput(True)

        outs = await asyncio.wait_for(dispatch([_req()] * 20, send, max_concurrency=2, cancel_event=cancel), timeout=5)
        assert len(started) == 2
        assert len(outs) == 2 and all(o.error == "cancelled" and not o.success for o in outs)

    asyncio.run(main())
