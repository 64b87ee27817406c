"""The device path, emulated on a CPU, against the CPU path: K2 INT4, K2 FP8 and K3 MXFP4.

``KIMITUI_EMULATE_DEVICE=1`` with ``TRITON_INTERPRET=1`` makes a CPU run take the branches a GPU run
takes: the Triton backend (quantised GEMMs, fused MoE, paged MLA decode, norms, router, rope and
cache write as Triton kernels, interpreted on CPU tensors) and no C++ CPU kernels. Each case writes a
tiny checkpoint once, then runs it in two child processes, configured only through their
environment (the interpreter is chosen when ``@triton.jit`` runs, so it cannot be switched inside
this process): the plain CPU path in float32 and the emulated device path in float16 (not bf16: the
interpreter multiplies bf16 dots as raw bits, triton issue #11584). Greedy tokens must be equal and
the log-probs of prompt and generated tokens close.

Tolerance (``LOGPROB_ATOL`` = 0.02): fp16 rounds every stored activation with relative error <= 2^-11
(4.9e-4). A log-prob is a difference of logits; with a few roundings per layer, L = 3-4 layers and
logits below ~3 in these tiny models the error stays around ``L * 4 * 4.9e-4 * 3`` ~ 0.02 at worst.
Measured (2026-12-01): K2 INT4 2.9e-4, K2 FP8 2.9e-4, K3 MXFP4 3.5e-3 (its SiTU experts and KDA
layers run more fp16 roundings) over 17 log-probs each. The fp32 path itself is pinned to Hugging
Face by the oracle tests; this bound has to catch a wrong kernel, which moves log-probs by O(1), or a
wrong routing choice (O(0.1) here).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOGPROB_ATOL = 0.02
PROMPTS = [[5, 17, 3, 99, 41, 7, 63], [250, 2, 8, 120]]
MAX_TOKENS = 4

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _write(kind: str, path: Path) -> None:
    if kind == "k3_mxfp4":
        from tests.helpers.k3_checkpoint import write_k3_checkpoint

        write_k3_checkpoint(path, seed=3, num_layers=4, kda_layers=(1, 2), full_attn_layers=(3, 4))
        return
    from tests.helpers.checkpoints import write_hf_checkpoint
    from tests.helpers.quantized import quantize_checkpoint

    # K2's shape at toy size: MLA with q-LoRA, a dense first layer, then MoE with a shared expert
    hf = write_hf_checkpoint(path, seed=11, num_hidden_layers=3)
    quantize_checkpoint(path, kind.split("_")[1], hf)


def _run_child(path: Path, dtype: str, emulate: bool) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TRITON_INTERPRET", "KIMITUI_EMULATE_DEVICE", "KIMITUI_KERNELS")
    }
    if emulate:
        env.update(KIMITUI_EMULATE_DEVICE="1", TRITON_INTERPRET="1")
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.engine.test_emulated_device", str(path), dtype],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        pytest.fail(f"child ({dtype}, emulate={emulate}) failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


@pytest.mark.parametrize("kind", ["k2_int4", "k2_fp8", "k3_mxfp4"])
def test_emulated_device_path_matches_cpu_path(kind, tmp_path):
    _write(kind, tmp_path)
    cpu = _run_child(tmp_path, "float32", emulate=False)
    dev = _run_child(tmp_path, "float16", emulate=True)
    assert cpu["backends"] == ["CpuBackend"], cpu["backends"]
    assert dev["backends"] == ["TritonBackend"], dev["backends"]  # the child really took the device path
    assert dev["triton_launches"] > 0 and cpu["triton_launches"] == 0
    assert dev["tokens"] == cpu["tokens"], (kind, cpu["tokens"], dev["tokens"])
    worst = 0.0
    for key in ("prompt_lp", "gen_lp"):
        for a_seq, b_seq in zip(cpu[key], dev[key]):
            assert len(a_seq) == len(b_seq)
            worst = max([worst] + [abs(a - b) for a, b in zip(a_seq, b_seq)])
    print(f"{kind}: max |log-prob difference| {worst:.2e} over {sum(map(len, cpu['prompt_lp'] + cpu['gen_lp']))}")
    assert worst < LOGPROB_ATOL, f"{kind}: max |log-prob difference| {worst:.4f} >= {LOGPROB_ATOL}"


def test_plain_small_ops_match_their_kernels_references():
    # The reference (and CPU) forms of the backend ops the device path runs as one launch each: the
    # layer-facing contract (x receives the sum; the cache row gets norm + rope) equals the oracles
    # the Triton kernels are tested against in tests/kernels.
    import torch

    from kimitui.engine.config import RopeScaling
    from kimitui.engine.layers.rope import YarnRotaryEmbedding
    from kimitui.kernels import reference as ref
    from kimitui.kernels.backend import REFERENCE

    torch.manual_seed(0)
    x, res, w = torch.randn(5, 40), torch.randn(5, 40), torch.rand(40) + 0.5
    want_norm, want_sum = ref.fused_add_rms_norm(x, res, w, 1e-6)
    x_in = x.clone()
    normed, summed = REFERENCE.add_rms_norm(x_in, res, w, 1e-6)
    torch.testing.assert_close(normed, want_norm, rtol=0, atol=0)
    torch.testing.assert_close(summed, want_sum, rtol=0, atol=0)
    assert summed.data_ptr() == x_in.data_ptr()  # the sum went into the caller's fresh tensor

    rope = YarnRotaryEmbedding(8, 10000.0, RopeScaling(factor=4.0, original_max_position_embeddings=16), 64)
    pos = torch.tensor([3, 0, 63, 17])
    kv, q_pe = torch.randn(4, 24), torch.randn(4, 3, 8)
    norm_w = torch.rand(16) + 0.5
    cache, want = torch.zeros(10, 24), torch.zeros(10, 24)
    slots = torch.tensor([7, 2, 9, 0])
    REFERENCE.mla_cache_write(kv, norm_w, 1e-6, rope, pos, slots, cache)
    ref.mla_cache_write(kv, norm_w, 1e-6, rope.cos, rope.sin, pos, slots, want)
    torch.testing.assert_close(cache, want, rtol=1e-6, atol=1e-6)
    assert cache[[1, 3, 4, 5, 6, 8]].abs().max() == 0  # only the four slots were written
    got_q = REFERENCE.mla_rope_query(q_pe, rope, pos)
    torch.testing.assert_close(got_q, ref.rope_mla(q_pe, kv[:, 16:], rope.cos, rope.sin, pos)[0], rtol=1e-6, atol=1e-6)


# -- child: load, generate, report ----------------------------------------------------------------


def _child(path: str, dtype: str) -> None:
    from kimitui.engine import LLM
    from kimitui.kernels.backend import Backend
    from tests.helpers.greedy_run import greedy_run

    llm = LLM(path, dtype=dtype, max_model_len=64, max_num_seqs=2, enable_prefix_caching=False)
    model = llm.engine.model
    backends = sorted({type(m.ops).__name__ for m in model.modules() if isinstance(getattr(m, "ops", None), Backend)})
    record, counts = greedy_run(llm, PROMPTS, MAX_TOKENS)
    llm.shutdown()
    print(json.dumps({"backends": backends, **record, "triton_launches": sum(counts.triton.values())}))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
