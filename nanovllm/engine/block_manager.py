"""Paged KV cache bookkeeping: a free list, reference counts and a prefix cache of full blocks.

Full blocks are identified by a hash chained over every token since the start of the sequence
(xxhash64), so equal hashes mean equal prefixes up to a hash collision, which the token check on
each hit rules out. Freed blocks keep their hash and content until the space is needed: the free
list is an LRU queue, evicted from the front, so a cached block can be revived by a later request.

An optional `observer` hears of every block the prefix cache gains (`stored(hash, parent_hash,
token_ids)`) and loses (`removed(hash)`): the KV-cache events a server publishes for routers
(engine/kv_events.py). Without one, that costs one attribute test per block indexed or evicted.
"""
from array import array
from collections import OrderedDict

import xxhash

from nanovllm.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None


def chain_hash(prev_hash: int | None, token_ids) -> int:
    h = xxhash.xxh64()
    if prev_hash is not None:
        h.update(prev_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.seq_block_hashes: dict[int, list[int]] = {}  # seq_id -> hashes of its full blocks
        self.observer = None  # hears of blocks indexed and evicted (see the module docstring)
        # Prefix-cache statistics, in tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (free cached blocks count as free)."""
        return 1.0 - len(self.free_blocks) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        """Chained hashes of seq's first num_full_blocks blocks, memoised per sequence."""
        hashes = self.seq_block_hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_full_blocks):
            hashes.append(chain_hash(hashes[-1] if hashes else None, seq.token_ids[i * bs:(i + 1) * bs]))
        return hashes

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Blocks of the prefix cache that hold seq's leading tokens. The last token is never
        served from the cache: the model must run on at least one token to produce logits."""
        if not self.enable_prefix_caching:
            return []
        num_full = (seq.num_tokens - 1) // self.block_size
        hits = []
        bs = self.block_size
        for i, h in enumerate(self._block_hashes(seq, num_full)):
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
                break
            hits.append(block_id)
        return hits

    # ---- allocation ----------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Make seq's block table cover its computed tokens (plus cached_blocks, adopted from the
        prefix cache when seq is admitted) and num_new_tokens more. False, changing nothing,
        when too few blocks are free."""
        num_cached_tokens = len(cached_blocks) * self.block_size
        total = seq.num_computed_tokens + num_cached_tokens + num_new_tokens
        num_new_blocks = self.blocks_needed(total) - len(seq.block_table) - len(cached_blocks)
        revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if max(num_new_blocks, 0) + revived > len(self.free_blocks):
            return False
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        if cached_blocks:
            seq.num_computed_tokens += num_cached_tokens
            seq.num_cached_tokens = num_cached_tokens
        for _ in range(num_new_blocks):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict it from the prefix cache
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
                if self.observer is not None:
                    self.observer.removed(block.hash)
            block.hash = block.token_ids = None
        block.ref_count = 1
        return block_id

    def cache_full_blocks(self, seq: Sequence):
        """Publish seq's blocks whose KV is now complete, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if num_full <= seq.num_published_blocks:
            return
        hashes = self._block_hashes(seq, num_full)
        bs = self.block_size
        for i in range(seq.num_published_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash = hashes[i]
                block.token_ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
                if self.hash_to_block.setdefault(hashes[i], block.block_id) == block.block_id \
                        and self.observer is not None:
                    self.observer.stored(hashes[i], hashes[i - 1] if i else None, block.token_ids)
        seq.num_published_blocks = num_full

    def free(self, seq: Sequence):
        """Drop seq's references. Unreferenced blocks go to the free queue, the tail of the
        sequence first, and uncached blocks ahead of cached ones, so the most shareable
        content is evicted last."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
                if block.hash is None:
                    self.free_blocks.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_published_blocks = 0

    def forget(self, seq: Sequence):
        """seq is gone for good: drop its memoised hashes."""
        self.seq_block_hashes.pop(seq.seq_id, None)

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int):
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens
