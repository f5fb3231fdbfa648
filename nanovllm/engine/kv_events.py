"""KV-cache events for routers that place requests by what each engine has cached, in vLLM's format.

With `nanovllm serve --kv-events-endpoint`, every engine core publishes its prefix cache's changes:
`BlockStored` (full blocks whose KV became shareable: their chain hashes, the hash of the block before
them, their tokens), `BlockRemoved` (blocks evicted from the cache) and `AllBlocksCleared` (sent once at
start: whatever a subscriber knew of an earlier run of this core is gone). Consumers written for vLLM
(llm-d's KV-cache indexer, vllm-router's kv_aware policy) read them unchanged:

- a ZMQ PUB socket; each message has three frames: topic, sequence number (8 bytes, big-endian,
  from 0 per core), payload;
- the payload is msgpack: an array [timestamp, events, data_parallel_rank]; vLLM has encoded the
  events two ways (msgspec tagged structs, `--kv-events-format`): "array" (vLLM up to 0.10, and
  llm-d's indexer), each event an array led by its type's name, e.g. ["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium]; "map" (later vLLM, vllm-router), each
  event a map with a "type" key and lora_name besides;
- as in vLLM, an endpoint with a wildcard ("tcp://*:5557") or an ipc:// / inproc:// one is bound, any
  other (e.g. "tcp://indexer:5557") connected to; data-parallel core i uses the port plus i.

The hashes are the block manager's own (xxhash64 chained over token ids), so a consumer should key
blocks by the hashes of these events (and match prompts by the token ids they carry), not recompute
them with vLLM's hash function. A core publishes once per pass of its loop, and only when it has
something to say; the block manager calls `stored` / `removed` only where it indexes or evicts a
block, and not at all without an endpoint.
"""
import logging
import time

import msgspec
import zmq

logger = logging.getLogger("nanovllm.kv_events")

_HIGH_WATER_MARK = 100_000  # messages queued per subscriber before ZMQ drops (vLLM's default)
_LINGER_MS = 1000           # at close: how long the last messages may take to leave


FORMATS = ("array", "map")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


# The "map" format's events (the tag is the "type" key; lora_name has no default, so it is sent).
class MapKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapBlockStored(MapKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class MapBlockRemoved(MapKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class MapAllBlocksCleared(MapKVCacheEvent, tag="AllBlocksCleared"):
    pass


def endpoint_for_rank(endpoint: str, rank: int) -> str:
    """vLLM's rule: data-parallel core `rank` publishes on the endpoint's port + rank (inproc: a suffix)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    head, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"cannot give data-parallel core {rank} a port of its own in {endpoint!r}: "
                         "use tcp://HOST:PORT")
    return f"{head}:{int(port) + rank}"


def check_endpoint(endpoint: str):
    """Raise ValueError unless ZMQ can use endpoint (before any engine starts)."""
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"--kv-events-endpoint must be a ZMQ endpoint (tcp://HOST:PORT, tcp://*:PORT, ipc://PATH), "
                         f"got {endpoint!r}")
    if endpoint.startswith("tcp://"):
        head, sep, port = endpoint[len("tcp://"):].rpartition(":")
        if not head or not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--kv-events-endpoint {endpoint!r} needs a host (or *) and a port: tcp://HOST:PORT")


class KVEventPublisher:
    """The block manager's observer in one engine core: gathers a pass's events, publishes them as
    one batch (`flush`). Consecutive stores that continue one chain (a prompt's blocks, filled in one
    step) merge into one BlockStored, as vLLM sends them; so do consecutive removals."""

    def __init__(self, endpoint: str, topic: str, rank: int, block_size: int, medium: str, wire_format: str = "array"):
        if wire_format not in FORMATS:
            raise ValueError(f"the KV events format must be one of {FORMATS}, got {wire_format!r}")
        self.rank = rank
        if wire_format == "array":
            self._stored = lambda h, p, t: BlockStored([h], p, t, block_size, None, medium)
            self._removed, self._cleared = BlockRemoved, AllBlocksCleared
        else:
            self._stored = lambda h, p, t: MapBlockStored([h], p, t, block_size, None, medium, None)
            self._removed, self._cleared = MapBlockRemoved, MapAllBlocksCleared
        self.block_size = block_size
        self.medium = medium
        self.endpoint = endpoint_for_rank(endpoint, rank)
        self._topic = topic.encode()
        self._encoder = msgspec.msgpack.Encoder()
        self._events: list = []
        self._seq = 0
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.set_hwm(_HIGH_WATER_MARK)
        self._socket.setsockopt(zmq.LINGER, _LINGER_MS)
        try:
            if "*" in self.endpoint or "::" in self.endpoint or self.endpoint.startswith(("ipc://", "inproc://")):
                self._socket.bind(self.endpoint)
            else:
                self._socket.connect(self.endpoint)
        except zmq.ZMQError as e:
            self._socket.close(0)
            self._context.term()
            raise ValueError(f"cannot publish KV events on {self.endpoint}: {e}") from None
        logger.info("engine core %d publishes KV-cache events on %s", rank, self.endpoint)
        self._events.append(self._cleared())
        self.flush()

    # ---- the block manager's observer interface --------------------------------------------
    def stored(self, block_hash: int, parent_hash: int | None, token_ids):
        last = self._events[-1] if self._events else None
        if isinstance(last, (BlockStored, MapBlockStored)) and last.block_hashes[-1] == parent_hash:
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
        else:
            self._events.append(self._stored(block_hash, parent_hash, list(token_ids)))

    def removed(self, block_hash: int):
        last = self._events[-1] if self._events else None
        if isinstance(last, (BlockRemoved, MapBlockRemoved)):
            last.block_hashes.append(block_hash)
        else:
            self._events.append(self._removed([block_hash], self.medium))

    # ---- publishing ------------------------------------------------------------------------
    def flush(self):
        """Publish what was gathered since the last call (nothing: no message)."""
        if not self._events:
            return
        events, self._events = self._events, []
        payload = self._encoder.encode(EventBatch(time.time(), events, self.rank))
        try:  # a PUB socket never blocks: past the high-water mark ZMQ drops the message
            self._socket.send_multipart((self._topic, self._seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.warning("KV-cache events batch %d was not sent: %s", self._seq, e)
        self._seq += 1

    def close(self):
        self.flush()
        self._socket.close()  # waits up to the linger time for what is queued
        self._context.term()
