"""What every HTTP request passes before the app, as plain ASGI: authentication, the drain, the
body's size bound and read timeout; and the memory a huge body leaves behind, given back.

The body is read here, up to its bound, then replayed to the app; a Content-Length over the bound
is refused without reading, and a body that stops arriving gets 408. Either way an endless or
stalled upload holds neither memory nor a connection for long.
"""
import asyncio
import ctypes
import ctypes.util
import hmac
import json

from nanovllm.entrypoints.openai.protocol import APIError

UNAUTHENTICATED_PATHS = ("/health", "/ready")  # probes work without credentials
ALWAYS_SERVED_PATHS = ("/health", "/ready", "/metrics")  # answered while draining, and not counted as in flight
RETRY_AFTER_S = 2  # what a 503 tells clients to wait (the queue moves; or another replica answers)
_TRIM_AFTER_BYTES = 1 << 20  # bodies this large leave freed memory that malloc keeps: return it


# A body's messages are awaited in the request's own task: asyncio.wait_for runs what it awaits as a
# task of its own, three turns of the event loop even for a body already received, each behind every
# stream's next chunk (milliseconds of TTFT under load). asyncio.timeout came with Python 3.11.
if hasattr(asyncio, "timeout"):
    async def _within(seconds: float | None, awaitable):
        """awaitable's result, or asyncio.TimeoutError after `seconds` (None: no limit)."""
        async with asyncio.timeout(seconds):
            return await awaitable
else:
    async def _within(seconds: float | None, awaitable):
        """awaitable's result, or asyncio.TimeoutError after `seconds` (None: no limit)."""
        return await asyncio.wait_for(awaitable, seconds)


class Admission:
    """Whether new requests are let in (not while draining), and how many are in flight."""

    def __init__(self):
        self.draining = False
        self.in_flight = 0


class GuardMiddleware:
    def __init__(self, app, api_key: str | None, max_body_bytes: int, body_timeout: float | None = None,
                 admission: Admission | None = None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout  # the longest wait for the next piece of a body (nginx's meaning)
        self.admission = admission or Admission()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        path = scope["path"]
        if self.expected is not None and path not in UNAUTHENTICATED_PATHS:
            # compare_digest: the time taken does not tell how much of a guess was right.
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                return await send_error(send, APIError("invalid or missing API key: send 'Authorization: "
                                                       "Bearer <key>'", 401, code="invalid_api_key"))
        counted = path not in ALWAYS_SERVED_PATHS
        if counted and self.admission.draining:
            return await send_error(send, APIError("the server is shutting down: retry later (another replica "
                                                   "may serve you)", 503, code="server_shutting_down"))
        if counted:
            self.admission.in_flight += 1  # admitted: from now on a drain waits for it
        try:
            size = await self._serve(scope, receive, send, headers)
        finally:
            if counted:
                self.admission.in_flight -= 1
        if size >= _TRIM_AFTER_BYTES:
            asyncio.get_running_loop().run_in_executor(None, trim_heap)

    async def _serve(self, scope, receive, send, headers: dict) -> int:
        """Read the body within its bounds, then run the app on it; returns the body's size."""
        too_large = APIError(f"the request body exceeds {self.max_body_bytes} bytes", 413, code="request_too_large")
        try:
            length = int(headers.get(b"content-length", b"0"))
        except ValueError:
            await send_error(send, APIError("invalid Content-Length header", 400))
            return 0
        if length > self.max_body_bytes:
            await send_error(send, too_large)
            return 0
        chunks, size, more = [], 0, True
        while more:
            try:
                message = await _within(self.body_timeout, receive())
            except asyncio.TimeoutError:
                await send_error(send, APIError(f"the request body stopped arriving: nothing came for "
                                                f"{self.body_timeout:g}s", 408, code="request_timeout"))
                return size
            if message["type"] == "http.disconnect":
                return size
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:  # a chunked upload that never said how long it is
                await send_error(send, too_large)
                return size
            chunks.append(body)
            more = message.get("more_body", False)
        chunks.reverse()

        async def replay():  # the chunks as they came (the app joins them: one copy, not two)
            if chunks:
                return {"type": "http.request", "body": chunks.pop(), "more_body": bool(chunks)}
            return await receive()  # then: the disconnect, which the handlers watch for
        await self.app(scope, replay, send)
        return size


async def send_error(send, error: APIError):
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if error.status in (408, 413, 503):
        headers.append((b"connection", b"close"))  # the rest of the upload is not going to be read
    if error.status == 503:
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _malloc_trim()


def trim_heap():
    """Give the memory malloc holds free back to the system. A body of megabytes, its JSON and its
    tokens are freed once answered, but glibc keeps freed chunks of that size in its heaps (its
    mmap threshold grows to the largest block freed): the process's size would stay at its peak."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)  # ctypes releases the interpreter lock meanwhile
