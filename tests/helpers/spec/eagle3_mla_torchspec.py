"""A plain-PyTorch MLA EAGLE-3 / EAGLE-3.1 drafter written from TorchSpec's trainer
(lightseekorg/TorchSpec: ``torchspec/models/draft/deepseek_eagle.py``, ``models/eagle3.py``,
``models/draft/keymap.py``), the trainer behind lightseekorg/kimi-k2.6-eagle3-mla. It is the
independent side of the trained-pair tests: it trains the tiny drafters
(``benchmarks/spec/train_eagle3.py``), exports them in the published key layouts, and measures
greedy acceptance with its own dense forward over a Hugging Face target. Nothing here imports
kimitui's drafter.

- ``fc`` over the concatenated aux hidden states (EAGLE-3.1: ``fc_norm.<i>`` RMSNorm per chunk first);
- one decoder layer (``midlayer``): residual = the hidden state, attention over
  ``cat(input_layernorm(embedding), hidden_norm(hidden))`` with DeepSeek MLA (q LoRA, kv latent,
  one shared k_rope, interleaved YaRN rope on the rope dims, softmax scale times mscale**2), then
  the SiLU MLP with its own residual;
- ``norm`` and ``lm_head`` (full vocabulary here: no d2t / t2d);
- the next chained step takes the pre-norm output (EAGLE-3), or the normed one (EAGLE-3.1's
  ``norm_output``).

Training-time test (TorchSpec's cached path): step j's rows sit at positions p + j, attend
causally to step 0's keys and to their own position's keys of steps 1..j.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _mscale(factor: float, m: float) -> float:
    return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0


def _yarn_inv_freq(dim: int, base: float, rs: dict | None) -> tuple[torch.Tensor, float]:
    """DeepSeek's YaRN inverse frequencies (as in DeepSeek-V3's modeling code) and the cos/sin
    amplitude mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
    pos = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    inv = 1.0 / base**pos
    if not rs or rs.get("rope_type", rs.get("type")) in (None, "default"):
        return inv.float(), 1.0
    factor, old = float(rs["factor"]), int(rs["original_max_position_embeddings"])
    beta_fast, beta_slow = float(rs.get("beta_fast") or 32), float(rs.get("beta_slow") or 1)

    def corr(rot):
        return dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (high frequencies), 0: interpolated
    inv = inv / factor * (1 - keep) + inv * keep
    amp = _mscale(factor, float(rs.get("mscale") or 1)) / _mscale(factor, float(rs.get("mscale_all_dim") or 0))
    return inv.float(), amp


def _rope(x: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor, amp: float) -> torch.Tensor:
    """Interleaved-pair rotation (DeepSeek) of x [..., S, D] at positions pos [S] or [B, S]."""
    f = pos.float()[..., None] * inv  # [(B,) S, D/2]
    cos, sin = f.cos() * amp, f.sin() * amp
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


class MLAAttention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        h2, H = 2 * c["hidden_size"], c["num_attention_heads"]
        self.H, self.nope, self.rope, self.vd = H, c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        self.r, self.qr = c["kv_lora_rank"], c.get("q_lora_rank")
        qk = self.nope + self.rope
        eps = c["rms_norm_eps"]
        if self.qr:
            self.q_a_proj = nn.Linear(h2, self.qr, bias=False)
            self.q_a_layernorm = RMSNorm(self.qr, eps)
            self.q_b_proj = nn.Linear(self.qr, H * qk, bias=False)
        else:
            self.q_proj = nn.Linear(h2, H * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h2, self.r + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.r, eps)
        self.kv_b_proj = nn.Linear(self.r, H * (self.nope + self.vd), bias=False)
        self.o_proj = nn.Linear(H * self.vd, c["hidden_size"], bias=False)
        inv, self.amp = _yarn_inv_freq(self.rope, c.get("rope_theta", 10000.0), c.get("rope_scaling"))
        self.register_buffer("inv_freq", inv, persistent=False)
        rs = c.get("rope_scaling") or {}
        m = _mscale(float(rs["factor"]), float(rs.get("mscale_all_dim") or 0)) if rs.get("mscale_all_dim") else 1.0
        self.scale = qk**-0.5 * m * m

    def qkv(self, x, pos):
        """x [B, S, 2h] -> q, k [B, H, S, qk], v [B, H, S, vd]."""
        B, S, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.qr else self.q_proj(x)
        q = q.view(B, S, self.H, -1).transpose(1, 2)
        kv = self.kv_a_proj_with_mqa(x)
        lat, k_pe = kv[..., : self.r], kv[..., self.r :]
        kvb = self.kv_b_proj(self.kv_a_layernorm(lat)).view(B, S, self.H, -1).transpose(1, 2)
        k_pe = _rope(k_pe[:, None], pos, self.inv_freq, self.amp)  # [B, 1, S, rope]
        q = torch.cat((q[..., : self.nope], _rope(q[..., self.nope :], pos, self.inv_freq, self.amp)), -1)
        k = torch.cat((kvb[..., : self.nope], k_pe.expand(B, self.H, S, self.rope)), -1)
        return q, k, kvb[..., self.nope :]

    def forward(self, x, pos, mask=None, cache=None):
        """Dense causal attention (``mask`` [S, S] bool, True = may attend; None: causal), or with a
        TTT ``cache`` list of earlier steps' (k, v): causal to step 0, diagonal to steps 1..j."""
        q, k, v = self.qkv(x, pos)
        B, H, S, _ = q.shape
        if cache is None:
            if mask is None:
                mask = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        else:
            cache.append((k, v))
            k0, v0 = cache[0]
            s0 = (q @ k0.transpose(-1, -2)) * self.scale
            s0 = s0.masked_fill(~torch.ones(S, S, dtype=torch.bool, device=x.device).tril(), float("-inf"))
            diag = [(q * ki).sum(-1, keepdim=True) * self.scale for ki, _ in cache[1:]]
            w = torch.cat([s0] + diag, -1).float().softmax(-1).to(q.dtype)
            o = w[..., :S] @ v0
            for i, (_, vi) in enumerate(cache[1:]):
                o = o + w[..., S + i : S + i + 1] * vi
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, h: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        h, eps = c["hidden_size"], c["rms_norm_eps"]
        self.self_attn = MLAAttention(c)
        self.mlp = MLP(h, c["intermediate_size"])
        self.hidden_norm = RMSNorm(h, eps)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)

    def forward(self, emb, hidden, pos, mask=None, cache=None):
        residual = hidden
        x = torch.cat((self.input_layernorm(emb), self.hidden_norm(hidden)), -1)
        hidden = residual + self.self_attn(x, pos, mask, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def aux_ids(c: dict) -> list[int]:
    return list(
        (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or c["eagle_aux_hidden_state_layer_ids"]
    )


class MLADrafter(nn.Module):
    """TorchSpec's ``Eagle3DeepseekV2ForCausalLM`` (plus EAGLE-3.1's fc_norm / norm_output)."""

    def __init__(self, c: dict):
        super().__init__()
        self.config = c
        h, td, eps = c["hidden_size"], c.get("target_hidden_size") or c["hidden_size"], c["rms_norm_eps"]
        n = len(aux_ids(c))
        self.embed_tokens = nn.Embedding(c["vocab_size"], h)
        self.fc = nn.Linear(n * td, h, bias=False)
        self.fc_norm = nn.ModuleList(RMSNorm(td, eps) for _ in range(n)) if c.get("fc_norm") else None
        self.midlayer = Layer(c)
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, c["vocab_size"], bias=False)
        self.norm_output = bool(c.get("norm_output"))

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        if self.fc_norm is not None:
            aux = torch.cat([nrm(p) for nrm, p in zip(self.fc_norm, aux.chunk(len(self.fc_norm), -1))], -1)
        return self.fc(aux)

    def step(self, tokens, hidden, pos, mask=None, cache=None):
        """-> (the hidden the next chained step takes, logits)."""
        out = self.midlayer(self.embed_tokens(tokens), hidden, pos, mask, cache)
        normed = self.norm(out)
        return (normed if self.norm_output else out), self.lm_head(normed)

    def export(self, layout: str = "torchspec", embed: bool = False) -> dict[str, torch.Tensor]:
        """The state dict under published names. ``torchspec``: TorchSpec's export
        (``midlayer.`` -> ``layers.0.``, keymap.py); ``midlayer``: SpecForge / ModelOpt style."""
        out = {}
        for k, v in self.state_dict().items():
            if k == "embed_tokens.weight" and not embed:
                continue
            if layout == "torchspec" and k.startswith("midlayer."):
                k = "layers.0." + k[len("midlayer.") :]
            out[k] = v.detach().clone().contiguous()
        return out

    @classmethod
    def load(cls, path: str | Path, embed: torch.Tensor | None = None) -> MLADrafter:
        """From a checkpoint directory in either layout (``embed``: the target's, when it has none)."""
        from safetensors.torch import load_file

        path = Path(path)
        c = json.loads((path / "config.json").read_text())
        m = cls(c)
        sd = {}
        for f in sorted(path.glob("*.safetensors")):
            for k, v in load_file(str(f)).items():
                k = k.removeprefix("model.")
                sd["midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k] = v.float()
        if "embed_tokens.weight" not in sd:
            sd["embed_tokens.weight"] = embed.float()
        m.load_state_dict(sd, strict=True)
        return m.eval()


def ttt_loss(drafter: MLADrafter, aux, tokens, probs, steps: int):
    """TorchSpec-style training-time test over a batch: aux [B, S, n * D] the target's aux states,
    tokens [B, S] the sequence, probs [B, S, V] the target's next-token distribution at each
    position. Step j's row p takes token p + 1 + j and predicts the target's greedy token at p + 1 + j
    (cross-entropy on its argmax).
    -> (loss, per-step argmax accuracy list)."""
    B, S, _ = aux.shape
    hidden = drafter.project(aux)
    cache, loss, acc = [], 0.0, []
    pos = torch.arange(S)
    for j in range(steps):
        n = S - 1 - j  # rows with an input token and a label
        if n < 1:
            break
        # every step keeps S rows (TTT keys line up by position); rows past the end are padding
        tok = torch.cat((tokens[:, 1 + j :], tokens.new_zeros(B, 1 + j)), 1)
        hidden, logits = drafter.step(tok, hidden, pos + j, cache=cache)
        lab = torch.cat((probs[:, 1 + j :], probs.new_zeros(B, 1 + j, probs.shape[-1])), 1)
        valid = torch.zeros(B, S, dtype=torch.bool)
        valid[:, :n] = True
        # the target's greedy token as the label (what greedy verification accepts; a tiny random
        # target's distributions are nearly flat, so soft targets teach little about their argmax)
        loss = loss + F.cross_entropy(logits[valid].float(), lab.argmax(-1)[valid])
        acc.append(((logits.argmax(-1) == lab.argmax(-1)) & valid).sum().item() / valid.sum().item())
    return loss, acc


@torch.no_grad()
def greedy_drafts(drafter: MLADrafter, aux, seq: list[int], k: int) -> list[int]:
    """Greedy chain drafts after ``seq`` (t_0..t_n, t_n just sampled; aux [n, n_aux * D] the target's
    aux states at positions 0..n-1): rows 0..n-1 take (target state p, token p + 1); draft 1 is
    row n-1's argmax; each further draft one more row at the next position fed with the previous
    row's output. Recomputed densely (causal over all rows) each time."""
    n = len(seq) - 1
    hid = drafter.project(aux[:n])[None]
    toks = torch.tensor(seq[1:])[None]
    drafts = []
    for j in range(k):
        pos = torch.arange(n + j)
        feed, logits = drafter.step(toks, hid, pos)
        d = int(logits[0, -1].argmax())
        drafts.append(d)
        toks = torch.cat((toks, torch.tensor([[d]])), 1)
        hid = torch.cat((hid, feed[:, -1:]), 1)
    return drafts


def greedy_acceptance(
    drafter: MLADrafter, aux_of, prompts: list[list[int]], continuations: list[list[int]], k: int
) -> tuple[int, int, list[int]]:
    """Greedy speculative decoding simulated over each prompt: ``continuations`` are the target's
    greedy tokens (greedy verification reproduces them, so acceptance is the longest draft prefix
    that matches them), ``aux_of(ids)`` the target's aux states [len(ids), n_aux * D]. Draft length
    min(k, tokens left - 1), as an engine that never drafts past ``max_tokens``.
    -> (draft tokens, accepted tokens, accepted per position)."""
    drafted = accepted = 0
    per_pos = [0] * k
    for prompt, cont in zip(prompts, continuations):
        aux = aux_of(prompt + cont)
        gen = 1  # the prefill sampled cont[0]
        while gen < len(cont):
            m = min(k, len(cont) - gen - 1)
            if m < 1:
                gen += 1
                continue
            seq = prompt + cont[:gen]
            d = greedy_drafts(drafter, aux, seq, m)
            a = 0
            while a < m and d[a] == cont[gen + a]:
                per_pos[a] += 1
                a += 1
            drafted, accepted = drafted + m, accepted + a
            gen += a + 1
    return drafted, accepted, per_pos


def hf_all_states(hf, ids: list[int], logits: bool = False):
    """Every hidden state of a Hugging Face DeepSeek-V3 model over ``ids``: [L + 1, T, D] fp32, index k
    the state entering layer k (L: the last layer's output, before the final norm); with ``logits``
    also the logits [T, V] fp32 of the same pass."""
    outs = []
    hooks = [
        layer.register_forward_hook(lambda m, i, o: outs.append(o[0] if isinstance(o, tuple) else o))
        for layer in hf.model.layers
    ]
    try:
        with torch.no_grad():
            t = torch.tensor([ids])
            first = hf.model.embed_tokens(t)
            out = hf(t).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    states = torch.stack([first[0].float()] + [o[0].float() for o in outs])
    return (states, out) if logits else states
