import pytest
import torch

from kimitui.engine.kv_cache.pool import (
    KVCachePool,
    MLACacheSpec,
    StateCacheSpec,
    bytes_per_block,
    num_blocks_for_budget,
    snapshots_for_budget,
)
from kimitui.engine.kv_cache.state import KDAState, KDAStateSpec

K2_MLA = MLACacheSpec(dim=512 + 64, dtype=torch.bfloat16)


def test_mla_layers_are_paged_latent_tensors():
    pool = KVCachePool([K2_MLA] * 3, num_blocks=5, block_size=4, max_num_seqs=2, device="cpu")
    assert len(pool) == 3
    for cache in pool.caches:
        assert cache.shape == (5, 4, 576)
        assert cache.dtype == torch.bfloat16
        assert not cache.any()
    assert pool[0].data_ptr() != pool[1].data_ptr()
    assert pool.capacity_tokens() == 20
    assert pool.num_bytes == 3 * 5 * 4 * 576 * 2


def test_mixed_layer_kinds():
    state = StateCacheSpec(shape=(2, 8, 8), dtype=torch.float32)
    pool = KVCachePool([K2_MLA, state, K2_MLA], num_blocks=3, block_size=2, max_num_seqs=4, device="cpu")
    assert pool[0].shape == (3, 2, 576)
    assert pool[1].shape == (4, 2, 8, 8)
    assert pool[1].dtype == torch.float32
    assert "2 x MLACacheSpec, 1 x StateCacheSpec" in pool.describe()
    assert "6 tokens" in pool.describe()


def test_bytes_per_block_counts_paged_layers_only():
    state = StateCacheSpec(shape=(16,), dtype=torch.float32)
    assert bytes_per_block([K2_MLA, state, K2_MLA], 64) == 2 * 64 * 576 * 2
    assert state.bytes_per_seq() == 64
    assert K2_MLA.bytes_per_seq() == 0


def test_num_blocks_for_budget():
    per_block = bytes_per_block([K2_MLA] * 2, 16)
    assert num_blocks_for_budget([K2_MLA] * 2, 16, 10 * per_block + 7, max_num_seqs=8) == 10
    # State for every possible sequence comes off the top before blocks are counted.
    state = StateCacheSpec(shape=(per_block // 4,), dtype=torch.float32)  # one block's worth per seq
    specs = [K2_MLA, K2_MLA, state]
    assert num_blocks_for_budget(specs, 16, 10 * per_block, max_num_seqs=3) == 7
    assert num_blocks_for_budget(specs, 16, 2 * per_block, max_num_seqs=3) == 0
    with pytest.raises(ValueError, match="no layer has a paged cache"):
        num_blocks_for_budget([state], 16, 10**9, max_num_seqs=1)


def test_pool_sized_from_budget_holds_the_budget():
    specs = [K2_MLA] * 4
    budget = 3 * 2**20
    n = num_blocks_for_budget(specs, 16, budget, max_num_seqs=4)
    pool = KVCachePool(specs, n, 16, 4, torch.device("cpu"))
    assert pool.num_bytes <= budget < pool.num_bytes + bytes_per_block(specs, 16)


def test_invalid_specs_and_sizes():
    with pytest.raises(ValueError):
        MLACacheSpec(dim=0, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        StateCacheSpec(shape=(), dtype=torch.float32)
    with pytest.raises(ValueError, match="must be positive"):
        KVCachePool([K2_MLA], num_blocks=0, block_size=16, max_num_seqs=1, device="cpu")


def test_device_is_honoured():
    pool = KVCachePool([K2_MLA], num_blocks=1, block_size=2, max_num_seqs=1, device="meta")
    assert pool[0].device.type == "meta"


# -- hybrid models: KDA state slots and prefix snapshots ------------------------------------------

KDA = KDAStateSpec(num_heads=2, head_k_dim=4, head_v_dim=4, conv_kernel=4)


def test_kda_state_has_a_row_per_sequence_and_per_snapshot():
    pool = KVCachePool([K2_MLA, KDA], num_blocks=3, block_size=2, max_num_seqs=4, device="cpu", num_snapshots=2)
    state = pool[1]
    assert isinstance(state, KDAState) and state.num_slots == 6
    assert state.recurrent.shape == (6, 2, 4, 4) and state.recurrent.dtype == torch.float32
    assert state.conv.shape == (6, 2 * (4 + 4 + 4), 3)
    assert pool.is_hybrid and pool.num_snapshots == 2
    assert pool.num_bytes == 3 * 2 * 576 * 2 + 6 * KDA.bytes_per_seq()
    assert "state slots for 4 sequences + 2 prefix snapshots" in pool.describe()
    # A model without state gets no snapshot rows whatever is asked.
    assert KVCachePool([K2_MLA], 3, 2, 4, "cpu", num_snapshots=2).num_snapshots == 0


def test_budget_sets_aside_state_slots_and_snapshots():
    per_block = bytes_per_block([K2_MLA, KDA], 16)
    per_slot = KDA.bytes_per_seq()
    budget = 100 * per_block + 8 * per_slot
    assert num_blocks_for_budget([K2_MLA, KDA], 16, budget, max_num_seqs=4) == 100 + (4 * per_slot) // per_block
    assert num_blocks_for_budget([K2_MLA, KDA], 16, budget, max_num_seqs=4, num_snapshots=4) == 100
    # Snapshots only where min_blocks still fit, never more than wanted, none without state.
    assert snapshots_for_budget([K2_MLA, KDA], 16, budget, 4, min_blocks=100, wanted=10) == 4
    assert snapshots_for_budget([K2_MLA, KDA], 16, budget, 4, min_blocks=100, wanted=2) == 2
    assert snapshots_for_budget([K2_MLA, KDA], 16, budget, 4, min_blocks=200, wanted=10) == 0
    assert snapshots_for_budget([K2_MLA], 16, budget, 4, min_blocks=1, wanted=10) == 0
