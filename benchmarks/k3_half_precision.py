"""Half precision on Kimi K3, part by part: each K3 part's bf16 / fp16 output against float32 on the
same inputs, and the end-to-end log-prob drift on two K3-shaped checkpoints.

    python -m benchmarks.k3_half_precision [--json FILE]      (from the repository root, on a CPU)

Every part is the engine's own code (the loaded model's modules and backend), run once on a half
copy of a K3-shaped tiny checkpoint and once on the float32 copy, with the *same* inputs (drawn in
float32, rounded to the half dtype, and fed as that rounded value to both), so the error is the
part's own. Beside it: ``ideal`` (the part computed in float32 on those inputs and cast once, the
floor a half output can reach) and ``naive`` (every step in the half dtype, what the part would do
if nothing were kept in float32). What the reference keeps in float32 (transformers' Kimi Linear,
fla-core's KDA, and the K3 serving code as the public K3 notes describe it) is listed per part.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

HALF = (torch.bfloat16, torch.float16)
ROWS = 96  # tokens per part input


@dataclass
class PartResult:
    part: str
    reference_keeps: str
    dtype: str
    engine: dict  # max_abs, mean_abs, rel
    ideal: dict
    naive: dict
    note: str = ""


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (out.float() - ref.float()).abs()
    return {
        "max_abs": d.max().item(),
        "mean_abs": d.mean().item(),
        "rel": (d.norm() / ref.float().norm().clamp_min(1e-30)).item(),
    }


# ------------------------------------------------------------------------------------------------
# Checkpoints and models


def write_checkpoints(root: Path) -> list[Path]:
    """Two K3-shaped checkpoints: the test fixture's layout (KDA + NoPE gated MLA, AttnRes every 2
    layers, latent MoE with MXFP4 experts, SiTU) and a deeper variant (AttnRes every 3 layers, more
    experts, another seed)."""
    from tests.helpers.k3_checkpoint import write_k3_checkpoint

    paths = [root / "k3-a", root / "k3-b"]
    write_k3_checkpoint(paths[0], seed=0)
    write_k3_checkpoint(
        paths[1],
        seed=1,
        num_layers=6,
        kda_layers=(1, 2, 4, 5),
        full_attn_layers=(3, 6),
        attn_res_block_size=3,
        num_experts=16,
    )
    return paths


def load(path: Path, dtype: torch.dtype):
    from kimitui.engine.config import ModelConfig
    from kimitui.engine.loader import load_model

    model, _ = load_model(ModelConfig.from_pretrained(path), path, torch.device("cpu"), dtype)
    model.source_path = Path(path)
    return model.eval()


def moe_layer(model) -> int:
    return next(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "routed_expert_down_proj"))


def mla_layer(model) -> int:
    return next(i for i, layer in enumerate(model.model.layers) if not layer.is_kda)


def kda_layer(model) -> int:
    return next(i for i, layer in enumerate(model.model.layers) if layer.is_kda)


# ------------------------------------------------------------------------------------------------
# Parts: each returns (engine half output, fp32 output, ideal half output, naive half output)


def _hidden(gen, rows: int, d: int, scale: float = 1.0) -> torch.Tensor:
    x = torch.randn(rows, d, generator=gen) * scale
    x[:, :: max(1, d // 8)] *= 8.0  # a few large channels, as residual streams have
    return x


def part_rmsnorm(m32, mh, dtype, gen):
    norm32, normh = m32.model.layers[1].input_layernorm, mh.model.layers[1].input_layernorm
    x = _hidden(gen, ROWS, norm32.weight.shape[0], 3.0).to(dtype)
    ref = norm32(x.float())
    w = normh.weight
    xf = x.float()
    ideal = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + normh.eps)).to(dtype)
    naive = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + normh.eps))
    return normh(x), ref, ideal, naive


def part_attn_res(m32, mh, dtype, gen):
    from kimitui.engine.layers.attn_res import attn_res_mix

    layer32, layerh = m32.model.layers[2], mh.model.layers[2]
    d = layer32.mlp_res_norm.weight.shape[0]
    # candidates of very different size (embedding, block sums, the running prefix)
    cands = [_hidden(gen, ROWS, d, s).to(dtype) for s in (1.0, 6.0, 20.0, 12.0)]
    eps = layerh.mlp_res_norm.eps

    def mix(x, blocks, nw, pw):
        return attn_res_mix(x, blocks, nw, eps, pw)

    out = mix(cands[-1], cands[:-1], layerh.mlp_res_norm.weight, layerh.mlp_res_proj.weight)
    ref = mix(
        cands[-1].float(), [c.float() for c in cands[:-1]], layer32.mlp_res_norm.weight, layer32.mlp_res_proj.weight
    )
    ideal = ref.to(dtype)
    v = torch.stack(cands, dim=1)  # all in half
    normed = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    q = layerh.mlp_res_norm.weight.to(dtype) * layerh.mlp_res_proj.weight.to(dtype).view(-1)
    p = torch.softmax(normed @ q, dim=1)
    naive = torch.einsum("tn,tnd->td", p, v)
    return out, ref, ideal, naive


def part_situ(m32, mh, dtype, gen):
    act = mh.model.layers[0].mlp.act
    gate = (torch.randn(ROWS, 256, generator=gen) * 4).to(dtype)
    up = (torch.randn(ROWS, 256, generator=gen) * 4).to(dtype)
    ref = act(gate.float(), up.float())
    ideal = ref.to(dtype)
    b, lb = act.beta, act.linear_beta
    naive = (b * torch.tanh(gate / b) * torch.sigmoid(gate)) * (lb * torch.tanh(up / lb))
    return act(gate, up), ref, ideal, naive


def _router_inputs(m32, mh, dtype, gen):
    i = moe_layer(m32)
    g32, gh = m32.model.layers[i].mlp.gate, mh.model.layers[i].mlp.gate
    x = _hidden(gen, ROWS, g32.weight.shape[1], 1.0).to(dtype)
    return g32, gh, x


def part_router(m32, mh, dtype, gen):
    """Routing weights (sorted by expert) for the same input; the ids must agree for the numbers to
    mean anything, and do when the scores are computed in fp32."""
    g32, gh, x = _router_inputs(m32, mh, dtype, gen)
    ids_h, w_h = gh(x)
    ids_32, w_32 = g32(x.float())

    def by_expert(ids, w):
        order = ids.argsort(dim=1)
        return ids.gather(1, order), w.float().gather(1, order)

    ih, wh = by_expert(ids_h, w_h)
    i32, w32 = by_expert(ids_32, w_32)
    agree = (ih == i32).all(dim=1)
    # naive: logits and sigmoid in the half dtype, the same top-k rule
    from kimitui.kernels import reference

    logits = F.linear(x, gh.weight.to(dtype))
    s = torch.sigmoid(logits).float()
    # the engine's top-k rule on these half-rounded scores: fed as logits through an identity
    # "router weight", so its sigmoid gives the same scores back (to fp32 rounding)
    ids_n, w_n = reference.moe_route(
        torch.logit(s.clamp(1e-7, 1 - 1e-7)),
        torch.eye(s.shape[1]),
        gh.e_score_correction_bias,
        gh.top_k,
        gh.n_group,
        gh.topk_group,
        "sigmoid",
        gh.norm_topk_prob,
        gh.scaling,
    )
    inn, wn = by_expert(ids_n, w_n.to(dtype))
    keep = agree & (inn == i32).all(dim=1)
    return (
        wh[keep],
        w32[keep],
        w32[keep],
        wn[keep],
        f"top-k ids agree on {agree.float().mean().item():.0%} of rows (naive half scores: "
        f"{(inn == i32).all(dim=1).float().mean().item():.0%})",
    )


def _experts_inputs(m32, mh, dtype, gen):
    i = moe_layer(m32)
    moe32, moeh = m32.model.layers[i].mlp, mh.model.layers[i].mlp
    z = _hidden(gen, ROWS, moe32.routed_expert_down_proj.out_features, 0.5).to(dtype)  # a latent row
    x = _hidden(gen, ROWS, moe32.gate.weight.shape[1], 1.0)
    ids, w = moe32.gate(x)  # fp32 routing, shared by every run
    return moe32, moeh, z, ids, w


def part_mxfp4_experts(m32, mh, dtype, gen):
    """The routed MXFP4 experts (dequant, GEMMs, SiTU epilogue, routed-weight sum) on fixed routing."""
    from kimitui.kernels import reference

    moe32, moeh, z, ids, w = _experts_inputs(m32, mh, dtype, gen)
    out = moeh.experts(z, ids, w, counted=True)
    ref = moe32.experts(z.float(), ids, w, counted=True)
    act = moeh.act
    raw = _checkpoint_experts(m32.source_path, moe_layer(m32))

    def run(weights_dtype, act_fp32, sum_dtype):
        y = torch.zeros(z.shape, dtype=sum_dtype)
        for e in ids.unique().tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            w1, w3, w2 = (reference.dequant_mxfp4(*raw[e][n], dtype) for n in ("w1", "w3", "w2"))
            w13 = torch.cat([w1, w3])
            gu = F.linear(z[tok], w13)
            g, u = gu.chunk(2, dim=-1)
            if act_fp32:
                h = act(g, u)
            else:
                h = (act.beta * torch.tanh(g / act.beta) * torch.sigmoid(g)) * (
                    act.linear_beta * torch.tanh(u / act.linear_beta)
                )
            yy = F.linear(h, w2)
            y.index_add_(0, tok, (yy.to(sum_dtype) * w[tok, slot, None].to(weights_dtype).to(sum_dtype)))
        return y.to(dtype)

    ideal = run(torch.float32, True, torch.float32)  # what the reference keeps: fp32 weights and sum
    naive = run(dtype, False, dtype)
    return out, ref, ideal, naive


def _checkpoint_experts(path: Path, layer: int) -> dict:
    """The routed experts' MXFP4 bytes as the checkpoint stores them (the loaded CPU model keeps
    them re-tiled): {expert: {"w1": (packed, scale), ...}}."""
    from safetensors import safe_open

    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    pre = f"language_model.model.layers.{layer}.block_sparse_moe.experts."
    out: dict = {}
    for name, shard in index.items():
        if name.startswith(pre) and name.endswith(".weight_packed"):
            e, proj = name[len(pre) :].split(".")[:2]
            with safe_open(str(path / shard), "pt") as f:
                packed = f.get_tensor(name)
            with safe_open(str(path / index[name.replace("weight_packed", "weight_scale")]), "pt") as f:
                scale = f.get_tensor(name.replace("weight_packed", "weight_scale"))
            out.setdefault(int(e), {})[proj] = (packed, scale)
    return out


def part_latent_norm(m32, mh, dtype, gen):
    i = moe_layer(m32)
    n32, nh = m32.model.layers[i].mlp.routed_expert_norm, mh.model.layers[i].mlp.routed_expert_norm
    y = _hidden(gen, ROWS, n32.weight.shape[0], 0.05).to(dtype)  # the latent sum is small
    ref = n32(y.float())
    yf = y.float()
    ideal = nh.weight * (yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + nh.eps)).to(dtype)
    naive = nh.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + nh.eps))
    return nh(y), ref, ideal, naive


def part_latent_moe(m32, mh, dtype, gen):
    """The whole latent MoE block (router, down projection, experts, norm, up projection, shared)."""
    i = moe_layer(m32)
    moe32, moeh = m32.model.layers[i].mlp, mh.model.layers[i].mlp
    x = _hidden(gen, ROWS, moe32.gate.weight.shape[1], 1.0).to(dtype)
    out, ref = moeh(x), moe32(x.float())
    return out, ref, ref.to(dtype), out  # no all-half variant: it is the sum of the parts above


def part_mla_gate(m32, mh, dtype, gen):
    """The NoPE MLA output gate: attn_out * sigmoid(g_proj(x)) before o_proj."""
    i = mla_layer(m32)
    a32, ah = m32.model.layers[i].self_attn, mh.model.layers[i].self_attn
    x = _hidden(gen, ROWS, a32.g_proj.in_features, 1.0).to(dtype)
    o = (torch.randn(ROWS, ah.num_heads * ah.v_dim, generator=gen) * 0.5).to(dtype)
    out = o * torch.sigmoid(ah.g_proj(x))  # as MLAttention.forward writes it
    ref = o.float() * torch.sigmoid(a32.g_proj(x.float()))
    ideal = (o.float() * torch.sigmoid(ah.g_proj(x).float())).to(dtype)
    return out, ref, ideal, out


def part_kda_gates(m32, mh, dtype, gen):
    """KDA forget gate (K3's lower-bounded sigmoid) and beta from half projections."""
    from kimitui.engine.layers.kda import kda_gate

    i = kda_layer(m32)
    k32, kh = m32.model.layers[i].self_attn, mh.model.layers[i].self_attn
    H, hd = kh.num_heads, kh.head_dim
    a = (torch.randn(ROWS, H * hd, generator=gen) * 2).to(dtype)
    b = (torch.randn(ROWS, H, generator=gen) * 2).to(dtype)
    lb = kh.config.gate_lower_bound

    def engine(kk, a, b):  # KimiDeltaAttention.forward's gate lines
        g = kda_gate((a.float() + kk.dt_bias).view(ROWS, H, hd), kk.A_log, lb)
        return torch.cat([g.reshape(ROWS, -1), torch.sigmoid(b.float())], dim=1)

    out, ref = engine(kh, a, b), engine(k32, a.float(), b.float())
    rate = kh.A_log.to(dtype).exp()[:, None]
    naive_g = lb * torch.sigmoid(rate * (a + kh.dt_bias.to(dtype)).view(ROWS, H, hd))
    naive = torch.cat([naive_g.reshape(ROWS, -1), torch.sigmoid(b)], dim=1)
    return out, ref, ref, naive


def part_kda_recurrence(m32, mh, dtype, gen):
    """The chunked delta rule (state and math in fp32 inside) on half q/k/v, fp32 gates."""
    i = kda_layer(m32)
    kh = mh.model.layers[i].self_attn
    H, hd = kh.num_heads, kh.head_dim
    q, k, v = ((torch.randn(ROWS, H, hd, generator=gen)).to(dtype) for _ in range(3))
    g = -torch.rand(ROWS, H, hd, generator=gen) * 0.5
    beta = torch.rand(ROWS, H, generator=gen)
    h0 = torch.zeros(1, H, hd, hd)
    cu = torch.tensor([0, ROWS])
    out, _ = kh.ops.kda_chunk(q, k, v, g, beta, h0, cu, kh.scale)
    ref, _ = kh.ops.kda_chunk(q.float(), k.float(), v.float(), g, beta, h0, cu, kh.scale)
    # naive: the recurrence with a half state, one token at a time
    S = torch.zeros(H, hd, hd, dtype=dtype)
    qn = F.normalize(q.float(), dim=-1).to(dtype) * kh.scale
    kn = F.normalize(k.float(), dim=-1).to(dtype)
    outs = []
    for t in range(ROWS):
        S = S * g[t].to(dtype).exp()[..., None]
        u = torch.einsum("hk,hkv->hv", kn[t], S)
        S = S + torch.einsum("hk,hv->hkv", kn[t], beta[t].to(dtype)[:, None] * (v[t] - u))
        outs.append(torch.einsum("hk,hkv->hv", qn[t], S))
    return out, ref, ref.to(dtype), torch.stack(outs)


def part_kda_out_norm(m32, mh, dtype, gen):
    """KDA's output: RMSNorm(o) * o_norm.weight * sigmoid(gate), per head (fla's FusedRMSNormGated)."""
    from kimitui.kernels.kda import gated_rms_norm as _gated_rms_norm

    i = kda_layer(m32)
    kh = mh.model.layers[i].self_attn
    H, hd = kh.num_heads, kh.head_dim
    o = (torch.randn(ROWS, H, hd, generator=gen) * 0.3).to(dtype)
    gate = (torch.randn(ROWS, H, hd, generator=gen) * 2).to(dtype)
    eps = kh.config.rms_norm_eps
    out = _gated_rms_norm(o, gate, kh.o_norm.weight, eps).to(dtype)
    ref = _gated_rms_norm(o.float(), gate.float(), kh.o_norm.weight, eps)
    naive = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * kh.o_norm.weight.to(dtype) * torch.sigmoid(gate)
    return out, ref, ref.to(dtype), naive


# name, function, what the reference keeps in fp32 (sources in the module docstring)
PARTS = [
    ("RMSNorm (layer norms)", part_rmsnorm, "variance and normalise in fp32, cast, x weight (HF)"),
    ("AttnRes mix (softmax over depth)", part_attn_res, "candidates, scores, softmax and mix in fp32"),
    ("SiTU", part_situ, "fp32, cast back (SituAndMul)"),
    ("router (sigmoid, top-k weights)", part_router, "logits, sigmoid, bias, top-k weights in fp32"),
    (
        "MXFP4 experts (dequant, SiTU, weighted sum)",
        part_mxfp4_experts,
        "exact dequant, fp32 SiTU, expert output x fp32 weight, fp32 sum",
    ),
    ("latent norm (routed_expert_norm)", part_latent_norm, "variance in fp32 (HF RMSNorm)"),
    ("latent MoE block (all of it)", part_latent_moe, "as its parts"),
    ("MLA output gate (NoPE MLA)", part_mla_gate, "model dtype: o * sigmoid(g_proj(x))"),
    ("KDA forget gate and beta", part_kda_gates, "fp32 (gate, A_log, dt_bias, beta)"),
    ("KDA recurrence (chunked)", part_kda_recurrence, "fp32 state and math, output cast"),
    ("KDA output norm and gate", part_kda_out_norm, "fp32 norm and sigmoid gate, cast"),
]


@torch.no_grad()
def measure_parts(path: Path, seed: int = 0) -> list[PartResult]:
    m32 = load(path, torch.float32)
    results = []
    for dtype in HALF:
        mh = load(path, dtype)
        for name, fn, keeps in PARTS:
            gen = torch.Generator().manual_seed(seed)
            got = fn(m32, mh, dtype, gen)
            out, ref, ideal, naive = got[:4]
            note = got[4] if len(got) > 4 else ""
            results.append(
                PartResult(
                    name,
                    keeps,
                    str(dtype).removeprefix("torch."),
                    errors(out, ref),
                    errors(ideal, ref),
                    errors(naive, ref),
                    note,
                )
            )
    return results


@torch.no_grad()
def end_to_end(path: Path, prompt_len: int = 96, seed: int = 0) -> dict:
    """max and mean |delta log-prob| (every position, every vocabulary entry) of bf16 / fp16 vs fp32."""
    from kimitui.engine.layers.router import Router
    from tests.helpers.hybrid_driver import HybridDriver

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 250, (prompt_len,), generator=gen).tolist()

    def run(dtype):
        drv = HybridDriver(path, max_seqs=1, max_len=prompt_len + 16, dtype=dtype)
        routes: list[torch.Tensor] = []  # each MoE layer's chosen experts per position, in layer order
        for m in drv.model.modules():
            if isinstance(m, Router):
                m.register_forward_hook(lambda mod, inp, out: routes.append(out[0].sort(dim=1).values))
        return drv.prompt_logprobs([ids])[0].float(), routes

    lp32, routes32 = run(torch.float32)
    out = {}
    for dtype in HALF:
        lp, routes = run(dtype)
        d = (lp - lp32).abs()
        per_pos = d.max(-1).values
        # positions where some MoE layer chose other experts than float32 did (a routing flip: the
        # router is fp32 in both, its input differs by the half rounding upstream)
        flipped = torch.zeros(len(ids), dtype=torch.bool)
        for a, b in zip(routes32, routes):
            flipped |= (a != b).any(dim=1)
        out[str(dtype).removeprefix("torch.")] = {
            "max": d.max().item(),
            "mean": d.mean().item(),
            "top1_agree": (lp.argmax(-1) == lp32.argmax(-1)).float().mean().item(),
            "positions_with_routing_flip": int(flipped.sum()),
            "max_at_flip": per_pos[flipped].max().item() if flipped.any() else 0.0,
            "max_elsewhere": per_pos[~flipped].max().item() if (~flipped).any() else 0.0,
        }
    return out


def format_parts(results: list[PartResult]) -> str:
    lines = [
        f"{'part':<46} {'dtype':<8} {'max|d| engine':>13} {'ideal':>10} {'naive':>10} {'mean engine':>12} {'rel':>9}"
    ]
    for r in results:
        lines.append(
            f"{r.part:<46} {r.dtype:<8} {r.engine['max_abs']:>13.3e} {r.ideal['max_abs']:>10.3e} "
            f"{r.naive['max_abs']:>10.3e} {r.engine['mean_abs']:>12.3e} {r.engine['rel']:>9.2e}"
            + (f"  {r.note}" if r.note else "")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_checkpoints(Path(tmp))
        parts = measure_parts(paths[0])
        e2e = {p.name: end_to_end(p) for p in paths}
    print(format_parts(parts))
    for name, r in e2e.items():
        print(
            f"end to end {name}: "
            + ", ".join(
                f"{dt} max |d log-prob| {v['max']:.3f} mean {v['mean']:.4f} top-1 {v['top1_agree']:.0%} "
                f"(routing flips at {v['positions_with_routing_flip']} positions: max {v['max_at_flip']:.3f} there, "
                f"{v['max_elsewhere']:.3f} elsewhere)"
                for dt, v in r.items()
            )
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"parts": [r.__dict__ for r in parts], "end_to_end": e2e}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
