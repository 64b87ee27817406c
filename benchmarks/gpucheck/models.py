"""Kimi-shaped random models for the graph and decode checks, built in memory (no checkpoint).

The config is the real one (tests/fixtures/configs: Kimi K2.6 INT4 for the DeepSeek-V3 architecture,
Kimi K3 MXFP4 for the hybrid one) at reduced depth, or at toy widths in the self-test. The engine
builds it exactly as it would for a checkpoint (``engine.loader.build_model``), its parameters are
filled with random values in each tensor's format and scale (writing tens of GB of safetensors
would take longer than the whole check), then ``post_load`` derives the merged and absorbed
weights and picks the kernel backend, as after loading. Steps run through the engine's own
``ModelRunner``, eager or through ``DecodeGraphRunner``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kimitui.engine.config import ModelConfig
from kimitui.engine.kv_cache.pool import KVCachePool
from kimitui.engine.loader import build_model, finish_load
from kimitui.engine.runner.model_runner import ModelRunner, StepInputs

CONFIGS = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "configs"

# toy widths for the CPU self-test (the structure, quantisation and routing stay Kimi's)
TINY_K2 = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
)
TINY_K3 = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    num_experts=8,
    num_experts_per_token=2,
    routed_expert_hidden_size=32,
)


def kimi_config(name: str, layers: int, tiny: bool) -> ModelConfig:
    """K2.6 ("k2": dense first layer, then MoE) or K3 ("k3": KDA, KDA, KDA, MLA ...) at ``layers`` depth."""
    raw = json.loads((CONFIGS / ("kimi_k26.json" if name == "k2" else "kimi_k3.json")).read_text())
    text = raw["text_config"]
    text["num_hidden_layers"] = layers
    if name == "k3":
        la = text["linear_attn_config"]  # 1-based layer numbers, every fourth layer full attention
        la["kda_layers"] = [i for i in range(1, layers + 1) if i % 4]
        la["full_attn_layers"] = [i for i in range(1, layers + 1) if i % 4 == 0]
        if tiny:
            la.update(num_heads=2, head_dim=16)
    if tiny:
        text.update(TINY_K2 if name == "k2" else TINY_K3)
    return ModelConfig.from_dict(raw)


@torch.no_grad()
def fill_random(model: torch.nn.Module) -> None:
    """Random weights in every parameter's own format, scaled like a trained model's (unit-RMS
    activations): norms near 1, dense weights ~ 1/sqrt(fan-in), INT4 / MXFP4 / FP8 codes uniform
    with scales that give the same spread."""
    for name, p in model.named_parameters():
        d = p.data
        last = d.shape[-1] if d.dim() else 1
        if d.dtype == torch.int32:  # INT4 words: 8 uniform nibbles
            d.random_(-(2**31), 2**31 - 1)
        elif d.dtype == torch.uint8 and name.endswith("weight_scale"):  # E8M0 near 2^-8
            d.random_(118, 121)
        elif d.dtype == torch.uint8:  # E2M1 codes
            d.random_(0, 256)
        elif d.dtype == torch.float8_e4m3fn:
            d.copy_(torch.randn(d.shape, device=d.device).clamp_(-4, 4))
        elif name.endswith("weight_scale_inv"):  # FP8 block scales; K = blocks * 128
            d.fill_(1.0 / (2 * (last * 128) ** 0.5))
        elif name.endswith("weight_scale"):  # INT4 group scales; K = groups * 32
            d.uniform_(0.5, 1.5).div_(4.6 * (last * 32) ** 0.5)
        elif name.endswith("norm.weight"):
            d.uniform_(0.9, 1.1)
        elif name.endswith("e_score_correction_bias"):
            d.normal_(0, 0.01)
        elif name.endswith("A_log"):
            d.uniform_(-1, 1)
        elif "embed_tokens" in name:
            d.normal_(0, 1)
        elif name.endswith("conv1d.weight") or name.endswith("dt_bias"):
            d.normal_(0, 0.5)
        elif d.dim() >= 2:
            d.normal_(0, last**-0.5)
        else:
            d.normal_(0, 0.02)


def build_random_model(config: ModelConfig, mode, max_model_len: int, expert_placement=None):
    model = build_model(config, mode.device, mode.dtype, max_model_len, expert_placement=expert_placement)
    fill_random(model)
    finish_load(model)
    return model


class Bench:
    """A random model, its KV cache and runners for ``max_num_seqs`` sequences of ``max_model_len``."""

    def __init__(self, model, mode, max_num_seqs: int, max_model_len: int, block_size: int = 16):
        self.model, self.mode = model, mode
        self.block_size, self.max_num_seqs, self.max_model_len = block_size, max_num_seqs, max_model_len
        self.blocks_per_seq = -(-max_model_len // block_size)
        pool = KVCachePool(
            model.cache_specs(mode.dtype), max_num_seqs * self.blocks_per_seq, block_size, max_num_seqs, mode.device
        )
        self.hybrid = pool.is_hybrid
        for cache in pool.caches:  # a latent cache of random rows, so attention is not over zeros
            if isinstance(cache, torch.Tensor) and cache.is_floating_point():
                cache.normal_(0, 0.5)
        self.caches = pool.caches

    def runner(self, graphs: bool) -> ModelRunner:
        """Eager, or decode steps through DecodeGraphRunner (captured on a GPU, the same static
        buffers with direct calls on a CPU)."""
        return ModelRunner(
            self.model,
            self.caches,
            self.block_size,
            self.mode.device,
            None,
            self.max_num_seqs,
            self.max_model_len,
            decode_graphs=True if graphs else False,
        )

    def decode_inputs(self, n: int, context: int, token0: int = 11) -> StepInputs:
        """A decode step of ``n`` sequences at ``context`` tokens, each on its own blocks."""
        need = -(-context // self.block_size)
        tables = [list(range(i * self.blocks_per_seq, i * self.blocks_per_seq + need)) for i in range(n)]
        vocab = self.model.config.vocab_size
        return StepInputs(
            ids=[(token0 + 7 * i) % vocab for i in range(n)],
            num_decodes=n,
            decode_tables=tables,
            decode_lens=[context - (i % 3) for i in range(n)],
            prefills=[],
            sample_rows=list(range(n)),
            state_slots=list(range(n)) if self.hybrid else [],
        )


def decode_step(runner: ModelRunner, inp: StepInputs) -> list[int]:
    """One decode step as the engine runs it: the forward pass, then greedy tokens to the host (the
    one host sync a step has)."""
    logits, _ = runner.forward_step(inp)
    return logits.argmax(-1).tolist()
