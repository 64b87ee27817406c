"""The planner on Kimi K3's real config.json (tests/fixtures/configs/kimi_k3.json) against hand
arithmetic from K3's tensor table (shapes and dtypes as stored in the checkpoint), and the two
stories: six 288 GiB GPUs hold everything with room for long contexts; four do not, so part of every
MoE layer's routed experts live in host RAM and the CPUs compute them."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimitui.engine.config import ModelConfig
from kimitui.engine.plan.param_count import count_params
from kimitui.engine.plan.planner import GiB, plan_placement
from kimitui.engine.plan.report import render

K3 = Path(__file__).resolve().parents[2] / "fixtures" / "configs" / "kimi_k3.json"
D, V = 7168, 163840  # hidden, vocab
KDA_LAYERS, MLA_LAYERS, MOE_LAYERS = 69, 24, 92
H, DK = 96, 128  # KDA heads x head_dim
N_EXP = 896

# One routed expert in MXFP4: w1 (gate) and w3 (up) are U8 [3072, 1792] packed + U8 [3072, 112]
# E8M0 scales; w2 (down) is U8 [3584, 1536] + [3584, 96]. 3 x (5,505,024 + 344,064) bytes.
EXPERT_PACKED = 2 * 3072 * 1792 + 3584 * 1536
EXPERT_SCALES = 2 * 3072 * 112 + 3584 * 96
EXPERT_BYTES = EXPERT_PACKED + EXPERT_SCALES
# The MLA latent per token: kv_lora_rank 512 + rope 64 values, bf16, in each of the 24 MLA layers.
MLA_BYTES_PER_TOKEN = MLA_LAYERS * (512 + 64) * 2


def kda_state_bytes(heads: int) -> int:
    """One sequence's KDA state on a rank holding ``heads`` heads: recurrent [heads, 128, 128] plus the
    q/k/v short-conv history [3 x heads x 128, K-1 = 3]. The engine keeps both in fp32 (the
    published estimate keeps the conv history in bf16: 428.6 MiB instead of 443.1 MiB)."""
    return KDA_LAYERS * 4 * (heads * DK * DK + 3 * heads * DK * 3)


@pytest.fixture(scope="module")
def k3() -> ModelConfig:
    return ModelConfig.from_pretrained(K3)


@pytest.fixture(scope="module")
def six(k3):
    return plan_placement(k3, 6, 288 * GiB, 1_048_576, 1)


@pytest.fixture(scope="module")
def four(k3):
    return plan_placement(k3, 4, 288 * GiB, 1_048_576, 1)


def test_k3_sizes_by_format_match_the_tensor_table(k3):
    size = count_params(k3)
    assert size.num_moe_layers == MOE_LAYERS and size.n_routed_experts == N_EXP
    assert size.routed_expert.nbytes == EXPERT_BYTES == 17_547_264
    assert size.routed_expert.params == 3 * 3072 * 3584  # 2 values per packed byte, scales not counted
    assert size.storage["mxfp4"] == MOE_LAYERS * N_EXP * EXPERT_PACKED
    assert size.storage["scales"] == MOE_LAYERS * N_EXP * EXPERT_SCALES
    kda = 5 * 12288 * D + 128 * D + 12288 * 128 + H * D  # q k v g o, f_a, f_b, b_proj
    mla = 1536 * D + 1536 + 18432 * 1536 + 576 * D + 512 + 24576 * 512 + 2 * 12288 * D
    moe = 2 * 3584 * D + 3584 + 3 * 6144 * D  # latent down/up + norm, 2 shared experts
    bf16 = (
        2 * V * D + KDA_LAYERS * kda + MLA_LAYERS * mla + MOE_LAYERS * moe + 3 * 33792 * D + 93 * 6 * D + 3 * D
    )  # dense layer 0, AttnRes + layer norms, model level
    assert size.storage["bf16"] == 2 * bf16
    # F32: dt_bias, A_log (96 real heads; the checkpoint pads it to 128), three conv weights and o_norm
    # per KDA layer; the router's correction bias, and its gate weight, which is BF16 on disk and
    # kept in fp32 by the engine (routing in fp32, as for Kimi K2).
    f32 = KDA_LAYERS * (12288 + H + 3 * 12288 * 4 + DK) + MOE_LAYERS * (N_EXP * D + N_EXP)
    assert size.storage["f32"] == 4 * f32
    assert sum(size.storage.values()) == size.total.nbytes
    assert size.total.nbytes / 1e12 == pytest.approx(1.56, abs=0.01)  # "K3.1 Pro ~1.56 TB"


def test_k3_per_sequence_memory(six, four):
    for p, gpus in ((six, 6), (four, 4)):
        assert p.num_state_layers == KDA_LAYERS and p.num_paged_layers == MLA_LAYERS
        assert p.kv_bytes_per_token == MLA_BYTES_PER_TOKEN == 27_648
        assert p.state_bytes_per_seq == kda_state_bytes(H) == 464_633_856
        assert [d.state_bytes for d in p.devices] == [kda_state_bytes(H // gpus)] * gpus
        assert all(d.kv_bytes == 1_048_576 * MLA_BYTES_PER_TOKEN for d in p.devices)  # replicated


def test_six_mi355x_hold_all_of_k3_with_room(six):
    assert six.fits_on_gpus and six.num_cpu_experts == 0 and six.host_bytes == 0
    non_expert = max(d.non_expert_bytes for d in six.devices)
    experts = max(d.num_experts for d in six.devices)
    assert experts == -(-MOE_LAYERS * N_EXP // 6)
    room = 288 * GiB - non_expert - experts * EXPERT_BYTES - six.devices[0].reserve_bytes
    per_seq = 1_048_576 * MLA_BYTES_PER_TOKEN + kda_state_bytes(16)
    assert six.max_num_seqs_with_placement == room // per_seq >= 1
    assert six.max_model_len_with_placement >= 1_048_576


def test_four_mi355x_put_experts_on_the_cpus(k3, four):
    assert four.fits and not four.fits_on_gpus
    d = four.devices[0]
    # the reserve: the activation estimate for 2048-token steps of one sequence (2.27 GiB)
    assert d.reserve_bytes == four.activation.total and 2.2 * GiB < d.reserve_bytes < 2.4 * GiB
    fixed = d.non_expert_bytes + d.kv_bytes + d.state_bytes + d.reserve_bytes
    gpu_experts = sum(
        (288 * GiB - x.non_expert_bytes - x.kv_bytes - x.state_bytes - x.reserve_bytes) // EXPERT_BYTES
        for x in four.devices
    )
    assert fixed < 288 * GiB and gpu_experts < MOE_LAYERS * N_EXP
    on_cpu = MOE_LAYERS * N_EXP - gpu_experts
    assert four.num_cpu_experts == on_cpu and four.host_bytes == on_cpu * EXPERT_BYTES
    per_layer = {c for _, c in four.experts_per_layer().values()}
    assert per_layer == {on_cpu // MOE_LAYERS, -(-on_cpu // MOE_LAYERS)}  # 294-295 of 896
    assert four.host_bytes / GiB == pytest.approx(442.1, abs=0.1)


def test_k3_story_lines(six, four):
    text6, text4 = "\n".join(render(six)), "\n".join(render(four))
    assert text6.splitlines()[0].startswith("fits on 6 x 288.00 GiB GPUs: all 896 routed experts of every MoE layer")
    assert f"room for {six.max_num_seqs_with_placement} concurrent sequence" in text6
    head = text4.splitlines()[:2]
    assert head[0].startswith("weights do not fit on 4 x 288.00 GiB GPUs")
    assert head[1].startswith("294-295 of 896 routed experts per MoE layer live in host RAM (442.09")
    for text in (text6, text4):
        assert "KDA state 443.1 MiB (69 KDA layers" in text and "MLA latent 27.0 KiB/token (24 MLA layers" in text
        assert "stored as: mxfp4 1267.88, bf16 104.57, scales 79.24, f32 2.24 GiB" in text


def test_more_sequences_at_shorter_context(k3):
    p = plan_placement(k3, 6, 288 * GiB, 131_072, 8)
    assert p.fits_on_gpus
    d = p.devices[0]
    per_seq = 131_072 * MLA_BYTES_PER_TOKEN + kda_state_bytes(16)
    assert p.max_num_seqs_with_placement == (288 * GiB - d.weight_bytes - d.reserve_bytes) // per_seq > 8
    assert p.to_dict()["max_num_seqs_with_placement"] == p.max_num_seqs_with_placement
    assert p.to_dict()["devices"][0]["state_bytes"] == 8 * kda_state_bytes(16)
