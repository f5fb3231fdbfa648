import pytest

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams


def _seq(tokens):
    return Sequence(tokens, SamplingParams(), seed=0)


def _run_prefill(bm: BlockManager, seq: Sequence):
    cached = bm.lookup_prefix(seq)
    n = seq.num_tokens - len(cached) * bm.block_size
    assert bm.allocate(seq, n, cached)
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)
    return cached


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
    hits = _run_prefill(bm, b)
    assert hits == a.block_table[:2]
    assert b.num_cached_tokens == 32
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


def test_last_token_never_served_from_cache():
    bm = BlockManager(num_blocks=8, block_size=16)
    a = _seq(list(range(32)))
    _run_prefill(bm, a)
    b = _seq(list(range(32)))  # identical: only the first block may hit
    assert len(_run_prefill(bm, b)) == 1


def test_token_check_rejects_hash_collisions():
    bm = BlockManager(num_blocks=8, block_size=16)
    a = _seq(list(range(20)))
    _run_prefill(bm, a)
    block = bm.blocks[a.block_table[0]]
    block.token_ids = tuple(range(100, 116))  # as if a different block had produced this hash
    assert bm.lookup_prefix(_seq(list(range(20)))) == []


def test_eviction_only_when_needed_and_lru():
    bm = BlockManager(num_blocks=4, block_size=16)
    a = _seq(list(range(33)))  # 2 full blocks + 1 partial
    _run_prefill(bm, a)
    full = a.block_table[:2]
    bm.free(a)
    assert len(bm.hash_to_block) == 2
    # One new block: the uncached (partial) block and the never-used one go first.
    b = _seq(list(range(500, 510)))
    _run_prefill(bm, b)
    c = _seq(list(range(600, 610)))
    _run_prefill(bm, c)
    assert len(bm.hash_to_block) == 2 and not set(full) & set(b.block_table + c.block_table)
    # Now the cache must give up a block: the tail block of `a` is evicted before its head.
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
    assert len(bm.lookup_prefix(_seq(list(range(40))))) == (2 if prefix_caching else 0)
