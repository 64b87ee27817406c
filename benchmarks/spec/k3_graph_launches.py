"""Launches of a Kimi K3 verification step (drafting on), graphed against eager, on the emulated device
path (``KIMITUI_EMULATE_DEVICE=1``, ``TRITON_INTERPRET=1``, fp16), with the replay's agreement.

Runs the child of tests/engine/runner/graphs/test_graph_verify_k3.py: a tiny K3 (KDA layers 1-3, MLA layer 4),
three sequences verifying up to 3 drafts each over four speculative steps (rejected drafts, KDA
rollbacks, padding positions, a padding sequence, buckets 4 and 2), one eager runner and one whose
verify graphs are ``EmulatedGraph`` recordings. Eager launches are counted op by op; graphed launches
are what the host issues: the step's ops outside the graph plus one per replay.

    python -m benchmarks.spec.k3_graph_launches      # a markdown table, then one JSON line
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> int:
    sys.path.insert(0, str(REPO))
    from tests.engine.runner.graphs.test_graph_verify_k3 import STEPS
    from tests.helpers.k3_checkpoint import write_k3_checkpoint

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KIMITUI_EMULATE_DEVICE")}
    env.update(KIMITUI_EMULATE_DEVICE="1", TRITON_INTERPRET="1", HF_HUB_OFFLINE="1")
    with tempfile.TemporaryDirectory() as tmp:
        write_k3_checkpoint(Path(tmp), seed=3, num_layers=4, kda_layers=(1, 2, 3), full_attn_layers=(4,))
        proc = subprocess.run(
            [sys.executable, "-m", "tests.engine.runner.graphs.test_graph_verify_k3", tmp],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=1200,
        )
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        return 1
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    print(
        "| step | rows per sequence | eager launches | graphed launches (replay = 1) | max abs diff logits / MLA cache / KDA state |"
    )
    print("|---|---|---|---|---|")
    for i, ((lens, _), s) in enumerate(zip(STEPS, got["steps"])):
        shown = ", ".join("-" if n is None else str(n) for n in lens)
        print(
            f"| {i + 1} | {shown} | {s['eager_launches']} | {s['graphed_launches']} | "
            f"{s['logits']:.1e} / {s['mla_cache']:.1e} / {s['kda_state']:.1e} |"
        )
    print(json.dumps(got))
    return 0


if __name__ == "__main__":
    sys.exit(main())
