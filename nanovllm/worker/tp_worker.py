"""One tensor-parallel worker process (ranks 1..N-1): it holds its shard of the model and KV
cache and runs each step's forward in lock-step with rank 0, which schedules and samples.

Protocol over the worker's Pipe (rank 0 <-> worker):
  worker -> rank 0: ("hello", None) once imported, just before joining the process group;
                    ("ready", num_blocks) once its shard and KV cache are built;
                    ("error", traceback text) just before it exits on an exception.
  rank 0 -> worker: send_bytes(pickled HostInputs) for each step, b"" to stop.
"""
import copy
import os
import pickle
import signal
import sys
import threading
import traceback
from multiprocessing import connection, parent_process

import torch

STOP = b""


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r runs on the r-th CUDA device counted from the configured one (cuda:0 if unnumbered)."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def worker_main(rank: int, config, port: int, timeout_s: float, conn):
    # Ctrl-C reaches the whole process group: leave it to rank 0, which stops the workers cleanly.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    try:
        from nanovllm import distributed
        from nanovllm.config import torch_threads
        from nanovllm.worker.model_runner import ModelRunner

        config = copy.copy(config)
        config.device = rank_device(config.device, rank)
        if (threads := torch_threads(config)) is not None:
            # The ranks share the host's cores; without this each would start one thread per core.
            torch.set_num_threads(threads)
        conn.send(("hello", None))
        distributed.init_process_group(rank, config.tensor_parallel_size, port, config.device, timeout_s)
        runner = ModelRunner(config, rank)
        conn.send(("ready", runner.num_blocks))
        while True:
            msg = conn.recv_bytes()
            if msg == STOP:
                break
            runner.run(pickle.loads(msg), None)
        runner.release_graphs()  # before the group: see ModelRunner.release_graphs
        distributed.disable_one_shot_all_reduce()
        distributed.destroy_process_group()
        # Skip the interpreter's teardown of torch & co (a second or more): nothing else to save.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except EOFError:
        os._exit(0)  # rank 0 is gone (its end of the pipe closed): nothing left to serve
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            # At once, without cleanup: closing our sockets is what releases rank 0 from a
            # collective that is waiting on us, and a broken process group may hang on destroy.
            os._exit(1)


def exit_with_parent():
    """Die if the parent process dies (a worker's rank 0, an engine core's server), even while blocked
    inside a collective (where a pipe's EOF would go unnoticed): a watcher thread waits on the
    parent's sentinel, which the kernel closes however the parent ends."""
    parent = parent_process()
    if parent is None:
        return

    def watch():
        connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="nanovllm-parent-watch", daemon=True).start()
