"""The prefix cache inside the real engine loop, against a stand-in device that checks every KV
slot a step reads: token-granular hits, copies, publish on finish, preemption, aborts, n > 1 and
the GPU's overlapped steps, on randomized chat-like workloads."""
import random

import pytest

from helpers import assert_greedy_match, check_block_manager
from nanovllm import LLM
from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams

VOCAB = 500


class _Output:
    awaits_masks = False  # never deferred: no grammars here

    def __init__(self, seqs, tokens):
        self.seqs, self._tokens = seqs, tokens

    def token_ids(self):
        return self._tokens

    def logprobs(self):
        return None


class KVCheckingDevice:
    """Stands in for the model runner. Its KV cache records in every slot which prefix produced
    it (a hash of all tokens up to that position: causal attention makes KV depend on them all).
    A step applies the batch's copies, asserts that every position a sequence has computed holds
    that sequence's own prefix, writes the new tokens, and 'samples' a token that depends on the
    whole context, so equal histories continue equally. Like a GPU it knows the tokens it sampled
    before the host reads them (the host's placeholders)."""

    block_bytes = 1

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.slots = [[None] * block_size for _ in range(num_blocks)]
        self.sampled: dict[int, dict[int, int]] = {}  # seq_id -> position -> token drawn there
        self.copied_tokens = 0

    def _tokens(self, seq) -> list[int]:
        drawn = self.sampled.get(seq.seq_id, {})
        return [t if t >= 0 else drawn[p] for p, t in enumerate(seq.token_ids)]

    def execute(self, batch, defer_sampling=False):
        for src, dst, n in batch.kv_copies:
            assert src != dst and 0 < n <= self.block_size
            self.slots[dst][:n] = self.slots[src][:n]
            self.copied_tokens += n
        bs = self.block_size
        seqs, tokens = [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            ids = self._tokens(seq)
            prefix, h = [], 0
            for t in ids:
                h = hash((h, t))
                prefix.append(h)
            table, start = seq.block_table, seq.num_computed_tokens
            for p in range(start):
                assert self.slots[table[p // bs]][p % bs] == prefix[p], (
                    f"seq {seq.seq_id}: position {p} of {start} computed reads another prefix's KV")
            for p in range(start, start + n):
                self.slots[table[p // bs]][p % bs] = prefix[p]
            if start + n == len(ids):
                token = prefix[-1] % VOCAB
                self.sampled.setdefault(seq.seq_id, {})[len(ids)] = token
                seqs.append(seq)
                tokens.append(token)
        return _Output(seqs, tokens)

    def shutdown(self):
        pass


@pytest.fixture
def make_engine(model_factory, monkeypatch):
    def make(num_blocks=24, block_size=16, max_num_batched_tokens=48, overlap=False, **kw):
        config = Config(model_factory("qwen3", with_tokenizer=False), device="cpu", num_kvcache_blocks=num_blocks,
                        kvcache_block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=num_blocks * block_size, **kw)
        device = KVCheckingDevice(num_blocks, block_size)
        monkeypatch.setattr(LLMEngine, "_make_runner", staticmethod(lambda *_: device))
        engine = LLMEngine(config)
        engine.overlap = overlap
        return engine, device
    return make


def _drive(engine, rng, conversations, num_turns, abort_rate=0.0, n_rate=0.0, max_output=12, max_steps=20_000):
    """Chat conversations, each turn sent when the previous answer is in: its prompt is the whole
    history (prompt and answer) plus a new message. Returns the finished sequences and, per later
    turn's request id, the length of the history it repeats."""
    pending = {}  # request_id -> conversation
    histories = [list(system) for system in conversations]
    turns = [0] * len(conversations)
    done, repeats, next_id = [], {}, 0

    def send(c):
        nonlocal next_id
        if turns[c]:
            repeats[next_id] = len(histories[c])
        histories[c] += [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
        n = 2 if rng.random() < n_rate else 1
        params = SamplingParams(max_tokens=rng.randint(1, max_output), ignore_eos=True, n=n)
        engine.add_request(next_id, list(histories[c]), params)
        pending[next_id] = c
        next_id += 1

    def next_turn(c):
        if turns[c] + 1 < num_turns:
            turns[c] += 1
            send(c)

    for c in range(len(conversations)):
        send(c)
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        finished, _, _ = engine.step()
        if abort_rate and pending and rng.random() < abort_rate:
            victim = rng.choice(list(pending))
            engine.abort_request(victim)
            next_turn(pending.pop(victim))
        for seq in finished:
            done.append(seq)
            c = pending.get(seq.request_id)
            if c is None or seq.index != 0 or engine.requests.get(seq.request_id):
                continue
            del pending[seq.request_id]
            histories[c] = list(seq.token_ids)
            next_turn(c)
    else:
        raise AssertionError("no progress")
    return done, repeats


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_every_kv_read_is_the_sequences_own_under_pressure(make_engine, seed, overlap):
    """A small cache (preemption and eviction), a small budget (chunked prefill), n > 1, aborts:
    every slot a step reads holds the KV of the sequence's own prefix, and at the end every block
    is free, with exact reference counts."""
    rng = random.Random(seed)
    engine, device = make_engine(num_blocks=14, overlap=overlap)
    systems = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 40))] for _ in range(2)]
    conversations = [list(rng.choice(systems)) for _ in range(6)]
    done, _ = _drive(engine, rng, conversations, num_turns=4, abort_rate=0.05, n_rate=0.2, max_output=24)
    print(f"preemptions {engine.scheduler.num_preemptions}, hits {engine.block_manager.prefix_hits} of "
          f"{engine.block_manager.prefix_queries}, copied {device.copied_tokens}")
    engine.drain()
    bm = engine.block_manager
    assert done and bm.prefix_hits > 0 and device.copied_tokens > 0
    assert engine.scheduler.num_preemptions > 0  # the pressure is real
    check_block_manager(bm, [])
    assert bm.num_free_blocks == bm.num_blocks and not engine.requests


@pytest.mark.parametrize("overlap", [False, True])
def test_multi_turn_reuses_the_whole_history(make_engine, overlap):
    """With room to spare, every later turn finds all of its history but the answer's last token
    (whose KV was never computed); the first turns, sent together, share nothing yet."""
    rng = random.Random(7)
    engine, device = make_engine(num_blocks=64, max_num_batched_tokens=512, overlap=overlap)
    system = [rng.randrange(VOCAB) for _ in range(37)]
    done, repeats = _drive(engine, rng, [list(system) for _ in range(3)], num_turns=4)
    cached = {seq.request_id: seq.num_cached_tokens for seq in done}
    assert [cached[i] for i in range(3)] == [0, 0, 0]
    assert len(repeats) == 9 and {i: cached[i] for i in repeats} == {i: n - 1 for i, n in repeats.items()}
    assert device.copied_tokens == 0  # each turn takes the previous turn's last block as it is
    check_block_manager(engine.block_manager, [])


def test_later_first_turns_copy_the_shared_system_prompt(make_engine):
    """A system prompt shorter than a block: later conversations copy its KV from the first's block."""
    rng = random.Random(3)
    engine, device = make_engine(num_blocks=64, max_num_batched_tokens=512)
    system = [rng.randrange(VOCAB) for _ in range(11)]
    engine.add_request("a", system + [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # a's prompt is computed (and offered while a runs)
    engine.add_request("b", system + [4, 5], SamplingParams(max_tokens=1, ignore_eos=True))
    b, = engine.requests["b"]
    engine.step()
    assert b.num_cached_tokens == 11 and device.copied_tokens == 11
    while engine.has_unfinished():
        engine.step()
    check_block_manager(engine.block_manager, [])


# ---- the real engine on a tiny model ---------------------------------------------------------------
def _chat(llm, ref, rng, num_conversations=3, num_turns=3, max_tokens=8):
    """Conversations sharing a 40-token system prompt, one turn of each per generate call (the
    next turn's prompt: the history, the answer and a new message); every answer checked
    against HF's greedy continuation. Returns num_cached_tokens per turn and the history lengths."""
    system = [rng.randrange(3, 500) for _ in range(40)]
    prompts = [system + [rng.randrange(3, 500) for _ in range(rng.randint(3, 30))] for _ in range(num_conversations)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    cached, repeated = [], []
    for turn in range(num_turns):
        outs = llm.generate(prompts, params, use_tqdm=False)
        for p, out in zip(prompts, outs):
            assert_greedy_match(out["token_ids"], *ref.greedy(p, max_tokens), f"turn {turn}, prompt of {len(p)}")
        cached.append([out["num_cached_tokens"] for out in outs])
        histories = [p + out["token_ids"] for p, out in zip(prompts, outs)]
        repeated.append([len(h) for h in histories])
        prompts = [h + [rng.randrange(3, 500) for _ in range(rng.randint(1, 30))] for h in histories]
    return cached, repeated


@pytest.mark.parametrize("arch,kw", [
    ("qwen3", dict()),                                                   # 256-token pages: every hit ends inside one
    ("llama", dict(kvcache_block_size=16, max_num_batched_tokens=24)),   # hits followed by chunked prefill
    ("qwen3", dict(kvcache_block_size=16, num_kvcache_blocks=12, max_model_len=192)),  # preemption
])
@pytest.mark.parametrize("overlap", [False, True])
def test_multi_turn_chat_matches_hf(arch, kw, overlap, model_factory, hf_reference):
    llm = LLM(model_factory(arch), dtype="float32", **kw)
    llm.engine.overlap = overlap
    cached, repeated = _chat(llm, hf_reference(arch), random.Random(11))
    # Sent together: nothing was computed yet, but in chunks the first prompt may be by the time
    # the others are admitted (then they find the system prompt).
    assert cached[0][0] == 0 and all(c <= 40 for c in cached[0])
    # Later turns: the whole history but the answer's last token (never computed); under
    # preemption a history may have been evicted meanwhile, in part.
    for turn in range(1, len(cached)):
        expected = [n - 1 for n in repeated[turn - 1]]
        if "num_kvcache_blocks" in kw:
            assert all(40 <= c <= e for c, e in zip(cached[turn], expected)) and cached[turn] != [40] * 3
        else:
            assert cached[turn] == expected
    if "num_kvcache_blocks" in kw:
        assert llm.engine.scheduler.num_preemptions > 0
    check_block_manager(llm.engine.block_manager, [])


def test_reuse_off_matches_hf_and_caches_nothing(model_factory, hf_reference):
    llm = LLM(model_factory("qwen3"), dtype="float32", enable_prefix_caching=False)
    cached, _ = _chat(llm, hf_reference("qwen3"), random.Random(11), num_turns=2)
    assert cached == [[0, 0, 0], [0, 0, 0]]
    bm = llm.engine.block_manager
    assert bm.prefix_hits == 0 and not bm.children and bm.num_free_blocks == bm.num_blocks


def test_a_one_token_request_shares_its_prompt(model_factory, hf_reference):
    """max_tokens=1 (scoring, classification, warming a system prompt) finishes in the step that
    computes its prompt; the next request with that prompt reuses it all but the last token."""
    llm = LLM(model_factory("qwen3"), dtype="float32")
    prompt = list(range(3, 103))
    first = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0]
    assert first["num_cached_tokens"] == 0 and len(first["token_ids"]) == 1
    again = llm.generate([prompt + [7, 8]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                         use_tqdm=False)[0]
    assert again["num_cached_tokens"] == 100  # the whole first prompt (its sampled token never had KV)
    assert_greedy_match(again["token_ids"], *hf_reference("qwen3").greedy(prompt + [7, 8], 6))


def test_embedded_model_chat_reuses_the_previous_turn_and_matches_hf(smollm_dir):
    """The real model, chatting through its template (256-token pages): the second turn's prompt
    is re-tokenized text, and the cache serves exactly what it shares with the first turn's tokens
    (less the answer's last token, never computed); both answers are HF's greedy ones."""
    from helpers import HFReference
    llm = LLM(dtype="float32")
    ref = HFReference(smollm_dir)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    conversation = [{"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
                    {"role": "user", "content": "What is the capital of France?"}]
    first = llm.chat(conversation, params, use_tqdm=False)[0]
    conversation += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "Why?"}]
    second = llm.chat(conversation, params, use_tqdm=False)[0]
    before, ids = first["prompt_token_ids"] + first["token_ids"], second["prompt_token_ids"]
    shared = next((k for k, (a, b) in enumerate(zip(ids, before)) if a != b), len(before))
    assert second["num_cached_tokens"] == min(shared, len(before) - 1) > len(first["prompt_token_ids"]) // 2
    for out in (first, second):
        assert_greedy_match(out["token_ids"], *ref.greedy(out["prompt_token_ids"], 16))
    llm.shutdown()
