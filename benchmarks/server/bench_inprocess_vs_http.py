"""What the HTTP server costs: one engine, the same workload, measured in-process and through
`kimitui serve`'s app on 127.0.0.1 (uvicorn in a thread of this process).

Both runs drive the same AsyncLLM with the same seeded prompts (token for token), so the
difference in TTFT, TPOT and throughput is the server: HTTP, JSON, SSE framing and the extra
event loop. The in-process run goes first and again last, to show run-to-run noise.

    python benchmarks/server/bench_inprocess_vs_http.py [--model DIR] [--num-prompts 32] [--max-concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kimitui.bench import BenchmarkConfig, InProcessClient, OpenAICompletionsClient, run_benchmark  # noqa: E402
from kimitui.engine import AsyncLLM, EngineArgs  # noqa: E402

COLUMNS = (
    ("output_throughput", "out tok/s"),
    ("mean_ttft_ms", "TTFT ms"),
    ("median_tpot_ms", "TPOT ms"),
    ("mean_itl_ms", "ITL ms"),
    ("total_input_tokens", "in tok"),
    ("total_output_tokens", "out tok"),
)


def _serve(llm: AsyncLLM, name: str):
    from kimitui.server import BackgroundServer, create_app

    # The server `kimitui serve` runs (its socket setup included: TCP_NODELAY on every connection).
    return BackgroundServer(port=0).start(create_app(llm, name))


async def _run(config: BenchmarkConfig, client, tokenizer) -> dict:
    try:
        return await run_benchmark(config, client, tokenizer)
    finally:
        await client.aclose()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the demo)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    args = p.parse_args()

    llm = AsyncLLM(engine_args=EngineArgs(model=args.model, max_num_seqs=max(args.max_concurrency, 1)))
    name = args.model or llm.config.name
    config = BenchmarkConfig(
        random_input_len=args.input_len,
        random_output_len=args.output_len,
        num_prompts=args.num_prompts,
        max_concurrency=args.max_concurrency,
        num_warmups=args.max_concurrency,
        max_model_len=llm.engine.max_model_len,
    )
    server = None
    try:
        server = _serve(llm, name)
        url = server.url
        rows = []
        for label, make in (
            ("in-process", lambda: InProcessClient(llm, name, text_prompts=True)),
            ("http", lambda: OpenAICompletionsClient(url, name)),
            ("in-process again", lambda: InProcessClient(llm, name, text_prompts=True)),
        ):
            rows.append((label, asyncio.run(_run(config, make(), llm.tokenizer))))
    finally:
        if server is not None:
            server.stop()
        llm.shutdown()

    print(
        f"{name}: {args.num_prompts} prompts, {args.input_len} in / {args.output_len} out, "
        f"concurrency {args.max_concurrency}"
    )
    print("{:<18}".format("") + "".join(f"{h:>12}" for _, h in COLUMNS))
    for label, r in rows:
        print(
            f"{label:<18}" + "".join(f"{r[k]:>12.2f}" if isinstance(r[k], float) else f"{r[k]:>12}" for k, _ in COLUMNS)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
