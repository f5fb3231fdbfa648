"""LoadBalancer: least loaded core first (ties in turn), prefix-cache affinity unless that core is
overloaded or the shared prefix is a small part of the prompt, cores that serve nothing skipped,
a bounded memory of prefixes."""
import random

from nanovllm.engine.load_balancer import LoadBalancer, prefix_hashes, prefix_lengths


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50000) for _ in range(n)]


def test_prefix_ladder():
    assert prefix_lengths(31) == [] and prefix_lengths(33) == [32]
    assert prefix_lengths(513) == list(range(32, 513, 32))
    assert prefix_lengths(5000) == list(range(32, 513, 32)) + [1024, 2048, 4096]
    assert prefix_lengths(10**6)[-1] == 1 << 15
    a, b = _prompt(0, 300), _prompt(1, 300)
    shared = a[:100] + b[100:]
    ha, hs = prefix_hashes(a), prefix_hashes(shared)
    assert [length for length, _ in ha] == list(range(32, 300, 32))
    assert ha[:3] == hs[:3] and all(x != y for x, y in zip(ha[3:], hs[3:]))  # equal up to 96 tokens, not after


def test_least_loaded_with_ties_in_turn():
    lb = LoadBalancer(3)
    assert lb.choose([5, 2, 7], [1, 2, 3]) == 1
    picks = [lb.choose([0, 0, 0], _prompt(i, 8)) for i in range(6)]  # too short for affinity
    assert sorted(picks) == [0, 0, 1, 1, 2, 2]
    assert {lb.choose([None, 3, None], _prompt(i, 8)) for i in range(3)} == {1}  # only core 1 serves


def test_affinity_follows_the_longest_prefix_unless_overloaded():
    lb = LoadBalancer(2, slack=4)
    system = _prompt(42, 400)
    first = lb.choose([0, 0], system + _prompt(1, 50))
    other = 1 - first
    # Same prefix, idle cores, or this core somewhat busier: it stays where the prefix is.
    assert lb.choose([0, 0], system + _prompt(2, 50)) == first
    loads = [0, 0]
    loads[first] = 4
    assert lb.choose(loads, system + _prompt(3, 50)) == first
    # Overloaded (more than `slack` and half again the least loaded): the least loaded takes it.
    loads[first], loads[other] = 20, 2
    assert lb.choose(loads, system + _prompt(4, 50)) == other
    # Now both hold the prefix: the less loaded of the two.
    loads[first], loads[other] = 3, 1
    assert lb.choose(loads, system + _prompt(5, 50)) == other
    # A prefix shared over a small part of the prompt does not pull (min_match 0.3).
    unrelated = lb.choose([0, 0], _prompt(7, 40) + _prompt(8, 1000))
    loads = [0, 0]
    loads[unrelated] = 1
    assert lb.choose(loads, _prompt(7, 40) + _prompt(9, 1000)) == 1 - unrelated


def test_a_core_that_serves_nothing_is_skipped_and_forgotten():
    lb = LoadBalancer(2)
    prompt = _prompt(3, 200)
    core = lb.choose([0, 0], prompt)
    loads = [0, 0]
    loads[core] = None
    assert lb.choose(loads, prompt) == 1 - core
    lb.forget(core)
    assert not lb.recent[core]


def test_memory_is_bounded_by_the_kv_cache():
    lb = LoadBalancer(2)
    lb.set_kv_capacity(0, 32 * 100)  # 100 rungs of 32 tokens
    for i in range(50):
        lb.choose([0, None], _prompt(i, 600))
    assert len(lb.recent[0]) == 100
    # The most recent prompt's prefixes survive, shortest included.
    assert all(h in lb.recent[0] for _, h in prefix_hashes(_prompt(49, 600)))
