"""Checkpoint files of the wrong JSON shape: one line naming the file and the field, no traceback."""

from __future__ import annotations

import json

import pytest

from kimitui.engine.config import ConfigError, ModelConfig
from kimitui.engine.loader import CheckpointError
from kimitui.engine.loader.checkpoint import CheckpointReader
from tests.helpers.checkpoints import rewrite_checkpoint, state_dict_from, write_hf_checkpoint


@pytest.fixture()
def ckpt(tmp_path):
    write_hf_checkpoint(tmp_path, num_hidden_layers=1)
    return tmp_path


def _one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg
    return msg


def test_config_json_that_is_a_list(ckpt):
    (ckpt / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_pretrained(ckpt)
    msg = _one_line(e)
    assert "config.json" in msg and "JSON object" in msg and "list" in msg


@pytest.mark.parametrize("field, value", [("rope_scaling", "yarn"), ("rope_scaling", [1]), ("rope_parameters", 3)])
def test_rope_scaling_that_is_not_an_object(ckpt, field, value):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg[field] = value
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_pretrained(ckpt)
    msg = _one_line(e)
    assert "config.json" in msg and f"'{field}'" in msg and "object" in msg


def test_weight_map_that_is_a_list(ckpt):
    sd = state_dict_from(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    rewrite_checkpoint(ckpt, sd, cfg, shards=2)
    index = ckpt / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"] = sorted(data["weight_map"])
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(ckpt)
    msg = _one_line(e)
    assert "model.safetensors.index.json" in msg and "'weight_map'" in msg and "list" in msg
