"""Programmatic dependent launch (Hopper and later): our kernels are launched while their
predecessor in the stream is still finishing, so a decode step's ~300 short kernels do not each
pay the launch latency and block scheduling after the previous one has drained.

Every kernel calls `pdl_prologue()` before it reads anything a previous kernel wrote: wait until
the predecessor has completed and its writes are visible (griddepcontrol.wait), then allow the
successor to be launched early. Waiting first keeps the stream's ordering exact for every
kernel, ours or not; only launch and scheduling overlap. What no kernel writes (weights, the
step's inputs copied from the host) may be read before the wait: a kernel launched early starts
only once its predecessor is running past its own wait (or, not launched this way, running at
all), so every older kernel and copy has completed (decode attention reads its block ids and
RMSNorm its weight that way; tests/kernels/test_pdl_order.py holds every kernel to its list).
Launch sites pass `**PDL_LAUNCH`. CUDA graphs keep these edges. Off under the Triton interpreter,
on older GPUs, or with NANOVLLM_PDL=0.
"""
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control
    gdc_wait = gdc_launch_dependents = None


def _enabled() -> bool:
    if gdc_wait is None or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("NANOVLLM_PDL", "1") == "0":
        return False
    try:
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
    except RuntimeError:
        return False


PDL_ENABLED = tl.constexpr(_enabled())
PDL_LAUNCH = {"launch_pdl": True} if PDL_ENABLED else {}


@triton.jit
def pdl_prologue():
    if PDL_ENABLED:
        gdc_wait()
        gdc_launch_dependents()
