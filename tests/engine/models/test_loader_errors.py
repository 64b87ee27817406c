"""Every bad checkpoint gives one line naming the file and the tensor, never a half-loaded model."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kimitui.engine import LLM
from kimitui.engine.config import ConfigError, ModelConfig
from kimitui.engine.loader import CheckpointError, load_model
from tests.helpers.checkpoints import rewrite_checkpoint, state_dict_from, write_hf_checkpoint


@pytest.fixture()
def ckpt(tmp_path):
    write_hf_checkpoint(tmp_path, num_hidden_layers=2)
    sd = state_dict_from(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    rewrite_checkpoint(tmp_path, sd, cfg, shards=2)
    return tmp_path, sd, cfg


def _load_error(path) -> str:
    with pytest.raises((CheckpointError, ConfigError)) as e:
        LLM(str(path), max_model_len=64, max_num_seqs=1)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_missing_shard(ckpt):
    path, _, _ = ckpt
    (path / "model-00002-of-00002.safetensors").unlink()
    msg = _load_error(path)
    assert "model-00002-of-00002.safetensors" in msg and "missing shard" in msg and "model." in msg


def test_missing_tensor(ckpt):
    path, sd, cfg = ckpt
    del sd["model.layers.0.self_attn.kv_b_proj.weight"]
    rewrite_checkpoint(path, sd, cfg)
    msg = _load_error(path)
    assert "model.layers.0.self_attn.kv_b_proj.weight" in msg and "missing" in msg


def test_missing_expert(ckpt):
    path, sd, cfg = ckpt
    del sd["model.layers.1.mlp.experts.3.up_proj.weight"]
    rewrite_checkpoint(path, sd, cfg)
    msg = _load_error(path)
    assert "model.layers.1.mlp.experts" in msg and "missing" in msg


def test_expert_out_of_range(ckpt):
    path, sd, cfg = ckpt
    sd["model.layers.1.mlp.experts.99.up_proj.weight"] = torch.zeros(32, 64)
    rewrite_checkpoint(path, sd, cfg)
    msg = _load_error(path)
    assert "model.layers.1.mlp.experts.99.up_proj.weight" in msg and "expert 99 out of range" in msg


def test_fused_expert_layout_loads_like_per_expert_tensors(ckpt, tmp_path_factory):
    # transformers 5.x may save all experts of a layer as gate_up_proj [E, 2I, D] and down_proj [E, D, I]
    path, sd, cfg = ckpt
    fused_dir = tmp_path_factory.mktemp("fused")
    fused = {k: v for k, v in sd.items() if ".mlp.experts." not in k}
    base = "model.layers.1.mlp.experts"
    n = cfg["n_routed_experts"]
    fused[f"{base}.gate_up_proj"] = torch.stack(
        [torch.cat([sd[f"{base}.{e}.gate_proj.weight"], sd[f"{base}.{e}.up_proj.weight"]]) for e in range(n)]
    )
    fused[f"{base}.down_proj"] = torch.stack([sd[f"{base}.{e}.down_proj.weight"] for e in range(n)])
    rewrite_checkpoint(fused_dir, fused, cfg)
    config = ModelConfig.from_pretrained(path)
    a, _ = load_model(config, path, torch.device("cpu"), torch.float32)
    b, _ = load_model(config, fused_dir, torch.device("cpu"), torch.float32)
    for name in ("w13_weight", "w2_weight"):
        ea = getattr(a.model.layers[1].mlp.experts.local, name)
        assert torch.equal(ea, getattr(b.model.layers[1].mlp.experts.local, name)) and ea.abs().sum() > 0


def test_wrong_shape(ckpt):
    path, sd, cfg = ckpt
    sd["model.layers.1.self_attn.o_proj.weight"] = torch.zeros(64, 60)
    rewrite_checkpoint(path, sd, cfg)
    msg = _load_error(path)
    assert "model.layers.1.self_attn.o_proj.weight" in msg and "[64, 60]" in msg and "[64, 64]" in msg
    assert ".safetensors" in msg


def test_wrong_dtype(ckpt):
    path, sd, cfg = ckpt
    sd["model.norm.weight"] = torch.ones(64, dtype=torch.int32)
    rewrite_checkpoint(path, sd, cfg)
    msg = _load_error(path)
    assert "model.norm.weight" in msg and "int32" in msg


def test_truncated_shard(ckpt):
    path, _, _ = ckpt
    shard = path / "model-00001-of-00002.safetensors"
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    msg = _load_error(path)
    assert "model-00001-of-00002.safetensors" in msg and "truncated" in msg


def test_corrupt_header(ckpt):
    path, _, _ = ckpt
    shard = path / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:40] = b"\xff" * 32
    shard.write_bytes(bytes(data))
    msg = _load_error(path)
    assert "model-00002-of-00002.safetensors" in msg


def test_index_names_tensor_not_in_shard(ckpt):
    path, _, _ = ckpt
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.ghost.weight"] = "model-00001-of-00002.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    msg = _load_error(path)
    assert "model.layers.0.ghost.weight" in msg and "model-00001-of-00002.safetensors" in msg


def test_unused_tensors_are_skipped_and_counted(ckpt):
    path, sd, cfg = ckpt
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    sd["model.layers.2.eh_proj.weight"] = torch.zeros(4, 4)  # MTP layer beyond num_hidden_layers
    rewrite_checkpoint(path, sd, cfg)
    llm = LLM(str(path), max_model_len=64, max_num_seqs=1)
    report = llm.engine.load_report
    assert report.tensors_skipped == 2
    assert any("inv_freq" in s for s in report.skipped_examples)


def test_progress_callback_counts_bytes_and_tensors(ckpt):
    path, sd, _ = ckpt
    seen = []
    LLM(str(path), max_model_len=64, max_num_seqs=1, progress=seen.append)
    assert seen[-1].tensors_done == seen[-1].tensors_total == len(sd)
    assert seen[-1].bytes_done == seen[-1].bytes_total
    assert all(a.bytes_done <= b.bytes_done for a, b in zip(seen, seen[1:]))


def test_config_errors_name_the_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="model_type 'llama' is not supported.*kimi_k2, deepseek_v3, kimi_k25"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k2", "vocab_size": 10}))
    with pytest.raises(ConfigError, match="required field 'hidden_size' is missing"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="text_config"):
        ModelConfig.from_dict({"model_type": "kimi_k25"})


def test_missing_checkpoint_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
