"""Host syncs of a step, counted on the CPU with kernels/launch_count.py.

A GPU decode step should ask the host for nothing inside the forward pass (a sync there stalls the
launch queue and breaks CUDA graph capture) and read back once, after sampling. On a CPU the counter
sees ``.item()``, data-dependent ops (``nonzero``, ``bincount``...) and device->host copies as
they would be on a GPU; ``.tolist()`` of a CPU tensor dispatches nothing, so the single read-back is
checked through ``SamplerOutput.to_host``'s packing instead.
"""

from __future__ import annotations

import torch

from kimitui.engine import LLM
from kimitui.engine.runner.model_runner import ModelRunner, StepInputs
from kimitui.engine.sampling.sampler import SamplerOutput, SamplingBatch, sample
from kimitui.kernels.launch_count import count_launches
from tests.helpers.checkpoints import write_hf_checkpoint

DECODE = StepInputs(
    ids=[11, 12, 13],
    num_decodes=3,
    decode_tables=[[1, 2], [3], [4, 5, 6]],
    decode_lens=[20, 5, 40],
    prefills=[],
    sample_rows=[0, 1, 2],
)
MIXED = StepInputs(
    ids=[11, 12, 13, 14, 15],
    num_decodes=1,
    decode_tables=[[1, 2]],
    decode_lens=[20],
    prefills=[(1, 5, 4, [3])],
    sample_rows=[0, 4],
)


def _llm(tmp_path, dtype):
    write_hf_checkpoint(tmp_path, seed=5, num_hidden_layers=2)
    return LLM(
        str(tmp_path), dtype=dtype, max_model_len=96, max_num_seqs=8, enable_prefix_caching=False, kv_cache_tokens=512
    )


def _op_by_op_llm(tmp_path, monkeypatch):
    # bf16 without the C++ CPU kernels (which now take bf16 models too): layer by layer, as a GPU runs
    monkeypatch.setenv("KIMITUI_CPU_KERNELS", "0")
    return _llm(tmp_path, "bfloat16")


def _syncs(runner, inp) -> dict:
    runner.forward_step(inp)  # warm: lazy buffers, extension loading
    with count_launches() as counts:
        logits, _ = runner.forward_step(inp)
    assert logits is not None and counts.kernels > 0  # the counter saw the step
    return dict(counts.host_syncs)


def test_float32_cpu_forward_has_no_host_sync(tmp_path):
    runner = _llm(tmp_path, "float32").engine.runner
    assert _syncs(runner, DECODE) == {}
    assert _syncs(runner, MIXED) == {}
    graphed = ModelRunner(
        runner.model,
        runner.kv_caches,
        runner.block_size,
        runner.device,
        max_num_seqs=8,
        max_model_len=96,
        decode_graphs=True,
    )
    assert _syncs(graphed, DECODE) == {}  # the static-buffer (graph) path too


def test_op_by_op_forward_syncs_only_in_the_reference_moe(tmp_path, monkeypatch):
    # bfloat16 on a CPU without the C++ kernels runs layer by layer, as a GPU does, with kernels/reference/__init__.py in place of
    # the Triton kernels. The one sync left is the reference grouped MoE's bincount (it sizes its
    # per-expert loop on the host); the Triton fused_moe a GPU runs counts with scatter_add_ instead.
    runner = _op_by_op_llm(tmp_path, monkeypatch).engine.runner
    assert _syncs(runner, DECODE) == {"bincount": 1}
    assert _syncs(runner, MIXED) == {"bincount": 1}


def test_sampler_reads_back_once_with_logprobs_packed():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)

    class P:  # the sampling params fields the sampler reads
        def __init__(self, t, k, p, lp):
            self.temperature, self.top_k, self.top_p, self.logprobs = t, k, p, lp

    params = [P(0.0, 0, 1.0, 2), P(0.8, 5, 0.9, None), P(1.0, 0, 0.5, 0)]
    batch = SamplingBatch.build(params, [None] * 3, torch.device("cpu"))
    with count_launches() as counts:
        out = sample(logits, batch)
        tokens, chosen, top_ids, top_vals = out.to_host()
    assert not counts.host_syncs
    assert counts.aten["cat"] == 1  # everything read back goes through one packed tensor
    assert tokens == out.token_ids.tolist() and chosen == out.sampled_logprobs.tolist()
    assert top_ids == out.logprob_token_ids.tolist() and top_vals == out.logprob_values.tolist()
    assert SamplerOutput(torch.tensor([7, 2**40])).to_host() == ([7, 2**40], None, None, None)
