import pytest

from kimitui.engine.kv_cache import block_manager as bm_module
from kimitui.engine.kv_cache.block_manager import BlockManager
from kimitui.engine.sequence import Sequence

BS = 4


def seq(seq_id, tokens):
    return Sequence(seq_id, list(tokens))


def admit(bm, s):
    """Admission as the scheduler does it: prefix hit, then blocks for the rest of the prompt."""
    assert bm.can_allocate(s, s.num_tokens - bm.match_prefix(s))
    bm.allocate(s)
    assert bm.append_slots(s, s.num_uncomputed_tokens)


def compute_all(bm, s):
    s.num_computed_tokens = s.num_tokens
    bm.register_computed(s)


def test_allocate_and_free_accounting():
    bm = BlockManager(num_blocks=8, block_size=BS)
    s = seq("a", range(10))  # 3 blocks
    admit(bm, s)
    assert len(s.block_table) == 3
    assert len(set(s.block_table)) == 3
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    assert all(bm.blocks[b].ref_count == 1 for b in s.block_table)
    bm.free(s)
    assert s.block_table == []
    assert bm.num_free_blocks == 8
    assert bm.usage == 0.0


def test_append_slots_grows_one_block_at_a_time_and_is_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=BS)
    s = seq("a", range(4))
    admit(bm, s)
    assert len(s.block_table) == 1
    s.num_computed_tokens = 4
    s.append_token(99)
    assert bm.append_slots(s, 1)  # token 4 starts block 2
    assert len(s.block_table) == 2
    assert bm.append_slots(s, 3)  # tokens 4..6 still in block 2
    assert len(s.block_table) == 2
    assert not bm.append_slots(s, 4 + 2 * BS)  # needs 3 more blocks, only 1 free
    assert len(s.block_table) == 2 and bm.num_free_blocks == 1


def test_slot_mapping():
    bm = BlockManager(num_blocks=8, block_size=BS)
    s = seq("a", range(9))
    s.block_table = [5, 2, 7]
    assert bm.slot_mapping(s, 0, 9) == [20, 21, 22, 23, 8, 9, 10, 11, 28]
    assert bm.slot_mapping(s, 3, 6) == [23, 8, 9]
    assert bm.slot_mapping(s, 4, 4) == []


def test_second_request_hits_the_shared_three_block_prefix():
    bm = BlockManager(num_blocks=16, block_size=BS)
    prefix = list(range(100, 112))  # 3 full blocks
    a = seq("a", prefix + [1, 2])
    admit(bm, a)
    compute_all(bm, a)
    b = seq("b", prefix + [3, 4, 5])
    assert bm.match_prefix(b) == 12
    admit(bm, b)
    assert b.num_cached_tokens == b.num_computed_tokens == 12
    assert b.block_table[:3] == a.block_table[:3]
    assert b.block_table[3] != a.block_table[3]
    assert [bm.blocks[x].ref_count for x in a.block_table] == [2, 2, 2, 1]
    assert bm.num_free_blocks == 16 - 5
    assert bm.prefix_cache_hit_rate == pytest.approx(12 / (14 + 15))
    bm.free(a)
    assert [bm.blocks[x].ref_count for x in b.block_table] == [1, 1, 1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_hit_always_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = seq("a", range(8))
    admit(bm, a)
    compute_all(bm, a)
    b = seq("b", range(8))  # both blocks cached, but the last token must produce logits
    admit(bm, b)
    assert b.num_computed_tokens == 4
    assert b.num_uncomputed_tokens == 4


def test_freed_blocks_stay_findable_until_reused():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = seq("a", range(9))
    admit(bm, a)
    compute_all(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = seq("b", range(9))
    assert bm.can_allocate(b, 1)
    admit(bm, b)
    assert b.num_cached_tokens == 8
    assert bm.num_free_blocks == 1
    bm.free(b)
    # A sequence that needs every block evicts the cache.
    c = seq("c", range(50, 66))
    admit(bm, c)
    assert bm.num_cached_blocks == 0
    bm.free(c)
    assert bm.match_prefix(seq("d", range(9))) == 0


def test_hash_collision_does_not_give_a_false_hit(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: 42)
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = seq("a", [1, 1, 1, 1, 2, 2, 2, 2, 0])
    admit(bm, a)
    compute_all(bm, a)
    assert bm.match_prefix(seq("b", [3, 3, 3, 3, 2, 2, 2, 2, 0])) == 0
    # Same second block after a different first block: the tokens match but the prefix does not.
    c = seq("c", [3, 3, 3, 3, 2, 2, 2, 2, 0])
    admit(bm, c)
    compute_all(bm, c)
    bm.free(a)
    bm.free(c)
    assert bm.match_prefix(seq("d", [1, 1, 1, 1, 2, 2, 2, 2, 0])) == 4  # block 0 only


def test_equal_tokens_at_another_position_are_not_a_hit(monkeypatch):
    # Every block collides, so the cached block found for position 4..7 is the one computed at
    # 0..3 with identical tokens: its KV belongs to another prefix and must not be reused.
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: 42)
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = seq("a", [2, 2, 2, 2, 0])
    admit(bm, a)
    compute_all(bm, a)
    assert bm.match_prefix(seq("b", [2, 2, 2, 2, 2, 2, 2, 2, 0])) == 4


def test_hash_chain_covers_the_prefix():
    h0 = bm_module.hash_block(None, (1, 2))
    assert h0 == bm_module.hash_block(None, (1, 2))
    assert h0 != bm_module.hash_block(None, (2, 1))
    assert bm_module.hash_block(h0, (3, 4)) != bm_module.hash_block(None, (3, 4))


def test_lru_evicts_least_recently_freed_first():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a, b = seq("a", range(0, 5)), seq("b", range(10, 15))
    for s in (a, b):
        admit(bm, s)
        compute_all(bm, s)
    bm.free(a)  # a's cached block 0 freed first
    bm.free(b)
    filler = seq("x", range(100, 101))
    admit(bm, filler)
    # The two uncached tail blocks go first, then a's cached block (freed before b's).
    filler2 = seq("y", range(200, 201))
    admit(bm, filler2)
    assert bm.match_prefix(seq("a2", range(0, 5))) == 4
    filler3 = seq("z", range(300, 301))
    admit(bm, filler3)
    assert bm.match_prefix(seq("a3", range(0, 5))) == 0
    assert bm.match_prefix(seq("b2", range(10, 15))) == 4


def test_prefix_caching_disabled():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = seq("a", range(9))
    admit(bm, a)
    compute_all(bm, a)
    b = seq("b", range(9))
    admit(bm, b)
    assert b.num_cached_tokens == 0
    assert bm.prefix_cache_hit_rate == 0.0
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_revived_cached_blocks_count_against_free_space():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = seq("a", range(9))
    admit(bm, a)
    compute_all(bm, a)
    bm.free(a)
    b = seq("b", range(9))  # hits 2 free cached blocks, needs 1 more: all 3
    assert bm.can_allocate(b, 1)
    assert not bm.can_allocate(b, 1 + BS)


def test_double_admission_is_refused():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = seq("a", range(3))
    admit(bm, a)
    with pytest.raises(RuntimeError, match="already holds blocks"):
        bm.allocate(a)


def test_hybrid_prefix_hit_ends_at_a_block_with_a_state_snapshot():
    from kimitui.engine.kv_cache.state_slots import StateSlots

    slots = StateSlots(max_num_seqs=2, num_snapshots=2)
    bm = BlockManager(num_blocks=8, block_size=BS, state_slots=slots)
    a = seq("a", range(1, 18))  # 4 full blocks + 1 token
    admit(bm, a)
    compute_all(bm, a)
    assert bm.match_prefix(seq("x", range(1, 18))) == 0  # blocks cached, but no snapshot yet
    snap = slots.reserve_snapshot()
    slots.commit_snapshot(snap, bm.block_hash(a, 1))  # the state after 8 tokens
    assert bm.match_prefix(seq("x", range(1, 18))) == 8  # 16 cached by MLA, cut back to 8
    bm.free(a)
    # Evicting a's blocks (taken by a sequence needing all 8) drops the snapshot with them.
    big = seq("big", range(100, 132))
    admit(bm, big)
    assert slots.num_snapshots_held == 0
    assert slots.num_free_snapshot_slots == 2
    bm.free(big)
    assert bm.match_prefix(seq("y", range(1, 18))) == 0


def test_a_prefix_computed_twice_side_by_side_keeps_both_continuations_findable():
    # Two sequences compute the same prefix in one step; the second's blocks are duplicates of the
    # cached ones, and the blocks it registers after them must still chain to the cached prefix.
    bm = BlockManager(num_blocks=16, block_size=BS)
    a, b = seq("a", [1] * 8 + [2] * 4 + [9]), seq("b", [1] * 8 + [3] * 4 + [9])
    admit(bm, a)
    admit(bm, b)
    compute_all(bm, a)
    compute_all(bm, b)
    bm.free(a)
    bm.free(b)
    assert bm.match_prefix(seq("a2", a.token_ids + [5])) == 12
    assert bm.match_prefix(seq("b2", b.token_ids + [5])) == 12
