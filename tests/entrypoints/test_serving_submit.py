"""OpenAIServing._submit: the handler goes on in the event loop's next turn once the engine has
taken its prompts in; a rejection of one prompt aborts them all; a client that leaves while the
engine has not answered leaves no answer pending."""
import asyncio
from types import SimpleNamespace

import pytest

from nanovllm.engine.request_output import RequestRejected
from nanovllm.entrypoints.openai.protocol import APIError
from nanovllm.entrypoints.openai.serving import OpenAIServing
from nanovllm.sampling_params import SamplingParams


class _Handle:
    def __init__(self, request_id):
        self.request_id = request_id
        self.accepted = asyncio.get_running_loop().create_future()
        self.aborted = False

    def abort(self):
        self.aborted = True


class _Engine:
    """Hands out handles and leaves their answers to the test."""
    config = SimpleNamespace(max_model_len=64, reasoning_parser=None)

    def __init__(self):
        self.handles = []

    def check_capacity(self, num_requests):
        pass

    def add_request(self, token_ids, params, stream, out_queue):
        self.handles.append(_Handle(f"r{len(self.handles)}"))
        return self.handles[-1]


def _serving():
    return OpenAIServing(_Engine(), None, ["m"])


def _submit(serving, num_prompts):
    return serving._submit([[1, 2]] * num_prompts, [SamplingParams()] * num_prompts, True, "prompt")


def test_the_handler_goes_on_in_the_next_turn_after_the_acceptance():
    """The acceptance arrives as a callback of the event loop; the handler runs in the turn after
    it, ahead of what that callback's turn scheduled after it (another stream's chunk)."""
    async def main():
        serving, order = _serving(), []

        async def handler():
            await _submit(serving, 1)
            order.append("handler")
        task = asyncio.create_task(handler())
        await asyncio.sleep(0)  # the handler now waits for the engine
        serving.engine.handles[0].accepted.set_result(2)
        asyncio.get_running_loop().call_soon(order.append, "next chunk")
        await task
        return order
    assert asyncio.run(main()) == ["handler", "next chunk"]


def test_a_rejected_prompt_aborts_every_prompt_of_the_request():
    async def main():
        serving = _serving()
        task = asyncio.create_task(_submit(serving, 3))
        await asyncio.sleep(0)
        first, second, third = serving.engine.handles
        second.accepted.set_exception(RequestRejected("prompt token id 99 is outside the vocabulary", 400))
        first.accepted.set_result(2)
        third.accepted.set_exception(RequestRejected("the server is overloaded", 503))
        with pytest.raises(APIError) as e:
            await task
        return e.value, serving.engine.handles
    error, handles = asyncio.run(main())
    assert error.status == 400 and error.param == "prompt" and "outside the vocabulary" in str(error)
    assert all(h.aborted for h in handles)


def test_a_client_that_leaves_before_the_answer_leaves_none_pending():
    async def main():
        serving = _serving()
        task = asyncio.create_task(_submit(serving, 2))
        await asyncio.sleep(0)
        serving.engine.handles[0].accepted.set_result(2)
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return serving.engine.handles
    handles = asyncio.run(main())
    assert all(h.aborted for h in handles)
    assert handles[0].accepted.result() == 2 and handles[1].accepted.cancelled()
