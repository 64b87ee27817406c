"""kimitui's inference engine: Kimi K2.x (DeepSeek-V3 architecture) on CPU, CUDA or ROCm.

    from engine import LLM, SamplingParams
    llm = LLM()                      # the built-in demo checkpoint
    out = llm.generate("Hello", SamplingParams(max_tokens=8))
"""

from engine.args import EngineArgs
from engine.async_llm import AsyncLLM
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics",
           "EngineArgs"]
