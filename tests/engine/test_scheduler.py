import random

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams


def _scheduler(num_blocks=64, block_size=16, max_seqs=8, max_tokens=64, prefix=True):
    bm = BlockManager(num_blocks, block_size, prefix)
    return Scheduler(max_seqs, max_tokens, bm), bm


def _seq(n, max_tokens=8, start=0):
    return Sequence(list(range(start, start + n)), SamplingParams(max_tokens=max_tokens), seed=0)


def _step(sched):
    """One fake step: every sequence that reaches its last token 'samples' token 1."""
    batch = sched.schedule()
    samplers = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
    sched.advance(batch)
    sched.publish(batch)
    for seq in samplers:
        seq.append_token(1)
        if seq.num_completion_tokens >= seq.sampling_params.max_tokens:
            sched.finish(seq, "length")
    return batch


def _run(sched, limit=10_000):
    steps = 0
    while sched.has_unfinished():
        _step(sched)
        steps += 1
        assert steps < limit, "no progress"
    return steps


def test_chunked_prefill_respects_token_budget():
    sched, _ = _scheduler(max_tokens=50)
    long, short = _seq(120), _seq(10, start=500)
    sched.add(long)
    sched.add(short)
    b1 = _step(sched)
    assert b1.seqs == [long] and b1.num_new_tokens == [50] and not b1.samples(0)
    b2 = _step(sched)
    assert b2.num_new_tokens == [50]
    b3 = _step(sched)  # the last 20 of the long prompt, and the short one joins with the rest of the budget
    assert sorted(b3.num_new_tokens) == [10, 20] and b3.num_tokens <= 50
    b4 = _step(sched)  # both decode now
    assert b4.num_new_tokens == [1, 1] and b4.num_decodes == 2


def test_decodes_come_first_in_the_batch():
    sched, _ = _scheduler(max_tokens=100)
    a = _seq(5)
    sched.add(a)
    _step(sched)
    sched.add(_seq(30, start=100))
    b = _step(sched)
    assert b.seqs[0] is a and b.num_new_tokens == [1, 30] and b.num_decodes == 1


def test_max_num_seqs():
    sched, _ = _scheduler(max_seqs=3, max_tokens=1000)
    for i in range(5):
        sched.add(_seq(4, start=i * 10))
    b = _step(sched)
    assert len(b.seqs) == 3 and len(sched.waiting) == 2


def test_preemption_finishes_everything_and_frees_all_blocks():
    rng = random.Random(0)
    sched, bm = _scheduler(num_blocks=12, block_size=16, max_seqs=8, max_tokens=64)
    seqs = [_seq(rng.randint(5, 60), max_tokens=rng.randint(10, 60), start=i * 1000) for i in range(12)]
    for s in seqs:
        sched.add(s)
    _run(sched)
    assert sched.num_preemptions > 0
    assert all(s.is_finished and s.num_completion_tokens == s.sampling_params.max_tokens for s in seqs)
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_oldest_request_is_never_preempted():
    sched, _ = _scheduler(num_blocks=6, block_size=16, max_seqs=8, max_tokens=64)
    first = _seq(40, max_tokens=40)
    sched.add(first)
    for i in range(4):
        sched.add(_seq(30, max_tokens=40, start=(i + 1) * 1000))
    _run(sched)
    assert first.num_preemptions == 0


def test_prefix_hit_counts():
    sched, bm = _scheduler(num_blocks=32, block_size=16, max_tokens=1000)
    prefix = list(range(2000, 2048))  # 3 blocks
    a = Sequence(prefix + [1, 2], SamplingParams(max_tokens=2), seed=0)
    sched.add(a)
    _run(sched)
    assert (bm.prefix_queries, bm.prefix_hits) == (50, 0)
    b = Sequence(prefix + [3, 4, 5], SamplingParams(max_tokens=2), seed=0)
    c = Sequence(prefix, SamplingParams(max_tokens=2), seed=0)  # last token must be recomputed
    sched.add(b)
    sched.add(c)
    batch = _step(sched)
    # b: the 3 full blocks (its next tokens differ from a's); c: 2 full blocks and 15 tokens of
    # the third, copied (c's 1 token left to compute makes it a decode, first in the batch).
    assert batch.seqs == [c, b] and batch.num_new_tokens == [1, 3]
    assert (b.num_cached_tokens, c.num_cached_tokens) == (48, 47)
    assert batch.kv_copies == [(b.block_table[2], c.block_table[2], 15)]
    assert (bm.prefix_queries, bm.prefix_hits) == (50 + 51 + 48, 95)
    _run(sched)
    assert bm.num_free_blocks == bm.num_blocks


def test_abort_waiting_and_running():
    sched, bm = _scheduler()
    a, b = _seq(20), _seq(20, start=100)
    sched.add(a)
    _step(sched)
    sched.add(b)
    sched.finish(a, "abort")
    sched.finish(b, "abort")
    assert not sched.has_unfinished() and bm.num_free_blocks == bm.num_blocks
    assert a.finish_reason == b.finish_reason == "abort"


def test_a_finished_request_shares_its_prompt_and_its_output():
    """max_tokens=1 finishes in the step that computes its prompt: its blocks are offered as it is
    freed, so a later request with the same system prompt finds them."""
    sched, bm = _scheduler(num_blocks=32, block_size=16, max_tokens=1000)
    system = list(range(3000, 3040))  # 2 full blocks + 8 tokens
    first = Sequence(system + [1], SamplingParams(max_tokens=1), seed=0)
    sched.add(first)
    _run(sched)
    second = Sequence(system + [2, 3], SamplingParams(max_tokens=4), seed=0)
    sched.add(second)
    batch = _step(sched)
    assert second.num_cached_tokens == 40 and batch.num_new_tokens == [2]
    assert len(batch.kv_copies) == 1  # 8 of the 9 tokens of first's free partial block
    _run(sched)
    # The next turn: the whole conversation so far (the prompt and the output) but the last token.
    history = second.token_ids
    turn2 = Sequence(history + [9, 9, 9], SamplingParams(max_tokens=2), seed=0)
    sched.add(turn2)
    batch = _step(sched)
    assert turn2.num_cached_tokens == len(history) - 1 and batch.num_new_tokens == [4]
    assert batch.kv_copies == []  # second's last block is free and holds exactly those tokens: taken
    _run(sched)
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_siblings_of_n_copy_the_shared_partial_prompt_block():
    sched, bm = _scheduler(num_blocks=32, block_size=16, max_tokens=1000)
    prompt = list(range(500, 520))  # a full block and 4 tokens
    seqs = [Sequence(prompt, SamplingParams(n=3, max_tokens=3), seed=i, request_id="r", index=i) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    first = _step(sched)
    assert first.seqs == [seqs[0]]  # the siblings wait for the leader's prompt
    second = _step(sched)
    assert [s.num_cached_tokens for s in seqs[1:]] == [19, 19]
    assert sorted(second.kv_copies) == sorted((seqs[0].block_table[1], s.block_table[1], 3) for s in seqs[1:])
    assert [s.block_table[0] for s in seqs] == [seqs[0].block_table[0]] * 3
    _run(sched)
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_prefix_caching_off_reuses_nothing():
    sched, bm = _scheduler(num_blocks=32, block_size=16, max_tokens=1000, prefix=False)
    for i in range(2):
        sched.add(Sequence(list(range(40)), SamplingParams(max_tokens=1), seed=0))
        _run(sched)
    assert bm.prefix_hits == 0 and not bm.children and not bm.hash_to_block
