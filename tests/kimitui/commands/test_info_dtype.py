"""`kimitui info` says which dtype ``--dtype auto`` computes in on this CPU, and why."""

import shutil

import torch

from kimitui.cli import main
from kimitui.engine.args import cpu_auto_dtype


def test_info_names_the_auto_dtype_for_a_quantised_checkpoint(tmp_path, capsys):
    shutil.copy("tests/fixtures/configs/kimi_k2_instruct.json", tmp_path / "config.json")  # FP8 blocks
    assert main(["info", "--model", str(tmp_path)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "--dtype auto" in ln)
    assert "computes float32" in line and "FP8" in line


def test_int4_experts_compute_in_bf16_where_the_cpu_has_bf16_arithmetic(tmp_path):
    from kimitui.engine.config import ModelConfig

    shutil.copy("tests/fixtures/configs/kimi_k26.json", tmp_path / "config.json")  # INT4 experts, bf16 rest
    config = ModelConfig.from_pretrained(str(tmp_path))
    assert cpu_auto_dtype("bfloat16", config, flags={"amx_bf16"}, kernels=True)[0] is torch.bfloat16
    assert cpu_auto_dtype("bfloat16", config, flags={"avx2"}, kernels=True)[0] is torch.float32


def test_info_names_the_auto_dtype_for_a_bf16_checkpoint(capsys, monkeypatch):
    monkeypatch.setattr("kimitui.engine.args.cpu_flags", lambda: {"avx2"})  # a CPU without bf16 arithmetic
    assert main(["info"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "--dtype auto" in ln)
    assert "computes float32 for an unquantised bf16" in line and "no bf16 arithmetic" in line
    assert cpu_auto_dtype("bfloat16", flags={"amx_bf16"}, kernels=True)[1].startswith("bf16 checkpoint")
