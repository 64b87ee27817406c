"""MLA EAGLE-3 and EAGLE-3.1 drafters (``Eagle3DeepseekV2ForCausalLM``): chosen by ``architectures``,
loaded from the published layout, and their paged forward against a dense float64 reference written
from the DeepSeek-V3 equations (tests/helpers/spec/eagle3_mla_checkpoint.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from kimitui.engine.layers.attn_metadata import PrefillChunk
from kimitui.engine.spec_decode.eagle3.loader import load_eagle3, read_config
from tests.helpers.checkpoints import BASE
from tests.helpers.spec.eagle3_mla_checkpoint import mla_combine, mla_reference, write_mla_checkpoint

TARGET = {**BASE, "num_hidden_layers": 6}
TCFG = SimpleNamespace(num_hidden_layers=6, hidden_size=BASE["hidden_size"], vocab_size=BASE["vocab_size"])


def embedding(seed: int = 5) -> nn.Embedding:
    emb = nn.Embedding(BASE["vocab_size"], BASE["hidden_size"])
    emb.weight.data = torch.randn(
        BASE["vocab_size"], BASE["hidden_size"], generator=torch.Generator().manual_seed(seed)
    )
    return emb


@pytest.mark.parametrize("v31", [False, True], ids=["eagle3-mla", "eagle3.1-mla"])
def test_paged_forward_matches_dense_reference(tmp_path, v31):
    """13 rows as one prefill-like chunk in scattered blocks, then one chain step fed with the
    pass's own first output (pre-norm, or normed under EAGLE-3.1's norm_output)."""
    c, w = write_mla_checkpoint(tmp_path, TARGET, v31=v31, seed=3)
    emb = embedding()
    d = load_eagle3(tmp_path, TCFG, "cpu", torch.float32, target_embedding=emb)
    assert d.config.mla is not None and d.config.fc_norm == v31 and d.config.norm_output == v31
    g = torch.Generator().manual_seed(4)
    n, bs = 13, 4
    tokens = torch.randint(0, 320, (n + 1,), generator=g).tolist()
    aux = torch.randn(n, 3 * 64, generator=g) * 3
    table = torch.randperm(10, generator=g)[:4].int()
    cache = d.allocate_cache(10, bs, "cpu")
    assert cache.shape == (10, bs, 16 + 8)  # kv_lora_rank + qk_rope_head_dim per token
    with torch.inference_mode():
        hid = d.combine(aux)
        first, normed = d(torch.tensor(tokens[:n]), hid, [PrefillChunk(0, n, n, table)], cache)
        first2, normed2 = d(torch.tensor(tokens[n:]), first[-1:], [PrefillChunk(0, 1, n + 1, table)], cache)
    ref_hid = mla_combine(c, w, aux)
    torch.testing.assert_close(hid.double(), ref_hid, atol=1e-4, rtol=1e-4)
    ref_pre, ref_norm = mla_reference(c, w, emb.weight.data, tokens[:n], list(ref_hid))
    torch.testing.assert_close(normed.double(), ref_norm, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(first.double(), ref_norm if v31 else ref_pre, atol=1e-4, rtol=1e-4)
    fed = (ref_norm if v31 else ref_pre)[-1]
    ref_pre2, ref_norm2 = mla_reference(c, w, emb.weight.data, tokens, list(ref_hid) + [fed])
    torch.testing.assert_close(normed2.double(), ref_norm2[-1:], atol=1e-4, rtol=1e-4)
    with torch.inference_mode():
        logits = d.compute_logits(normed)
    torch.testing.assert_close(logits.double(), ref_norm @ w["lm_head.weight"].double().T, atol=1e-3, rtol=1e-4)


def test_shares_the_targets_lm_head_when_it_has_none(tmp_path):
    c, w = write_mla_checkpoint(tmp_path, TARGET, drop=("lm_head.weight",))
    head = nn.Linear(64, 320, bias=False)
    d = load_eagle3(tmp_path, TCFG, "cpu", torch.float32, target_embedding=embedding(), target_lm_head=head)
    assert d.lm_head is None and "lm_head.weight" not in dict(d.named_parameters())
    x = torch.randn(3, 64)
    torch.testing.assert_close(d.draft_logits(x), head(x))


def test_unknown_architecture_is_one_line_before_any_weight_is_read(tmp_path):
    import json

    write_mla_checkpoint(tmp_path, TARGET)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["Eagle3QwenForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")  # reading it would fail differently
    with pytest.raises(ValueError) as e:
        load_eagle3(tmp_path, TCFG, "cpu", torch.float32)
    msg = str(e.value)
    assert "architectures ['Eagle3QwenForCausalLM'] not supported" in msg and "Eagle3DeepseekV2ForCausalLM" in msg
    assert "\n" not in msg


def test_torchspec_training_name_kv_a_proj_loads(tmp_path):
    c, w = write_mla_checkpoint(tmp_path / "a", TARGET, seed=2)
    renamed = {k.replace("kv_a_proj_with_mqa", "kv_a_proj"): v for k, v in w.items()}
    write_mla_checkpoint(tmp_path / "b", TARGET, tensors=renamed)
    a = load_eagle3(tmp_path / "a", TCFG, "cpu", torch.float32)
    b = load_eagle3(tmp_path / "b", TCFG, "cpu", torch.float32)
    torch.testing.assert_close(
        a.layers[0].self_attn.kv_a_proj_with_mqa.weight, b.layers[0].self_attn.kv_a_proj_with_mqa.weight
    )


def test_layer_ids_precedence_and_convention(tmp_path, caplog):
    write_mla_checkpoint(tmp_path, TARGET, aux_layer_ids=(0, 2, 5), top_level_ids=True)
    with caplog.at_level(logging.WARNING):
        cfg = read_config(tmp_path, TCFG)
    assert cfg.aux_layer_ids == (0, 2, 5)  # the top-level key is honoured
    assert "read as layer inputs (vLLM's convention" in caplog.text  # the interpretation, named
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert read_config(tmp_path, TCFG, aux_convention="output").aux_layer_ids == (1, 3, 6)
        assert read_config(tmp_path, TCFG, aux_convention="input").aux_layer_ids == (0, 2, 5)
    assert "read as layer inputs" not in caplog.text  # explicit: no warning
    assert read_config(tmp_path, TCFG, aux_override=(1, 2, 3)).aux_layer_ids == (1, 2, 3)
    with pytest.raises(ValueError, match=r"in 0\.\.6 for a 6-layer target"):
        read_config(tmp_path, TCFG, aux_override=(1, 2, 6), aux_convention="output")


@pytest.mark.parametrize("v31", [False, True], ids=["eagle3-mla", "eagle3.1-mla"])
def test_footprint_counts_the_mla_drafter_exactly(tmp_path, v31):
    from kimitui.engine.spec_decode.footprint import drafter_footprint

    write_mla_checkpoint(tmp_path, TARGET, v31=v31)
    d = load_eagle3(tmp_path, TCFG, "cpu", torch.float32)
    fp = drafter_footprint(tmp_path, 64, 320, 4)
    assert fp.weight_bytes == sum(p.numel() * 4 for p in d.parameters()) + 320 * 8
    assert fp.kv_bytes_per_token == d.cache_bytes_per_token() == (16 + 8) * 4


@pytest.mark.parametrize("v31", [False, True], ids=["eagle3-mla", "eagle3.1-mla"])
def test_engine_greedy_output_unchanged_with_an_mla_drafter(tmp_path, v31):
    """In process, through speculative_config as a vLLM recipe writes it (the drafter shares the
    target's embedding; EAGLE-3.1 also its LM head): the same greedy tokens as without drafting."""
    from kimitui.engine import LLM, SamplingParams
    from tests.helpers.checkpoints import write_hf_checkpoint

    write_hf_checkpoint(tmp_path / "k2", seed=3)
    write_mla_checkpoint(
        tmp_path / "d", BASE, aux_layer_ids=(0, 1, 3), v31=v31, seed=4, drop=("lm_head.weight",) if v31 else ()
    )
    spec = {"model": str(tmp_path / "d"), "method": "eagle3", "num_speculative_tokens": 3, "max_model_len": 8192}
    prompts = [[5 + i, 17, 33, 9 * i + 1, 40, 41] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    def run(spec_config):
        llm = LLM(str(tmp_path / "k2"), max_model_len=128, max_num_seqs=4, speculative_config=spec_config)
        out = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        return out, llm

    ref, _ = run(None)
    got, llm = run(spec)
    assert got == ref
    assert llm.engine.proposer.drafter.config.mla is not None
    assert llm.engine.model.model.aux_layers == (0, 1, 3)
    assert llm.engine.stats().spec_decode.num_draft_tokens > 0


def test_plan_counts_a_k26_shaped_mla_drafter(tmp_path, capsys):
    """`kimitui plan` with a config shaped like lightseekorg/kimi-k2.6-eagle3-mla's (full vocabulary,
    the target's MLA shape): its weights on GPU 0 and its latent KV per token."""
    import json

    from tests.kimitui.commands.test_plan import CONFIGS, run_plan

    k26 = str(CONFIGS / "kimi_k26.json")
    target = json.loads((CONFIGS / "kimi_k26.json").read_text())
    target = target.get("text_config", target)
    drafter = tmp_path / "mla"
    drafter.mkdir()
    (drafter / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Eagle3DeepseekV2ForCausalLM"],
                "model_type": "deepseek_v3",
                "hidden_size": 7168,
                "intermediate_size": 18432,
                "num_attention_heads": 64,
                "q_lora_rank": 1536,
                "kv_lora_rank": 512,
                "qk_nope_head_dim": 128,
                "qk_rope_head_dim": 64,
                "v_head_dim": 128,
                "vocab_size": 163840,
                "rope_scaling": target.get("rope_scaling"),
                "torch_dtype": "bfloat16",
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]},
            }
        )
    )
    assert run_plan(["--config", k26, "--gpus", "6", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    spec = json.dumps({"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 3})
    assert run_plan(["--config", k26, "--gpus", "6", "--json", "--speculative-config", spec]) in (0, 1)
    with_d = json.loads(capsys.readouterr().out)
    w0 = with_d["devices"][0]["weight_bytes"] - plain["devices"][0]["weight_bytes"]
    # fc 3 x 7168^2, the MLA layer (~117M), the MLP (396M) and a 163840-row lm_head: ~1.84e9 bf16 values
    assert 3.3e9 < w0 < 4.1e9, w0
    assert with_d["devices"][1]["weight_bytes"] == plain["devices"][1]["weight_bytes"]
