"""``AsyncLLM.start`` adds its request to the engine at once (``generate`` only when first read), and
closing its stream before the end aborts the request and frees its KV blocks."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from kimitui.engine import AsyncLLM, EngineArgs, SamplingParams

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    os.environ.setdefault("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg"))
    engine = AsyncLLM(engine_args=EngineArgs(max_model_len=128, max_num_seqs=2, kv_cache_tokens=512))
    yield engine
    engine.shutdown()


async def _until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def _free_blocks(llm: AsyncLLM) -> int:
    return llm.engine.block_manager.num_free_blocks


def test_start_adds_the_request_now_and_streams_to_the_end(llm):
    async def run():
        lazy = llm.generate([5, 6, 7], PARAMS, "lazy")
        stream = llm.start([5, 6, 7], PARAMS, "eager")
        await _until(lambda: stream._q.qsize() > 0)  # outputs arrive while nobody reads it
        assert "lazy" not in llm.engine.request_ids()  # not added until read
        outs = [out async for out in stream]
        await lazy.aclose()
        return outs

    outs = asyncio.run(run())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 8
    assert all(not o.finished for o in outs[:-1])


def test_closing_a_started_stream_aborts_it_and_frees_its_blocks(llm):
    async def run():
        await _until(lambda: not llm.engine.request_ids())
        free = _free_blocks(llm)
        stream = llm.start(list(range(5, 60)), SamplingParams(max_tokens=100, ignore_eos=True), "closed")
        first = await stream.__anext__()  # it runs
        assert not first.finished
        await stream.aclose()
        await _until(lambda: "closed" not in llm.engine.request_ids())
        await _until(lambda: _free_blocks(llm) == free)
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        never_read = llm.start([5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True), "never-read")
        await never_read.aclose()  # closed before anything was read: aborted too
        await _until(lambda: "never-read" not in llm.engine.request_ids())
        await _until(lambda: _free_blocks(llm) == free)

    asyncio.run(run())
