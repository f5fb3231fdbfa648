"""The SSE response (request_job._EventStream): the first chunk is written in the turn of the event loop
that starts the response; a client that disconnects cancels the stream; the stream's own error
comes out as itself."""
import asyncio

import pytest

from nanovllm.entrypoints.openai.request_job import _EventStream

_SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}


async def _never_disconnects():
    await asyncio.Event().wait()


def test_the_first_chunk_is_written_in_the_turn_that_starts_the_response():
    async def main():
        order = []

        async def chunks():
            yield "data: 1\n\n"

        async def send(message):
            order.append(message.get("body", message["type"]))
        asyncio.get_running_loop().call_soon(order.append, "next turn")
        await _EventStream(chunks(), media_type="text/event-stream")(_SCOPE, _never_disconnects, send)
        return order
    order = asyncio.run(main())
    assert order.index(b"data: 1\n\n") < order.index("next turn")
    assert [m for m in order if m != "next turn"] == ["http.response.start", b"data: 1\n\n", b""]


def test_a_disconnect_cancels_the_stream():
    async def main():
        sent, closed, disconnected = [], asyncio.Event(), asyncio.Event()

        async def chunks():
            try:
                yield "data: 1\n\n"
                await asyncio.Event().wait()  # the engine has nothing more yet
            finally:
                closed.set()

        async def receive():
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message.get("body"))
            if message.get("body"):
                disconnected.set()  # the client leaves after the first chunk
        await asyncio.wait_for(_EventStream(chunks())(_SCOPE, receive, send), 5)
        return sent, closed.is_set()
    sent, closed = asyncio.run(main())
    assert sent == [None, b"data: 1\n\n"] and closed


def test_the_streams_error_comes_out_as_itself():
    async def main():
        async def chunks():
            yield "data: 1\n\n"
            raise KeyError("boom")

        async def send(message):
            pass
        await _EventStream(chunks())(_SCOPE, _never_disconnects, send)
    with pytest.raises(KeyError, match="boom"):
        asyncio.run(main())
