"""GuardMiddleware as plain ASGI, without a server."""
import asyncio

from nanovllm.entrypoints.openai.http_guard import GuardMiddleware


def test_a_body_already_received_reaches_the_app_in_the_same_turn_of_the_event_loop():
    """Reading the body under its timeout must not cost turns of the event loop: under load each
    turn waits behind every stream's next chunk, and the request's TTFT with it."""
    async def scenario():
        turns = 0

        async def ticker():  # counts the event loop's turns
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)
        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        seen = {}

        async def app(scope, receive, send):
            seen["turns"] = turns
            seen["body"] = (await receive())["body"]

        async def receive():
            return {"type": "http.request", "body": b"{}", "more_body": False}
        guard = GuardMiddleware(app, None, 1 << 20, body_timeout=30.0)
        start = turns
        await guard({"type": "http", "path": "/v1/completions", "headers": [(b"content-length", b"2")]},
                    receive, None)
        tick.cancel()
        return seen["turns"] - start, seen["body"]

    elapsed, body = asyncio.run(scenario())
    assert body == b"{}" and elapsed == 0
