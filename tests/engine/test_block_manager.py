"""BlockManager on its own: allocation and reference counts, the chained prefix hash, the one prompt
token a full hit still recomputes, the can_allocate / can_append accounting, the eviction order of
freed cached blocks (least recently freed first, a prefix's tail before its head) and usage()."""

from __future__ import annotations

import pytest

import metainfer.engine.block_manager as block_manager
from metainfer.engine.block_manager import BlockManager, chain_hash
from metainfer.engine.sequence import PENDING, Sequence
from metainfer.sampling_params import SamplingParams

BS = 4


def _seq(tokens) -> Sequence:
    return Sequence("r", 0, list(tokens), SamplingParams())


def _prefill(bm: BlockManager, seq: Sequence) -> Sequence:
    """What one step of the engine does for a waiting sequence: blocks, compute, read back, hash."""
    bm.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_full_blocks(seq)
    return seq


def _refs(bm: BlockManager, table) -> list[int]:
    return [bm.blocks[b].ref_count for b in table]


# -- allocation, reference counts, usage --------------------------------------------------------
def test_allocate_takes_ceil_blocks_and_free_returns_them():
    bm = BlockManager(8, BS)
    assert (bm.num_blocks, bm.num_free_blocks, bm.usage()) == (8, 8, 0.0)
    assert [bm.blocks_needed(n) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]
    seq = _seq(range(1, 10))  # 9 tokens: 3 blocks, the last one partly filled
    bm.allocate(seq)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert _refs(bm, seq.block_table) == [1, 1, 1]
    assert not set(seq.block_table) & set(bm.free)
    assert bm.num_free_blocks == 5 and bm.usage() == pytest.approx(3 / 8)
    assert seq.num_computed_tokens == 0  # nothing cached yet
    seq.num_computed_tokens = 9
    bm.register_full_blocks(seq)
    assert seq.num_hashed_blocks == 2
    table = list(seq.block_table)
    bm.free_sequence(seq)
    assert _refs(bm, table) == [0, 0, 0] and bm.num_free_blocks == 8 and bm.usage() == 0.0
    assert (seq.block_table, seq.num_computed_tokens, seq.num_hashed_blocks) == ([], 0, 0)


def test_allocating_twice_is_refused():
    bm = BlockManager(8, BS)
    seq = _seq([1, 2, 3])
    bm.allocate(seq)
    with pytest.raises(AssertionError):
        bm.allocate(seq)


def test_shared_blocks_count_references_and_stay_until_the_last_owner_frees():
    bm = BlockManager(16, BS)
    a = _prefill(bm, _seq(range(1, 13)))  # 3 full blocks
    b = _seq(list(range(1, 9)) + [90, 91, 92])  # the first 2 blocks of a, then its own tail
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    assert _refs(bm, a.block_table) == [2, 2, 1] and _refs(bm, b.block_table[2:]) == [1]
    assert bm.num_free_blocks == 16 - 4
    assert bm.usage() == pytest.approx(4 / 16)
    shared = a.block_table[:2]
    bm.free_sequence(a)
    assert _refs(bm, shared) == [1, 1] and not set(shared) & set(bm.free), "b still reads them"
    assert bm.num_free_blocks == 16 - 3
    bm.free_sequence(b)
    assert bm.num_free_blocks == 16


# -- the chained prefix hash ---------------------------------------------------------------------
def test_full_blocks_hash_as_a_chain_and_only_full_computed_blocks():
    bm = BlockManager(8, BS)
    seq = _seq(range(1, 11))  # 2 full blocks + 2 tokens
    bm.allocate(seq)
    seq.num_computed_tokens = 6  # a chunk: only block 0 is wholly in the cache
    bm.register_full_blocks(seq)
    h0 = chain_hash(None, (1, 2, 3, 4))
    assert [bm.blocks[b].hash for b in seq.block_table] == [h0, None, None]
    assert bm.blocks[seq.block_table[0]].token_ids == (1, 2, 3, 4)
    assert seq.num_hashed_blocks == 1
    seq.num_computed_tokens = 10
    bm.register_full_blocks(seq)
    h1 = chain_hash(h0, (5, 6, 7, 8))
    assert [bm.blocks[b].hash for b in seq.block_table] == [h0, h1, None], "a partial block is never hashed"
    assert bm.hash_to_block == {h0: seq.block_table[0], h1: seq.block_table[1]}
    assert seq.num_hashed_blocks == 2


def test_a_different_earlier_block_changes_every_later_hash():
    bm = BlockManager(16, BS)
    a = _prefill(bm, _seq([1, 2, 3, 4, 5, 6, 7, 8]))
    c = _prefill(bm, _seq([9, 2, 3, 4, 5, 6, 7, 8]))  # block 1's tokens equal a's block 1
    ha = [bm.blocks[x].hash for x in a.block_table]
    hc = [bm.blocks[x].hash for x in c.block_table]
    assert ha[0] != hc[0] and ha[1] != hc[1], "block 1's hash must depend on block 0"
    assert not set(a.block_table) & set(c.block_table)
    d = _seq([9, 2, 3, 4, 5, 6, 7, 8, 10])  # c's prefix: both of c's blocks are hits, not a's
    bm.allocate(d)
    assert d.block_table[:2] == c.block_table and d.num_computed_tokens == 8


def test_same_prefix_shares_blocks_and_skips_their_compute():
    bm = BlockManager(16, BS)
    a = _prefill(bm, _seq(range(1, 14)))  # 3 full blocks + 1 token
    a_table = list(a.block_table)
    bm.free_sequence(a)  # freed blocks keep their hash and stay findable
    b = _seq(list(range(1, 9)) + [50, 51, 52, 53, 54])
    bm.allocate(b)
    assert b.block_table[:2] == a_table[:2] and not set(b.block_table[2:]) & set(a_table)
    assert b.num_computed_tokens == 8
    assert (bm.prefix_hit_tokens, bm.prefix_query_tokens) == (8, 13 + 13)


def test_prefix_cache_stats_count_as_vllm_does():
    """Queries and hits count at a request's first admission where the cache applies: not with prefix caching off,
    not for a request scoring its prompt (it skips the cache), and a preempted request's re-admission apart
    (vLLM's preempted_queries / preempted_hits), so recomputation under memory pressure is not read as misses."""
    off = BlockManager(16, BS, enable_prefix_caching=False)
    off.allocate(_seq(range(1, 14)))
    assert (off.prefix_query_tokens, off.prefix_hit_tokens, off.preempted_query_tokens) == (0, 0, 0)
    bm = BlockManager(16, BS)
    a = _prefill(bm, _seq(range(1, 14)))
    assert (bm.prefix_query_tokens, bm.prefix_hit_tokens) == (13, 0)
    scoring = Sequence("s", 0, list(range(1, 14)), SamplingParams(prompt_logprobs=1))
    bm.allocate(scoring)
    assert (bm.prefix_query_tokens, bm.prefix_hit_tokens) == (13, 0) and scoring.num_computed_tokens == 0
    bm.free_sequence(a)  # the scheduler's preemption: blocks freed (still findable), the sequence counted
    a.num_preemptions += 1
    bm.allocate(a)
    assert (bm.prefix_query_tokens, bm.prefix_hit_tokens) == (13, 0)
    assert (bm.preempted_query_tokens, bm.preempted_hit_tokens) == (13, 12)


@pytest.mark.parametrize("length", [4, 8, 12])
def test_a_block_aligned_full_hit_computes_its_last_block_afresh(length):
    """The last prompt position needs its logits, so it is recomputed; recomputing it inside the shared
    last block would write into a's cache, so that block is not a hit (vLLM's rule): a fresh block, its
    BS tokens computed again."""
    bm = BlockManager(16, BS)
    a = _prefill(bm, _seq(range(1, length + 1)))
    b = _seq(range(1, length + 1))
    bm.allocate(b)
    assert b.block_table[:-1] == a.block_table[:-1] and b.block_table[-1] not in a.block_table
    assert b.num_computed_tokens == length - BS
    assert bm.prefix_hit_tokens == length - BS


def test_an_unaligned_full_hit_shares_every_full_block():
    bm = BlockManager(16, BS)
    a = _prefill(bm, _seq(range(1, 2 * BS + 2)))  # 2 full blocks + 1 token
    b = _seq(range(1, 2 * BS + 2))
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_computed_tokens == 2 * BS  # only the partial block's token is computed


def test_a_hash_collision_is_not_a_hit(monkeypatch):
    """Every block hashes alike: the stored tokens must still be compared."""
    monkeypatch.setattr(block_manager, "chain_hash", lambda prev, tokens: 7)
    bm = BlockManager(8, BS)
    _prefill(bm, _seq([1, 2, 3, 4, 5]))
    other = _seq([5, 6, 7, 8, 9])
    bm.allocate(other)
    assert other.num_computed_tokens == 0
    same = _seq([1, 2, 3, 4, 6])
    bm.allocate(same)
    assert same.num_computed_tokens == 4


def test_prefix_caching_off_never_hashes_or_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = _prefill(bm, _seq(range(1, 9)))
    assert all(bm.blocks[b].hash is None for b in a.block_table) and not bm.hash_to_block
    b = _seq(range(1, 9))
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and not set(a.block_table) & set(b.block_table)


def test_pending_tokens_are_never_hashed():
    bm = BlockManager(8, BS)
    seq = _seq([1, 2, 3])
    bm.allocate(seq)
    seq.num_computed_tokens = 3
    seq.add_pending(0)  # the 4th token is launched, its value not read back yet
    bm.append_slots(seq)
    seq.num_computed_tokens = 4
    bm.register_full_blocks(seq)
    assert bm.blocks[seq.block_table[0]].hash is None and seq.num_hashed_blocks == 0
    seq.resolve_pending(3, 4)
    bm.register_full_blocks(seq)
    assert bm.blocks[seq.block_table[0]].hash == chain_hash(None, (1, 2, 3, 4))
    assert PENDING not in bm.blocks[seq.block_table[0]].token_ids


def test_hashing_continues_from_the_last_hashed_block():
    """Decode fills block after block; each new full block chains onto the previous one's hash."""
    bm = BlockManager(8, BS)
    seq = _prefill(bm, _seq([1, 2, 3, 4, 5]))
    for token in (6, 7, 8, 9):
        seq.token_ids.append(token)
        bm.append_slots(seq)
        seq.num_computed_tokens += 1
        bm.register_full_blocks(seq)
    h0 = chain_hash(None, (1, 2, 3, 4))
    assert [bm.blocks[b].hash for b in seq.block_table] == [h0, chain_hash(h0, (5, 6, 7, 8)), None]


# -- capacity accounting ------------------------------------------------------------------------
def test_can_allocate_counts_blocks_in_use_as_free_hits():
    bm = BlockManager(5, BS)
    _prefill(bm, _seq(range(1, 13)))  # 3 blocks in use, 2 free
    shared = _seq(list(range(1, 13)) + [70, 71, 72, 73])  # 4 blocks, 3 of them a's (in use)
    assert bm.can_allocate(shared)
    fresh = _seq(range(100, 113))  # 4 new blocks > 2 free
    assert not bm.can_allocate(fresh)
    assert bm.can_allocate(_seq(range(100, 108)))  # exactly the 2 free blocks
    bm.allocate(shared)
    assert bm.num_free_blocks == 1


def test_can_allocate_counts_freed_cached_hits_against_the_free_list():
    """A hit on a freed block leaves the free list: it is not free capacity on top of the hit."""
    bm = BlockManager(3, BS)
    a = _prefill(bm, _seq(range(1, 9)))
    bm.free_sequence(a)  # 3 free, 2 of them cached
    assert bm.can_allocate(_seq(range(1, 13)))  # 2 cached + 1 fresh = 3
    assert not bm.can_allocate(_seq(range(1, 17)))  # 2 cached + 2 fresh > 3


def test_can_append_and_append_slots_cross_block_boundaries():
    bm = BlockManager(3, BS)
    seq = _seq([1, 2, 3])
    bm.allocate(seq)
    seq.num_computed_tokens = 3
    assert bm.can_append(seq) and bm.can_append(seq, 1)
    bm.append_slots(seq)  # position 3 still fits block 0
    assert len(seq.block_table) == 1
    seq.num_computed_tokens = 4
    bm.append_slots(seq)  # position 4 needs block 1
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 1
    assert bm.can_append(seq, 8) and not bm.can_append(seq, 9)  # up to 12 tokens: 1 more block, 13: 2
    bm.append_slots(seq, 8)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 0
    seq.num_computed_tokens = 12
    assert not bm.can_append(seq)


# -- eviction of freed cached blocks ------------------------------------------------------------
def test_freed_blocks_are_reused_least_recently_freed_first_tail_before_head():
    bm = BlockManager(4, BS)
    a = _prefill(bm, _seq(range(1, 9)))  # blocks 0, 1
    b = _prefill(bm, _seq(range(20, 28)))  # blocks 2, 3
    (a_head, a_tail), b_table = a.block_table, list(b.block_table)
    bm.free_sequence(a)  # freed in reverse: a's tail, then a's head
    bm.free_sequence(b)
    assert list(bm.free) == [a_tail, a_head, *reversed(b_table)]
    c = _seq(range(40, 44))  # one fresh block: a's tail is evicted, its head stays findable
    bm.allocate(c)
    assert c.block_table == [a_tail]
    assert bm.blocks[a_tail].hash is None and bm.blocks[a_tail].token_ids == ()
    assert a_tail not in bm.hash_to_block.values()
    again = _seq(range(1, 10))
    bm.allocate(again)
    assert again.block_table[0] == a_head and again.num_computed_tokens == 4
    assert again.block_table[1] != a_tail


def test_a_cache_hit_takes_its_block_off_the_free_list():
    bm = BlockManager(4, BS)
    a = _prefill(bm, _seq(range(1, 9)))
    a_table = list(a.block_table)
    bm.free_sequence(a)
    b = _seq(range(1, 10))  # a's 8 tokens + 1: both of a's blocks are hits
    bm.allocate(b)
    assert b.block_table[:2] == a_table
    assert not set(b.block_table) & set(bm.free) and _refs(bm, b.block_table) == [1, 1, 1]
    c = _seq(range(50, 54))  # must not be handed b's blocks
    bm.allocate(c)
    assert not set(c.block_table) & set(b.block_table) and bm.num_free_blocks == 0


def test_evicting_a_duplicate_keeps_the_original_findable():
    """Two sequences computed the same block before either was hashed: the table keeps the first.
    Reusing the duplicate must not drop the first one's entry."""
    bm = BlockManager(3, BS)
    a, b = _seq([1, 2, 3, 4]), _seq([1, 2, 3, 4])
    bm.allocate(a)
    bm.allocate(b)
    for seq in (a, b):
        seq.num_computed_tokens = 4
        bm.register_full_blocks(seq)
    h = chain_hash(None, (1, 2, 3, 4))
    assert bm.hash_to_block == {h: a.block_table[0]} and bm.blocks[b.block_table[0]].hash == h
    dup = b.block_table[0]
    bm.free_sequence(b)
    c = _seq(range(9, 17))  # two fresh blocks: the never-used one, then the duplicate
    bm.allocate(c)
    assert dup in c.block_table
    assert bm.hash_to_block == {h: a.block_table[0]}
    d = _seq([1, 2, 3, 4, 5])
    assert bm.can_allocate(d) is False  # no free block left for d's tail...
    bm.free_sequence(c)
    bm.allocate(d)  # ...until c is gone; a's block is still the hit
    assert d.block_table[0] == a.block_table[0] and d.num_computed_tokens == 4


def test_chain_hash_is_the_hash_of_the_previous_hash_and_the_block_tokens():
    """The prefix-cache key as the blueprint's sched.prefix_hash states it: Python's hash of (previous block's
    hash or None, this block's token ids), computed here without chain_hash."""
    first = hash((None, (1, 2, 3, 4)))
    assert chain_hash(None, (1, 2, 3, 4)) == first
    assert chain_hash(first, (5, 6, 7, 8)) == hash((first, (5, 6, 7, 8)))
    assert chain_hash(first, (5, 6, 7, 8)) != chain_hash(None, (5, 6, 7, 8))
