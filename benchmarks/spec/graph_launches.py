"""Launches of a K2 decode step with an EAGLE-3 drafter on, graphed against eager, on the emulated
device path (``KIMITUI_EMULATE_DEVICE=1``, ``TRITON_INTERPRET=1``, fp16; set here for a child
process, as tests/engine/runner/test_launch_budget.py does).

The target keeps its aux hidden states for the drafter. Before, such a step never took the decode
graphs (``keep_all_rows`` excluded them); now a decode-only step (plain decodes, or a verification
of 1 + k rows per sequence) replays its bucket's graph and the aux states come out of the graph's
static memory. On a GPU a replay is one launch for everything ``DecodeGraphRunner._forward`` runs,
so the graphed count is: the step's launches outside that forward, plus one. Under emulation the
forward still runs op by op, which is what lets this count it.

    python -m benchmarks.spec.graph_launches            # prints a table and one JSON line
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STRUCTURE = dict(
    num_hidden_layers=3,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
)


def _child(path: str) -> dict:
    import torch

    from kimitui.engine import LLM
    from kimitui.engine.runner.graphs import DecodeGraphRunner
    from kimitui.engine.runner.model_runner import StepInputs
    from kimitui.kernels.launch_count import count_launches
    from tests.helpers.checkpoints import BASE, write_hf_checkpoint
    from tests.helpers.spec.eagle3_mla_checkpoint import write_mla_checkpoint

    target, drafter = Path(path) / "k2", Path(path) / "drafter"
    write_hf_checkpoint(target, seed=5, **STRUCTURE)
    write_mla_checkpoint(drafter, {**BASE, **STRUCTURE}, aux_layer_ids=(1, 2, 3), seed=1)
    spec = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 3}
    # a verification step: sequence A verifies 3 drafts (4 rows), B and C decode plainly
    step = dict(
        ids=[11, 5, 6, 7, 12, 13],
        num_decodes=6,
        decode_tables=[[1, 2]] * 4 + [[3], [4, 5]],
        decode_lens=[20, 21, 22, 23, 5, 30],
        prefills=[],
        sample_rows=list(range(6)),
    )
    plain = dict(
        ids=[11, 12, 13],
        num_decodes=3,
        decode_tables=[[1, 2], [3], [4, 5]],
        decode_lens=[20, 5, 30],
        prefills=[],
        sample_rows=[0, 1, 2],
    )
    out = {}
    for mode in ("eager", "graphed"):
        llm = LLM(
            str(target),
            dtype="float16",
            max_model_len=96,
            max_num_seqs=4,
            enable_prefix_caching=False,
            kv_cache_tokens=512,
            enforce_eager=mode == "eager",
            speculative_config=spec,
        )
        runner = llm.engine.runner
        assert (runner.graphs is not None) == (mode == "graphed") and runner.keep_hidden
        for name, kw in (("verify (1 + 3 rows, 2 decodes)", step), ("decode (3 rows)", plain)):
            inp = StepInputs(**kw)
            inp.keep_all_rows = True
            if kw is step:
                inp.spec_lens = [4, 1, 1]
            runner.forward_step(inp)  # warm
            inside = {}
            real = DecodeGraphRunner._forward

            def forward(self, b, _real=real):
                before = sum(counts.aten.values()) + sum(counts.triton.values())
                try:
                    return _real(self, b)
                finally:
                    inside["n"] = inside.get("n", 0) + sum(counts.aten.values()) + sum(counts.triton.values()) - before

            DecodeGraphRunner._forward = forward
            try:
                with count_launches() as counts:
                    logits, _ = runner.forward_step(inp)
            finally:
                DecodeGraphRunner._forward = real
            total = sum(counts.aten.values()) + sum(counts.triton.values())
            aux = runner.model.aux_hidden
            row = {
                "op by op": total,
                "host syncs": sum(counts.host_syncs.values()),
                "aux rows": int(aux.shape[0]) if aux is not None else 0,
            }
            if mode == "graphed":
                row["inside graph"] = inside.get("n", 0)
                row["launches (graph replay = 1)"] = total - inside.get("n", 0) + 1
            else:
                row["launches (graph replay = 1)"] = total
            row["logits"] = logits.float().cpu().tolist()
            row["aux"] = aux[: len(kw["ids"])].float().cpu().tolist()
            out.setdefault(name, {})[mode] = row
        llm.shutdown()
    return out


def main() -> int:
    if os.environ.get("_SPEC_GRAPH_CHILD"):
        result = _child(sys.argv[1])
        print(json.dumps(result))
        return 0
    env = {
        **os.environ,
        "KIMITUI_EMULATE_DEVICE": "1",
        "TRITON_INTERPRET": "1",
        "HF_HUB_OFFLINE": "1",
        "_SPEC_GRAPH_CHILD": "1",
    }
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.spec.graph_launches", tmp],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        return 1
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    import torch

    print(
        "| step | eager launches | graphed launches (replay = 1) | inside the graph | aux rows | host syncs "
        "(eager / graphed) | max abs diff logits / aux |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in result.items():
        e, g = r["eager"], r["graphed"]
        dl = (torch.tensor(e["logits"]) - torch.tensor(g["logits"])).abs().max().item()
        da = (torch.tensor(e["aux"]) - torch.tensor(g["aux"])).abs().max().item()
        print(
            f"| {name} | {e['launches (graph replay = 1)']} | {g['launches (graph replay = 1)']} | "
            f"{g['inside graph']} | {g['aux rows']} | {e['host syncs']} / {g['host syncs']} | {dl:.2e} / {da:.2e} |"
        )
    slim = {
        n: {m: {k: v for k, v in row.items() if k not in ("logits", "aux")} for m, row in r.items()}
        for n, r in result.items()
    }
    print(json.dumps(slim))
    return 0


if __name__ == "__main__":
    sys.exit(main())
