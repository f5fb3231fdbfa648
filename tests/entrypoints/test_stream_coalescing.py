"""Streaming merges the outputs that queued up while the client was being served."""
import asyncio

from nanovllm.engine.request_output import CompletionOutput, RequestOutput
from nanovllm.entrypoints.openai.request_job import Job


class _Handle:
    def __init__(self, request_id):
        self.request_id = request_id


def test_queued_deltas_merge_into_one_output_per_choice():
    async def scenario():
        job = Job("cmpl-1", "m", 1, [_Handle("a"), _Handle("b")], [[1, 2], [3]])
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(RequestOutput("a", [CompletionOutput(0, "he", [5], [{"logprob": -1.0}], num_tokens=1)]))
        queue.put_nowait(RequestOutput("b", [CompletionOutput(0, "x", [7], None, num_tokens=1)]))
        queue.put_nowait(RequestOutput("a", [CompletionOutput(0, "llo", [6], [{"logprob": -2.0}], "length",
                                                              num_tokens=2)], finished=True))
        got = []
        async for _, output, index in job.stream(queue):
            got.append((index, output))
            if len(got) == 2:  # b finishes later, after the first batch was sent
                queue.put_nowait(RequestOutput("b", [CompletionOutput(0, "y", [8], None, "stop", num_tokens=2)],
                                               finished=True))
        return job, got

    job, got = asyncio.run(scenario())
    (i0, a), (i1, b1), (i2, b2) = got
    assert (i0, a.text, a.token_ids, a.finish_reason, a.num_tokens) == (0, "hello", [5, 6], "length", 2)
    assert [e["logprob"] for e in a.logprobs] == [-1.0, -2.0]
    assert (i1, b1.text, i2, b2.text, b2.finish_reason) == (1, "x", 1, "y", "stop")
    assert job.num_tokens == {0: 2, 1: 2}


def test_a_failure_mid_stream_ends_the_open_choices_as_aborted():
    """The engine failed (or died) mid-stream: what came before the failure is kept, each choice
    still open ends with finish_reason "abort", and the job remembers the error (for its SSE event)."""
    from nanovllm.engine.request_output import RequestRejected

    async def scenario():
        job = Job("cmpl-1", "m", 2, [_Handle("a")], [[1, 2]])
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(RequestOutput("a", [CompletionOutput(0, "x", [5], None, num_tokens=1),
                                             CompletionOutput(1, "y", [6], None, "stop", num_tokens=1)]))
        queue.put_nowait(RequestOutput("a", finished=True, error=RequestRejected("boom", 500)))
        return job, [(index, output) async for _, output, index in job.stream(queue)]

    job, got = asyncio.run(scenario())
    by_index = {index: output for index, output in got}
    assert (by_index[0].text, by_index[0].finish_reason, by_index[0].num_tokens) == ("x", "abort", 1)
    assert (by_index[1].text, by_index[1].finish_reason) == ("y", "stop")
    assert str(job.error) == "boom" and job.error.status == 500
    assert job.num_tokens == {0: 1, 1: 1}
