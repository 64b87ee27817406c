"""The engine on a CUDA/ROCm device against the same engine on the CPU (Triton kernels vs the
PyTorch path): tiny checkpoints in every weight format, float32 so the two agree closely."""

from __future__ import annotations

import pytest
import torch

from kimitui.engine import LLM, SamplingParams
from tests.helpers.checkpoints import write_hf_checkpoint
from tests.helpers.quantized import quantize_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device"),
]

PROMPTS = [[5, 17, 3, 99, 41, 7, 250, 13], [250, 2, 8], list(range(40, 140))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)


def _generate(path, device, **kw):
    # the cache size given, not sized from free host RAM (psutil), which a bare GPU image may lack
    llm = LLM(
        str(path), device=device, dtype="float32", max_model_len=256, max_num_seqs=4, kv_cache_tokens=4 * 256 + 16, **kw
    )
    try:
        return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method", ["dense", "int4", "mxfp4", "fp8"])
def test_device_engine_matches_cpu_engine(tmp_path, monkeypatch, method):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("KIMITUI_KERNELS", raising=False)
    hf = write_hf_checkpoint(tmp_path, seed=11, num_hidden_layers=3)
    if method != "dense":
        quantize_checkpoint(tmp_path, method, hf)
    cpu = _generate(tmp_path, "cpu")
    gpu = _generate(tmp_path, "cuda")
    for a, b in zip(cpu, gpu):
        assert a.token_ids == b.token_ids, method
        assert max(abs(x[t] - y[t]) for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids)) < 1e-2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpu_tensor_parallel_matches_one(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    write_hf_checkpoint(tmp_path, seed=12, num_hidden_layers=3)
    one = _generate(tmp_path, "cuda")
    two = _generate(tmp_path, "cuda", tensor_parallel_size=2)
    assert [a.token_ids for a in one] == [b.token_ids for b in two]
