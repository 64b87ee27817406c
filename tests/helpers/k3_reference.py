"""An independent, naive float64 forward of the Kimi K3 text model, straight from the published
formulas, for one sequence without any cache: per-token KDA recurrence, full causal NoPE MLA with an
output gate, SiTU MLPs, latent MoE with group-limited sigmoid routing, attention residuals.
It reads the checkpoint's tensors by their K3 names and imports nothing from the engine.

Sources: Kimi Linear arXiv:2510.26692 and transformers' models/kimi_linear/modeling_kimi_linear.py
(KDA, MLA, routing); Kimi K3 tech report arXiv:2607.24653, Attention Residuals arXiv:2603.15031 and
SGLang python/sglang/srt/models/kimi_k3.py (SiTU, latent MoE, AttnRes, bounded gate, A_log[:H]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def mxfp4_decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(E2M1, dtype=torch.float64)
    codes = torch.stack([packed & 0xF, packed >> 4], -1).flatten(-2).long()  # low nibble = even column
    return lut[codes] * torch.pow(2.0, scale.double() - 127).repeat_interleave(32, -1)


def rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def situ(g, u, beta, lin_beta):
    up = u if lin_beta is None else lin_beta * torch.tanh(u / lin_beta)
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * up


class K3Reference:
    def __init__(self, config: dict, tensors: dict[str, torch.Tensor]):
        self.c = config["text_config"]
        self.t = {}
        for name, v in tensors.items():
            if name.endswith(".weight_scale"):
                continue
            if name.endswith(".weight_packed"):
                base = name[: -len(".weight_packed")]
                self.t[base + ".weight"] = mxfp4_decode(v, tensors[base + ".weight_scale"])
            else:
                self.t[name] = v.double()

    def w(self, name):
        return self.t[name]

    def act(self, g, u):
        c = self.c
        if c.get("hidden_act") == "situ":
            return situ(g, u, c.get("activation_situ_beta") or 1.0, c.get("activation_situ_linear_beta"))
        return F.silu(g) * u

    def kda(self, p, x):
        c, la = self.c, self.c["linear_attn_config"]
        h, dk, kk = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
        t = x.shape[0]

        def conv(name, y):  # depthwise causal conv, zero left padding, then SiLU; y [T, P]
            w = self.w(p + name)[:, 0, :]  # [P, K]
            pad = torch.cat([torch.zeros(kk - 1, y.shape[1], dtype=y.dtype), y])
            return F.silu(torch.stack([(pad[i : i + kk].T * w).sum(-1) for i in range(t)]))

        q = conv("q_conv1d.weight", x @ self.w(p + "q_proj.weight").T).view(t, h, dk)
        k = conv("k_conv1d.weight", x @ self.w(p + "k_proj.weight").T).view(t, h, dk)
        v = conv("v_conv1d.weight", x @ self.w(p + "v_proj.weight").T).view(t, h, dk)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk**-0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        a = (x @ self.w(p + "f_a_proj.weight").T @ self.w(p + "f_b_proj.weight").T + self.w(p + "dt_bias")).view(
            t, h, dk
        )
        rate = torch.exp(self.w(p + "A_log").reshape(-1)[:h])[None, :, None]  # A_log[:H], one value per head
        if la.get("gate_lower_bound") is not None:
            g = la["gate_lower_bound"] * torch.sigmoid(rate * a)
        else:
            g = -rate * F.softplus(a)
        beta = torch.sigmoid(x @ self.w(p + "b_proj.weight").T)  # [T, H]
        s = torch.zeros(h, dk, dk, dtype=torch.float64)
        out = torch.zeros(t, h, dk, dtype=torch.float64)
        for i in range(t):
            s = s * torch.exp(g[i])[:, :, None]
            u = torch.einsum("hk,hkv->hv", k[i], s)
            s = s + k[i][:, :, None] * (beta[i][:, None] * (v[i] - u))[:, None, :]
            out[i] = torch.einsum("hk,hkv->hv", q[i], s)
        if la.get("use_full_rank_gate"):
            gate = x @ self.w(p + "g_proj.weight").T
        else:
            gate = x @ self.w(p + "g_a_proj.weight").T @ self.w(p + "g_b_proj.weight").T
        o = rms(out, self.w(p + "o_norm.weight"), c["rms_norm_eps"]) * torch.sigmoid(gate.view(t, h, dk))
        return o.reshape(t, -1) @ self.w(p + "o_proj.weight").T

    def mla(self, p, x):
        c = self.c
        t, h = x.shape[0], c["num_attention_heads"]
        nope, rope, vd, r = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
        eps = c["rms_norm_eps"]
        if c.get("q_lora_rank"):
            q = (
                rms(x @ self.w(p + "q_a_proj.weight").T, self.w(p + "q_a_layernorm.weight"), eps)
                @ self.w(p + "q_b_proj.weight").T
            )
        else:
            q = x @ self.w(p + "q_proj.weight").T
        q = q.view(t, h, nope + rope)
        kv = x @ self.w(p + "kv_a_proj_with_mqa.weight").T
        lat = rms(kv[:, :r], self.w(p + "kv_a_layernorm.weight"), eps)
        kvb = (lat @ self.w(p + "kv_b_proj.weight").T).view(t, h, nope + vd)
        k = torch.cat([kvb[..., :nope], kv[:, None, r:].expand(t, h, rope)], -1)  # NoPE: unrotated
        scores = torch.einsum("thd,shd->hts", q, k) * (nope + rope) ** -0.5
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("hts,shd->thd", scores.softmax(-1), kvb[..., nope:]).reshape(t, -1)
        if c.get("mla_use_output_gate"):
            o = o * torch.sigmoid(x @ self.w(p + "g_proj.weight").T)
        return o @ self.w(p + "o_proj.weight").T

    def dense(self, p, x):
        return (
            self.act(x @ self.w(p + "gate_proj.weight").T, x @ self.w(p + "up_proj.weight").T)
            @ self.w(p + "down_proj.weight").T
        )

    def moe(self, p, x):
        c = self.c
        e, k, ng, tg = c["num_experts"], c["num_experts_per_token"], c["num_expert_group"], c["topk_group"]
        s = torch.sigmoid(x @ self.w(p + "gate.weight").T)
        choice = (s + self.w(p + "gate.e_score_correction_bias")).view(-1, ng, e // ng)
        keep = choice.topk(2, -1).values.sum(-1).topk(tg, -1).indices
        mask = torch.full_like(choice, float("-inf")).scatter(1, keep[..., None].expand(-1, -1, e // ng), 0.0)
        ids = (choice + mask).view(-1, e).topk(k, -1).indices
        wts = s.gather(1, ids)
        if c.get("moe_renormalize", True):
            wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
        wts = wts * c["routed_scaling_factor"]
        latent = c.get("routed_expert_hidden_size")
        z = x @ self.w(p + "routed_expert_down_proj.weight").T if latent else x
        y = torch.zeros_like(z)
        for i in range(x.shape[0]):
            for j in range(k):
                ep = f"{p}experts.{int(ids[i, j])}."
                hdn = self.act(z[i] @ self.w(ep + "w1.weight").T, z[i] @ self.w(ep + "w3.weight").T)
                y[i] += wts[i, j] * (hdn @ self.w(ep + "w2.weight").T)
        if latent:
            if c.get("latent_moe_use_norm"):
                y = rms(y, self.w(p + "routed_expert_norm.weight"), c["rms_norm_eps"])
            y = y @ self.w(p + "routed_expert_up_proj.weight").T
        return y + self.dense(p + "shared_experts.", x)

    def mix(self, x, blocks, name):
        cands = torch.stack([*blocks, x], 1)  # [T, n+1, D]
        scores = (
            rms(cands, self.w(name + "_norm.weight"), self.c["rms_norm_eps"]) * self.w(name + "_proj.weight")[0]
        ).sum(-1)
        return (scores.softmax(-1)[..., None] * cands).sum(1)

    @torch.no_grad()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """[T, V] next-token log-probabilities after each token."""
        c = self.c
        kda_layers = set(c["linear_attn_config"]["kda_layers"])  # 1-indexed
        block = c.get("attn_res_block_size")
        eps = c["rms_norm_eps"]
        h = self.w("model.embed_tokens.weight")[torch.tensor(ids)]
        blocks = []
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            attn = self.kda if i + 1 in kda_layers else self.mla
            mlp = self.dense if i < c["first_k_dense_replace"] else self.moe
            mp = p + ("mlp." if i < c["first_k_dense_replace"] else "block_sparse_moe.")
            if not block:
                h = h + attn(p + "self_attn.", rms(h, self.w(p + "input_layernorm.weight"), eps))
                h = h + mlp(mp, rms(h, self.w(p + "post_attention_layernorm.weight"), eps))
                continue
            prefix = h
            x = self.mix(prefix, blocks, p + "self_attention_res") if blocks else prefix
            if i % block == 0:
                blocks, prefix = blocks + [prefix], None
            a = attn(p + "self_attn.", rms(x, self.w(p + "input_layernorm.weight"), eps))
            prefix = a if prefix is None else prefix + a
            x = self.mix(prefix, blocks, p + "mlp_res")
            h = prefix + mlp(mp, rms(x, self.w(p + "post_attention_layernorm.weight"), eps))
        if block:
            h = self.mix(h, blocks, "model.output_attn_res")
        h = rms(h, self.w("model.norm.weight"), eps)
        return (h @ self.w("lm_head.weight").T).log_softmax(-1)
