"""``--cpu-offload``: how much of the host experts' CPU time a decode step hides behind the device.

A K2.6-shaped model of two layers (the dense first one and one MoE layer) keeps a share of each MoE
layer's experts in host RAM (computed by the CPU kernels while the device computes its own
experts), decodes at batch 1 and 64, and asks the engine's overlap meter
(``engine.offload.overlap_meter``: ``enable(model)``, ``report(model)``) for host time, time the
device waited at the join, and the hidden fraction ``1 - wait / host``. Where the engine has no
overlap meter yet the section says so and skips.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator

from benchmarks.gpucheck.common import FAIL, PASS, SKIP, Row
from benchmarks.gpucheck.models import Bench, build_random_model, decode_step, kimi_config

S = "offload"


def offload_rows(mode, sink) -> None:
    if importlib.util.find_spec("kimitui.engine.offload.overlap_meter") is None:
        sink.add(Row(S, "host-expert overlap", SKIP, note="engine/offload/overlap_meter.py is not in this tree yet"))
        return
    sink.run("host-expert overlap", _measure, mode)


def _measure(mode) -> Iterator[Row]:
    meter = importlib.import_module("kimitui.engine.offload.overlap_meter")
    config = kimi_config("k2", 2, tiny=mode.emulate)
    experts = config.n_routed_experts
    host = experts // 8  # an eighth of every MoE layer's experts in host RAM
    placement = [[-1 if e < host else 0 for e in range(experts)] for _ in range(config.num_hidden_layers)]
    max_model_len = mode.pick(2048, 64)
    model = build_random_model(config, mode, max_model_len, expert_placement=placement)
    bench = Bench(model, mode, max_num_seqs=mode.pick(64, 4), max_model_len=max_model_len)
    runner = bench.runner(False)  # host experts cannot be captured in a device graph
    for n in mode.pick((1, 64), (1, 4)):
        inp = bench.decode_inputs(n, mode.pick(1024, 20))
        decode_step(runner, inp)  # warm-up: pinned buffers, worker threads, kernels
        if meter.enable(model) == 0:
            yield Row(S, "host-expert overlap", FAIL, note="no layer has host experts: the placement was ignored")
            return
        for _ in range(mode.pick(5, 2)):
            decode_step(runner, inp)
        total = meter.report(model)["total"]
        hidden = total.get("hidden_fraction")
        calls = max(1, total["calls"])
        note = "hidden fraction " + (f"{hidden:.2f}" if hidden is not None else "unknown: no host time recorded")
        yield Row(S, f"K2.6 shape, {host}/{experts} experts on the host, B={n}", PASS if hidden is not None else FAIL,
                  note=f"{note}; per layer call: host {total['host_s'] * 1e3 / calls:.2f} ms, "
                       f"waited {total['wait_s'] * 1e3 / calls:.2f} ms, device experts {total['device_s'] * 1e3 / calls:.2f} ms")
