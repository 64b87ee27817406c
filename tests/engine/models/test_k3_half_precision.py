"""Half precision on K3, part by part: every part whose reference keeps float32 steps keeps them in
the engine too. Per part and half dtype, on a K3-shaped tiny checkpoint (the same inputs for the half
and the float32 model, see benchmarks/k3_half_precision.py):

- the engine's half output is as close to float32 as the float32-kept computation cast once
  (``ideal``), to rounding;
- it is clearly closer to float32 than the same part with every step in the half dtype (``naive``).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import k3_half_precision as hp

# part -> (how much worse than ideal the engine may be, how much better than naive it must be)
FP32_KEPT = {
    "rmsnorm": (hp.part_rmsnorm, 1e-6, 0.85),
    "attn_res": (hp.part_attn_res, 1e-6, 0.6),
    "situ": (hp.part_situ, 1e-6, 0.6),
    "latent_norm": (hp.part_latent_norm, 1e-6, 0.85),
    "kda_gates": (hp.part_kda_gates, 1e-6, 0.01),
    "kda_recurrence": (hp.part_kda_recurrence, 1e-6, 0.5),
    "kda_out_norm": (hp.part_kda_out_norm, 1e-6, 0.6),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.helpers.k3_checkpoint import write_k3_checkpoint

    path = tmp_path_factory.mktemp("k3-half")
    write_k3_checkpoint(path, seed=0)
    # the experts' float products: these tests weigh the half-precision steps around them, and W4A8's
    # int8 activations (on by default for bf16 where the CPU has int8 dot products) would swamp them
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KIMITUI_CPU_W4A8", "0")
        return {dtype: hp.load(path, dtype) for dtype in (torch.float32, *hp.HALF)}


def _run(fn, models, dtype, seed=0):
    with torch.no_grad():
        return fn(models[torch.float32], models[dtype], dtype, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", hp.HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("part", sorted(FP32_KEPT))
def test_part_keeps_float32_where_the_reference_does(models, part, dtype):
    fn, slack, better = FP32_KEPT[part]
    out, ref, ideal, naive = _run(fn, models, dtype)[:4]
    # the KDA gates go on into the recurrence in fp32 (fla and transformers hand it fp32 g and beta)
    want = torch.float32 if part == "kda_gates" else dtype
    assert out.dtype == want, f"{part}: output in {out.dtype}, expected {want}"
    e, i, n = (hp.errors(t, ref)["mean_abs"] for t in (out, ideal, naive))
    # the float32-kept steps then one cast: the engine's output is that computation
    # (to one unit in the last place at the output's largest magnitude: summation order may differ)
    ulp = torch.finfo(dtype).eps * ideal.float().abs().max().item()
    assert (out.float() - ideal.float()).abs().max().item() <= ulp + slack
    assert e <= i * (1 + 1e-3) + 1e-9, (part, e, i)
    assert e < better * n, f"{part}: engine error {e:.3e} is not clearly below the all-half error {n:.3e}"


@pytest.mark.parametrize("dtype", hp.HALF, ids=["bf16", "fp16"])
def test_router_scores_and_weights_are_float32(models, dtype):
    g_h = models[dtype].model.layers[hp.moe_layer(models[dtype])].mlp.gate
    assert g_h.weight.dtype == g_h.e_score_correction_bias.dtype == torch.float32
    wh, w32, _, wn, note = _run(hp.part_router, models, dtype)
    assert "ids agree on 100%" in note, note
    assert (wh - w32).abs().max().item() < 1e-6  # fp32 routing on the same (rounded) input
    assert (wn - w32).abs().mean().item() > 1e-5  # half scores would move the weights


@pytest.mark.parametrize("dtype", hp.HALF, ids=["bf16", "fp16"])
def test_mxfp4_experts_weight_their_outputs_in_float32(models, dtype):
    # The routed experts' outputs are weighted by the router's fp32 weights, as transformers' Kimi
    # Linear experts and the serving kernels do; rounding the weights to the half dtype first (what
    # the engine did) puts them further from float32.
    out, ref, ideal, naive = _run(hp.part_mxfp4_experts, models, dtype)[:4]
    moe32, moeh, z, ids, w = hp._experts_inputs(
        models[torch.float32], models[dtype], dtype, torch.Generator().manual_seed(0)
    )
    rounded = moeh.experts(z, ids, w.to(dtype), counted=True)
    e, r, i, n = (hp.errors(t, ref)["mean_abs"] for t in (out, rounded, ideal, naive))
    assert e < 0.9 * r, f"fp32 routing weights {e:.3e} vs rounded {r:.3e}"
    assert e <= 1.05 * i and e < 0.6 * n, (e, i, n)


def test_mxfp4_dequant_is_exact_in_bf16():
    # E2M1 x 2^k has at most 2 significant bits: every MXFP4 weight is a bf16 value for scales
    # 2^-127..2^127 (the weights are never rounded), and an fp16 value for 2^-14..2^15.
    from kimitui.kernels.reference import dequant_mxfp4

    packed = torch.arange(256, dtype=torch.int64).to(torch.uint8).repeat(4, 1)  # every byte, 4 rows
    scale = torch.tensor([[1], [100], [127], [160]], dtype=torch.uint8).repeat(1, 16)
    w32 = dequant_mxfp4(packed, scale, torch.float32)
    assert torch.equal(dequant_mxfp4(packed, scale, torch.bfloat16).float(), w32)
    assert torch.equal(dequant_mxfp4(packed[2:3], scale[2:3], torch.float16).float(), w32[2:3])
