import pytest

from helpers import check_block_manager
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams


def _seq(tokens):
    return Sequence(tokens, SamplingParams(), seed=0)


def _run_prefill(bm: BlockManager, seq: Sequence):
    """Admit seq as the scheduler does and compute its prompt; returns the full blocks it adopted."""
    hit = bm.lookup_prefix(seq)
    n = seq.num_tokens - hit.num_tokens
    assert bm.allocate(seq, n, hit)
    bm.release_pins()  # the step is launched
    seq.num_computed_tokens += n
    bm.publish(seq)
    return hit.blocks


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(num_blocks=9, block_size=16)
    seqs = [_seq(list(range(i * 100, i * 100 + 40))) for i in range(3)]
    for s in seqs:
        _run_prefill(bm, s)
        assert len(s.block_table) == 3
    assert bm.num_free_blocks == 0 and bm.usage == 1.0
    assert len({b for s in seqs for b in s.block_table}) == 9
    for s in seqs:
        bm.free(s)
        assert s.block_table == []
    assert bm.num_free_blocks == 9 and bm.usage == 0.0
    assert all(blk.ref_count == 0 for blk in bm.blocks)


def test_allocation_fails_cleanly_when_full():
    bm = BlockManager(num_blocks=4, block_size=16)
    a, b = _seq(list(range(40))), _seq(list(range(100, 140)))
    _run_prefill(bm, a)
    table_before = list(b.block_table)
    assert not bm.allocate(b, 40)  # needs 3, only 1 free
    assert b.block_table == table_before and bm.num_free_blocks == 1
    bm.free(a)
    assert bm.num_free_blocks == 4
    assert all(blk.ref_count == 0 for blk in bm.blocks)


def test_prefix_hits_share_blocks_and_refcounts_return_to_zero():
    bm = BlockManager(num_blocks=16, block_size=16)
    prefix = list(range(1000, 1040))  # 2 full blocks + 8 tokens
    a = _seq(prefix + [1, 2, 3])
    b = _seq(prefix + [4, 5, 6, 7])
    assert _run_prefill(bm, a) == []
    hit = bm.lookup_prefix(b)
    assert hit.num_tokens == 40  # 2 full blocks, then 8 tokens of a's partial block (copied)
    hits = _run_prefill(bm, b)
    assert hits == a.block_table[:2] and bm.take_copies() == [(a.block_table[2], b.block_table[2], 8)]
    assert [bm.blocks[i].ref_count for i in hits] == [2, 2]
    assert bm.prefix_hits == 0  # stats are recorded by the scheduler, not here
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in hits] == [1, 1]
    bm.free(b)
    assert all(blk.ref_count == 0 for blk in bm.blocks) and bm.num_free_blocks == 16
    # Freed cached blocks stay findable until their space is needed.
    c = _seq(prefix + [9])
    assert _run_prefill(bm, c) == hits
    bm.free(c)
    assert all(blk.ref_count == 0 for blk in bm.blocks) and bm.num_free_blocks == 16


def test_last_token_never_served_from_cache():
    bm = BlockManager(num_blocks=8, block_size=16)
    a = _seq(list(range(32)))
    _run_prefill(bm, a)
    b = _seq(list(range(32)))  # identical: the first block and 15 tokens of the second hit
    assert bm.lookup_prefix(b).num_tokens == 31
    assert len(_run_prefill(bm, b)) == 1


def test_token_check_rejects_hash_collisions():
    bm = BlockManager(num_blocks=8, block_size=16)
    a = _seq(list(range(20)))
    _run_prefill(bm, a)
    block = bm.blocks[a.block_table[0]]
    assert bm.lookup_prefix(_seq(list(range(20)))).blocks == [block.block_id]
    bm._unindex(block)  # as if a different block had produced this hash:
    block.token_ids, block.hash = tuple(range(100, 116)), bm.seq_block_hashes[a.seq_id][0]
    bm.hash_to_block[block.hash] = block.block_id
    assert bm.lookup_prefix(_seq(list(range(20)))).blocks == []


def test_eviction_only_when_needed_and_lru():
    bm = BlockManager(num_blocks=4, block_size=16)
    a = _seq(list(range(33)))  # 2 full blocks + 1 partial
    _run_prefill(bm, a)
    table = list(a.block_table)
    full, tail = table[:2], table[2]
    bm.free(a)
    assert len(bm.hash_to_block) == 2 and bm.blocks[tail].token_ids == (32,)  # the partial block too
    # One new block: the never-used one goes first.
    b = _seq(list(range(500, 510)))
    _run_prefill(bm, b)
    assert len(bm.hash_to_block) == 2 and not set(table) & set(b.block_table)
    # Now the cache must give up blocks: the tail of `a` is evicted before its head.
    c = _seq(list(range(600, 610)))
    _run_prefill(bm, c)
    assert c.block_table == [tail] and bm.lookup_prefix(_seq(list(range(34)))).num_tokens == 32
    d = _seq(list(range(700, 710)))
    _run_prefill(bm, d)
    assert d.block_table == [full[1]] and list(bm.hash_to_block.values()) == [full[0]]


def test_block_size_must_divide_cleanly():
    bm = BlockManager(num_blocks=2, block_size=256)
    s = _seq(list(range(300)))
    assert bm.allocate(s, 300) and len(s.block_table) == 2
    assert not BlockManager(num_blocks=1, block_size=256).allocate(_seq(list(range(300))), 300)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_caching_switch(prefix_caching):
    bm = BlockManager(num_blocks=8, block_size=16, enable_prefix_caching=prefix_caching)
    a = _seq(list(range(40)))
    _run_prefill(bm, a)
    assert bm.lookup_prefix(_seq(list(range(40)))).num_tokens == (39 if prefix_caching else 0)
    bm.free(a)
    assert bm.lookup_prefix(_seq(list(range(40)))).num_tokens == (39 if prefix_caching else 0)
    assert bool(bm.children) == prefix_caching


# ---- token-granular hits ---------------------------------------------------------------------
def test_partial_hit_copies_the_leading_tokens_of_a_cached_block():
    bm = BlockManager(num_blocks=8, block_size=16)
    system = list(range(1000, 1012))  # 12 tokens: shorter than a block
    a = _seq(system + [1, 2, 3, 4])
    _run_prefill(bm, a)  # running: its partial first block holds prompt tokens, offered at once
    b = _seq(system + [5, 6])
    hit = bm.lookup_prefix(b)
    assert hit == (([], a.block_table[0], 12, 12))
    assert bm.allocate(b, b.num_tokens - 12, hit)
    assert b.num_computed_tokens == 12 and b.block_table != a.block_table
    assert bm.take_copies() == [(a.block_table[0], b.block_table[0], 12)]
    assert bm.blocks[a.block_table[0]].ref_count == 2  # pinned until the step is launched
    check_block_manager(bm, [a, b])
    bm.release_pins()
    assert bm.blocks[a.block_table[0]].ref_count == 1
    for s in (a, b):
        bm.free(s)
    check_block_manager(bm, [])
    assert bm.num_free_blocks == 8


def test_a_free_block_holding_exactly_the_hit_is_taken_without_a_copy():
    """The next turn of a conversation: the previous turn's last, partial block is free and the
    new prompt extends it."""
    bm = BlockManager(num_blocks=8, block_size=16)
    turn1 = _seq(list(range(100, 140)))  # 2 full blocks + 8 tokens
    _run_prefill(bm, turn1)
    for t in (7, 8, 9):  # three generated tokens, the last one never computed
        turn1.append_token(t)
        turn1.num_computed_tokens = turn1.num_tokens - 1
    table = list(turn1.block_table)
    bm.free(turn1)
    assert bm.blocks[table[2]].token_ids == tuple(range(132, 140)) + (7, 8)
    turn2 = _seq(list(range(100, 140)) + [7, 8, 9, 50, 51])
    hit = bm.lookup_prefix(turn2)
    assert hit == (table[:2], table[2], 10, 42)
    assert bm.allocate(turn2, turn2.num_tokens - hit.num_tokens, hit)
    assert turn2.block_table == table and bm.take_copies() == [] and not bm._pinned
    # Still offered (its new owner only appends): a request in the same step copies from it.
    other = _seq(list(range(100, 140)) + [7, 8, 60])
    assert bm.lookup_prefix(other) == (table[:2], table[2], 10, 42)
    assert bm.allocate(other, 1, bm.lookup_prefix(other)) and bm.take_copies() == [(table[2], other.block_table[2], 10)]
    bm.release_pins()
    bm.free(other)
    check_block_manager(bm, [turn2])
    turn2.num_computed_tokens = turn2.num_tokens
    bm.free(turn2)
    assert bm.lookup_prefix(_seq(turn2.token_ids + [1])).num_tokens == turn2.num_tokens
    check_block_manager(bm, [])


def test_a_partial_source_sharing_fewer_tokens_is_copied_not_taken():
    bm = BlockManager(num_blocks=8, block_size=16)
    a = _seq(list(range(20)))
    _run_prefill(bm, a)
    src = a.block_table[1]
    bm.free(a)
    b = _seq(list(range(18)) + [99, 98])  # shares 2 of the 4 tokens of a's free partial block
    hit = bm.lookup_prefix(b)
    assert hit.source == src and hit.num_partial == 2 and hit.num_tokens == 18
    assert bm.allocate(b, 2, hit)
    assert b.block_table[1] != src and bm.take_copies() == [(src, b.block_table[1], 2)]
    assert src not in bm.free_blocks  # pinned: no allocation can hand it out before the copy
    check_block_manager(bm, [b])
    bm.release_pins()
    assert list(bm.free_blocks)[-1] == src  # back, as the most recently used
    assert bm.lookup_prefix(_seq(list(range(21)))).num_tokens == 20  # a's tokens are still there
    bm.free(b)
    check_block_manager(bm, [])


def test_a_pinned_free_source_needs_room_and_is_not_evicted():
    bm = BlockManager(num_blocks=3, block_size=16)
    a = _seq(list(range(10)))
    _run_prefill(bm, a)
    src = a.block_table[0]
    bm.free(a)
    b = _seq(list(range(5)) + [70] * 40)  # 3 blocks of its own + the pinned source: 4 > 3
    hit = bm.lookup_prefix(b)
    assert hit.source == src and hit.num_partial == 5
    assert not bm.allocate(b, b.num_tokens - 5, hit) and b.block_table == [] and not bm._pinned
    c = _seq(list(range(5)) + [70] * 20)  # 2 blocks + the pinned source: fits
    assert bm.allocate(c, c.num_tokens - 5, bm.lookup_prefix(c))
    assert src not in c.block_table and bm.num_free_blocks == 0
    check_block_manager(bm, [c])
    bm.release_pins()
    bm.free(c)
    check_block_manager(bm, [])


def test_dominated_partial_blocks_are_not_indexed_twice():
    bm = BlockManager(num_blocks=8, block_size=16)
    a = _seq(list(range(10)))
    _run_prefill(bm, a)
    b = _seq(list(range(6)))
    _run_prefill(bm, b)  # copies 5 tokens from a; its own 6 tokens are a prefix of a's 10
    a_block, b_block = a.block_table[0], b.block_table[0]
    assert [entry[1] for entry in bm.children[None]] == [a_block]
    bm.free(b)
    bm.free(a)
    assert [entry[1] for entry in bm.children[None]] == [a_block]
    assert next(iter(bm.free_blocks)) == b_block  # offering nothing, it is evicted first
    check_block_manager(bm, [])
