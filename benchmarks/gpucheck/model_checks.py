"""Model checks: CUDA/HIP graph capture of the decode step, and decode tokens per second.

Kimi K2.6's shape (DeepSeek-V3 architecture, INT4 experts) at reduced depth: graph replay against
the eager step (same model, same cache) for several batch buckets, then decode steps at batch 1
and 64, eager and through graphs. Kimi K3's shape (KDA + MLA, MXFP4 latent experts): a graph step of
five sequences in bucket 8 (three padding rows, which must write nothing: issue 38) against the eager
step from the same caches, logits and every KDA state and latent cache compared, then eager decode.
Tokens per second count one token per sequence per step, timed over whole steps (forward pass,
logits, greedy tokens to the host), so they are the decode speed of a model this deep, not of the
full 61 (K2) or 93 (K3) layers.
"""

from __future__ import annotations

import time

import torch

from benchmarks.gpucheck.common import ERROR, FAIL, PASS, SKIP, Row, rel_err, status_for
from benchmarks.gpucheck.models import Bench, build_random_model, decode_step, kimi_config

K2_LAYERS, K3_LAYERS = 4, 4  # K2: the dense first layer and 3 MoE layers; K3: 3 KDA layers and 1 MLA
TINY_K2_LAYERS = 2  # the self-test keeps the structure (dense, then MoE) at half the interpreter's time


def _bench(mode, name: str, layers: int, emulated_seqs: int = 4) -> Bench:
    config = kimi_config(name, layers, tiny=mode.emulate)
    max_model_len = mode.pick(2048, 64)
    model = build_random_model(config, mode, max_model_len)
    return Bench(model, mode, max_num_seqs=mode.pick(64, emulated_seqs), max_model_len=max_model_len)


def _capture_row(mode, g) -> Row:
    if mode.device.type != "cuda":
        return Row(
            "graphs",
            "capture",
            SKIP,
            note="no capture on a CPU: the same static buffers, buckets and padding ran with direct calls",
        )
    if g.failed:
        return Row(
            "graphs",
            "capture",
            FAIL,
            note=f"capture failed for buckets {sorted(g.failed)}, which ran eagerly: "
            f"{next(iter(g.failed.values()))[:200]}",
        )
    return Row("graphs", "capture", PASS, note=f"buckets captured: {sorted(g._graphs)}")


def graph_rows(mode, bench: Bench) -> list[Row]:
    """Replayed graphs give the eager step's logits, bucket by bucket; no silent fall back to eager."""
    s = "graphs"
    eager, graphed = bench.runner(False), bench.runner(True)
    context = mode.pick(1000, 20)
    rows = []
    for n in mode.pick((3, 1, 64, 3), (3, 1)):  # capture bucket 4, bucket 1, the largest, replay 4 again
        inp = bench.decode_inputs(n, context)
        want, _ = eager.forward_step(inp)
        got, _ = graphed.forward_step(inp)
        err = rel_err(got, want)
        rows.append(Row(s, f"decode step B={n}: graph vs eager logits", status_for(err, mode.tolerance), err))
    rows.append(_capture_row(mode, graphed.graphs))
    return rows


def _cache_tensors(caches) -> list[torch.Tensor]:
    out = []
    for c in caches:
        out += [c.recurrent, c.conv] if hasattr(c, "recurrent") else [c]
    return out


def k3_graph_rows(mode, bench: Bench) -> list[Row]:
    """K3 graph step with padding rows against eager from the same caches: logits, KDA states, latents."""
    from kimitui.engine.runner.graphs import bucket_for

    s = "graphs"
    eager, graphed = bench.runner(False), bench.runner(True)
    tensors = _cache_tensors(bench.caches)
    torch.manual_seed(0)
    for c in bench.caches:  # sequences mid-way: every KDA slot holds some state (the latents are random already)
        if hasattr(c, "recurrent"):
            c.recurrent.normal_(0, 0.3)
    before = [t.clone() for t in tensors]
    context = mode.pick(1000, 20)
    rows = []
    for n in mode.pick((5, 3), (5,)):  # bucket 8 with three padding rows; bucket 4 with one
        inp = bench.decode_inputs(n, context)
        want, _ = eager.forward_step(inp)
        want_caches = [t.clone() for t in tensors]
        for t, b in zip(tensors, before):
            t.copy_(b)
        got, _ = graphed.forward_step(inp)
        err = rel_err(got, want)
        cache_err = max(float((a.float() - b.float()).abs().max()) for a, b in zip(tensors, want_caches))
        padding = bucket_for(n, graphed.graphs.buckets) - n
        rows.append(
            Row(
                s,
                f"K3 decode step B={n} ({padding} padding rows): graph vs eager logits",
                status_for(err, mode.tolerance),
                err,
            )
        )
        rows.append(
            Row(
                s,
                f"K3 decode step B={n}: caches (KDA states, latents) graph vs eager",
                PASS if cache_err <= 1e-3 else FAIL,
                cache_err,
                note="padding rows must write no KDA slot and no cache slot",
            )
        )
        for t, b in zip(tensors, before):
            t.copy_(b)
    rows.append(_capture_row(mode, graphed.graphs))
    return rows


def decode_rows(mode, bench: Bench, label: str, graphs: tuple[bool, ...]) -> list[Row]:
    s = "decode"
    steps = mode.pick(20, 1)
    context = mode.pick(1024, 20)
    rows = []
    runners = {g: bench.runner(g) for g in graphs}
    for n in mode.pick((1, 64), (1, 4)):
        eager_ms = None
        for g, runner in runners.items():
            inp = bench.decode_inputs(n, context)
            for _ in range(mode.pick(3, 1)):  # warm-up: Triton compiles, the graph's capture, cuBLAS workspaces
                decode_step(runner, inp)
            t = time.perf_counter()
            for _ in range(steps):
                tokens = decode_step(runner, inp)
            ms = (time.perf_counter() - t) / steps * 1e3
            vocab = bench.model.config.vocab_size
            ok = len(tokens) == n and all(0 <= x < vocab for x in tokens)
            note = ""
            if g and mode.device.type == "cuda" and runner.graphs.failed:
                ok, note = False, f"graph capture failed for buckets {sorted(runner.graphs.failed)}: those ran eagerly"
            elif g and eager_ms:
                note = f"{eager_ms / ms:.2f}x eager"
            if not g:
                eager_ms = ms
            rows.append(
                Row(
                    s,
                    f"{label} B={n} {'graphs' if g else 'eager'}",
                    PASS if ok else FAIL,
                    ms=ms,
                    tok_s=n / ms * 1e3,
                    note=note or f"context {context}, {steps} steps",
                )
            )
    return rows


def k2_rows(mode, sink) -> None:
    """K2.6-shaped model: graph capture, then decode speed with and without graphs."""
    try:
        layers = mode.pick(K2_LAYERS, TINY_K2_LAYERS)
        bench = _bench(mode, "k2", layers)
    except Exception as e:
        sink.add(Row("decode", "build K2.6-shaped model", ERROR, note=f"{type(e).__name__}: {e}"[:300]))
        return
    label = f"K2.6 shape, {layers} of 61 layers, INT4 experts"
    sink.run("graph capture", graph_rows, mode, bench)
    sink.run("decode K2", decode_rows, mode, bench, label, (False, True))
    del bench
    if mode.device.type == "cuda":
        torch.cuda.empty_cache()


def k3_rows(mode, sink) -> None:
    try:
        bench = _bench(mode, "k3", K3_LAYERS, emulated_seqs=8)  # bucket 8: room for three padding rows
    except Exception as e:
        sink.add(Row("decode", "build K3-shaped model", ERROR, note=f"{type(e).__name__}: {e}"[:300]))
        return
    label = f"K3 shape, {K3_LAYERS} of 93 layers (3 KDA + 1 MLA), MXFP4 experts"
    sink.run("graph capture K3", k3_graph_rows, mode, bench)
    sink.run("decode K3", decode_rows, mode, bench, label, (False,))
