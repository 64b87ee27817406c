"""Launches per decode step with host-RAM experts (``--cpu-offload``): eager against piecewise graphs.

Before, any expert in host RAM turned decode graphs off for the whole model, so every kernel of the
step was launched from the host. Now the step is captured in segments cut at each MoE layer's host
join (engine/runner/piecewise.py) and replayed: a replayed segment is one launch from the host
(``kernels.launch_count``: graph launches count one each, the kernels inside are not counted again).

This script builds tiny checkpoints in the real on-disk formats (Kimi K3: demo-k3's layout, KDA layers
then MLA, MXFP4 latent experts; Kimi K2: MLA, INT4 experts), loads each on the emulated device path
(``KIMITUI_EMULATE_DEVICE=1 TRITON_INTERPRET=1``, set here for a child process) with ``--cpu-offload N``,
captures the decode graphs with the CPU emulation of capture (engine/runner/emulated_graph.py) and counts one
decode step of five sequences (bucket 8) eager and replayed, then times both, alternating, in the same
process (medians of ``--repeats``). Launch counts do not depend on the widths (grids grow, not the
number of launches), so they carry over to the real models per layer; the milliseconds do not: under
the Triton interpreter every kernel is Python, so eager and replayed steps do the same slow work and
the time shows only the Python a replay skips.

    python benchmarks/piecewise_graphs.py [--repeats 5] [--models k3,k2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LENS = [20, 5, 40, 17, 33]  # bucket 8: three padding rows
SLOTS = [2, 5, 1, 7, 0]
BLOCK = 16
K2_STRUCTURE = dict(
    num_hidden_layers=3,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
)


def measure(kind: str, repeats: int) -> dict:
    """In the emulated child: launches and ms per step of model ``kind``, eager and piecewise."""
    with tempfile.TemporaryDirectory() as tmp:
        return _measure(kind, repeats, tmp)


def _measure(kind: str, repeats: int, tmp: str) -> dict:
    from kimitui.engine import LLM
    from kimitui.engine.kv_cache.state import KDAState
    from kimitui.engine.runner.model_runner import ModelRunner, StepInputs
    from kimitui.kernels.launch_count import count_launches

    if kind == "k3":
        from tests.helpers.k3_checkpoint import write_k3_checkpoint

        write_k3_checkpoint(Path(tmp), seed=3, num_layers=4, kda_layers=(1, 2, 3), full_attn_layers=(4,))
        offload = 5
    else:
        from tests.helpers.checkpoints import write_hf_checkpoint
        from tests.helpers.quantized import quantize_checkpoint

        hf = write_hf_checkpoint(Path(tmp), seed=5, **K2_STRUCTURE)
        quantize_checkpoint(Path(tmp), "int4", hf)
        offload = 8
    llm = LLM(
        tmp,
        dtype="float16",
        max_model_len=64,
        max_num_seqs=8,
        enable_prefix_caching=False,
        kv_cache_tokens=512,
        cpu_offload=offload,
        enforce_eager=True,
    )
    base = llm.engine.runner
    runners = {
        "eager": ModelRunner(
            base.model,
            base.kv_caches,
            base.block_size,
            base.device,
            max_num_seqs=8,
            max_model_len=64,
            decode_graphs=False,
        ),
        "piecewise": ModelRunner(
            base.model,
            base.kv_caches,
            base.block_size,
            base.device,
            max_num_seqs=8,
            max_model_len=64,
            decode_graphs=True,
            emulate_graphs=True,
        ),
    }
    graphs = runners["piecewise"].graphs
    t0 = time.perf_counter()
    graphs.capture_all()
    capture_s = time.perf_counter() - t0
    hybrid = any(isinstance(c, KDAState) for c in base.kv_caches)
    tables = [[i * 4 + j for j in range(-(-n // BLOCK))] for i, n in enumerate(LENS)]
    inp = StepInputs(
        ids=[11, 12, 13, 14, 15],
        num_decodes=5,
        decode_tables=tables,
        decode_lens=list(LENS),
        prefills=[],
        sample_rows=list(range(5)),
        state_slots=list(SLOTS) if hybrid else [],
    )
    caches = [t for c in base.kv_caches for t in ([c.recurrent, c.conv] if isinstance(c, KDAState) else [c])]
    before = [t.clone() for t in caches]
    out = {
        "model": kind,
        "cpu_offload": offload,
        "layers": len(base.model.model.layers),
        "host_layers": len(graphs.host_experts),
        "segments": graphs.segments(8),
        "capture_s": round(capture_s, 1),
    }
    ms = {name: [] for name in runners}
    logits = {}
    for r in range(repeats + 2):  # round 0 warms up (first-step buffers), round 1 counts, then timed
        for name, runner in runners.items():  # alternating, same caches each time
            for t, b in zip(caches, before):
                t.copy_(b)
            if r == 0:
                runner.forward_step(inp)
                continue
            if r == 1:
                with count_launches() as c:
                    step_logits = runner.forward_step(inp)[0]
                logits[name] = step_logits.float()
                out[name] = {
                    "launches": c.launches,
                    "kernels": c.kernels,
                    "graph_launches": sum(c.graphs.values()),
                    "host_syncs": sum(c.host_syncs.values()),
                }
                continue
            t0 = time.perf_counter()
            runner.forward_step(inp)[0].argmax(-1).tolist()
            ms[name].append((time.perf_counter() - t0) * 1e3)
    for name in runners:
        out[name]["ms_median"] = round(statistics.median(ms[name]), 1)
    out["max_logits_diff"] = float((logits["eager"] - logits["piecewise"]).abs().max())
    llm.shutdown()
    return out


def table(results: list[dict]) -> str:
    rows = [
        "| model (layers, MoE layers with host experts) | step | launches per step | kernels outside graphs | "
        "graph launches | host ms per step (interpreter) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        name = f"{r['model'].upper()} ({r['layers']}, {r['host_layers']}; --cpu-offload {r['cpu_offload']})"
        for step in ("eager", "piecewise"):
            c = r[step]
            rows.append(
                f"| {name} | {step} | {c['launches']} | {c['kernels']} | {c['graph_launches']} | {c['ms_median']} |"
            )
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--models", default="k3,k2")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.repeats)))
        return 0
    env = dict(os.environ, KIMITUI_EMULATE_DEVICE="1", TRITON_INTERPRET="1", HF_HUB_OFFLINE="1")
    env.pop("KIMITUI_KERNELS", None)
    results = []
    for kind in args.models.split(","):
        proc = subprocess.run(
            [sys.executable, __file__, "--child", kind, "--repeats", str(args.repeats)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            return 1
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
