"""Streamed outputs merged: deltas of one sequence, outputs of one request, several passes' events; the
metrics record of a completion that ended."""
from nanovllm.engine.request_output import (CompletionOutput, FinishedSequence, RequestOutput, RequestRejected,
                                            coalesce_outputs)
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams


def _delta(index, ids, finish=None, logprobs=None):
    return CompletionOutput(index, "".join(f"<{t}>" for t in ids), list(ids), logprobs, finish, None, ids[-1] if ids else 0)


def test_deltas_concatenate_and_the_later_one_ends():
    a = _delta(0, [1, 2], logprobs=[{"token_id": 1}, {"token_id": 2}])
    b = _delta(0, [3], finish="length")
    ab = a.followed_by(b)
    assert (ab.text, ab.token_ids, ab.finish_reason, ab.num_tokens) == ("<1><2><3>", [1, 2, 3], "length", 3)
    assert ab.logprobs == [{"token_id": 1}, {"token_id": 2}]
    assert _delta(0, [1]).followed_by(_delta(0, [2])).logprobs is None


def test_request_outputs_merge_per_sequence_and_an_error_stands_alone():
    first = RequestOutput("r", [_delta(0, [1]), _delta(1, [7])], num_prompt_tokens=4)
    second = RequestOutput("r", [_delta(1, [8], finish="stop")], finished=False, num_prompt_tokens=4)
    third = RequestOutput("r", [_delta(0, [2], finish="length")], finished=True, num_prompt_tokens=4,
                          num_cached_tokens=2)
    merged = first.followed_by(second).followed_by(third)
    assert {o.index: o.token_ids for o in merged.outputs} == {0: [1, 2], 1: [7, 8]}
    assert merged.finished and merged.num_cached_tokens == 2
    failed = RequestOutput("r", finished=True, error=RequestRejected("boom", 500))
    assert first.followed_by(failed) is failed


def test_several_passes_become_one_output_per_request_at_its_last_place():
    out = lambda rid, ids, finished=False: ("output", rid, RequestOutput(rid, [_delta(0, ids)], finished))
    passes = [
        [("stats", 1), out("a", [1]), out("b", [10])],
        [("stats", 2), ("accept", "c", 5), out("a", [2]), ("tokens", 2)],
        [("stats", 3), out("c", [20]), out("a", [3], finished=True), ("finished", "a")],
    ]
    events = coalesce_outputs(passes)
    assert [e[:2] for e in events] == [("stats", 1), ("output", "b"), ("stats", 2), ("accept", "c"),
                                      ("tokens", 2), ("stats", 3), ("output", "c"), ("output", "a"),
                                      ("finished", "a")]
    outputs = {e[1]: e[2] for e in events if e[0] == "output"}
    assert outputs["a"].outputs[0].token_ids == [1, 2, 3] and outputs["a"].finished
    assert outputs["b"].outputs[0].token_ids == [10] and outputs["c"].outputs[0].token_ids == [20]
    assert coalesce_outputs([passes[0]]) is passes[0]  # one pass: nothing to merge



def test_a_finished_record_counts_only_known_tokens():
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=8), seed=0)
    seq.arrival_time, seq.first_scheduled_time, seq.first_token_time = 1.0, 1.5, 2.0
    seq.append_token(7)
    seq.append_pending()  # a token of a step still in flight: not known yet
    record = FinishedSequence.of(seq, now=3.0, aborted=True)
    assert record == FinishedSequence("abort", 1.0, 1.5, 2.0, 3, 1, 3.0)
    seq.resolve_pending(8)
    seq.finish_reason = "length"
    done = FinishedSequence.of(seq, now=4.0)
    assert (done.finish_reason, done.num_tokens, done.time) == ("length", 2, 4.0)
    seq.finish_reason = None  # ended without a reason of its own (failed): an abort
    assert FinishedSequence.of(seq, now=4.0).finish_reason == "abort"
