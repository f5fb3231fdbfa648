"""The engine process's side of the pipe to the server: an EngineCore whose inbox and outbox are
the pipe's ends (started by `AsyncLLMEngine` with multiprocessing's spawn)."""
import logging
import pickle
import queue
import signal
import threading

from nanovllm.config import Config
from nanovllm.engine.engine_core import CoreOptions, EngineCore
from nanovllm.engine.request_output import coalesce_outputs
from nanovllm.worker.tp_worker import exit_with_parent


class PipeInbox:
    """The core's inbox in the engine process: commands from the parent's writer thread. Once the
    parent is gone (EOF), `get` answers "stop" and `get_nowait` finds nothing more."""

    def __init__(self, conn):
        self.conn = conn
        self.closed = False

    def get(self):
        if not self.closed:
            try:
                return self.conn.recv()
            except (EOFError, OSError):
                self.closed = True
        return ("stop", None)

    def get_nowait(self):
        if self.closed:
            raise queue.Empty
        try:
            ready = self.conn.poll()
        except OSError:
            ready = True  # get() meets the error and closes
        if not ready:
            raise queue.Empty
        return self.get()


class PipeOutbox:
    """The core's events in the engine process: the loop hands each pass's events over and goes on;
    a sender thread writes them to the pipe, all passes that queued up since its last write as one
    message with one output per request (`coalesce_outputs`). The loop never waits for the server
    (writing in the loop blocked it for 31% of a run on the H200 at 256 streams while the GPU
    idled), and a server that falls behind gets fewer, larger outputs instead of a growing backlog
    (BENCHMARKS.md, "Serving")."""

    _FLUSH_TIMEOUT_S = 10.0  # at exit: how long the last events may wait for a reader

    def __init__(self, conn):
        self.conn = conn
        self._pending: list[list] = []
        self._closed = False
        self._wakeup = threading.Condition()
        self._sender = threading.Thread(target=self._send_all, name="nanovllm-engine-sender", daemon=True)
        self._sender.start()

    def emit(self, events: list):
        with self._wakeup:
            self._pending.append(events)
            self._wakeup.notify()

    def _send_all(self):
        while True:
            with self._wakeup:
                while not self._pending and not self._closed:
                    self._wakeup.wait()
                if not self._pending:
                    return
                passes, self._pending = self._pending, []
            events = coalesce_outputs(passes)
            try:
                data = pickle.dumps(events, protocol=pickle.HIGHEST_PROTOCOL)
            except (pickle.PicklingError, TypeError, AttributeError):
                # An exception that does not pickle (startup errors can be anything): send its text.
                data = pickle.dumps([(e[0], RuntimeError(f"{type(e[1]).__name__}: {e[1]}"))
                                     if e[0] == "startup_error" else e for e in events])
            try:
                self.conn.send_bytes(data)
            except OSError:  # the parent is gone; the inbox reads EOF next and the loop stops
                return

    def close(self):
        """Send what is queued (the last outputs, a "dead" event), unless nobody reads any more."""
        with self._wakeup:
            self._closed = True
            self._wakeup.notify()
        self._sender.join(self._FLUSH_TIMEOUT_S)


def engine_process_main(conn, config: Config, engine_factory, log_level: int, options: CoreOptions | None = None):
    """The engine process: one EngineCore over the pipe. Ctrl-C reaches the whole process group,
    and service managers (systemd) send SIGTERM to every process of the service; the parent decides
    how to shut down (a drain lets requests finish), so both are ignored here. The process stops
    when told to, or when its parent is gone: the pipe closes, and a watcher thread ends the process
    at once even while a step runs (a server killed with SIGKILL leaves no engine behind)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    exit_with_parent()  # its own tensor-parallel workers watch it likewise
    logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    options = options or CoreOptions()
    if options.cpu_threads is not None:
        import torch
        torch.set_num_threads(options.cpu_threads)  # the cores of a data-parallel server share the host's
    outbox = PipeOutbox(conn)
    try:
        EngineCore(config, PipeInbox(conn), outbox.emit, engine_factory, options).run()
    finally:
        outbox.close()
        conn.close()
