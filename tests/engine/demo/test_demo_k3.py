"""The K3 demo checkpoint: the real K3 layout (wrapper config, tensor names, shapes, dtypes, MXFP4
experts, tokenizer files) at toy size, written once and found by the name "demo-k3"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kimitui.engine.demo import demo_checkpoint
from kimitui.engine.demo.k3 import TEXT_CONFIG, _random_weights, demo_k3_dir, ensure_demo_k3_checkpoint

P = "language_model.model.layers"


@pytest.fixture(scope="module")
def ckpt() -> Path:
    return ensure_demo_k3_checkpoint()


@pytest.fixture(scope="module")
def tensors(ckpt) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    out = {}
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(ckpt / fname), "pt") as f:
            for name in f.keys():
                assert index["weight_map"][name] == fname
                t = f.get_slice(name)
                out[name] = (
                    tuple(t.get_shape()),
                    {"BF16": torch.bfloat16, "F32": torch.float32, "U8": torch.uint8}[t.get_dtype()],
                )
    assert len(out) == len(index["weight_map"])
    return out


def test_resolved_by_name(ckpt):
    assert demo_checkpoint("demo-k3") == ckpt == demo_k3_dir()
    from kimitui.engine.engine import _resolve_model

    assert _resolve_model("demo-k3") == str(ckpt)
    with pytest.raises(ValueError, match="unknown built-in model 'demo-k9'"):
        demo_checkpoint("demo-k9")


def test_wrapper_config(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3" and cfg["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (163584, 163586, 163839)
    assert "quantization_config" not in cfg and cfg["kimitui_demo"]
    text = cfg["text_config"]
    assert text["model_type"] == "kimi_linear" and text["vocab_size"] == 163840 and text["hidden_act"] == "situ"
    lin = text["linear_attn_config"]
    n = text["num_hidden_layers"]
    assert sorted(lin["kda_layers"] + lin["full_attn_layers"]) == list(range(1, n + 1))
    assert lin["full_attn_layers"][-1] == n and lin["num_heads"] <= lin["head_dim"]
    q = text["quantization_config"]
    assert q["format"] == "mxfp4-pack-quantized" and q["quant_method"] == "compressed-tensors"
    w = q["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["group_size"], w["type"], w["scale_dtype"]) == (4, 32, "float", "torch.uint8")
    assert json.loads((ckpt / "generation_config.json").read_text())["eos_token_id"] == 163586


def test_tensor_names_shapes_dtypes(tensors):
    c, lin = TEXT_CONFIG, TEXT_CONFIG["linear_attn_config"]
    d, h, kd = c["hidden_size"], c["num_attention_heads"], lin["head_dim"]
    p, lat = lin["num_heads"] * kd, c["routed_expert_hidden_size"]
    inter, e = c["moe_intermediate_size"], c["num_experts"]
    bf16, f32, u8 = torch.bfloat16, torch.float32, torch.uint8
    want = {
        "language_model.model.embed_tokens.weight": ((163840, d), bf16),
        "language_model.lm_head.weight": ((163840, d), bf16),
        "language_model.model.norm.weight": ((d,), bf16),
        "language_model.model.output_attn_res_norm.weight": ((d,), bf16),
        "language_model.model.output_attn_res_proj.weight": ((1, d), bf16),
    }
    for i in range(c["num_hidden_layers"]):
        lp, a = f"{P}.{i}", f"{P}.{i}.self_attn"
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            want[f"{lp}.{norm}.weight"] = ((d,), bf16)
        want[f"{lp}.self_attention_res_proj.weight"] = want[f"{lp}.mlp_res_proj.weight"] = ((1, d), bf16)
        if i + 1 in lin["kda_layers"]:
            for proj in ("q_proj", "k_proj", "v_proj", "g_proj"):
                want[f"{a}.{proj}.weight"] = ((p, d), bf16)
            for conv in ("q_conv1d", "k_conv1d", "v_conv1d"):
                want[f"{a}.{conv}.weight"] = ((p, 1, 4), f32)
            want |= {
                f"{a}.f_a_proj.weight": ((kd, d), bf16),
                f"{a}.f_b_proj.weight": ((p, kd), bf16),
                f"{a}.b_proj.weight": ((lin["num_heads"], d), bf16),
                f"{a}.A_log": ((kd,), f32),
                f"{a}.dt_bias": ((p,), f32),
                f"{a}.o_norm.weight": ((kd,), f32),
                f"{a}.o_proj.weight": ((d, p), bf16),
            }
        else:
            nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
            want |= {
                f"{a}.q_a_proj.weight": ((c["q_lora_rank"], d), bf16),
                f"{a}.q_a_layernorm.weight": ((c["q_lora_rank"],), bf16),
                f"{a}.q_b_proj.weight": ((h * (nope + rope), c["q_lora_rank"]), bf16),
                f"{a}.kv_a_proj_with_mqa.weight": ((c["kv_lora_rank"] + rope, d), bf16),
                f"{a}.kv_a_layernorm.weight": ((c["kv_lora_rank"],), bf16),
                f"{a}.kv_b_proj.weight": ((h * (nope + v), c["kv_lora_rank"]), bf16),
                f"{a}.g_proj.weight": ((h * v, d), bf16),
                f"{a}.o_proj.weight": ((d, h * v), bf16),
            }
        if i < c["first_k_dense_replace"]:
            for proj, shape in (
                ("gate_proj", (c["intermediate_size"], d)),
                ("up_proj", (c["intermediate_size"], d)),
                ("down_proj", (d, c["intermediate_size"])),
            ):
                want[f"{lp}.mlp.{proj}.weight"] = (shape, bf16)
            continue
        m = f"{lp}.block_sparse_moe"
        want |= {
            f"{m}.gate.weight": ((e, d), bf16),
            f"{m}.gate.e_score_correction_bias": ((e,), f32),
            f"{m}.routed_expert_down_proj.weight": ((lat, d), bf16),
            f"{m}.routed_expert_norm.weight": ((lat,), bf16),
            f"{m}.routed_expert_up_proj.weight": ((d, lat), bf16),
            f"{m}.shared_experts.gate_proj.weight": ((inter, d), bf16),
            f"{m}.shared_experts.up_proj.weight": ((inter, d), bf16),
            f"{m}.shared_experts.down_proj.weight": ((d, inter), bf16),
        }
        for x in range(e):
            for w, (rows, cols) in (("w1", (inter, lat)), ("w3", (inter, lat)), ("w2", (lat, inter))):
                want[f"{m}.experts.{x}.{w}.weight_packed"] = ((rows, cols // 2), u8)
                want[f"{m}.experts.{x}.{w}.weight_scale"] = ((rows, cols // 32), u8)
    assert tensors == want


def test_values_a_log_and_mxfp4(ckpt):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]

    def load(name):
        with safe_open(str(ckpt / index[name]), "pt") as f:
            return f.get_tensor(name)

    heads = TEXT_CONFIG["linear_attn_config"]["num_heads"]
    a_log = load(f"{P}.0.self_attn.A_log")
    assert bool((a_log[:heads] > 0).all()) and bool((a_log[:heads] <= torch.tensor(16.0).log()).all())
    assert bool((a_log[heads:] == 0).all())  # K3's padding past num_heads
    packed, scale = (
        load(f"{P}.1.block_sparse_moe.experts.3.w1.weight_packed"),
        load(f"{P}.1.block_sparse_moe.experts.3.w1.weight_scale"),
    )
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    nib = torch.stack([packed & 0xF, packed >> 4], -1).flatten(-2).long()  # even column = low nibble
    w = e2m1[nib] * torch.exp2(scale.float() - 127).repeat_interleave(32, -1)
    assert w.shape == (TEXT_CONFIG["moe_intermediate_size"], TEXT_CONFIG["routed_expert_hidden_size"])
    assert 0.005 < float(w.std()) < 0.05 and float(w.abs().max()) <= 6 / 128


def test_weights_deterministic():
    a, b = _random_weights(TEXT_CONFIG), _random_weights(TEXT_CONFIG)
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_tokenizer_files(ckpt):
    from kimitui.engine.text.tokenizer import load_tiktoken_ranks

    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert "chat_template" not in cfg and not (ckpt / "tokenizer.json").exists()
    dec = cfg["added_tokens_decoder"]
    assert sorted(map(int, dec)) == list(range(163584, 163840))
    named = {int(i): v["content"] for i, v in dec.items() if not v["content"].startswith("<|reserved_token_")}
    assert named[163586] == "<|end_of_msg|>" and named[163587] == "<|open|>" and named[163839] == "[PAD]"
    assert [i for i, v in dec.items() if not v["special"]] == ["163587", "163588", "163589"]
    ranks = load_tiktoken_ranks(ckpt / "tiktoken.model")
    assert sorted(ranks.values()) == list(range(163584))
