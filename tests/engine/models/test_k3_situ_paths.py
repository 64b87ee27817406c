"""Kimi K3's SiTU routed experts on the fast paths, end to end on a tiny K3 checkpoint (MXFP4 experts):

- the emulated device path (``KIMITUI_EMULATE_DEVICE=1``, ``TRITON_INTERPRET=1``, fp16) with most
  experts in host RAM (``cpu_offload``): the device experts run in the fused Triton MoE kernel (SiTU
  in its epilogue), the host experts in the packed C++ CPU MoE, on the CPU expert executor;
- the plain CPU path with the same offload, and without it;

all give the greedy tokens the float64 K3 reference (tests/helpers/k3_reference.py, no engine code)
predicts, and log-probs close to the plain CPU path's. Each run is a child process configured through
its environment (the Triton interpreter is chosen when ``@triton.jit`` runs). Tolerance: as
tests/engine/test_emulated_device.py (fp16 activations: 0.02 on log-probs; fp32 CPU paths: 1e-4).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
PROMPTS = [[5, 17, 3, 99, 41, 7, 63, 120, 8], [250, 2, 8, 120]]
MAX_TOKENS = 4
NUM_EXPERTS = 8
OFFLOADED = NUM_EXPERTS - 2  # experts per layer in host RAM


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.helpers.k3_checkpoint import write_k3_checkpoint

    path = tmp_path_factory.mktemp("k3_situ")
    tensors = write_k3_checkpoint(
        path, seed=3, num_layers=4, kda_layers=(1, 2), full_attn_layers=(3, 4), num_experts=NUM_EXPERTS
    )
    return path, tensors


def _run(path: Path, dtype: str, offload: str, emulate: bool) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TRITON_INTERPRET", "KIMITUI_EMULATE_DEVICE", "KIMITUI_KERNELS")
    }
    if emulate:
        env.update(KIMITUI_EMULATE_DEVICE="1", TRITON_INTERPRET="1")
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.engine.models.test_k3_situ_paths", str(path), dtype, offload],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        pytest.fail(
            f"child ({dtype}, offload={offload}, emulate={emulate}) failed (rc={proc.returncode}):\n"
            f"{proc.stderr[-4000:]}"
        )
    return json.loads(lines[-1])


def _reference_tokens(path: Path, tensors: dict) -> list[list[int]]:
    from tests.helpers.k3_reference import K3Reference

    ref = K3Reference(json.loads((path / "config.json").read_text()), tensors)
    outs = []
    for prompt in PROMPTS:
        ids = list(prompt)
        for _ in range(MAX_TOKENS):
            ids.append(int(ref.logprobs(ids)[-1].argmax()))
        outs.append(ids[len(prompt) :])
    return outs


def _max_diff(a: dict, b: dict) -> float:
    return max(abs(x - y) for key in ("prompt_lp", "gen_lp") for sa, sb in zip(a[key], b[key]) for x, y in zip(sa, sb))


def test_cpu_paths_with_and_without_host_experts_match_the_reference(ckpt):
    path, tensors = ckpt
    want = _reference_tokens(path, tensors)
    local = _run(path, "float32", "none", emulate=False)
    offloaded = _run(path, "float32", str(OFFLOADED), emulate=False)
    assert local["stacks"] == {"local": ["CpuBackend"]}, local["stacks"]
    assert offloaded["stacks"] == {"host": ["CpuBackend"], "local": ["CpuBackend"]}, offloaded["stacks"]
    assert offloaded["host_experts"] == [OFFLOADED] * 3  # the three MoE layers
    assert local["tokens"] == want and offloaded["tokens"] == want
    assert _max_diff(local, offloaded) < 1e-4


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_emulated_device_with_host_experts_matches_the_reference(ckpt):
    path, tensors = ckpt
    want = _reference_tokens(path, tensors)
    cpu = _run(path, "float32", "none", emulate=False)
    dev = _run(path, "float16", str(OFFLOADED), emulate=True)
    # device experts on the Triton backend, host experts on the CPU backend, SiTU fused in both
    assert dev["stacks"] == {"host": ["CpuBackend"], "local": ["TritonBackend"]}, dev["stacks"]
    assert dev["triton"].get("_fused_moe_kernel", 0) > 0, dev["triton"]
    assert dev["tokens"] == want, (dev["tokens"], want)
    worst = _max_diff(cpu, dev)
    print(f"k3 emulated device + host experts vs CPU: max |log-prob difference| {worst:.2e}")
    assert worst < 0.02


def test_a_backend_without_situ_experts_is_refused_at_load(ckpt):
    import dataclasses

    from kimitui.engine.config import ModelConfig
    from kimitui.engine.layers.moe import RoutedExperts
    from kimitui.kernels.backend import Backend

    class SiluOnly(Backend):
        name = "silu-only"
        expert_activations = ("silu",)

    config = ModelConfig.from_pretrained(ckpt[0])
    experts = RoutedExperts(
        dataclasses.replace(config, hidden_size=config.routed_expert_hidden_size), "model.layers.1.mlp.experts"
    )
    assert experts.local.activation.kind == "situ" and experts.local.activation.linear_beta == 25.0
    experts.post_load(torch.float32)  # the reference backend computes SiTU
    experts.local.ops = SiluOnly()
    with pytest.raises(ValueError, match="silu-only backend's MoE kernels compute silu, not the experts' activation"):
        experts.post_load(torch.float32)


# -- child: load, generate, report ----------------------------------------------------------------


def _child(path: str, dtype: str, offload: str) -> None:
    from kimitui.engine import LLM
    from kimitui.engine.layers.moe import RoutedExperts
    from tests.helpers.greedy_run import greedy_run

    llm = LLM(
        path,
        dtype=dtype,
        max_model_len=64,
        max_num_seqs=2,
        enable_prefix_caching=False,
        cpu_offload=offload if offload == "none" else int(offload),
    )
    experts = [m for m in llm.engine.model.modules() if isinstance(m, RoutedExperts)]
    stacks: dict[str, set] = {}
    for m in experts:
        for name in ("local", "host"):
            stack = getattr(m, name)
            if stack is not None:
                assert stack.activation is not None and stack.activation.kind == "situ"
                stacks.setdefault(name, set()).add(type(stack.ops).__name__)
    with torch.inference_mode():
        record, counts = greedy_run(llm, PROMPTS, MAX_TOKENS)
    llm.shutdown()
    print(
        json.dumps(
            {
                "stacks": {k: sorted(v) for k, v in sorted(stacks.items())},
                "triton": dict(counts.triton),
                "host_experts": [m.host.num for m in experts if m.host is not None],
                **record,
            }
        )
    )


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], sys.argv[3])
