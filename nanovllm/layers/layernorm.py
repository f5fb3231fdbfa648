import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 like the HF reference; with a residual, the add is fused in and
    the updated residual returned (pre-norm transformer blocks)."""

    # The input form of the quantized projection this norm feeds (layers/quantization): on the GPU
    # the norm's kernel then writes its output in that form (block FP8) instead of the plain tensor.
    quant_out = None

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps)).to(dtype)

    def forward(self, x, residual: torch.Tensor | None = None):
        """x: a tensor, or (on the GPU, with a residual) a `SplitKOutput` whose partials the fused
        kernel sums."""
        if (x if residual is None else residual).is_cuda:  # one fused kernel instead of ~8 elementwise ones
            if self.quant_out is not None:
                from nanovllm.kernels.fp8_quant import fused_add_rms_norm_quant
                out, residual = fused_add_rms_norm_quant(x, residual, self.weight, self.eps)
                return out if residual is None else (out, residual)
            from nanovllm.kernels.fused_ops import fused_add_rms_norm, rms_norm
            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        dtype = x.dtype
        if residual is None:
            return self._norm(x.float(), dtype)
        x = x.float() + residual.float()
        residual = x.to(dtype)
        return self._norm(x, dtype), residual
