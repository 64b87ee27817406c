"""benchmarks/cpu_decode_step.py's checkpoint in both expert formats: the bytes a step reads, the
tensors it writes, and that the engine decodes it (the MXFP4 / INT4 end-to-end comparison needs both)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors import safe_open

from benchmarks import cpu_decode_step as bench

TINY = dict(hidden=64, inter=32, experts=4, top_k=2, layers=1, heads=2, vocab=64)


def _args(fmt):
    return argparse.Namespace(format=fmt, **TINY)


def test_step_bytes_count_one_scale_byte_per_32_columns_for_mxfp4_and_two_for_int4():
    int4, mxfp4 = bench.step_bytes(_args("int4"), torch.float32), bench.step_bytes(_args("mxfp4"), torch.float32)
    d, i, k = TINY["hidden"], TINY["inter"], TINY["top_k"]
    assert int4["experts"] - mxfp4["experts"] == k * TINY["layers"] * 3 * d * i // 32
    assert mxfp4["experts"] == k * TINY["layers"] * (3 * d * i // 2 + 3 * d * i // 32)
    assert int4["dense"] == mxfp4["dense"]


@pytest.mark.parametrize(
    "fmt, dtype, config_format",
    [("int4", torch.int32, "pack-quantized"), ("mxfp4", torch.uint8, "mxfp4-pack-quantized")],
)
def test_checkpoint_holds_the_format_asked_for(tmp_path, fmt, dtype, config_format):
    bench.write_checkpoint(tmp_path, _args(fmt))
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["format"] == config_format
    seen = 0
    for f in tmp_path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                if name.endswith("experts.0.down_proj.weight_packed"):
                    t = st.get_tensor(name)
                    assert t.dtype == dtype and t.shape == (
                        TINY["hidden"],
                        TINY["inter"] // (8 if fmt == "int4" else 2),
                    )
                    seen += 1
                if fmt == "mxfp4" and name.endswith("experts.0.down_proj.weight_scale"):
                    assert st.get_tensor(name).dtype == torch.uint8
    assert seen == TINY["layers"]


def test_the_engine_decodes_the_mxfp4_checkpoint(tmp_path):
    bench.write_checkpoint(tmp_path, _args("mxfp4"))
    with bench.LLM(str(tmp_path), dtype="float32", device="cpu", max_model_len=32, max_num_seqs=1) as llm:
        out = llm.generate([list(range(1, 9))], bench.SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
