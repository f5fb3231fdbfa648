"""Kernel tests run on the real GPU when CUDA is present, otherwise under the Triton
interpreter (CPU, small shapes).  TRITON_INTERPRET must be set before any
``@triton.jit`` function is defined, i.e. before ``nanovllm.kernels`` is imported."""

import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # If an earlier conftest/test imported the kernels, they were built for a GPU; drop
    # them so the test modules re-import interpreter versions.
    for _name in [m for m in sys.modules if m.startswith("nanovllm.kernels")]:
        del sys.modules[_name]


@pytest.fixture
def device():
    return torch.device("cuda" if ON_GPU else "cpu")


@pytest.fixture
def gen():
    """CPU generator: inputs are sampled on the CPU, so cases are identical on any device."""
    return torch.Generator().manual_seed(1234)
