"""The seam between linear layers and weight quantization.

A linear layer built with a `LinearMethod` hands it its weights: the method creates the layer's
parameters (each with its `weight_loader`, so checkpoints load and shard as for plain weights),
finishes them once loading is done, and computes the layer's products. A layer without one (the
default) keeps its plain weight and its own tuned paths, untouched. A method may take its input
already quantized (`input_quant`): the kernel that produces the layer's input (the RMSNorm before
qkv and gate_up, the SwiGLU before down) then hands it over in that form.

A fused-MoE layer takes quantized experts the same way (`QuantizationConfig.experts_method`): the
method creates the [E, N, K] expert weights with their [E, ceil(N/128), ceil(K/128)] scales (the
layer gives each its `weight_loader`) and finishes them once loaded; the layer then reads
`experts.quant_method` to pick its kernels (block FP8: kernels/moe_gemm.py's W8A8 form).
"""
from typing import NamedTuple

import torch


class ActivationQuant(NamedTuple):
    """Activations quantized in groups of `group_size` consecutive values of a row, one scale each."""
    dtype: torch.dtype
    group_size: int


class LinearMethod:
    input_quant: ActivationQuant | None = None  # what a producer may hand over instead of a plain tensor

    def create_weights(self, layer: torch.nn.Module, in_features: int, out_features: int,
                       output_partitions: list[int]):
        """Register the layer's parameters for an [out_features, in_features] weight on this rank,
        whose output rows are the fused projections `output_partitions` (one entry if not fused)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: torch.nn.Module):
        """Called once every parameter is loaded (or randomly filled)."""

    def apply(self, layer: torch.nn.Module, x, bias: torch.Tensor | None, partials_ok: bool = False):
        """x @ W^T (+ bias). partials_ok: as RowParallelLinear.forward's (a `SplitKOutput` may come back)."""
        raise NotImplementedError

    def apply_swiglu(self, layer: torch.nn.Module, x):
        """silu(x @ gate^T) * (x @ up^T) for a [gate | up] projection, in the form `layer.quant_out` asks."""
        raise NotImplementedError


def input_quant(layer: torch.nn.Module | None) -> ActivationQuant | None:
    """The input form a (quantized) layer takes directly; None for plain layers."""
    method = getattr(layer, "quant_method", None)
    return None if method is None else method.input_quant


class QuantizationConfig:
    """A checkpoint's (or the user's) quantization, parsed and validated; picklable (tensor-parallel
    workers get a copy with the engine's Config)."""
    name: str = "base"

    def linear_method(self, device: torch.device) -> LinearMethod:
        raise NotImplementedError

    def experts_method(self, device: torch.device):
        """The method of a fused-MoE layer's stacked experts (`create_weights(experts, shapes)`,
        `process_weights_after_loading(experts)`)."""
        raise NotImplementedError
