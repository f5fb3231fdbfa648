"""Linear layers that know how to load (and shard) their checkpoint weights.

Each parameter carries a `weight_loader(param, loaded_weight, shard_id=None)`; fused layers
(qkv, gate_up) place each checkpoint tensor at its offset, and tensor-parallel layers keep only
their rank's slice, so the model code never sees the sharding. A block-scale parameter
(`block_size` > 1: one entry per block of weight rows and columns) shards and stacks in blocks.

A layer built with a quantization config hands its weights and products to a `LinearMethod`
(layers/quantization); the plain path below is untouched by it.
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed import all_reduce, tp_rank, tp_size
from nanovllm.layers.activation import silu_and_mul
from nanovllm.layers.cpu_int4 import INT4_MAX_ROWS, int4_linear
from nanovllm.layers.cpu_linear import packed_linear


def _divide(a: int, b: int) -> int:
    if a % b:
        raise ValueError(f"{a} is not divisible by tensor_parallel_size={b}")
    return a // b


def _copy(dst: torch.Tensor, src: torch.Tensor):
    if dst.shape != src.shape:
        raise ValueError(f"a checkpoint tensor of shape {tuple(src.shape)} does not fit its parameter's "
                         f"{tuple(dst.shape)}")
    dst.copy_(src)


def _in_blocks(param, offset: int, size: int, start: int) -> tuple[int, int, int]:
    """(offset, size, start) of a slice of weight rows, in the rows of `param` (block scales: one row
    per block; the fused partitions and shards before a slice fill whole blocks)."""
    unit = getattr(param, "block_size", 1)
    if unit == 1:
        return offset, size, start
    return offset // unit, -(-size // unit), start // unit


class LinearBase(nn.Module):
    # oneDNN's packed copy of the weight, which then replaces it (bf16 on the CPU: cpu_linear.py).
    packed_weight: torch.Tensor | None = None
    # A GGUF's 4-bit blocks for decode-sized batches on the CPU: (packed, scales_zeros) (cpu_int4.py).
    int4_weight: tuple[torch.Tensor, torch.Tensor] | None = None
    quant_method = None  # a quantization.LinearMethod owns the weights and products when set
    quant_out = None  # MergedColumnParallelLinear.swiglu: the form of output its consumer takes

    def __init__(self, in_features: int, out_features: int, bias: bool, shard_dim: int | None,
                 quant_config=None, output_partitions: list[int] | None = None):
        super().__init__()
        self.shard_dim = shard_dim  # 0: output dim split across ranks, 1: input dim, None: replicated
        if quant_config is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
            self.weight.weight_loader = self.weight_loader
        else:
            self.quant_method = quant_config.linear_method(torch.get_default_device())
            self.quant_method.create_weights(self, in_features, out_features, output_partitions or [out_features])
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None):
        dim = self.shard_dim
        if dim is not None and dim < loaded.dim() and tp_size() > 1:
            size = param.shape[dim]
            loaded = loaded.narrow(dim, tp_rank() * size, size)
        _copy(param.data, loaded)

    def library_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W^T (+ bias) by the library: torch's int4 product for a few rows of a 4-bit GGUF
        weight, oneDNN with the packed weight, else F.linear."""
        if self.int4_weight is not None and x.shape[0] <= INT4_MAX_ROWS:
            return int4_linear(x, *self.int4_weight, bias)
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, self.bias)
        return self.library_linear(x, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, quant_config=None):
        super().__init__(in_features, out_features, bias, None, quant_config)


def _gemm_kernel_applies(x: torch.Tensor, bias) -> bool:
    """Whether x may take our Triton GEMM (kernels/gemm.py): a 2-D half-precision batch on the GPU
    and no bias. Its tables then decide by size."""
    return bias is None and x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16)


def _dense_config(x: torch.Tensor, weight: torch.Tensor, bias, gated: bool = False):
    """The dense / gated kernel's configuration for x, or None (then cuBLAS)."""
    if not _gemm_kernel_applies(x, bias):
        return None
    from nanovllm.kernels.gemm import dense_config
    return dense_config(x.shape[0], weight.shape[0], x.shape[1], gated)


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, quant_config=None,
                 output_partitions: list[int] | None = None):
        super().__init__(in_features, _divide(out_features, tp_size()), bias, 0, quant_config, output_partitions)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, self.bias)
        config = _dense_config(x, self.weight, self.bias)
        if config is not None:
            from nanovllm.kernels.gemm import dense_linear
            return dense_linear(x, self.weight, config)
        return self.library_linear(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (gate_up)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, quant_config=None):
        self.output_sizes = output_sizes
        n = tp_size()
        super().__init__(in_features, sum(output_sizes), bias, quant_config, [_divide(s, n) for s in output_sizes])

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for a [gate, up] projection: one kernel for decode batches on the GPU
        (the [M, 2I] product never reaches memory), else the product then SiLU-and-mul. A quantized
        layer returns its output in the form `quant_out` names (block FP8 for an FP8 down_proj)."""
        assert len(self.output_sizes) == 2 and self.output_sizes[0] == self.output_sizes[1]
        if self.quant_method is not None:
            return self.quant_method.apply_swiglu(self, x)
        config = _dense_config(x, self.weight, self.bias, gated=True)
        if config is not None:
            from nanovllm.kernels.gemm import gated_linear
            return gated_linear(x, self.weight, config)
        return silu_and_mul(self.library_linear(x, self.bias))

    def weight_loader(self, param, loaded, shard_id: int):
        n = tp_size()
        offset = sum(self.output_sizes[:shard_id]) // n
        size = self.output_sizes[shard_id] // n
        offset, size, start = _in_blocks(param, offset, size, tp_rank() * size)
        _copy(param.data.narrow(0, offset, size), loaded.narrow(0, start, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused. With fewer KV heads than ranks, KV heads are replicated."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 quant_config=None):
        n = tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, n)
        self.num_kv_heads = max(1, num_kv_heads // n) if num_kv_heads < n else _divide(num_kv_heads, n)
        self.kv_replicas = max(1, n // num_kv_heads)
        q_size, kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        LinearBase.__init__(self, hidden_size, q_size + 2 * kv_size, bias, 0, quant_config, [q_size, kv_size, kv_size])

    def rope_store_kv(self, x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                      kv_cache: tuple, q_weight=None, k_weight=None, eps: float = 1e-6,
                      q_out: torch.Tensor | None = None, kv_scales: tuple | None = None) -> torch.Tensor | None:
        """The projection, the q/k norms (Qwen3), the rotation and the K/V store in one kernel for
        the decode batches our GEMM serves (kernels/qkv_rope.py): returns q [T, Hq, D] with k and v
        in kv_cache = (k_cache, v_cache, slot_mapping), q into q_out when given; None (nothing done)
        elsewhere (and for a quantized layer: no FP8 form of this kernel yet). kv_scales: an FP8
        cache's (k_scale, v_scale)."""
        if self.quant_method is not None or not _gemm_kernel_applies(x, self.bias):
            return None
        from nanovllm.kernels.qkv_rope import qkv_rope_store_kv
        k_scale, v_scale = kv_scales or (None, None)
        return qkv_rope_store_kv(x, self.weight, self.num_heads, self.num_kv_heads, positions, cos_sin_cache,
                                 *kv_cache, q_weight, k_weight, eps, q_out=q_out, k_scale=k_scale, v_scale=v_scale)

    def weight_loader(self, param, loaded, shard_id: str):
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            offset, size, rank = 0, q_size, tp_rank()
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, rank = kv_size, tp_rank() // self.kv_replicas
        offset, size, start = _in_blocks(param, offset, size, rank * size)
        _copy(param.data.narrow(0, offset, size), loaded.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    """Input dim split across ranks; partial products are summed with one all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, quant_config=None):
        super().__init__(_divide(in_features, tp_size()), out_features, bias, 1, quant_config)

    def forward(self, x: torch.Tensor, partials_ok: bool = False):
        """partials_ok: the caller feeds the result to a fused residual-add RMSNorm, which can
        sum split-K partials itself; small (decode) batches on the GPU then return a
        `SplitKOutput` instead of a tensor (kernels/gemm.py says why)."""
        if self.quant_method is not None:
            if tp_size() == 1:
                return self.quant_method.apply(self, x, self.bias, partials_ok=partials_ok)
            return all_reduce(self.quant_method.apply(self, x, self.bias if tp_rank() == 0 else None))
        if partials_ok and tp_size() == 1 and _gemm_kernel_applies(x, self.bias):
            from nanovllm.kernels.gemm import splitk_linear
            parts = splitk_linear(x, self.weight)
            if parts is not None:
                return parts
        # Bias is added once, after the reduction.
        y = self.library_linear(x, self.bias if tp_rank() == 0 else None)
        return all_reduce(y)
