"""Headless benchmarks with `vllm bench serve`'s workload, timing, metrics and JSON keys,
plus per-GPU throughput, measured energy and $/M tokens. Never imports textual or the server;
the engine is imported only when an in-process client builds sampling parameters."""

from kimitui.bench.args import add_bench_arguments, config_from_args
from kimitui.bench.clients import InProcessClient, OpenAICompletionsClient, RequestFuncOutput, fetch_models
from kimitui.bench.cost import CostSettings, PricingTier, load_cost_settings
from kimitui.bench.metrics import BenchmarkMetrics, calculate_metrics, format_result_block, result_json
from kimitui.bench.runner import (
    BenchmarkConfig,
    run_benchmark,
    run_sweep,
    save_result,
)
from kimitui.bench.sweep import SweepPoint, frontier, ladder
from kimitui.bench.workload import SampleRequest, Workload, sample_random

__all__ = [
    "BenchmarkConfig",
    "BenchmarkMetrics",
    "CostSettings",
    "InProcessClient",
    "OpenAICompletionsClient",
    "PricingTier",
    "RequestFuncOutput",
    "SampleRequest",
    "SweepPoint",
    "Workload",
    "add_bench_arguments",
    "calculate_metrics",
    "config_from_args",
    "fetch_models",
    "format_result_block",
    "frontier",
    "ladder",
    "load_cost_settings",
    "result_json",
    "run_benchmark",
    "run_sweep",
    "sample_random",
    "save_result",
]
