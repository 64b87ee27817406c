"""Launch budget of one decode step on the emulated device path, for Kimi K2.6's structure.

A decode step on a GPU is launch-bound: its cost is the number of kernels, not their size. This
test builds a tiny model with K2.6's structure (MLA with q-LoRA; a dense first layer, then MoE
layers with one shared expert; INT4 routed experts; sigmoid ``noaux_tc`` routing with a correction
bias; group-limited routing, n_group 4 / topk_group 2, so the grouped path is the one counted),
loads it in fp16 on the emulated device path (``KIMITUI_EMULATE_DEVICE=1``, ``TRITON_INTERPRET=1``,
set in a child's environment: the interpreter is chosen when ``@triton.jit`` runs) and counts, with
``kernels.launch_count.count_launches``, the ATen kernels, Triton launches, collectives and host
syncs of one decode step of three sequences (``ModelRunner.forward_step``: embedding, layers, final
norm, logits), split per decoder layer into its attention half (input norm + MLA) and its FFN half
(residual add + norm, router, experts, shared expert, residual add).

Counts do not depend on the tiny sizes: every op runs once per layer whatever the widths (the
kernel grids grow, not their number). They are taken on one rank. Tensor parallel adds, per layer,
exactly two collectives and no other op: the all-reduce after o_proj (heads are split) and the one
all-reduce of routed + shared expert partial sums (``DecoderLayer.forward``); per step, the
vocab-parallel embedding's all-reduce and the LM head's gather. A collective is one launch whatever
the number of ranks, so 6 ranks (K2.6 on six GPUs) add 2 collectives per layer and 2 per step to the
kernels counted here: 2 x 61 + 2 = 124 per step for the 61 layers of K2.6.

Before the small ops were fused (df1cbad, same structure and batch, fp16): 90 kernels per MoE
layer (MLA half 48, MoE half 42), 62 for the dense layer, 271 per step, and a host sync per MoE
layer (the grouped router's ``repeat_interleave``). With the first fused kernels (RMSNorm, residual
add + norm, router, query rope, cache write, split merge; ce2e1c0): 31 per MoE layer (13 + 18), 19
for the dense layer, 103 per step, no host sync. Now: 20 per MoE layer (9 + 11), 13 for the dense
layer, 75 per step, no host sync: 4.5x fewer than df1cbad and 6.7x fewer than the issue's count
("about 134 per MoE layer", which asks for at most 134 / 5 = 26.8, and at most 30 per layer).
What runs per MoE layer, one launch each: MLA half: add + norm (the residual form: a layer returns
``(out, residual)`` and the next norm adds them), fused q_a/kv_a GEMM, cache write + q_a norm, q_b
GEMM, absorbed query (W_UK product + query rope), MLA decode, split merge, W_UV bmm, o_proj GEMM;
MoE half: add + norm (+ the router's fp32 copy), router gate GEMM, router (+ weights in fp16 +
routing statistics), expert alignment, 2 fused-MoE GEMMs, combine (top-k sum + cast), shared
gate_up GEMM, SiLU-and-mul, shared down GEMM, the add of shared and routed outputs.
See benchmarks/README.md "Launch budget".
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# K2.6's structure at toy widths: 3 layers = the dense first layer and two MoE layers
STRUCTURE = dict(
    num_hidden_layers=3,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
)

# measured on df1cbad (before) and set from this branch's counts (20, 9, 11, 13, 75) with a margin of
# one or two launches
BEFORE = {"moe_layer": 90, "mla_half": 48, "moe_half": 42, "dense_layer": 62, "step": 271, "host_syncs": 2}
BUDGET = {"moe_layer": 22, "mla_half": 10, "moe_half": 12, "dense_layer": 15, "step": 78}
ISSUE_MOE_LAYER = 134  # issue 20's count per MoE layer before the work: at least a 5x cut, at most 30


def _measure(tmp_path, kind: str = "k2") -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("KIMITUI_KERNELS",)}
    env.update(KIMITUI_EMULATE_DEVICE="1", TRITON_INTERPRET="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.engine.runner.test_launch_budget", str(tmp_path), kind],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        pytest.fail(f"launch-count child failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def table(result: dict) -> str:
    """The markdown table of benchmarks/README.md "Launch budget"."""
    rows = ["| part | kernels | ATen | Triton | collectives (1 rank) | host syncs |", "|---|---|---|---|---|---|"]
    for name, c in result["parts"].items():
        rows.append(
            f"| {name} | {c['kernels']} | {c['aten']} | {c['triton']} | {c['collectives']} | {c['host_syncs']} |"
        )
    return "\n".join(rows)


def test_decode_step_stays_under_the_launch_budget(tmp_path):
    result = _measure(tmp_path)
    print("\n" + table(result))
    assert result["backend"] == "TritonBackend"
    parts = result["parts"]
    moe, step = parts["MoE layer (MLA + MoE)"], parts["decode step"]
    assert step["host_syncs"] == 0, result["syncs"]  # no host sync anywhere in the forward
    assert step["collectives"] == 0  # one rank: the all-reduces are no-ops (see the docstring for 6 ranks)
    assert moe["kernels"] <= BUDGET["moe_layer"], (moe, result["ops"])
    assert parts["  MLA half (input norm + attention)"]["kernels"] <= BUDGET["mla_half"]
    assert parts["  MoE half (add + norm, router, experts, shared, add)"]["kernels"] <= BUDGET["moe_half"]
    assert parts["dense layer (MLA + MLP)"]["kernels"] <= BUDGET["dense_layer"]
    assert step["kernels"] <= BUDGET["step"], step
    # the issue's acceptance, and well under the op-by-op counts (a regression to op by op fails too)
    assert moe["kernels"] * 5 <= ISSUE_MOE_LAYER and moe["kernels"] <= 30
    assert moe["kernels"] * 4 <= BEFORE["moe_layer"] and step["kernels"] * 3 <= BEFORE["step"]


# -- child: build, load on the emulated device path, count one decode step -------------------------


def _snapshot(counts) -> dict:
    return {
        "aten": sum(counts.aten.values()),
        "triton": sum(counts.triton.values()),
        "collectives": sum(counts.collectives.values()),
        "host_syncs": sum(counts.host_syncs.values()),
        "ops": dict(counts.aten) | {f"triton:{k}": v for k, v in counts.triton.items()},
    }


def _diff(a: dict, b: dict) -> dict:
    out = {k: b[k] - a[k] for k in ("aten", "triton", "collectives", "host_syncs")}
    out["kernels"] = out["aten"] + out["triton"]
    return out


def _child(path: str) -> None:
    from kimitui.engine import LLM
    from kimitui.engine.runner.model_runner import StepInputs
    from kimitui.kernels.launch_count import count_launches
    from tests.helpers.checkpoints import write_hf_checkpoint
    from tests.helpers.quantized import quantize_checkpoint

    hf = write_hf_checkpoint(Path(path), seed=5, **STRUCTURE)
    quantize_checkpoint(Path(path), "int4", hf)
    # eager: the step as launched op by op (a graphed step replays these same kernels in one launch)
    llm = LLM(
        path,
        dtype="float16",
        max_model_len=96,
        max_num_seqs=8,
        enable_prefix_caching=False,
        kv_cache_tokens=512,
        enforce_eager=True,
    )
    runner = llm.engine.runner
    layers = runner.model.model.layers
    step = StepInputs(
        ids=[11, 12, 13],
        num_decodes=3,
        decode_tables=[[1, 2], [3], [4, 5, 6]],
        decode_lens=[20, 5, 40],
        prefills=[],
        sample_rows=[0, 1, 2],
    )
    runner.forward_step(step)  # warm: lazy buffers, kernel compilation
    marks: dict[str, list] = {}
    live = {}

    def mark(name):
        def hook(*_):
            marks.setdefault(name, []).append(_snapshot(live["counts"]))

        return hook

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(mark(f"{i}.start")))
        handles.append(layer.self_attn.register_forward_hook(mark(f"{i}.attn_end")))
        handles.append(layer.register_forward_hook(mark(f"{i}.end")))
    with count_launches() as counts:
        live["counts"] = counts
        start = _snapshot(counts)
        runner.forward_step(step)
    for h in handles:
        h.remove()
    end = _snapshot(counts)
    moe_i = STRUCTURE["first_k_dense_replace"]  # the first MoE layer
    m = {k: v[0] for k, v in marks.items()}
    parts = {
        "dense layer (MLA + MLP)": _diff(m["0.start"], m["0.end"]),
        "MoE layer (MLA + MoE)": _diff(m[f"{moe_i}.start"], m[f"{moe_i}.end"]),
        "  MLA half (input norm + attention)": _diff(m[f"{moe_i}.start"], m[f"{moe_i}.attn_end"]),
        "  MoE half (add + norm, router, experts, shared, add)": _diff(m[f"{moe_i}.attn_end"], m[f"{moe_i}.end"]),
        "decode step": _diff(start, end),
    }

    def ops(a: dict, b: dict) -> dict:
        return {k: v - a["ops"].get(k, 0) for k, v in sorted(b["ops"].items()) if v - a["ops"].get(k, 0)}

    last = len(layers) - 1
    outside = ops(start, m["0.start"]) | {f"after: {k}": v for k, v in ops(m[f"{last}.end"], end).items()}
    result = {
        "backend": type(layers[0].self_attn.ops).__name__,
        "parts": parts,
        "ops": ops(m[f"{moe_i}.start"], m[f"{moe_i}.end"]),
        "outside_layers": outside,
        "syncs": dict(counts.host_syncs),
    }
    llm.shutdown()
    print(json.dumps(result))


# -- Kimi K3: KDA and MLA layers, latent MoE with MXFP4 experts, AttnRes -------------------------

# K3's structure at toy widths (tests/helpers/k3_checkpoint.py): a dense first layer (KDA), then
# MoE layers, KDA and gated NoPE MLA interleaved, the last one MLA; AttnRes blocks of 2
K3_STRUCTURE = dict(num_layers=5, kda_layers=(1, 2, 4), full_attn_layers=(3, 5))
K3_LAYER_BUDGET = 30  # issue 25: at most 30 kernels per layer, KDA layers included
# Measured on the emulated path (fp16, 3 decodes, 2026-12-02). Before the K3 fusions: KDA + MoE layer
# 106 kernels (97 ATen, 9 Triton), MLA + MoE layer 61 (48 + 13), the dense KDA layer 79, 451 per step,
# no host sync: the KDA decode (gate, beta, conv and delta rule in PyTorch where fla-core is not used,
# the gated RMSNorm) and the AttnRes mixes ran op by op. Now: KDA + MoE 21 (11 + 10), MLA + MoE 27
# (13 + 14), the dense KDA layer 10, 130 per step, no host sync. One launch each for the KDA decode
# step (kernels/triton/kda_decode.py), each AttnRes mix with its norm (and the running sum's add, the block
# snapshot: kernels/triton/attn_res_mix.py), MLA's NoPE cache write and absorbed query, its output gate.
K3_BEFORE = {"kda_moe_layer": 106, "mla_moe_layer": 61, "kda_dense_layer": 79, "step": 451}


def test_k3_decode_step_stays_under_the_launch_budget(tmp_path):
    result = _measure(tmp_path, "k3")
    print("\n" + table(result))
    assert result["backend"] == "TritonBackend"
    parts = result["parts"]
    step = parts["decode step"]
    assert step["host_syncs"] == 0, result["syncs"]  # capturable: nothing asks the host
    assert step["collectives"] == 0
    kinds = {name.split(" ", 2)[2] for name in parts if name.startswith("layer ")}
    assert kinds == {"(KDA + MLP)", "(KDA + MoE)", "(MLA + MoE)"}, kinds  # every layer kind is counted
    for name, c in parts.items():
        if name.startswith("layer "):
            assert c["kernels"] <= K3_LAYER_BUDGET, (name, c, result["ops"].get(name))
    # well under the op-by-op counts: a regression to op by op (a fusion falling back) fails too
    assert step["kernels"] * 3 <= K3_BEFORE["step"], step


def _k3_child(path: str) -> None:
    from kimitui.engine import LLM
    from kimitui.engine.runner.model_runner import StepInputs
    from kimitui.kernels.launch_count import count_launches
    from tests.helpers.k3_checkpoint import write_k3_checkpoint

    write_k3_checkpoint(Path(path), seed=3, **K3_STRUCTURE)
    llm = LLM(
        path,
        dtype="float16",
        max_model_len=96,
        max_num_seqs=8,
        enable_prefix_caching=False,
        kv_cache_tokens=512,
        enforce_eager=True,
    )
    runner = llm.engine.runner
    layers = runner.model.model.layers
    step = StepInputs(
        ids=[11, 12, 13],
        num_decodes=3,
        decode_tables=[[1, 2], [3], [4, 5, 6]],
        decode_lens=[20, 5, 40],
        prefills=[],
        sample_rows=[0, 1, 2],
        state_slots=[0, 1, 2],
    )
    runner.forward_step(step)  # warm: lazy buffers, kernel compilation
    live, marks = {}, {}

    def wrap(i, fn):  # the model calls forward_attn_res, which module hooks do not see
        def counted(*args, **kwargs):
            marks[f"{i}.start"] = _snapshot(live["counts"])
            out = fn(*args, **kwargs)
            marks[f"{i}.end"] = _snapshot(live["counts"])
            return out

        return counted

    for i, layer in enumerate(layers):
        layer.forward_attn_res = wrap(i, layer.forward_attn_res)
    with count_launches() as counts:
        live["counts"] = counts
        start = _snapshot(counts)
        runner.forward_step(step)
    end = _snapshot(counts)
    parts, ops = {}, {}
    for i, layer in enumerate(layers):
        kind = f"({'KDA' if layer.is_kda else 'MLA'} + {'MoE' if hasattr(layer.mlp, 'experts') else 'MLP'})"
        name = f"layer {i} {kind}"
        a, b = marks[f"{i}.start"], marks[f"{i}.end"]
        parts[name] = _diff(a, b)
        ops[name] = {k: v - a["ops"].get(k, 0) for k, v in sorted(b["ops"].items()) if v - a["ops"].get(k, 0)}
    parts["decode step"] = _diff(start, end)
    result = {
        "backend": type(layers[1].mlp.gate.ops).__name__,
        "parts": parts,
        "ops": ops,
        "syncs": dict(counts.host_syncs),
    }
    llm.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    (_k3_child if sys.argv[2:] == ["k3"] else _child)(sys.argv[1])
