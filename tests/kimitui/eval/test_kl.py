"""``kimitui eval kl``: the KL arithmetic against an independent formula, and the acceptance runs on
a tiny checkpoint whose distributions are sharp enough for top-1 agreement to mean something
(random weights with the attention projections and the LM head scaled up; plain random tiny
models give near-uniform rows whose argmax is noise).

Measured on this checkpoint (4 prompts x 48 tokens, the last 16 teacher-forced through decode;
mean KL, top-1 agreement; 2026-12-02): float32 vs itself 1.0e-12, 1.000; bf16 9.8e-4, 0.973; fp16
1.0e-5, 1.000; emulated fp16 device path 1.1e-5, 1.000; INT4 / MXFP4 experts offloaded (bf16)
1.1e-3 / 1.2e-3, 0.984 / 0.989; gloo tensor parallel x2 bf16 8.2e-4, 0.973 (float32 1.4e-12);
the deliberately broken float32 path (rope_scale=2) 4.1e-2, 0.910."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kimitui.cli import main
from kimitui.eval.kl import Dist, KLReport, kl_per_position
from tests.helpers.checkpoints import hf_model

REPO = Path(__file__).resolve().parents[3]
PROMPTS = ["--num-prompts", "4", "--prompt-len", "48", "--decode-tokens", "16"]


def sharp_model(seed: int = 3):
    m = hf_model(seed=seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight")):
                p.mul_(4.0)  # attention scores of O(1): rope and attention mistakes move the output
        m.lm_head.weight.mul_(40.0)  # logits spread over several nats: a clear argmax
    return m


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("kl")
    sharp_model().save_pretrained(str(path))
    return str(path)


def run_kl(tmp_path, *args) -> dict:
    out = tmp_path / f"kl-{len(list(tmp_path.glob('kl-*.json')))}.json"
    assert main(["eval", "kl", *args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


# -- the arithmetic ---------------------------------------------------------------------------


def _random_rows(n=6, v=50, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, v, generator=g) * scale).log_softmax(-1)


def test_kl_matches_torch_kl_div_and_is_zero_on_itself():
    p, q = _random_rows(seed=0), _random_rows(seed=1)
    tok = torch.zeros(6, dtype=torch.int64)
    kl, approx = kl_per_position(Dist.dense(p, tok), Dist.dense(q, tok))
    want = torch.nn.functional.kl_div(q.double(), p.double(), log_target=True, reduction="none").sum(-1)
    assert not approx and torch.allclose(kl, want, atol=1e-9)
    same, _ = kl_per_position(Dist.dense(p, tok), Dist.dense(p.clone(), tok))
    assert same.abs().max().item() == 0.0


def test_top_k_kl_is_a_lower_bound_and_exact_with_every_token():
    p, q = _random_rows(seed=2), _random_rows(seed=3)
    tok = torch.arange(6)
    exact, _ = kl_per_position(Dist.dense(p, tok), Dist.dense(q, tok))
    for k in (1, 5, 20):
        for sides in (
            (Dist.dense(p, tok).top_k(k), Dist.dense(q, tok)),
            (Dist.dense(p, tok), Dist.dense(q, tok).top_k(k)),
            (Dist.dense(p, tok).top_k(k), Dist.dense(q, tok).top_k(k + 3)),
        ):
            approx_kl, approx = kl_per_position(*sides)
            assert approx and (approx_kl <= exact + 1e-9).all() and (approx_kl >= -1e-12).all()
    full, _ = kl_per_position(Dist.dense(p, tok).top_k(49), Dist.dense(q, tok))
    assert torch.allclose(full, exact, atol=1e-6)  # top-49 of 50 plus the bucket of the last token: exact


def test_report_counts_paths_and_agreement():
    p, q = _random_rows(seed=4), _random_rows(seed=4)
    q[0] = q[0].roll(1)  # a different argmax at position 0
    tok = torch.zeros(6, dtype=torch.int64)
    rep = KLReport()
    rep.add("prefill", Dist.dense(p[:4], tok[:4]), Dist.dense(q[:4], tok[:4]))
    rep.add("decode", Dist.dense(p[4:], tok[4:]), Dist.dense(q[4:], tok[4:]))
    s = rep.summary()
    assert (s["positions"], s["prefill"]["positions"], s["decode"]["positions"]) == (6, 4, 2)
    assert s["top1_agreement"] == pytest.approx(5 / 6) and s["same_top_p"] == s["top1_agreement"]
    assert s["decode"]["max_kl"] == pytest.approx(0.0, abs=1e-12) and s["max_kl"] > 0.1
    with pytest.raises(ValueError, match="prefill or decode"):
        rep.add("verify", Dist.dense(p, tok), Dist.dense(q, tok))


# -- the command ------------------------------------------------------------------------------


def test_float32_against_itself_is_zero(ckpt, tmp_path):
    s = run_kl(tmp_path, "--model", ckpt, "--dtype", "float32", *PROMPTS)
    assert s["positions"] == 4 * 47 and s["decode"]["positions"] == 4 * 16 and s["prefill"]["positions"] == 4 * 31
    assert 0.0 <= s["mean_kl"] < 1e-9 and s["max_kl"] < 1e-8 and s["top1_agreement"] == 1.0
    assert not s["approximate"]


def test_bf16_is_close_and_a_broken_path_is_not(ckpt, tmp_path, monkeypatch, capsys):
    bf16 = run_kl(tmp_path, "--model", ckpt, "--dtype", "bfloat16", *PROMPTS)
    assert 1e-6 < bf16["mean_kl"] < 1e-2 and bf16["top1_agreement"] >= 0.9
    for path in ("prefill", "decode"):
        assert 0 < bf16[path]["mean_kl"] < 1e-2 and bf16[path]["top1_agreement"] >= 0.85
    assert "Same top p" in capsys.readouterr().out  # printed as llama.cpp prints it
    monkeypatch.setenv("KIMITUI_EVAL_BREAK", "rope_scale=2")
    broken = run_kl(tmp_path, "--model", ckpt, "--dtype", "float32", *PROMPTS)
    assert broken["broken"].startswith("rope_scale=2")
    assert broken["mean_kl"] > 10 * bf16["mean_kl"] and broken["top1_agreement"] < bf16["top1_agreement"]
    assert broken["decode"]["mean_kl"] > 10 * bf16["decode"]["mean_kl"]  # the decode path is broken too


@pytest.mark.parametrize("method", ["int4", "mxfp4"])
def test_offloaded_packed_experts(tmp_path, method):
    from kimitui.kernels.cpu import quant_moe as cpu_quant_moe
    from tests.helpers.quantized import quantize_checkpoint

    if not cpu_quant_moe.available():
        pytest.skip("the C++ extension does not build here")
    m = sharp_model(seed=5)
    m.save_pretrained(str(tmp_path / "ck"))
    quantize_checkpoint(tmp_path / "ck", method, m)
    s = run_kl(tmp_path, "--model", str(tmp_path / "ck"), "--dtype", "bfloat16", "--cpu-offload", "6", *PROMPTS)
    assert "cpu-offload=6" in s["tested"]
    assert 0 < s["mean_kl"] < 1e-2 and s["top1_agreement"] >= 0.9


def test_speculative_decoding_verifies_through_the_decode_path(ckpt, tmp_path):
    prompts = tmp_path / "rep.jsonl"
    pattern = list(range(40, 46))
    prompts.write_text("".join(json.dumps({"prompt_token_ids": (pattern * 8)[i:]}) + "\n" for i in range(3)))
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}'
    s = run_kl(
        tmp_path,
        "--model",
        ckpt,
        "--dtype",
        "float32",
        "--prompts",
        str(prompts),
        "--prompt-len",
        "48",
        "--decode-tokens",
        "20",
        "--speculative-config",
        spec,
    )
    assert "speculative" in s["tested"] and s["decode"]["positions"] == 3 * 20
    assert s["mean_kl"] < 1e-9 and s["top1_agreement"] == 1.0


@pytest.mark.slow  # eight engine loads
def test_saved_reference_gives_the_in_process_numbers(ckpt, tmp_path):
    full, top = tmp_path / "full.safetensors", tmp_path / "top.safetensors"
    assert (
        main(
            [
                "eval",
                "kl",
                "--model",
                ckpt,
                "--dtype",
                "float32",
                *PROMPTS,
                "--save-base",
                str(full),
                "--base-top-k",
                "0",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "eval",
                "kl",
                "--model",
                ckpt,
                "--dtype",
                "float32",
                *PROMPTS,
                "--save-base",
                str(top),
                "--base-top-k",
                "8",
            ]
        )
        == 0
    )
    here = run_kl(tmp_path, "--model", ckpt, "--dtype", "bfloat16", *PROMPTS)
    from_file = run_kl(tmp_path, "--model", ckpt, "--dtype", "bfloat16", "--base", str(full), "--decode-tokens", "16")
    assert from_file["positions"] == here["positions"] and not from_file["approximate"]
    assert from_file["mean_kl"] == pytest.approx(here["mean_kl"], rel=1e-6)
    assert from_file["top1_agreement"] == here["top1_agreement"]
    approx = run_kl(tmp_path, "--model", ckpt, "--dtype", "bfloat16", "--base", str(top), "--decode-tokens", "16")
    assert approx["approximate"] and 0 < approx["mean_kl"] <= here["mean_kl"] * (1 + 1e-6)
    assert approx["top1_agreement"] == here["top1_agreement"]
    assert top.stat().st_size < full.stat().st_size / 5


def test_remote_server_top_k_approximation(ckpt, tmp_path, capsys):
    from kimitui.engine import AsyncLLM, EngineArgs
    from kimitui.server import BackgroundServer, create_app

    llm = AsyncLLM(engine_args=EngineArgs(model=ckpt, dtype="bfloat16", max_model_len=128, max_num_seqs=2))
    server = BackgroundServer(port=0).start(create_app(llm, "tiny", api_key="k"))
    try:
        s = run_kl(tmp_path, "--model", ckpt, *PROMPTS, "--base-url", server.url, "--api-key", "k")
    finally:
        server.stop()
        llm.shutdown()
    assert s["approximate"] and s["decode"]["positions"] == 0 and s["prefill"]["positions"] == 4 * 47
    assert 0 < s["mean_kl"] < 1e-2 and s["top1_agreement"] >= 0.9
    assert "approximation" in capsys.readouterr().out


@pytest.mark.slow
def test_tensor_parallel_on_gloo(ckpt, tmp_path):
    s = run_kl(tmp_path, "--model", ckpt, "--dtype", "bfloat16", "--tensor-parallel-size", "2", *PROMPTS)
    assert "tensor-parallel=2" in s["tested"]
    assert 0 < s["mean_kl"] < 1e-2 and s["top1_agreement"] >= 0.9 and s["decode"]["positions"] == 64


@pytest.mark.slow
def test_emulated_fp16_device_path(ckpt, tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "emu.json"
    env = {k: v for k, v in os.environ.items() if k not in ("KIMITUI_KERNELS", "KIMITUI_EVAL_BREAK")}
    env.update(KIMITUI_EMULATE_DEVICE="1", TRITON_INTERPRET="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kimitui.cli",
            "eval",
            "kl",
            "--model",
            ckpt,
            "--dtype",
            "float16",
            "--num-prompts",
            "2",
            "--prompt-len",
            "24",
            "--decode-tokens",
            "8",
            "--json",
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(out.read_text())
    assert "emulated device path" in s["tested"]
    assert 0 < s["mean_kl"] < 1e-2 and s["top1_agreement"] >= 0.9 and s["decode"]["positions"] == 16
