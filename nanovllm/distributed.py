"""Tensor-parallel state: which rank this process is and how to combine partial results."""
import threading

import torch
import torch.distributed as dist

from nanovllm.logger import init_logger

logger = init_logger(__name__)

_tp_rank = 0
_tp_size = 1


def set_tensor_parallel(rank: int, size: int):
    global _tp_rank, _tp_size
    _tp_rank, _tp_size = rank, size


def tp_rank() -> int:
    return _tp_rank


def tp_size() -> int:
    return _tp_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _tp_size > 1:
        dist.all_reduce(x)
    return x


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
