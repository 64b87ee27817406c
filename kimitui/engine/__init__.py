"""kimitui's inference engine: Kimi K2.x (DeepSeek-V3 architecture) on CPU, CUDA or ROCm.

from kimitui.engine import LLM, SamplingParams
llm = LLM()                      # the built-in demo checkpoint
out = llm.generate("Hello", SamplingParams(max_tokens=8))
"""

from kimitui._source_tree import with_folder

__path__ = with_folder(__path__, "engine", "llm.py")  # the modules: the top-level engine/ folder

import os

# OpenMP threads that finish a parallel region sleep instead of spinning (libgomp's default spins for
# up to ~300,000 iterations first). When other work shares the cores (other processes, the TUI, the C++
# kernels' own thread team, kernels/cpu/csrc/cpu_team.h, which spins only while the machine has a core free for
# it) each spinning thread burns the time the late thread needs, and a decode step took 10x longer
# (benchmarks/README.md, "CPU-only decode step"). libgomp reads this once, when torch loads it: it only takes effect when the
# engine is imported before torch, and a value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from kimitui.engine.args import EngineArgs  # noqa: E402
from kimitui.engine.async_llm import AsyncLLM  # noqa: E402
from kimitui.engine.llm import LLM  # noqa: E402
from kimitui.engine.outputs import CompletionOutput, LogprobRows, RequestMetrics, RequestOutput  # noqa: E402
from kimitui.engine.sampling_params import SamplingParams  # noqa: E402
from kimitui.engine.text.tokenizer import Tokenizer  # noqa: E402

__all__ = [
    "LLM",
    "AsyncLLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "EngineArgs",
    "LogprobRows",
    "Tokenizer",
]
