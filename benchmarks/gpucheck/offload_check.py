"""``--cpu-offload``: how much of the host experts' CPU time a decode step hides behind the device.

A K2.6-shaped model of two layers (the dense first one and one MoE layer) keeps a share of each MoE
layer's experts in host RAM (computed by the CPU kernels while the device computes its own
experts), decodes at batch 1 and 64, and asks the engine's overlap meter
(``engine.offload.overlap_meter``: ``enable(model)``, ``report(model)``) for host time, time the
device waited at the join, and the hidden fraction ``1 - wait / host``. Where the engine has no
overlap meter yet the section says so and skips. Then a K3-shaped model (KDA + MLA, MXFP4 latent
experts) with an eighth of its routed experts on the host runs decode steps: the configuration of a
K3 workstation with CPU experts, which must run and give finite logits and valid tokens. Last, that
K3 model's decode step through piecewise graphs (engine/runner/piecewise.py: CUDA/HIP graph segments
cut at each MoE layer's host join; on the CPU self-test, emulated recordings): five sequences in
bucket 8 (three padding rows), replayed against eager from the same caches (logits and caches), with
the launches per step of each (kernels.launch_count: graph launches count one each).
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
    else:
        sink.run("host-expert overlap", _measure, mode)
    sink.run("offloaded K3 step", _k3_offloaded, mode)


def _host_placement(config) -> tuple[list[list[int]], int, int]:
    experts = config.n_routed_experts
    host = max(1, experts // 8)  # an eighth of every MoE layer's experts in host RAM
    return [[-1 if e < host else 0 for e in range(experts)] for _ in range(config.num_hidden_layers)], host, experts


def _k3_offloaded(mode) -> Iterator[Row]:
    import time

    import torch

    config = kimi_config("k3", 4, tiny=mode.emulate)
    placement, host, experts = _host_placement(config)
    max_model_len = mode.pick(2048, 64)
    model = build_random_model(config, mode, max_model_len, expert_placement=placement)
    bench = Bench(model, mode, max_num_seqs=mode.pick(64, 4), max_model_len=max_model_len)
    runner = bench.runner(False)
    for n in mode.pick((1, 16), (1, 4)):
        inp = bench.decode_inputs(n, mode.pick(1024, 20))
        decode_step(runner, inp)  # warm-up: pinned buffers, worker threads, kernels
        t = time.perf_counter()
        logits, _ = runner.forward_step(inp)
        tokens = logits.argmax(-1).tolist()
        ms = (time.perf_counter() - t) * 1e3
        ok = bool(torch.isfinite(logits).all()) and len(tokens) == n and all(0 <= x < config.vocab_size for x in tokens)
        yield Row(
            S,
            f"K3 shape, {host}/{experts} experts on the host, decode B={n}",
            PASS if ok else FAIL,
            ms=ms,
            tok_s=n / ms * 1e3,
            note="finite logits, valid tokens" if ok else "non-finite logits or bad tokens",
        )
    yield from _k3_piecewise(model, mode, host, experts, max_model_len)


def _k3_piecewise(model, mode, host: int, experts: int, max_model_len: int) -> Iterator[Row]:
    """The offloaded K3 model's decode step through piecewise graphs against eager (own caches)."""
    import time

    from kimitui.engine.runner.model_runner import ModelRunner
    from kimitui.kernels.launch_count import count_launches

    bench = Bench(model, mode, max_num_seqs=8, max_model_len=max_model_len)
    eager = bench.runner(False)
    # a GPU captures CUDA/HIP graph segments; the CPU self-test records them (EmulatedGraph). Bucket 8
    # is captured by the first step that needs it (the warm-up below), the other buckets never.
    graphed = ModelRunner(
        model,
        bench.caches,
        bench.block_size,
        mode.device,
        None,
        bench.max_num_seqs,
        bench.max_model_len,
        decode_graphs=True,
        emulate_graphs=mode.device.type == "cpu",
    )
    graphs = graphed.graphs
    layers = len(graphs.host_experts)
    inp = bench.decode_inputs(5, mode.pick(1024, 20))  # bucket 8: three padding rows
    caches = [t for c in bench.caches for t in ([c.recurrent, c.conv] if hasattr(c, "recurrent") else [c])]
    before = [t.clone() for t in caches]

    def step(runner):
        for t, b in zip(caches, before):
            t.copy_(b)
        with count_launches() as counts:
            t0 = time.perf_counter()
            logits, _ = runner.forward_step(inp)
            tokens = logits.argmax(-1).tolist()  # the step's one host sync
            ms = (time.perf_counter() - t0) * 1e3
        return logits, tokens, [t.clone() for t in caches], counts, ms

    step(eager), step(graphed)  # warm-up: pinned buffers, worker threads, kernels; captures bucket 8
    segments = graphs.segments(8)
    want, want_tokens, want_caches, e, e_ms = step(eager)
    got, tokens, got_caches, g, g_ms = step(graphed)
    diff = float((got.float() - want.float()).abs().max())
    cache_diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got_caches, want_caches))
    ok = (
        segments == 2 * layers + 1
        and sum(g.graphs.values()) == segments
        and not graphs.failed
        and diff < mode.pick(5e-2, 1e-3)
        and cache_diff < mode.pick(5e-2, 1e-3)
    )
    note = (
        f"{segments} segments ({layers} host joins); launches per step eager {e.launches}, "
        f"graphed {g.launches} ({sum(g.graphs.values())} graph launches + {g.kernels} kernels); "
        f"max |logits diff| {diff:.2e}, caches {cache_diff:.2e}; tokens equal: {tokens == want_tokens}"
        + (f"; failed buckets {graphs.failed}" if graphs.failed else "")
    )
    yield Row(
        S,
        f"K3 shape, {host}/{experts} host experts, piecewise graphs B=5 in bucket 8",
        PASS if ok else FAIL,
        ms=g_ms,
        tok_s=5 / g_ms * 1e3,
        note=note + f"; eager {e_ms:.2f} ms",
    )


def _measure(mode) -> Iterator[Row]:
    meter = importlib.import_module("kimitui.engine.offload.overlap_meter")
    config = kimi_config("k2", 2, tiny=mode.emulate)
    placement, host, experts = _host_placement(config)
    max_model_len = mode.pick(2048, 64)
    model = build_random_model(config, mode, max_model_len, expert_placement=placement)
    bench = Bench(model, mode, max_num_seqs=mode.pick(64, 4), max_model_len=max_model_len)
    runner = bench.runner(False)  # eager: the overlap meter times the join of the eager step
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
        yield Row(
            S,
            f"K2.6 shape, {host}/{experts} experts on the host, B={n}",
            PASS if hidden is not None else FAIL,
            note=f"{note}; per layer call: host {total['host_s'] * 1e3 / calls:.2f} ms, "
            f"waited {total['wait_s'] * 1e3 / calls:.2f} ms, device experts {total['device_s'] * 1e3 / calls:.2f} ms",
        )
