"""uvicorn, hardened: a deadline for each request's head, and a graceful drain on SIGTERM.

uvicorn's h11 protocol waits for a request's head (request line and headers) for ever, so a client
sending them a byte at a time (slowloris) holds a connection as long as it likes; `GuardedH11Protocol`
gives each head a deadline from its first byte (from the connection's opening for the first one).
The body's timeout is the middleware's (http_guard.py), which can still answer 408.

On SIGTERM or SIGINT `Server` drains, as a rolling update needs: new requests get 503 with
Retry-After (the listening socket stays open, so they are answered rather than refused), /health
turns 503, the requests in flight finish; those still running after `shutdown_timeout` seconds
are finished at once with what they generated (finish_reason "abort", streams with their final
chunks). Then uvicorn shuts down and the process exits 0. A second signal ends the drain at once.
"""
import asyncio
import contextlib
import logging
import signal
import threading
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from nanovllm.engine.async_engine import AsyncLLMEngine
from nanovllm.entrypoints.openai.http_guard import Admission

logger = logging.getLogger("nanovllm.serve")

_ABORTED_GRACE_S = 5.0  # after aborting what is left: how long its last chunks may take to go out


class GuardedH11Protocol(H11Protocol):
    header_timeout: float = 10.0  # set per server by `guarded_h11`

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport):
        super().connection_made(transport)
        self._start_head_timer()  # the first request's head is due from now

    def data_received(self, data: bytes):
        if self._head_timer is None and self.conn.their_state is h11.IDLE:
            self._start_head_timer()  # the first byte of a new request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is in
            self._stop_head_timer()

    def connection_lost(self, exc):
        self._stop_head_timer()
        super().connection_lost(exc)

    def _start_head_timer(self):
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _stop_head_timer(self):
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self):
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:  # part of a head came: say why the connection closes
            body = f"the request line and headers did not arrive within {self.header_timeout:g}s\n".encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        self.transport.close()


def guarded_h11(header_timeout: float) -> type[GuardedH11Protocol]:
    """The protocol class for uvicorn.Config(http=...), with this head deadline."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout": header_timeout})


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, admission: Admission,
                 shutdown_timeout: float):
        super().__init__(config)
        self.engine = engine
        self.admission = admission
        self.shutdown_timeout = shutdown_timeout
        self._signals = 0          # how many SIGTERM/SIGINT came (set by the signal handler only)
        self._drain_deadline = None
        self._abort_deadline = None

    @contextlib.contextmanager
    def capture_signals(self):
        """Our own handlers, and unlike uvicorn's, the signal is not raised again once shut down
        (that made the exit status 143): a drained server exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame):
        """A signal handler: it only counts; the event loop acts on it (on_tick)."""
        self.admission.draining = True  # from now on the middleware answers new requests 503
        self._signals += 1
        if self._signals >= 3:
            self.force_exit = True  # uvicorn's: stop waiting for connections too

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if not self._signals:
            return False
        if self.force_exit:
            return True
        now = time.monotonic()
        in_flight = self.admission.in_flight
        if self._drain_deadline is None:
            self._drain_deadline = now + self.shutdown_timeout
            logger.info("draining: %d requests in flight may finish within %gs (signal again to end them now)",
                        in_flight, self.shutdown_timeout)
        if in_flight == 0:
            return True
        if self._abort_deadline is None and (now >= self._drain_deadline or self._signals > 1):
            logger.warning("ending the %d requests still in flight (finish_reason 'abort')", in_flight)
            self.engine.begin_shutdown()
            self._abort_deadline = now + _ABORTED_GRACE_S
        return self._abort_deadline is not None and now >= self._abort_deadline
