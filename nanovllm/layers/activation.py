import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [gate | up] projection: silu(x[..., :I]) * x[..., I:]."""
    if x.is_cuda:
        from nanovllm.kernels.fused_ops import silu_and_mul as fused
        return fused(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
