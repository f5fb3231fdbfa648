"""Tensor-parallel state: which rank this process is and how to combine partial results."""
import contextlib
import os
import threading
from typing import NamedTuple

import torch
import torch.distributed as dist

from nanovllm.logger import init_logger

logger = init_logger(__name__)

_tp_rank = 0
_tp_size = 1


def set_tensor_parallel(rank: int, size: int):
    global _tp_rank, _tp_size
    _tp_rank, _tp_size = rank, size


@contextlib.contextmanager
def single_device():
    """Code run inside sees no tensor parallelism (rank 0 of 1), whatever this process's group:
    a speculative draft model on rank 0 of a tensor-parallel target, built and run alone. The
    layers read the state at construction and in their forward passes, so both go inside."""
    global _tp_rank, _tp_size
    saved = _tp_rank, _tp_size
    _tp_rank, _tp_size = 0, 1
    try:
        yield
    finally:
        _tp_rank, _tp_size = saved


def tp_rank() -> int:
    return _tp_rank


def tp_size() -> int:
    return _tp_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks (x itself, or a new tensor: use the result)."""
    if _tp_size == 1:
        return x
    fast = _one_shot
    if (fast is not None and x.dtype == fast.buffer.dtype and x.is_cuda and x.is_contiguous()
            and x.numel() * x.element_size() <= ONE_SHOT_MAX_BYTES):
        out = torch.empty_like(x)
        staged = fast.buffer[:x.numel()].view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, x, "sum", fast.group_name, out)
    dist.all_reduce(x)
    return x


# ---- one-shot all-reduce over peer memory (decode-sized sums on GPUs; opt-in) ----
# PyTorch's symmetric memory maps every rank's staging buffer into its peers, and its one-shot kernel
# copies the input there, meets the peers at a barrier and sums every rank's buffer over NVLink: one
# kernel instead of NCCL's ring, no NVLink multicast (which stays off on the machines we run on).
# Measured on two H200s (BENCHMARKS.md): Qwen3-8B over two GPUs 14,416 against 14,063 tok/s, decode 128+
# 8.65 against 9.02 ms per step; 14,569 against 14,198 in a later pair. Opt-in
# (NANOVLLM_ONE_SHOT_ALL_REDUCE=1) because of its failure path: with a worker SIGKILLed mid-step,
# generate raises as quickly as with NCCL (0.2 s), but the process then never finishes its exit (hung
# below Python, still after 100 s, also with the staging buffer never freed), where with NCCL it exits
# cleanly (tests/gpu/test_tensor_parallel_gpu.py). Past ONE_SHOT_MAX_BYTES (prefill steps) each rank
# reading every peer's whole input loses to NCCL's ring.
ONE_SHOT_MAX_BYTES = 8 << 20


class _OneShot(NamedTuple):
    buffer: torch.Tensor  # this rank's staging buffer, mapped into its peers
    group_name: str


_one_shot: _OneShot | None = None
# Once per process: the second tensor-parallel group of one process hung in its set-up on the H200s.
# PyTorch's symmetric memory records a group's rank, size and store under the group's name for the life
# of the process (its set_group_info refuses a name twice, nothing removes one), and the next default
# group takes the same name, so rank 0 would meet its new peers through the old group's store. Later
# groups keep NCCL (checked on the GPUs: tests/gpu/test_tensor_parallel_gpu.py).
_one_shot_taken = False


def enable_one_shot_all_reduce(device: torch.device, dtype: torch.dtype) -> bool:
    """Collective (every rank, same point): route all-reduces of up to ONE_SHOT_MAX_BYTES of `dtype`
    through the one-shot kernel, if every rank can (the first group of each process only); a probe
    sum must come out exact. Only with NANOVLLM_ONE_SHOT_ALL_REDUCE=1. Returns whether it is on."""
    global _one_shot, _one_shot_taken
    _one_shot = None
    if _tp_size == 1 or device.type != "cuda":
        return False
    wanted = os.environ.get("NANOVLLM_ONE_SHOT_ALL_REDUCE", "0") == "1"
    try:
        import torch.distributed._symmetric_memory as symm_mem
        available = wanted and not _one_shot_taken and hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")
    except Exception:  # an older torch, or one built without symmetric memory
        available = False
    # Agree first: the rendezvous below waits for every rank.
    if not min_over_ranks(int(available)):
        return False
    reason = None
    _one_shot_taken = True
    try:
        group_name = dist.group.WORLD.group_name
        buffer = symm_mem.empty(ONE_SHOT_MAX_BYTES // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(buffer, group_name)
        probe = torch.full((256,), float(_tp_rank + 1), dtype=dtype, device=device)
        total = torch.ops.symm_mem.one_shot_all_reduce_copy_out(buffer[:256], probe, "sum", group_name,
                                                                torch.empty_like(probe))
        if not bool((total == _tp_size * (_tp_size + 1) / 2).all()):
            reason = "its probe sum came out wrong"
    except Exception as e:
        reason = repr(e)
    if not min_over_ranks(int(reason is None)):
        logger.warning("one-shot all-reduce unavailable (%s): NCCL for every all-reduce", reason or "on another rank")
        return False
    _one_shot = _OneShot(buffer, group_name)
    return True


def one_shot_all_reduce_on() -> bool:
    return _one_shot is not None


def disable_one_shot_all_reduce():
    global _one_shot
    _one_shot = None


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """In place: every rank's x becomes rank 0's (queued on the device like the all-reduces)."""
    if _tp_size > 1:
        dist.broadcast(x, src=0)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard of the last dimension (vocab-parallel logits)."""
    if _tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_tp_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


# ---- process group (tensor parallelism over torch.distributed; used by worker/tp_*.py) ----
# One group per process: rank 0 lives in the caller's process, ranks 1.. in spawned workers.

def init_process_group(rank: int, size: int, port: int, device: torch.device, timeout_s: float):
    """Join the group of `size` ranks that meets at 127.0.0.1:port. On CUDA, collectives on GPU
    tensors go through NCCL and the few control collectives on CPU tensors through gloo; on the
    CPU everything is gloo. The timeout bounds how long a collective waits for a silent peer."""
    from datetime import timedelta
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds each rank's communicator to its current device
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))


_ABORT_WAIT_S = 10.0


def destroy_process_group(abort: bool = False):
    """Leave the group, if any. `abort` after a peer failed while this process may be blocked on
    the device (start-up: NCCL work queued on the GPU would otherwise wait for the dead peer
    forever). The abort itself is waited for at most _ABORT_WAIT_S: some NCCL versions block in it
    (pytorch/pytorch#119215; NCCL 2.28.9 never returned after a peer was SIGKILLed mid-collective),
    and a failure must reach the caller even if the communicator is then left behind."""
    if not dist.is_initialized():
        return
    if not abort:
        dist.destroy_process_group()
        return
    done = threading.Event()

    def leave():
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # no abort for this backend/version: a plain destroy is all there is
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        finally:
            done.set()

    threading.Thread(target=leave, name="nanovllm-tp-abort", daemon=True).start()
    if not done.wait(_ABORT_WAIT_S):
        logger.warning("aborting the tensor-parallel process group did not finish within %.0f s: left behind",
                       _ABORT_WAIT_S)


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's `value` (a CPU collective: gloo on CUDA, too)."""
    if _tp_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
