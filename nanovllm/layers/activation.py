import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [gate | up] projection: ``F.silu(x[..., :I]) * x[..., I:]``."""
    if x.is_cuda:
        from nanovllm.kernels.fused_ops import silu_and_mul as fused
        return fused(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """SwiGLU on a fused [gate | up] projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
