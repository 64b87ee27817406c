"""The KDA layer against transformers 5.x: ``KimiLinearDeltaAttention`` (Kimi Linear) and, for K3's
bounded gate, ``Glm5NextTextForgetGate``. transformers runs each sequence alone over its whole
length; our layer runs them as a serving engine does (several sequences per step, chunked prefill
continuing from a slot, then batched decodes) and must give the same rows within 1e-4 in fp32."""

import pytest
import torch
from torch import nn

from kimitui.engine.layers.attn_metadata import AttentionMetadata, PrefillChunk
from kimitui.engine.layers.kda import KDAConfig, KimiDeltaAttention, kda_gate

transformers = pytest.importorskip("transformers")
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig  # noqa: E402
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention  # noqa: E402

D, H, HD = 64, 4, 16
LINEAR = {"full_attn_layers": [2], "kda_layers": [1], "num_heads": H, "head_dim": HD, "short_conv_kernel_size": 4}


def _hf_config():
    return KimiLinearConfig(
        vocab_size=128,
        hidden_size=D,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        linear_attn_config=LINEAR,
    )


def _hf_layer(k3: bool):
    torch.manual_seed(0)
    hf = KimiLinearDeltaAttention(_hf_config(), layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        hf.forget_gate.A_log.copy_(torch.rand(1, 1, H, 1) * 2)
        hf.o_norm.weight.copy_(1 + 0.1 * torch.randn(HD))
    if k3:  # K3: bounded gate and a full-rank output gate g_proj [P, D] (g_a_proj = identity)
        from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextForgetGate

        gate = Glm5NextTextForgetGate(
            Glm5NextTextConfig(hidden_size=D, linear_attn_config=dict(LINEAR, gate_lower_bound=-5.0))
        )
        assert gate.safe_gate_lower_bound == -5.0
        with torch.no_grad():
            for name in ("f_a_proj", "f_b_proj"):
                getattr(gate, name).weight.copy_(getattr(hf.forget_gate, name).weight * 3)
            gate.dt_bias.copy_(hf.forget_gate.dt_bias)
            gate.A_log.copy_(torch.rand(H) * 2)
        hf.forget_gate = gate
        hf.g_a_proj = nn.Identity()
        hf.g_b_proj = nn.Linear(D, H * HD, bias=False)
        nn.init.normal_(hf.g_b_proj.weight, std=0.3)
    return hf


def _checkpoint(hf, k3: bool) -> dict:
    """The layer's tensors under the checkpoint names (HF splits the conv and nests the gate on load)."""
    sd = {name: t.detach().clone() for name, t in hf.state_dict().items()}
    q, k, v = sd.pop("conv1d.weight").chunk(3)
    ckpt = {"q_conv1d.weight": q, "k_conv1d.weight": k, "v_conv1d.weight": v}
    for name in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"):
        ckpt[name] = sd.pop(f"forget_gate.{name}")
    if k3:
        ckpt["g_proj.weight"] = sd.pop("g_b_proj.weight")
        ckpt["A_log"] = torch.cat([ckpt["A_log"], torch.zeros(HD - H)])  # K3 ships [head_dim], first H real
    ckpt.update(sd)
    return ckpt


def _ours(ckpt: dict, k3: bool, fused: bool) -> KimiDeltaAttention:
    linear = dict(LINEAR, gate_lower_bound=-5.0, use_full_rank_gate=True) if k3 else LINEAR
    layer = KimiDeltaAttention(KDAConfig.from_linear_attn_config(D, linear, 1e-5), "model.layers.0.self_attn")
    params = dict(layer.named_parameters())
    assert sorted(params) == sorted(ckpt), "parameter names must equal the checkpoint's"
    with torch.no_grad():
        for name, t in ckpt.items():
            if hasattr(params[name], "weight_loader"):
                params[name].weight_loader(params[name], t)
            else:
                assert params[name].shape == t.shape, name
                params[name].copy_(t)
    if fused:
        layer.post_load()
    if fused == "block":  # a decode step in one C++ call (kernels/cpu/k3_blocks.py)
        from kimitui.kernels.cpu.backend import CpuBackend
        from kimitui.kernels.cpu.k3_blocks import KdaBlock

        layer.fused = CpuBackend().fuse_attention(layer)
        if not isinstance(layer.fused, KdaBlock):
            pytest.skip("the C++ CPU kernels did not build here")
    return layer


def _meta(decodes: list[int], chunks: list[tuple[int, int, int]]) -> AttentionMetadata:
    """decodes: slots of the decode rows; chunks: (slot, rows, context_len after the chunk)."""
    d = len(decodes)
    prefills, start = [], d
    for _, n, ctx in chunks:
        prefills.append(PrefillChunk(start, start + n, ctx, torch.zeros(1, dtype=torch.int32)))
        start += n
    return AttentionMetadata(
        positions=torch.zeros(start, dtype=torch.int64),
        slot_mapping=torch.zeros(start, dtype=torch.int64),
        block_size=16,
        num_decode_tokens=d,
        prefills=prefills,
        state_slots=torch.tensor(decodes + [c[0] for c in chunks], dtype=torch.int64),
    )


@pytest.mark.parametrize("k3,fused", [(False, False), (False, True), (True, True), (False, "block"), (True, "block")])
def test_layer_matches_transformers_over_chunked_prefill_and_decodes(k3, fused, monkeypatch):
    hf = _hf_layer(k3)
    layer = _ours(_checkpoint(hf, k3), k3, fused)
    torch.manual_seed(1)
    lens = {"a": 152, "b": 8, "c": 72}
    xs = {s: torch.randn(n, D) for s, n in lens.items()}
    with torch.no_grad():
        want = {s: hf(x[None])[0] for s, x in xs.items()}
    slot = {"a": 3, "b": 0, "c": 5}
    state = layer.config.state_spec().allocate(0, 0, 8, torch.device("cpu"))
    state.recurrent.normal_()  # stale state from a previous owner must not leak into a new sequence
    state.conv.normal_()
    done = {s: 0 for s in lens}
    # (decoding sequences, [(sequence, rows)]) per step, rows laid out decodes first
    steps = [
        ([], [("a", 100), ("b", 4)]),
        (["b"], [("a", 50), ("c", 70)]),
        (["a", "b", "c"], []),
        (["c", "a", "b"], []),
        (["b"], []),
    ]
    for dec, chunks in steps:
        meta = _meta([slot[s] for s in dec], [(slot[s], n, done[s] + n) for s, n in chunks])
        rows = [(s, done[s], done[s] + 1) for s in dec] + [(s, done[s], done[s] + n) for s, n in chunks]
        x = torch.cat([xs[s][a:b] for s, a, b in rows])
        blocks = []
        if layer.fused is not None:  # count the steps the block ran (every plain decode step must)
            monkeypatch.setattr(type(layer.fused), "__call__", _counted(type(layer.fused).__call__, blocks))
        with torch.no_grad():
            out = layer(x, meta, state)
        monkeypatch.undo()
        torch.testing.assert_close(out, torch.cat([want[s][a:b] for s, a, b in rows]), atol=1e-4, rtol=1e-4)
        if fused == "block":
            assert len(blocks) == (0 if chunks else 1)
        for s, a, b in rows:
            done[s] = b


def _counted(call, calls: list):
    def counted(self, *args):
        calls.append(1)
        return call(self, *args)

    return counted


def test_bounded_gate_matches_glm5_forget_gate_and_slices_A_log():
    hf = _hf_layer(k3=True)
    layer = _ours(_checkpoint(hf, k3=True), k3=True, fused=False)
    assert torch.equal(layer.A_log, hf.forget_gate.A_log)  # first H of the [head_dim] tensor
    x = torch.randn(1, 9, D) * 3
    with torch.no_grad():
        want = hf.forget_gate(x)[0]
        a = (layer.f_b_proj(layer.f_a_proj(x[0])) + layer.dt_bias).view(9, H, HD)
        got = kda_gate(a, layer.A_log, -5.0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # matmul summation order
    assert (got >= -5.0).all() and (got <= 0).all()  # (-5, 0), closed by fp32 saturation
    # Hand formula for one channel: g = -5 * sigmoid(exp(A_log[h]) * a)
    h, c = 2, 7
    expect = -5.0 / (1 + torch.exp(-torch.exp(layer.A_log[h]) * a[3, h, c]))
    torch.testing.assert_close(got[3, h, c], expect)


def test_A_log_layouts_and_errors():
    layer = KimiDeltaAttention(KDAConfig(hidden_size=D, num_heads=3, head_dim=HD), "p")
    layer.load_A_log(torch.arange(3.0).view(1, 1, 3, 1))
    assert layer.A_log.tolist() == [0.0, 1.0, 2.0]
    layer.load_A_log(torch.arange(128.0))  # K3: [128] for fewer heads, the first num_heads are used
    assert layer.A_log.tolist() == [0.0, 1.0, 2.0] and layer.A_log.dtype == torch.float32
    with pytest.raises(ValueError, match=r"A_log: shape \[2\]"):
        layer.load_A_log(torch.zeros(2))
    with pytest.raises(ValueError, match="A_log"):
        layer.load_A_log(torch.zeros(1, 1, 4, 1))


def test_tensor_parallel_shards_follow_heads():
    from kimitui.engine.parallel.state import ParallelState

    cfg = KDAConfig(hidden_size=D, num_heads=5, head_dim=HD, gate_lower_bound=-5.0, use_full_rank_gate=True)
    ranks = [KimiDeltaAttention(cfg, "p", ParallelState(rank=r, world_size=2)) for r in range(2)]
    assert [r.num_heads for r in ranks] == [3, 2]
    assert ranks[1].q_conv1d.weight.shard == (0, 48, 80) and ranks[1].q_conv1d.weight.full_shape == (80, 1, 4)
    assert ranks[1].dt_bias.shard == (0, 48, 80) and ranks[1].b_proj.weight.shard == (0, 3, 5)
    assert ranks[1].o_proj.weight.shard == (1, 48, 80) and ranks[1].f_a_proj.weight.shard is None
    ranks[1].load_A_log(torch.arange(128.0))
    assert ranks[1].A_log.tolist() == [3.0, 4.0]
    assert cfg.state_spec(ParallelState(rank=1, world_size=2)).num_heads == 2


def test_config_from_linear_attn_config_and_errors():
    cfg = KDAConfig.from_linear_attn_config(
        7168,
        {
            "num_heads": 96,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
        1e-5,
    )
    assert (cfg.num_heads, cfg.proj_size, cfg.gate_lower_bound, cfg.use_full_rank_gate) == (96, 12288, -5.0, True)
    with pytest.raises(ValueError, match="missing head_dim"):
        KDAConfig.from_linear_attn_config(64, {"num_heads": 4}, 1e-5)
    with pytest.raises(ValueError, match="gate_lower_bound"):
        KDAConfig(hidden_size=64, num_heads=4, head_dim=16, gate_lower_bound=5.0)
    layer = KimiDeltaAttention(KDAConfig(hidden_size=D, num_heads=H, head_dim=HD), "p")
    state = layer.config.state_spec().allocate(0, 0, 2, torch.device("cpu"))
    meta = _meta([], [(0, 3, 3)])
    meta.state_slots = None
    with pytest.raises(ValueError, match="state_slots"):
        layer(torch.zeros(3, D), meta, state)


def _load_from_safetensors(ckpt: dict, tmp_path, cfg: KDAConfig, par) -> KimiDeltaAttention:
    """Our layer filled by the engine's loader from a safetensors file with the checkpoint's names."""
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from kimitui.engine.loader.checkpoint import CheckpointReader
    from kimitui.engine.loader.weights import load_weights

    path = tmp_path / "model.safetensors"
    if not path.exists():
        save_file({f"model.layers.0.self_attn.{k}": v.contiguous() for k, v in ckpt.items()}, str(path))
    layer = KimiDeltaAttention(cfg, "model.layers.0.self_attn", par)
    holder = nn.Module()
    holder.config = SimpleNamespace(num_hidden_layers=1, tie_word_embeddings=False)
    holder.model = nn.Module()
    holder.model.layers = nn.ModuleList([nn.Module()])
    holder.model.layers[0].self_attn = layer
    # the registry protocol's name mapping: checkpoint names are module paths here
    from kimitui.engine.registry import WeightTarget

    holder.checkpoint_target = lambda name: WeightTarget(*name.rsplit(".", 1))
    with torch.no_grad():
        load_weights(holder, CheckpointReader(tmp_path))
    return layer


class _NoComm:
    """A ParallelState stand-in whose all_reduce is left to the test (ranks run in one process)."""

    def __init__(self, rank, world_size):
        from kimitui.engine.parallel.state import ParallelState

        self._par = ParallelState(rank=rank, world_size=world_size)
        self.rank, self.world_size, self.is_parallel = rank, world_size, True

    def range(self, total):
        return self._par.range(total)

    def all_reduce(self, x):
        return x


def test_loader_fills_k3_layer_and_uneven_tensor_parallel_ranks_sum_to_one(tmp_path):
    hf = _hf_layer(k3=True)
    ckpt = _checkpoint(hf, k3=True)  # A_log stored as [head_dim] = [16] for 4 heads
    cfg = KDAConfig.from_linear_attn_config(D, dict(LINEAR, gate_lower_bound=-5.0, use_full_rank_gate=True), 1e-5)
    from kimitui.engine.parallel.state import SINGLE

    full = _load_from_safetensors(ckpt, tmp_path, cfg, SINGLE)
    ranks = [_load_from_safetensors(ckpt, tmp_path, cfg, _NoComm(r, 3)) for r in range(3)]
    assert [r.num_heads for r in ranks] == [2, 1, 1]
    assert torch.equal(ranks[2].A_log, ckpt["A_log"][3:4])
    x = torch.randn(75, D)
    outs = []
    for layer in [full, *ranks]:
        layer.post_load()
        state = layer.config.state_spec(layer.par).allocate(0, 0, 2, torch.device("cpu"))
        with torch.no_grad():
            first = layer(x[:70], _meta([], [(1, 70, 70)]), state)
            rest = layer(x[70:], _meta([], [(1, 5, 75)]), state)
        outs.append(torch.cat([first, rest]))
    with torch.no_grad():
        torch.testing.assert_close(outs[0], hf(x[None])[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(sum(outs[1:]), outs[0], atol=1e-5, rtol=1e-5)


def test_bf16_model_keeps_fp32_params_and_state():
    hf = _hf_layer(k3=False)
    ckpt = _checkpoint(hf, k3=False)
    ref_layer = _ours(ckpt, k3=False, fused=True)
    layer = KimiDeltaAttention(KDAConfig.from_linear_attn_config(D, LINEAR, 1e-5), "p", dtype=torch.bfloat16)
    fp32 = {"A_log", "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "o_norm.weight"}
    for name, p in layer.named_parameters():
        assert p.dtype == (torch.float32 if name in fp32 else torch.bfloat16), name
        with torch.no_grad():
            if name == "A_log":
                layer.load_A_log(ckpt[name])
            else:
                p.copy_(ckpt[name])
    layer.post_load()
    x = torch.randn(80, D)
    outs = []
    for lay, dtype in ((ref_layer, torch.float32), (layer, torch.bfloat16)):
        state = lay.config.state_spec().allocate(0, 0, 1, torch.device("cpu"))
        with torch.no_grad():
            outs.append(
                torch.cat(
                    [
                        lay(x[:79].to(dtype), _meta([], [(0, 79, 79)]), state),
                        lay(x[79:].to(dtype), _meta([0], []), state),
                    ]
                )
            )
        assert state.recurrent.dtype == torch.float32 and state.conv.dtype == torch.float32
    assert outs[1].dtype == torch.bfloat16
    err = (outs[1].float() - outs[0]).norm() / outs[0].norm()
    assert err < 0.03, err
