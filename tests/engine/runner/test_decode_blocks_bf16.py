"""A bf16 model's decode on the CPU: the fused C++ decode blocks (bf16 weights and latent cache,
float32 sums inside a block) against the pure PyTorch bf16 path (no C++ kernels at all), within
bf16 rounding; and ``--dtype auto``'s choice on the CPU."""

from __future__ import annotations

import random

import pytest
import torch

from kimitui.engine import LLM, SamplingParams
from kimitui.engine.args import EngineArgs, cpu_auto_dtype
from kimitui.kernels.cpu import few_rows as cpu_few_rows
from tests.helpers.checkpoints import write_hf_checkpoint

needs_ext = pytest.mark.skipif(not cpu_few_rows.available(), reason="C++ CPU kernels did not build here")


def _generate(path: str, prompts: list[list[int]], monkeypatch, cxx: bool):
    if not cxx:
        monkeypatch.setenv("KIMITUI_CPU_KERNELS", "0")
    llm = LLM(path, dtype="bfloat16", max_model_len=128, max_num_seqs=8, enable_prefix_caching=False)
    layers = llm.engine.runner.model.model.layers
    fused = [
        layer.fused is not None and layer.fused.attention_weights is not None and layer.fused.ffn_weights is not None
        for layer in layers
    ]
    calls = {"n": 0}
    original = cpu_few_rows.attention_block

    def counted(*args):
        calls["n"] += 1
        return original(*args)

    monkeypatch.setattr(cpu_few_rows, "attention_block", counted)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    monkeypatch.undo()
    return outs, fused, calls["n"]


@needs_ext
def test_bf16_fused_decode_matches_the_pytorch_bf16_path(tmp_path, monkeypatch):
    write_hf_checkpoint(tmp_path, seed=7, n_group=2, topk_group=1)
    rng = random.Random(3)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (3, 11, 29, 7, 2)]
    fused_out, fused, calls = _generate(str(tmp_path), prompts, monkeypatch, True)
    plain_out, plain, plain_calls = _generate(str(tmp_path), prompts, monkeypatch, False)
    assert all(fused) and calls >= 3 * 2  # every layer fused, and the blocks ran for the decode steps
    assert not any(plain) and plain_calls == 0
    compared = 0
    for a, b in zip(fused_out, plain_out):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        # step 0 comes from the prefill; later steps from the decode blocks, compared while both
        # paths have the same history (a random tiny model's near-ties may part them)
        for step in range(len(ta)):
            if ta[:step] != tb[:step]:
                break
            common = set(la[step]) & set(lb[step])
            assert len(common) >= 3
            for tok in common:
                assert abs(la[step][tok] - lb[step][tok]) < 0.1, (step, tok, la[step][tok], lb[step][tok])
            compared += step > 0
    assert compared >= 4  # decode steps actually compared


def test_auto_dtype_on_the_cpu():
    bf16_cpu = {"avx512f", "avx512_bf16", "amx_bf16"}
    assert cpu_auto_dtype("bfloat16", flags=bf16_cpu, kernels=True)[0] == torch.bfloat16
    dtype, why = cpu_auto_dtype("bfloat16", flags={"avx2", "fma"}, kernels=True)  # AVX2-only: widened in C++
    assert dtype == torch.bfloat16 and "avx2" in why
    assert cpu_auto_dtype("bfloat16", flags={"avx2", "fma"}, kernels=False)[0] == torch.float32
    assert cpu_auto_dtype("bfloat16", flags={"avx2", "fma", "avx512f"}, kernels=True)[0] == torch.float32
    assert cpu_auto_dtype("bfloat16", flags={"sse4_2"}, kernels=True)[0] == torch.float32
    assert cpu_auto_dtype("bfloat16", flags=bf16_cpu, kernels=False)[0] == torch.float32
    assert cpu_auto_dtype("float32", flags=bf16_cpu, kernels=True)[0] == torch.float32
    dtype, why = cpu_auto_dtype("float16", flags=bf16_cpu, kernels=True)
    assert dtype == torch.float32 and "float16" in why
    # an explicit dtype is never second-guessed; a GPU keeps the checkpoint's
    assert EngineArgs(dtype="float32").resolve_dtype(torch.device("cpu"), "bfloat16") == torch.float32
    assert EngineArgs().resolve_dtype(torch.device("cuda"), "bfloat16") == torch.bfloat16


def test_auto_dtype_keeps_float32_for_fp8_or_hybrid_models():
    from types import SimpleNamespace

    base = dict(
        quantization=None,
        layer_types=(),
        mla_use_output_gate=False,
        mla_use_nope=False,
        hidden_act="silu",
        routed_expert_hidden_size=None,
        attn_res_block_size=None,
    )
    flags = {"avx512_bf16"}
    assert cpu_auto_dtype("bfloat16", SimpleNamespace(**base), flags, True)[0] == torch.bfloat16
    for change in (
        dict(quantization=SimpleNamespace(method="fp8")),
        dict(layer_types=("linear_attention", "full_attention")),
        dict(hidden_act="situ"),
    ):
        assert cpu_auto_dtype("bfloat16", SimpleNamespace(**{**base, **change}), flags, True)[0] == torch.float32
    for method in ("int4", "mxfp4"):  # packed experts take bf16 activations in their own kernels
        config = SimpleNamespace(**{**base, "quantization": SimpleNamespace(method=method)})
        assert cpu_auto_dtype("bfloat16", config, flags, True)[0] == torch.bfloat16
