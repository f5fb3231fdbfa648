"""Paged KV cache bookkeeping: a free list, reference counts and a prefix cache that reuses KV
token by token while the pages stay large (256 tokens by default: big pages keep attention fast).

- Full blocks are identified by a hash chained over every token since the start of the sequence
  (xxhash64); equal hashes mean equal prefixes up to a collision, which the token check on each hit
  rules out. A new request adopts the full blocks of its longest cached prefix as they are (shared,
  reference counted).
- Where that prefix ends inside a block, the request gets a fresh block whose leading tokens' KV
  is copied on the device from the cached block sharing the most of them (`take_copies`: the
  step's copies, one kernel launch for all of them), or takes that block itself when it is free
  and holds exactly those tokens (the next turn of a conversation: no copy at all; the block stays
  offered, since its new owner only appends). A copy's source is pinned (referenced) until the
  step is launched, so it cannot be handed out or overwritten before the copy has read it.

Lookup: every indexed block, full or partial, is listed under its parent (the chain hash of the
blocks before it, None for a first block) in a list sorted by its tokens. The entry sharing the
longest prefix with the prompt's next tokens sits next to where those tokens would be inserted, so
a lookup costs one hash per prompt block plus one binary search, however large the cache.

Blocks are offered to the cache (indexed) as their KV becomes known: full blocks once the step
that completed them has its results in; a running sequence's partial last block while it holds
prompt tokens (so concurrent requests and the n > 1 siblings of a request share a short system
prompt); and everything a sequence computed, generated tokens included, when it is freed
(finished, aborted or preempted), so the next turn of a conversation finds it. Freed blocks keep
their content until the space is needed: the free list is an LRU queue evicted from the front; a
sequence's blocks go back tail first, unindexed ones in front, so the most shareable content
(a conversation's head, a system prompt) is evicted last.

An optional `observer` hears of every full block the prefix cache gains (`stored(hash, parent_hash,
token_ids)`) and loses (`removed(hash)`): the KV-cache events a server publishes for routers
(engine/kv_events.py). Partial blocks are not announced (vLLM's events name full blocks only).
Without an observer, that costs one attribute test per full block indexed or evicted.
"""
from array import array
from bisect import bisect_left
from collections import OrderedDict
from typing import NamedTuple

import xxhash

from nanovllm.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "parent")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        # What the prefix cache offers from this block: the tokens whose KV it holds from its start
        # (None: not indexed), under `parent` (the chain hash of the blocks before it, None for a
        # sequence's first block); `hash`: its own chain hash when it is indexed as a full block.
        self.token_ids: tuple[int, ...] | None = None
        self.parent: int | None = None
        self.hash: int | None = None


class PrefixHit(NamedTuple):
    """The cached prefix of a prompt: full blocks to adopt, then the first `num_partial` tokens of
    block `source` (a block of the cache, to copy or to take), `num_tokens` in all."""
    blocks: list[int]
    source: int | None
    num_partial: int
    num_tokens: int


NO_HIT = PrefixHit([], None, 0, 0)


def chain_hash(prev_hash: int | None, token_ids) -> int:
    h = xxhash.xxh64()
    if prev_hash is not None:
        h.update(prev_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


def common_prefix_len(a: tuple, b: tuple) -> int:
    """Length of the longest common prefix of two token tuples (slice compares run in C)."""
    n = min(len(a), len(b))
    if not n or a[0] != b[0]:
        return 0
    if a[:n] == b[:n]:
        return n
    lo, hi = 1, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}  # indexed full blocks
        # parent chain hash -> (token_ids, block_id) of its indexed child blocks, sorted
        self.children: dict[int | None, list[tuple[tuple[int, ...], int]]] = {}
        self.seq_block_hashes: dict[int, list[int]] = {}  # seq_id -> hashes of its full blocks
        self.observer = None  # hears of blocks indexed and evicted (see the module docstring)
        self._copies: list[tuple[int, int, int]] = []  # (source, destination, tokens) for the next step
        self._pinned: list[int] = []  # sources of those copies, referenced until the step is launched
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

    def lookup_prefix(self, seq: Sequence) -> PrefixHit:
        """The longest prefix of seq's tokens whose KV the cache holds. The last token is never
        served from the cache: the model must run on at least one token to produce logits."""
        if not self.enable_prefix_caching:
            return NO_HIT
        limit = seq.num_tokens - seq.num_pending_tokens - 1
        bs = self.block_size
        tokens = seq.token_ids
        blocks, parent = [], None
        for i, h in enumerate(self._block_hashes(seq, limit // bs)):
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(tokens[i * bs:(i + 1) * bs]):
                break
            blocks.append(block_id)
            parent = h
        start = len(blocks) * bs
        source, num_partial = self._longest_child(parent, tuple(tokens[start:min(limit, start + bs)]))
        if not blocks and source is None:
            return NO_HIT
        return PrefixHit(blocks, source, num_partial, start + num_partial)

    def _longest_child(self, parent: int | None, token_ids: tuple) -> tuple[int | None, int]:
        """The indexed child of `parent` sharing the longest prefix with token_ids, and its length.
        In a sorted list that entry is a neighbour of token_ids' insertion point."""
        entries = self.children.get(parent) if token_ids else None
        if not entries:
            return None, 0
        i = bisect_left(entries, (token_ids,))
        best, best_len = None, 0
        for entry in entries[max(i - 1, 0):i + 1]:
            n = common_prefix_len(entry[0], token_ids)
            if n > best_len:
                best, best_len = entry[1], n
        return best, best_len

    # ---- the index -----------------------------------------------------------------------
    def _index(self, block: Block, parent: int | None, token_ids: tuple, block_hash: int | None = None):
        """Offer block's leading token_ids to the prefix cache (in place of what it offered), as a
        full block when block_hash is given. Content another indexed block already offers (the
        same full block, or a partial one it extends) is not indexed twice."""
        if block.token_ids is not None:
            self._unindex(block)
        entries = self.children.get(parent, ())
        i = bisect_left(entries, (token_ids,))
        if block_hash is not None:
            if block_hash in self.hash_to_block:
                return
            self.hash_to_block[block_hash] = block.block_id
            if self.observer is not None:
                self.observer.stored(block_hash, parent, token_ids)
        elif i < len(entries) and entries[i][0][:len(token_ids)] == token_ids:
            return
        if not entries:
            entries = self.children[parent] = []
        entries.insert(i, (token_ids, block.block_id))
        block.token_ids, block.parent, block.hash = token_ids, parent, block_hash

    def _unindex(self, block: Block):
        entries = self.children[block.parent]
        i = bisect_left(entries, (block.token_ids, block.block_id))
        assert entries[i][1] == block.block_id, f"block {block.block_id} missing from the prefix index"
        del entries[i]
        if not entries:
            del self.children[block.parent]
        if block.hash is not None:
            del self.hash_to_block[block.hash]
            if self.observer is not None:
                self.observer.removed(block.hash)
        block.token_ids = block.parent = block.hash = None

    def publish(self, seq: Sequence, final: bool = False):
        """Offer seq's computed KV to the prefix cache: its full blocks and, while it holds prompt
        tokens (or everything, when `final`: seq is being freed), its partial last block. Only
        tokens the host knows count: a step in flight may have sampled more. Costs nothing on a
        decode step that completes no block."""
        if not self.enable_prefix_caching:
            return
        known = seq.num_computed_tokens
        settled = len(seq.token_ids) - seq.num_pending_tokens
        if settled < known:
            known = settled
        bs = self.block_size
        published = seq.num_published_tokens
        if not final and known // bs <= published // bs and (known <= published or published >= seq.num_prompt_tokens):
            return  # a decode step inside a block (the usual case): nothing new
        table = seq.block_table
        num_full = min(known // bs, len(table))
        tokens = seq.token_ids
        hashes = self._block_hashes(seq, num_full)
        for i in range(seq.num_published_tokens // bs, num_full):
            block = self.blocks[table[i]]
            if block.hash is None:  # not adopted from the cache, nor indexed yet as a full block
                self._index(block, hashes[i - 1] if i else None, tuple(tokens[i * bs:(i + 1) * bs]), hashes[i])
        offered = num_full * bs
        end = known if final else min(known, seq.num_prompt_tokens)
        if end > max(offered, seq.num_published_tokens) and num_full < len(table):
            self._index(self.blocks[table[num_full]], hashes[num_full - 1] if num_full else None,
                        tuple(tokens[offered:end]))
            offered = end
        seq.num_published_tokens = max(seq.num_published_tokens, offered)

    # ---- allocation ----------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        """Make seq's block table cover its computed tokens (plus `hit`, the cached prefix found by
        lookup_prefix just before, when seq is admitted) and num_new_tokens more. False, changing
        nothing, when too few blocks are free."""
        blocks = hit.blocks
        total = seq.num_computed_tokens + hit.num_tokens + num_new_tokens
        num_new_blocks = max(self.blocks_needed(total) - len(seq.block_table) - len(blocks), 0)
        need = num_new_blocks + sum(1 for b in blocks if self.blocks[b].ref_count == 0)
        source = None if hit.source is None else self.blocks[hit.source]
        # A free source holding just the hit's tokens becomes seq's block; else its tokens are copied.
        take_source = source is not None and source.ref_count == 0 and len(source.token_ids) == hit.num_partial
        if source is not None and not take_source and source.ref_count == 0:
            need += 1  # out of the free list while pinned
        if need > len(self.free_blocks):
            return False
        assert not hit.num_tokens or not seq.block_table, "a prefix hit is adopted at admission only"
        for block_id in blocks:
            self._reference(self.blocks[block_id])
            seq.block_table.append(block_id)
        if take_source:  # still offered: seq only appends to the tokens its entry names
            self._reference(source)
            seq.block_table.append(source.block_id)
            num_new_blocks -= 1
        elif source is not None:
            self._reference(source)
            self._pinned.append(source.block_id)
        for _ in range(num_new_blocks):
            seq.block_table.append(self._take_free_block())
        if source is not None and not take_source:
            self._copies.append((source.block_id, seq.block_table[len(blocks)], hit.num_partial))
        seq.num_computed_tokens += hit.num_tokens
        return True

    def _reference(self, block: Block):
        if block.ref_count == 0:
            del self.free_blocks[block.block_id]
        block.ref_count += 1

    def _release(self, block: Block):
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block.block_id} freed twice"
        if block.ref_count == 0:
            self.free_blocks[block.block_id] = None
            if block.token_ids is None:  # nothing to offer: evicted first
                self.free_blocks.move_to_end(block.block_id, last=False)

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.token_ids is not None:  # evict it from the prefix cache
            self._unindex(block)
        block.ref_count = 1
        return block_id

    def take_copies(self) -> list[tuple[int, int, int]]:
        """The (source block, destination block, tokens) copies that the allocations since the
        last call need before their step's attention runs."""
        copies, self._copies = self._copies, []
        return copies

    def release_pins(self):
        """The step holding the copies is launched (their reads are queued ahead of any later
        write): their sources may be reused."""
        for block_id in self._pinned:
            self._release(self.blocks[block_id])
        self._pinned.clear()

    def rollback(self, seq: Sequence, num_tokens: int):
        """Speculative decoding: the KV of seq's last num_tokens computed tokens belongs to drafts
        its verification rejected. They are no longer computed, and the blocks past what seq needs
        now (its computed tokens and the next one) go back to the free list: they hold nothing
        else, and nothing of theirs was offered to the prefix cache (only computed tokens are)."""
        assert 0 <= num_tokens <= seq.num_computed_tokens - seq.num_published_tokens
        seq.num_computed_tokens -= num_tokens
        keep = self.blocks_needed(seq.num_computed_tokens + 1)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            assert block.ref_count == 1 and block.token_ids is None, f"block {block.block_id} is shared"
            self._release(block)

    def free(self, seq: Sequence):
        """Offer what seq computed to the prefix cache and drop its references. Unreferenced
        blocks go to the free queue, the tail of the sequence first, so its head is evicted last."""
        self.publish(seq, final=True)
        for block_id in reversed(seq.block_table):
            self._release(self.blocks[block_id])
        seq.block_table = []
        seq.num_published_tokens = 0

    def forget(self, seq: Sequence):
        """seq is gone for good: drop its memoised hashes."""
        self.seq_block_hashes.pop(seq.seq_id, None)

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int):
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens
