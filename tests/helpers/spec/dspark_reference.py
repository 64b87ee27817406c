"""An independent DSpark drafter in plain PyTorch (trainable), written from the public trainer and
serving code, not from the engine: speculators' ``models/dspark`` (Markov head ``W1`` embedding /
``W2`` projection, confidence head on ``cat(hidden, W1[prev])``, "sample from anchor": slot k of the
block scores the token after position anchor + k), its DFlash backbone's anchored-block mask (a block
sees the context before its anchor and the whole block), vLLM's ``vllm/models/kimi_k3/nvidia/
dspark_mla.py`` (context KV projected from the fused target taps by each layer's
``kv_a_proj_with_mqa``; pre-norm MLA + gated MLP layers; ``final_norm``) and TorchSpec's K3 options
(``fc_norm`` per tap, the ``attn_res`` stream). Parameter names are the checkpoint's, so
``state_dict()`` is the file's content. Imports nothing from the engine.

Also: the K3 target's taps from ``tests.helpers.k3_reference`` (the naive float64 K3 forward), and
a greedy speculative loop that measures acceptance with both.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """DeepSeek's interleaved rope on x [..., T, D] at positions pos [T] (no scaling)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos.double()[:, None] * inv[None]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


class Attn(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        h, n = c["hidden_size"], c["num_attention_heads"]
        self.c, self.n = c, n
        self.nope, self.rd, self.vd, self.r = (
            c["qk_nope_head_dim"],
            c["qk_rope_head_dim"],
            c["v_head_dim"],
            c["kv_lora_rank"],
        )
        self.q_a_proj = nn.Linear(h, c["q_lora_rank"], bias=False)
        self.q_a_layernorm = RMSNorm(c["q_lora_rank"], c["rms_norm_eps"])
        self.q_b_proj = nn.Linear(c["q_lora_rank"], n * (self.nope + self.rd), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.r + self.rd, bias=False)
        self.kv_a_layernorm = RMSNorm(self.r, c["rms_norm_eps"])
        self.kv_b_proj = nn.Linear(self.r, n * (self.nope + self.vd), bias=False)
        self.o_proj = nn.Linear(n * self.vd, h, bias=False)
        self.theta = (c.get("rope_parameters") or {}).get("rope_theta") or c.get("rope_theta", 10000.0)

    def kv(self, x, pos):
        """(normed latent [T, r], roped k_rope [T, rd])"""
        a = self.kv_a_proj_with_mqa(x)
        kr = a[:, self.r :]
        if not self.c.get("mla_use_nope"):
            kr = rope(kr, pos, self.theta)
        return self.kv_a_layernorm(a[:, : self.r]), kr

    def forward(self, x, pos, ctx_lat, ctx_kr, mask):
        """x [Q, H] block rows at pos [Q]; ctx_* [C, ...] context; mask [Q, C + Q] (True: visible)."""
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(-1, self.n, self.nope + self.rd)
        qr = q[..., self.nope :]
        if not self.c.get("mla_use_nope"):
            qr = rope(qr.transpose(0, 1), pos, self.theta).transpose(0, 1)
        lat, kr = self.kv(x, pos)
        lat, kr = torch.cat((ctx_lat, lat)), torch.cat((ctx_kr, kr))
        kvh = self.kv_b_proj(lat).view(-1, self.n, self.nope + self.vd)
        scores = (
            torch.einsum("qhd,khd->hqk", q[..., : self.nope], kvh[..., : self.nope])
            + torch.einsum("qhd,kd->hqk", qr, kr)
        ) / math.sqrt(self.nope + self.rd)
        p = scores.masked_fill(~mask[None], float("-inf")).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", p, kvh[..., self.nope :])
        return self.o_proj(o.reshape(o.shape[0], -1))


class Layer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attn(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(c["hidden_size"], c["intermediate_size"], bias=False)
        self.mlp.up_proj = nn.Linear(c["hidden_size"], c["intermediate_size"], bias=False)
        self.mlp.down_proj = nn.Linear(c["intermediate_size"], c["hidden_size"], bias=False)

    def forward(self, x, pos, ctx, mask):
        x = x + self.self_attn(self.input_layernorm(x), pos, *ctx, mask)
        h = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class RefDSpark(nn.Module):
    """The drafter. ``embed`` / ``lm_head``: the target's (frozen) tensors unless ``own_embedding``."""

    def __init__(self, c: dict, target_embed: torch.Tensor, target_lm_head: torch.Tensor, own_embedding=False):
        super().__init__()
        self.c = c
        h, td, n_taps = c["hidden_size"], c["target_hidden_size"], len(c["target_layer_ids"])
        self.context_proj = nn.Linear(n_taps * td, h, bias=False)
        self.context_norm = RMSNorm(h, c["rms_norm_eps"])
        if c.get("fc_norm"):
            self.fc_norm = nn.ModuleList(RMSNorm(td, c["rms_norm_eps"]) for _ in range(n_taps))
        if own_embedding:
            self.embed_tokens = nn.Embedding(c["vocab_size"], h)
            with torch.no_grad():
                self.embed_tokens.weight.copy_(target_embed)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.final_norm = RMSNorm(h, c["rms_norm_eps"])
        self.markov_head = nn.Module()
        self.markov_head.markov_w1 = nn.Embedding(c["vocab_size"], c["markov_rank"])
        self.markov_head.markov_w2 = nn.Linear(c["markov_rank"], c["vocab_size"], bias=False)
        nn.init.normal_(self.markov_head.markov_w1.weight, std=0.01)
        nn.init.zeros_(self.markov_head.markov_w2.weight)
        self.confidence_head = nn.Module()
        self.confidence_head.proj = nn.Linear(h + c["markov_rank"], 1)
        self.register_buffer("t_embed", target_embed.clone(), persistent=False)
        self.register_buffer("t_head", target_lm_head.clone(), persistent=False)

    def _embed(self, ids):
        return self.embed_tokens(ids) if hasattr(self, "embed_tokens") else self.t_embed[ids]

    def features(self, taps: list[torch.Tensor]) -> torch.Tensor:
        """``taps[i]`` [T, td]: the target's hidden state of ``target_layer_ids[i]`` (config order)."""
        if hasattr(self, "fc_norm"):
            taps = [norm(t) for norm, t in zip(self.fc_norm, taps)]
        return self.context_norm(self.context_proj(torch.cat(taps, -1)))

    def blocks(self, feats: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor, k: int) -> torch.Tensor:
        """Final-normed hidden [A, k, H] of blocks anchored at ``anchors`` (positions into ``ids``), each
        seeing the context rows before its anchor and its whole block."""
        t, a_n = feats.shape[0], anchors.shape[0]
        blk = torch.full((a_n, k), self.c["mask_token_id"], dtype=torch.long)
        blk[:, 0] = ids[anchors]
        pos = (anchors[:, None] + torch.arange(k)[None]).reshape(-1)
        x = self._embed(blk.reshape(-1))
        ctx_vis = torch.arange(t)[None, :] < anchors.repeat_interleave(k)[:, None]  # [A k, T]
        own = torch.arange(a_n).repeat_interleave(k)
        blk_vis = own[:, None] == own[None, :]
        mask = torch.cat((ctx_vis, blk_vis), dim=1)
        cpos = torch.arange(t)
        for layer in self.layers:
            ctx = layer.self_attn.kv(feats, cpos)
            x = layer(x, pos, ctx, mask)
        return self.final_norm(x).view(a_n, k, -1)

    def step_logits(self, hidden: torch.Tensor, prev: torch.Tensor):
        """(logits with the Markov bias [.., V], confidence logit [..]) of rows ``hidden`` after ``prev``."""
        emb = self.markov_head.markov_w1(prev)
        logits = hidden @ self.t_head.T + self.markov_head.markov_w2(emb)
        conf = self.confidence_head.proj(torch.cat((hidden, emb), -1))[..., 0]
        return logits, conf

    @torch.no_grad()
    def draft(self, taps: list[torch.Tensor], ids: list[int], k: int) -> list[int]:
        """Greedy drafts after ``ids`` (taps of positions 0 .. len(ids) - 2; the last token is the anchor)."""
        feats = self.features(taps)
        t = torch.tensor(ids)
        hidden = self.blocks(feats, t, torch.tensor([len(ids) - 1]), k)[0]
        prev, out = t[-1:], []
        for j in range(k):
            logits, _ = self.step_logits(hidden[j : j + 1], prev)
            prev = logits.argmax(-1)
            out.append(int(prev))
        return out


def target_taps(ref, ids: list[int], layer_ids: list[int], stream: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(the hidden state of each of ``layer_ids`` (layer outputs, DSpark's convention; ``stream``:
    ``prefix`` = the AttnRes running sum after the layer, ``attn_res`` = the mix the next layer's
    attention reads, the output mix after the last layer) [T, D] each, logits [T, V]) from the
    naive K3 forward of ``tests.helpers.k3_reference.K3Reference`` (its loop, with captures)."""
    from tests.helpers.k3_reference import rms

    c = ref.c
    kda_layers = set(c["linear_attn_config"]["kda_layers"])
    block = c.get("attn_res_block_size")
    eps = c["rms_norm_eps"]
    n = c["num_hidden_layers"]
    h = ref.w("model.embed_tokens.weight")[torch.tensor(ids)]
    blocks, taps = [], {}

    def tap(j, h):  # layer j's output, h = the running sum after it
        if j not in layer_ids:
            return
        if stream == "attn_res" and blocks:
            name = f"model.layers.{j + 1}.self_attention_res" if j + 1 < n else "model.output_attn_res"
            taps[j] = ref.mix(h, blocks, name)
        else:
            taps[j] = h

    with torch.no_grad():
        for i in range(n):
            p = f"model.layers.{i}."
            attn = ref.kda if i + 1 in kda_layers else ref.mla
            mlp = ref.dense if i < c["first_k_dense_replace"] else ref.moe
            mp = p + ("mlp." if i < c["first_k_dense_replace"] else "block_sparse_moe.")
            if not block:
                h = h + attn(p + "self_attn.", rms(h, ref.w(p + "input_layernorm.weight"), eps))
                h = h + mlp(mp, rms(h, ref.w(p + "post_attention_layernorm.weight"), eps))
                tap(i, h)
                continue
            prefix = h
            x = ref.mix(prefix, blocks, p + "self_attention_res") if blocks else prefix
            if i % block == 0:
                blocks, prefix = blocks + [prefix], None
            a = attn(p + "self_attn.", rms(x, ref.w(p + "input_layernorm.weight"), eps))
            prefix = a if prefix is None else prefix + a
            x = ref.mix(prefix, blocks, p + "mlp_res")
            h = prefix + mlp(mp, rms(x, ref.w(p + "post_attention_layernorm.weight"), eps))
            tap(i, h)
        if block:
            h = ref.mix(h, blocks, "model.output_attn_res")
        h = rms(h, ref.w("model.norm.weight"), eps)
        logits = h @ ref.w("lm_head.weight").T
    return [taps[j] for j in layer_ids], logits


def greedy_speculative(
    ref, drafter: RefDSpark, prompt: list[int], max_tokens: int, k: int, layer_ids: list[int] | None = None
) -> tuple[list[int], int, int]:
    """Greedy generation with block drafting and greedy verification, as the engine schedules it
    (drafts after every step, at most ``max_tokens - produced - 1`` of them, all ``k`` block rows
    computed). -> (output tokens, drafted, accepted). ``layer_ids``: taps (default: the drafter's)."""
    c = drafter.c
    layer_ids = list(layer_ids or c["target_layer_ids"])
    stream = c.get("aux_hidden_stream") or "prefix"
    dt = drafter.context_proj.weight.dtype
    _, logits = target_taps(ref, prompt, layer_ids, stream)
    seq = list(prompt) + [int(logits[-1].argmax())]
    out, drafted, accepted = [seq[-1]], 0, 0
    while len(out) < max_tokens:
        budget = min(k, max_tokens - len(out) - 1)
        taps, _ = target_taps(ref, seq[:-1], layer_ids, stream)
        drafts = drafter.draft([t.to(dt) for t in taps], seq, k)[:budget] if budget > 0 else []
        _, logits = target_taps(ref, seq + drafts, layer_ids, stream)
        greedy = logits[len(seq) - 1 :].argmax(-1).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == greedy[a]:
            a += 1
        new = drafts[:a] + [greedy[a]]
        drafted += len(drafts)
        accepted += a
        seq += new
        out += new
    return out[:max_tokens], drafted, accepted
