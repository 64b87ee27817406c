"""MXFP4 (compressed-tensors mxfp4-pack-quantized, Kimi K3's routed experts): the engine's decode
against a hand-decoded golden vector and transformers' MXFP4 helper."""

from __future__ import annotations

import torch

from kimitui.kernels import reference

# bytes [[0x01, 0x29], [0x93, 0xF4]] (even column in the low nibble), E8M0 scale 127 = 2^0:
# 0x01 -> (0.5, 0); 0x29 -> (-0.5, 1); 0x93 -> (1.5, -0.5); 0xF4 -> (2, -6)
GOLDEN_BYTES = [[0x01, 0x29], [0x93, 0xF4]]
GOLDEN = torch.tensor([[0.5, 0.0, -0.5, 1.0], [1.5, -0.5, 2.0, -6.0]])


def _golden_packed() -> tuple[torch.Tensor, torch.Tensor]:
    # one 32-column group per row: the golden bytes, then zero bytes
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    packed[:, :2] = torch.tensor(GOLDEN_BYTES, dtype=torch.uint8)
    return packed, torch.full((2, 1), 127, dtype=torch.uint8)


def _hf_decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """transformers' gpt-oss MXFP4 helper on compressed-tensors tensors: [out, in/2] viewed as
    [1, out, in/32, 16] blocks, [out, in/32] scales; its result is [1, in, out]."""
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    n, half = packed.shape
    out = _convert_moe_packed_tensors(
        packed.view(1, n, half // 16, 16), scale.view(1, n, half // 16), dtype=torch.float32
    )
    return out[0].transpose(0, 1)


def test_engine_decodes_golden_vector():
    packed, scale = _golden_packed()
    w = reference.dequant_mxfp4(packed, scale)
    assert w.shape == (2, 32)
    assert torch.equal(w[:, :4], GOLDEN)
    assert not w[:, 4:].any()


def test_transformers_helper_decodes_golden_vector():
    packed, scale = _golden_packed()
    assert torch.equal(_hf_decode(packed, scale)[:, :4], GOLDEN)


def test_scale_exponent_applies_per_group():
    packed, scale = _golden_packed()
    assert torch.equal(reference.dequant_mxfp4(packed, scale + 2)[:, :4], GOLDEN * 4)
    assert torch.equal(reference.dequant_mxfp4(packed, scale - 1)[:, :4], GOLDEN / 2)


def test_engine_matches_transformers_on_random_weights():
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (48, 64), generator=gen).to(torch.uint8)  # [out 48, in 128]
    scale = torch.randint(110, 140, (48, 4), generator=gen).to(torch.uint8)
    ours = reference.dequant_mxfp4(packed, scale)
    assert torch.equal(ours, _hf_decode(packed, scale))


def test_linear_keeps_mxfp4_packed_and_multiplies_by_the_decoded_weight():
    from kimitui.engine.config import QuantConfig
    from kimitui.engine.layers.linear import Linear

    lin = Linear(128, 48, QuantConfig(method="mxfp4"), "model.layers.1.mlp.experts.0.gate_proj")
    assert lin.fmt == "mxfp4"
    assert lin.weight_packed.dtype == torch.uint8 and tuple(lin.weight_packed.shape) == (48, 64)
    assert lin.weight_scale.dtype == torch.uint8 and tuple(lin.weight_scale.shape) == (48, 4)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        lin.weight_packed.copy_(torch.randint(0, 256, (48, 64), generator=gen).to(torch.uint8))
        lin.weight_scale.copy_(torch.randint(120, 130, (48, 4), generator=gen).to(torch.uint8))
    x = torch.randn(3, 128, generator=gen)
    want = x @ _hf_decode(lin.weight_packed, lin.weight_scale).T
    assert torch.allclose(lin(x), want, atol=1e-4, rtol=1e-5)
