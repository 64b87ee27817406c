"""Loading through the model's declarations: the registry, explicit dtypes (FP8 scales stay fp32 in a
bf16 model), and FP8 shards for GPU counts whose head split does not fall on scale blocks."""

from __future__ import annotations

import json
import random

import pytest
import torch

from kimitui.engine import LLM, SamplingParams
from kimitui.engine.config import ModelConfig
from kimitui.engine.loader import CheckpointReader, build_model, load_model
from kimitui.engine.parallel.state import ParallelState
from kimitui.engine.plan.param_count import meta_model, part_sizes
from kimitui.engine.plan.planner import plan_placement
from kimitui.engine.registry import WeightTarget, model_class, parameter_classes, supported_model_types
from kimitui.kernels import reference as R
from tests.helpers.checkpoints import hf_prompt_logprobs, write_hf_checkpoint
from tests.helpers.quantized import quantize_checkpoint

# 7 heads of 16 + 8 = 24 q rows: on 6 ranks the q_b_proj shards start at rows 0, 48, 72, 96, ...,
# and 72 is inside a 16-row FP8 scale block. Shared experts 2 x 48 = 6 blocks of 16.
SHAPE = dict(
    num_attention_heads=7,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    vocab_size=331,
    n_routed_experts=6,
    moe_intermediate_size=48,
    n_shared_experts=2,
    intermediate_size=96,
    num_hidden_layers=2,
    n_group=2,
    topk_group=1,
)


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8")
    hf = write_hf_checkpoint(path, seed=7, **SHAPE)
    quantize_checkpoint(path, "fp8", hf)
    return path, hf


def test_registry_maps_model_types_to_classes(fp8_ckpt):
    path, _ = fp8_ckpt
    config = ModelConfig.from_pretrained(path)
    assert supported_model_types()[:3] == ("kimi_k2", "deepseek_v3", "kimi_k25")
    assert model_class(config.model_type).__name__ == "DeepseekV3ForCausalLM"
    model = build_model(config, torch.device("meta"), torch.bfloat16)
    classes = set(parameter_classes(model).values())
    assert classes == {
        "embedding",
        "lm_head",
        "final_norm",
        "attention",
        "dense_mlp",
        "router",
        "shared_experts",
        "routed_experts",
    }
    assert model.checkpoint_target("model.layers.1.mlp.experts.3.up_proj.weight_scale_inv") == WeightTarget(
        "model.layers.1.mlp.experts", "up_proj.weight_scale_inv", 3
    )
    assert model.checkpoint_target("model.layers.1.self_attn.q_b_proj.weight") == WeightTarget(
        "model.layers.1.self_attn.q_b_proj", "weight"
    )
    assert model.checkpoint_target("model.layers.2.eh_proj.weight") == "MTP layer"
    assert len(model.cache_specs(torch.bfloat16)) == 2


def test_build_leaves_the_default_dtype_alone_and_keeps_fp32_tensors_fp32(fp8_ckpt):
    path, _ = fp8_ckpt
    config = ModelConfig.from_pretrained(path)
    model = build_model(config, torch.device("meta"), torch.bfloat16)
    assert torch.get_default_dtype() == torch.float32
    by_name = dict(model.named_parameters())
    scales = [n for n in by_name if n.endswith("scale_inv")]
    assert scales and all(by_name[n].dtype == torch.float32 for n in scales)
    assert by_name["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert by_name["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert by_name["model.norm.weight"].dtype == torch.bfloat16
    assert by_name["model.layers.0.self_attn.q_b_proj.weight"].dtype == torch.float8_e4m3fn


def test_bf16_forward_of_fp8_checkpoint(fp8_ckpt):
    path, hf = fp8_ckpt
    llm = LLM(str(path), dtype="bfloat16", max_model_len=128, max_num_seqs=2)
    q_b = llm.engine.model.model.layers[0].self_attn.q_b_proj
    assert q_b.weight_scale_inv.dtype == torch.float32  # what the FP8 GEMM and fused MoE require
    rng = random.Random(0)
    ids = [rng.randrange(331) for _ in range(40)]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    ref = hf_prompt_logprobs(hf, ids)
    worst = max(abs(out.prompt_logprobs[i][ids[i]] - ref[i - 1, ids[i]].item()) for i in range(1, len(ids)))
    assert worst < 0.15  # bf16 activations against the fp32 oracle


def _dequant(reader: CheckpointReader, name: str) -> torch.Tensor:
    return R.dequant_fp8_block(reader.get(f"{name}.weight"), reader.get(f"{name}.weight_scale_inv"), (16, 16))


@pytest.mark.parametrize("world", [4, 6])
def test_fp8_shards_off_the_scale_blocks_load_exactly(fp8_ckpt, world):
    # Each rank's weights, dequantised, equal its rows/columns of the whole dequantised weight.
    path, _ = fp8_ckpt
    config = ModelConfig.from_pretrained(path)
    reader = CheckpointReader(path)
    q_b = _dequant(reader, "model.layers.0.self_attn.q_b_proj")
    gate = _dequant(reader, "model.layers.1.mlp.shared_experts.gate_proj")
    down = _dequant(reader, "model.layers.1.mlp.shared_experts.down_proj")
    plan = plan_placement(config, world, 1 << 30, 128, 1)
    starts = set()
    for rank in range(world):
        par = ParallelState(rank, world)
        model, _ = load_model(config, path, torch.device("cpu"), torch.float32, par=par)
        attn = model.model.layers[0].self_attn
        h0, h1 = par.range(7)
        starts.add(h0 * 24 % 16)
        torch.testing.assert_close(attn.q_b_proj.dense_weight(), q_b[h0 * 24 : h1 * 24], rtol=0, atol=0)
        shared = model.model.layers[1].mlp.shared_experts
        i0, i1 = par.range(96, 16)
        torch.testing.assert_close(shared.gate_proj.dense_weight(), gate[i0:i1], rtol=0, atol=0)
        torch.testing.assert_close(shared.down_proj.dense_weight(), down[:, i0:i1], rtol=0, atol=0)
        # the planner's bytes for this rank are this rank's own build (in the checkpoint dtype)
        sizes = part_sizes(meta_model(config, world, rank))
        assert plan.devices[rank].non_expert_bytes == sum(v.nbytes for k, v in sizes.items() if k != "routed_experts")
    if world == 6:
        assert 8 in starts  # some shard did start mid-block


def test_int4_group_cut_is_refused_naming_the_tensor(fp8_ckpt):
    # An INT4 o_proj split by heads of 16 columns would cut 32-column groups on 6 ranks: the planner
    # (which builds what the engine builds) says so up front in one message naming the tensor.
    path, _ = fp8_ckpt
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"g": {"weights": {"num_bits": 4, "group_size": 32}}},
        "ignore": ["lm_head"],
    }
    config = ModelConfig.from_dict(raw)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight_scale: .* impossible"):
        plan_placement(config, 6, 1 << 30, 128, 1)
    plan_placement(config, 2, 1 << 30, 128, 1)  # 4 + 3 heads: columns [0, 64) and [64, 112) cut no group
