"""KV-cache events: the block manager tells its observer what the prefix cache gains and loses, and
the publisher sends it over ZMQ in vLLM's wire format (a multipart [topic, seq, payload] message,
the payload a msgpack array [ts, events, data_parallel_rank], events as arrays led by their tag)."""
import pytest

from nanovllm.engine.block_manager import BlockManager, chain_hash
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

zmq = pytest.importorskip("zmq", reason="KV events need pyzmq (pip install 'nanovllm[kv_events]')")
msgspec = pytest.importorskip("msgspec", reason="KV events need msgspec (pip install 'nanovllm[kv_events]')")

from nanovllm.engine.kv_events import KVEventPublisher, check_endpoint, endpoint_for_rank  # noqa: E402


class Recorder:
    def __init__(self):
        self.events = []

    def stored(self, block_hash, parent_hash, token_ids):
        self.events.append(("stored", block_hash, parent_hash, tuple(token_ids)))

    def removed(self, block_hash):
        self.events.append(("removed", block_hash))


def _run_prompt(bm: BlockManager, tokens: list[int]) -> tuple[Sequence, int]:
    """A prompt's prefill, as the scheduler runs it (cf. test_block_manager.py); with the number of
    its tokens found in the prefix cache."""
    seq = Sequence(tokens, SamplingParams(max_tokens=1), seed=0)
    hit = bm.lookup_prefix(seq)
    n = seq.num_tokens - hit.num_tokens
    assert bm.allocate(seq, n, hit)
    bm.release_pins()  # the step is launched
    seq.num_computed_tokens += n
    bm.publish(seq)
    return seq, hit.num_tokens


def test_block_manager_tells_its_observer_what_it_caches_and_evicts():
    bm = BlockManager(num_blocks=4, block_size=16)
    bm.observer = recorder = Recorder()
    a = list(range(40))  # two full blocks and a partial one
    seq, _ = _run_prompt(bm, a)
    h0 = chain_hash(None, a[:16])
    h1 = chain_hash(h0, a[16:32])
    assert recorder.events == [("stored", h0, None, tuple(a[:16])), ("stored", h1, h0, tuple(a[16:32]))]
    bm.free(seq)
    recorder.events.clear()
    # A prefix hit (both full blocks and 7 tokens of the partial one, which is not announced: vLLM's
    # events name full blocks only): nothing new is stored.
    again, num_hit = _run_prompt(bm, a)
    assert recorder.events == [] and num_hit == 39
    bm.free(again)
    # A different prompt needs every block: the cached ones are evicted, oldest content last.
    _run_prompt(bm, list(range(100, 164)))
    removed = [e[1] for e in recorder.events if e[0] == "removed"]
    assert sorted(removed) == sorted([h0, h1])
    assert sum(e[0] == "stored" for e in recorder.events) == 4


def test_endpoints():
    assert endpoint_for_rank("tcp://*:5557", 0) == "tcp://*:5557"
    assert endpoint_for_rank("tcp://indexer:5557", 2) == "tcp://indexer:5559"
    assert endpoint_for_rank("inproc://kv", 1) == "inproc://kv_dp1"
    for bad in ("http://x:1", "tcp://x", "tcp://:80", "tcp://x:99999"):
        with pytest.raises(ValueError, match="kv-events-endpoint"):
            check_endpoint(bad)


def test_publisher_speaks_vllms_wire_format():
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 10000)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    # Data-parallel rank 1 publishes on port + 1: here the test's port, by asking for port - 1.
    publisher = KVEventPublisher(f"tcp://127.0.0.1:{port - 1}", "kv@pod", 1, 16, "GPU")
    try:
        assert publisher.endpoint == f"tcp://127.0.0.1:{port}"
        got = []
        # A connecting publisher's first messages may leave before the connection is up: publish
        # until one arrives (ZMQ's slow joiner), then check the sequence numbers run on.
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        for _ in range(100):
            publisher.removed(7)
            publisher.flush()
            if poller.poll(100):
                got.append(sub.recv_multipart())
                break
        assert got, "no message arrived"
        publisher.stored(11, None, range(16))
        publisher.stored(12, 11, range(16, 32))  # continues the chain: one event
        publisher.stored(99, 5, [1] * 16)        # another chain
        publisher.removed(11)
        publisher.removed(12)
        publisher.flush()
        publisher.flush()  # nothing new: no message
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv@pod" and int.from_bytes(seq, "big") == int.from_bytes(got[0][1], "big") + 1
        ts, events, rank = msgspec.msgpack.decode(payload)
        assert isinstance(ts, float) and rank == 1
        assert events == [["BlockStored", [11, 12], None, list(range(32)), 16, None, "GPU"],
                          ["BlockStored", [99], 5, [1] * 16, 16, None, "GPU"],
                          ["BlockRemoved", [11, 12], "GPU"]]
        with pytest.raises(zmq.Again):
            sub.recv_multipart(zmq.NOBLOCK)
    finally:
        publisher.close()
        sub.close(0)
        context.term()


def test_hashes_above_63_bits_survive_the_wire():
    """xxhash64 digests use all 64 bits: msgpack's uint64 carries them."""
    from nanovllm.engine.kv_events import BlockRemoved, EventBatch
    payload = msgspec.msgpack.encode(EventBatch(1.0, [BlockRemoved([2**64 - 1], None)], 0))
    assert msgspec.msgpack.decode(payload) == [1.0, [["BlockRemoved", [2**64 - 1], None]], 0]


def test_the_map_format_tags_events_by_a_type_key():
    """Later vLLM versions (and vllm-router) read each event as a map with its type under "type"."""
    publisher = KVEventPublisher("inproc://kv-map-test", "", 0, 16, "GPU", "map")
    try:
        publisher.stored(11, None, range(16))
        publisher.removed(11)
        events = publisher._events
        payload = msgspec.msgpack.encode(events)
    finally:
        publisher.close()
    assert msgspec.msgpack.decode(payload) == [
        {"type": "BlockStored", "block_hashes": [11], "parent_block_hash": None, "token_ids": list(range(16)),
         "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"}]
    with pytest.raises(ValueError, match="format must be one of"):
        KVEventPublisher("inproc://kv-bad", "", 0, 16, "GPU", "json")
