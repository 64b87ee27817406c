"""`kimitui info --model DIR --gpus N` shows where the experts would live."""

import shutil

from kimitui.cli import main

FIXTURE = "tests/fixtures/configs/kimi_k26.json"


def test_info_shows_expert_placement(tmp_path, capsys):
    shutil.copy(FIXTURE, tmp_path / "config.json")
    assert main(["info", "--model", str(tmp_path), "--gpus", "4", "--gpu-memory-gb", "140"]) == 0
    out = capsys.readouterr().out
    assert "expert placement" in out
    assert "on GPU" in out and "on CPU" in out  # 4 x 140 GiB cannot hold K2.6's experts


def test_info_placement_bad_model_is_na(tmp_path, capsys):
    assert main(["info", "--model", str(tmp_path)]) == 0
    assert "n/a: " in capsys.readouterr().out
