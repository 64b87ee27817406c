"""The EAGLE-3 drafter: loading the published layouts, and its forward over a paged cache against a
dense float64 reference built from Hugging Face's Llama pieces (RMSNorm, rotary embedding, MLP)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from kimitui.engine.layers.attn_metadata import PrefillChunk
from kimitui.engine.spec_decode.eagle3.loader import load_eagle3
from kimitui.engine.spec_decode.eagle3.model import Eagle3Config, rope_parameters
from tests.helpers.checkpoints import BASE
from tests.helpers.spec.eagle3_checkpoint import write_eagle3_checkpoint
from tests.helpers.spec.eagle3_reference import hf_llama, reference

TARGET = {**BASE, "num_hidden_layers": 6}  # default aux ids (2, 3, 3) would repeat: tests name their own
AUX = [1, 3, 6]
TCFG = SimpleNamespace(num_hidden_layers=6, hidden_size=BASE["hidden_size"], vocab_size=BASE["vocab_size"])


def target_embedding(seed: int = 5) -> nn.Embedding:
    g = torch.Generator().manual_seed(seed)
    emb = nn.Embedding(BASE["vocab_size"], BASE["hidden_size"])
    emb.weight.data = torch.randn(BASE["vocab_size"], BASE["hidden_size"], generator=g)
    return emb


# -- tests -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_paged_forward_matches_dense_reference(tmp_path, norm_before_residual):
    """Two sequences in scattered blocks: A's rows in two prefill-like chunks (the second batched with
    B's first chunk), then a chain step of both (one row each, the padded path) fed with their own
    previous pre-norm output, as chain drafting does."""
    config, w = write_eagle3_checkpoint(
        tmp_path,
        TARGET,
        dtype=torch.float32,
        aux_layer_ids=AUX,
        draft_vocab_size=96,
        norm_before_residual=norm_before_residual,
        seed=1,
    )
    emb = target_embedding()
    drafter = load_eagle3(tmp_path, TCFG, "cpu", torch.float32, target_embedding=emb)
    g = torch.Generator().manual_seed(2)
    n_a, n_b, bs = 21, 9, 4
    tok_a = torch.randint(0, 320, (n_a,), generator=g).tolist()
    tok_b = torch.randint(0, 320, (n_b,), generator=g).tolist()
    aux_a = torch.randn(n_a, 3 * 64, generator=g)
    aux_b = torch.randn(n_b, 3 * 64, generator=g)
    perm = torch.randperm(24, generator=g)
    table_a, table_b = perm[:6].int(), perm[6:9].int()  # 6 blocks of 4 cover 21 rows; B: 3 blocks
    cache = drafter.allocate_cache(24, bs, "cpu")
    with torch.inference_mode():
        pre1, nrm1 = drafter(
            torch.tensor(tok_a[:13]), drafter.combine(aux_a[:13]), [PrefillChunk(0, 13, 13, table_a)], cache
        )
        ids2 = torch.tensor(tok_a[13:20] + tok_b[:8])
        hid2 = drafter.combine(torch.cat([aux_a[13:20], aux_b[:8]]))
        pre2, nrm2 = drafter(ids2, hid2, [PrefillChunk(0, 7, 20, table_a), PrefillChunk(7, 15, 8, table_b)], cache)
        hid3 = torch.stack([pre2[6], pre2[14]])  # each sequence's own last pre-norm output
        pre3, nrm3 = drafter(
            torch.tensor([tok_a[20], tok_b[8]]),
            hid3,
            [PrefillChunk(0, 1, 21, table_a), PrefillChunk(1, 2, 9, table_b)],
            cache,
        )
    fc = w["fc.weight"].double()
    hid_a = [aux_a[i].double() @ fc.T for i in range(20)] + [pre2[6].double()]
    hid_b = [aux_b[i].double() @ fc.T for i in range(8)] + [pre2[14].double()]
    ref_a, ref_an = reference(config, w, emb.weight.data, tok_a, hid_a)
    ref_b, ref_bn = reference(config, w, emb.weight.data, tok_b, hid_b)
    got_a = torch.cat([pre1, pre2[:7], pre3[:1]]).double()
    got_b = torch.cat([pre2[7:], pre3[1:]]).double()
    torch.testing.assert_close(got_a, ref_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_b, ref_b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat([nrm1, nrm2[:7], nrm3[:1]]).double(), ref_an, atol=1e-4, rtol=1e-4)
    # logits over the draft vocabulary, mapped to target ids through d2t
    ref_logits = ref_an @ w["lm_head.weight"].double().T  # [N, 96]
    vocab_ids = torch.arange(96) + w["d2t"]
    with torch.inference_mode():
        full = drafter.compute_logits(torch.cat([nrm1, nrm2[:7], nrm3[:1]]))
        greedy = drafter.greedy(torch.cat([nrm1, nrm2[:7], nrm3[:1]]))
    assert full.shape == (n_a, 320)
    torch.testing.assert_close(full[:, vocab_ids].double(), ref_logits, atol=1e-4, rtol=1e-4)
    outside = torch.ones(320, dtype=torch.bool)
    outside[vocab_ids] = False
    assert torch.isinf(full[:, outside]).all()
    assert greedy.tolist() == vocab_ids[ref_logits.argmax(-1)].tolist()


def test_long_chunk_is_tiled_and_bf16_stays_close(tmp_path, monkeypatch):
    """A chunk longer than the query tile, in a bf16 drafter, against the float64 reference."""
    import kimitui.engine.spec_decode.eagle3.model as e3

    monkeypatch.setattr(e3, "QUERY_TILE", 8)
    config, w = write_eagle3_checkpoint(
        tmp_path, TARGET, dtype=torch.bfloat16, aux_layer_ids=AUX, seed=3, own_embedding=True, hidden_size=48
    )  # its own width: fc 192 -> 48
    drafter = load_eagle3(tmp_path, TCFG, "cpu", torch.bfloat16)
    assert drafter.embed_tokens is not None
    g = torch.Generator().manual_seed(4)
    n = 30
    tok = torch.randint(0, 320, (n,), generator=g).tolist()
    aux = torch.randn(n, 3 * 64, generator=g)
    cache = drafter.allocate_cache(10, 4, "cpu")
    with torch.inference_mode():
        pre, nrm = drafter(
            torch.tensor(tok), drafter.combine(aux), [PrefillChunk(0, n, n, torch.arange(10).int())], cache
        )
    assert pre.dtype == torch.bfloat16 and cache.dtype == torch.bfloat16
    fc = w["fc.weight"].double()
    ref, _ = reference(
        config, w, w["embed_tokens.weight"], tok, [aux[i].to(torch.bfloat16).double() @ fc.T for i in range(n)]
    )
    err = (pre.double() - ref).abs().max() / ref.abs().max()
    assert err < 0.03, err


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "beta_fast": 16,
        },
    ],
)
def test_rope_matches_hugging_face(scaling):
    from tests.helpers.spec.eagle3_checkpoint import eagle3_config

    d = eagle3_config(TARGET, rope_scaling=scaling, aux_layer_ids=AUX)
    cfg = Eagle3Config.from_dict(d, 6, 64, 320)
    hf_scaling = None if scaling is None else {("rope_type" if k == "type" else k): v for k, v in scaling.items()}
    _, rotary = hf_llama({**d, "rope_scaling": hf_scaling})
    pos = torch.tensor([0, 1, 7, 63, 200, 511])
    cos_ref, sin_ref = rotary(torch.zeros(1, 6, 16), pos[None])
    inv, amp = rope_parameters(cfg)
    f = pos.float()[:, None] * inv[None]
    torch.testing.assert_close(torch.cat([f.cos(), f.cos()], -1) * amp, cos_ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([f.sin(), f.sin()], -1) * amp, sin_ref[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["midlayer", "model"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_published_layouts_load_the_same_weights(tmp_path, layout, dtype):
    config, w = write_eagle3_checkpoint(
        tmp_path, TARGET, layout=layout, dtype=dtype, aux_layer_ids=AUX, draft_vocab_size=64
    )
    drafter = load_eagle3(tmp_path, TCFG, "cpu", torch.float32, target_embedding=target_embedding())
    got = dict(drafter.named_parameters())
    assert set(got) == {n for n in w if n not in ("d2t", "t2d")}
    for name, p in got.items():
        assert torch.equal(p, w[name]), name
    assert torch.equal(drafter.draft_to_target(), torch.arange(64) + w["d2t"])
    assert drafter.config.aux_layer_ids == (1, 3, 6) and drafter.config.draft_vocab_size == 64
    assert drafter.cache_bytes_per_token() == 2 * 2 * 16 * 4


def test_a_narrower_drafter_needs_its_own_embedding(tmp_path):
    write_eagle3_checkpoint(tmp_path, TARGET, aux_layer_ids=AUX, hidden_size=48)
    with pytest.raises(ValueError, match="hidden_size 48 differs from the target's 64"):
        load_eagle3(tmp_path, TCFG, "cpu", torch.float32)


def test_config_defaults_and_errors(tmp_path):
    from tests.helpers.spec.eagle3_checkpoint import eagle3_config

    d = eagle3_config({**BASE, "num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840})
    cfg = Eagle3Config.from_dict(d, 61, 7168, 163840)
    assert cfg.aux_layer_ids == (2, 30, 58)  # vLLM's (2, L // 2, L - 3) for Kimi K2's 61 layers
    base = eagle3_config(TARGET, aux_layer_ids=AUX)
    cases = [
        ({"num_hidden_layers": 2}, "num_hidden_layers must be 1"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"vocab_size": 321}, "vocab_size 321 differs"),
        ({"target_hidden_size": 32}, "target_hidden_size 32 differs"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"draft_vocab_size": 400}, "draft_vocab_size must be in"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 1, 2]}}, "must be distinct"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 7]}}, r"in 0\.\.6"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic'"),
    ]
    for change, msg in cases:
        with pytest.raises(ValueError, match=msg):
            Eagle3Config.from_dict({**base, **change}, 6, 64, 320)


def test_checkpoint_errors_name_the_problem(tmp_path):
    from safetensors.torch import load_file, save_file

    write_eagle3_checkpoint(tmp_path, TARGET, aux_layer_ids=AUX, draft_vocab_size=64)
    f = tmp_path / "model.safetensors"
    good = load_file(str(f))

    def expect(tensors, msg):
        save_file(tensors, str(f))
        with pytest.raises(ValueError, match=msg):
            load_eagle3(tmp_path, TCFG, "cpu", torch.float32)

    expect({k: v for k, v in good.items() if k != "midlayer.mlp.up_proj.weight"}, "lacks 'layers.0.mlp.up_proj")
    expect(
        {**good, "fc.weight": good["fc.weight"][:, :64].contiguous()},
        r"'fc.weight' has shape \[64, 64\], expected \[64, 192\]",
    )
    expect(
        {**good, "midlayer.self_attn.qkv_proj.weight": good["fc.weight"].clone()},
        "unexpected tensor 'midlayer.self_attn",
    )
    expect({**good, "d2t": good["d2t"] + 1000}, "outside the target vocabulary")
    expect({k: v for k, v in good.items() if k != "d2t"}, "needs a d2t tensor")
    save_file(good, str(f))
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "draft_vocab_size": None, "vocab_size": None}))
    with pytest.raises(ValueError, match=r"has shape \[64"):  # no draft_vocab_size: the full vocabulary
        load_eagle3(tmp_path, TCFG, "cpu", torch.float32)
