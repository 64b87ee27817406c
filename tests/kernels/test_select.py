"""Backend selection (once, from device, dtype and settings); the CPU backend a CPU model gets
matches the reference; kernel wrappers reject bad inputs; moe_align_block_size."""

import importlib.util

import pytest
import torch

from kimitui.kernels import backend, select
from kimitui.kernels import reference as ref
from kimitui.kernels.cpu.backend import CpuBackend
from kimitui.kernels.settings import KernelSettings

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def test_cpu_and_meta_tensors_use_reference():
    auto = KernelSettings()
    assert isinstance(select.select_backend("cpu", torch.float32, auto), CpuBackend)
    assert select.select_backend("meta", torch.float32, auto) is backend.REFERENCE
    assert select.select_backend("cpu", torch.float32, KernelSettings(kernels="reference")) is backend.REFERENCE


@needs_triton
def test_env_forces_reference():
    from kimitui.kernels.triton.backend import TritonBackend

    assert isinstance(select.select_backend("cuda", torch.bfloat16, KernelSettings.from_env({})), TritonBackend)
    forced = KernelSettings.from_env({"KIMITUI_KERNELS": "reference"})
    assert select.select_backend("cuda", torch.bfloat16, forced) is backend.REFERENCE


def test_settings_are_read_once_and_checked():
    s = KernelSettings.from_env(
        {
            "KIMITUI_KERNELS": "Reference",
            "KIMITUI_CPU_KERNELS": "off",
            "KIMITUI_EMULATE_DEVICE": "1",
            "TRITON_INTERPRET": "1",
        }
    )
    assert s == KernelSettings(kernels="reference", cpu_kernels=False, emulate_device=True, triton_interpret=True)
    with pytest.raises(Exception):
        s.kernels = "auto"  # frozen
    with pytest.raises(ValueError, match="KIMITUI_KERNELS='triton'"):
        KernelSettings.from_env({"KIMITUI_KERNELS": "triton"})
    with pytest.raises(ValueError, match="KIMITUI_CPU_KERNELS='maybe'"):
        KernelSettings.from_env({"KIMITUI_CPU_KERNELS": "maybe"})
    with pytest.raises(ValueError, match="needs TRITON_INTERPRET=1"):
        select.select_backend("cpu", torch.float32, KernelSettings(emulate_device=True))


@needs_triton
def test_emulation_takes_the_device_backend_on_cpu_tensors():
    from kimitui.kernels.triton.backend import TritonBackend

    ops = select.select_backend("cpu", torch.float32, KernelSettings(emulate_device=True, triton_interpret=True))
    assert isinstance(ops, TritonBackend)
    assert not ops.mla_decode_fusable(torch.empty(1, 8), torch.empty(4, 8), torch.empty(1), torch.empty(1))
    assert ops.fuse_decoder_layer(object()) is None  # no C++ decode blocks on the device path


def test_cpu_backend_matches_reference():
    ops = select.select_backend("cpu", torch.float32, KernelSettings())
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64)
    w = torch.randn(40, 64)
    p, s = ref.quantize_int4(w)
    torch.testing.assert_close(ops.linear_w4a16(x, p, s, 64), ref.linear_w4a16(x, p, s, 64))
    q, si = ref.quantize_fp8_block(w)
    torch.testing.assert_close(ops.linear_fp8_block(x, q, si), ref.linear_fp8_block(x, q, si))
    pm, sm = ref.quantize_mxfp4(w)
    torch.testing.assert_close(ops.linear_mxfp4(x, pm, sm), ref.linear_mxfp4(x, pm, sm))
    weight = torch.rand(64)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5))
    ids, tw = torch.tensor([[0, 1], [1, 2]]), torch.rand(2, 2)
    w13, w2 = torch.randn(3, 16, 64), torch.randn(3, 64, 8)
    # On a CPU the experts may run in kernels.cpu_few_rows, which sums the products in another order.
    torch.testing.assert_close(
        ops.moe_experts(x[0, :2], ids, tw, w13, w2),
        ref.moe_experts_reference(x[0, :2], ids, tw, w13, w2),
        rtol=1e-5,
        atol=1e-4,
    )
    with pytest.raises(ValueError, match="input features"):
        ops.linear_w4a16(x, p, s, 32)


@needs_triton
def test_wrappers_reject_bad_inputs(monkeypatch):
    from kimitui.kernels.triton.fused_moe import fused_moe
    from kimitui.kernels.triton.gemm.fp8_block import fp8_block_gemm
    from kimitui.kernels.triton.gemm.mxfp4 import mxfp4_gemm
    from kimitui.kernels.triton.gemm.w4a16 import w4a16_gemm

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(2, 64)
    p, s = ref.quantize_int4(torch.randn(8, 64))
    with pytest.raises(ValueError, match="CUDA/ROCm"):
        w4a16_gemm(x, p, s)  # CPU tensors outside the interpreter
    with pytest.raises(ValueError, match="packed must be int32"):
        w4a16_gemm(x, p.float(), s)
    with pytest.raises(ValueError, match="scale must be"):
        w4a16_gemm(x, p, s[:, :1])
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_gemm(torch.randn(2, 40), torch.zeros(4, 20, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8))
    q, si = ref.quantize_fp8_block(torch.randn(8, 64))
    with pytest.raises(ValueError, match="scale_inv must be fp32"):
        fp8_block_gemm(x, q, si, (32, 32))
    with pytest.raises(ValueError, match="w2 must be"):
        ids = torch.zeros(2, 1, dtype=torch.int64)
        fused_moe(x, ids, torch.ones(2, 1), torch.randn(2, 8, 64), torch.randn(2, 64, 3))


@needs_triton
def test_moe_align_block_size_matches_vllm_example():
    from kimitui.kernels.triton.moe_align import moe_align_block_size_torch as moe_align_block_size

    # vLLM's docstring example (expert ids 1..4, so 5 experts with expert 0 idle), block 4.
    topk_ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]])
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, 4, 5)
    assert num_post.tolist() == [16]
    assert sorted_ids[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert expert_ids[:4].tolist() == [1, 2, 3, 4]
    assert (sorted_ids[16:] == 12).all()  # unused tail is padding
