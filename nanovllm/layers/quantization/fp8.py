"""Block-quantized FP8 linear layers: the Qwen3-*-FP8 / DeepSeek-V3 checkpoint format.

config.json: ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
"dynamic", "weight_block_size": [128, 128]}``. Each linear layer has ``weight`` [N, K] in
float8_e4m3fn and ``weight_scale_inv`` [ceil(N/128), ceil(K/128)] (fp32 or bf16): the real weight is
``weight * weight_scale_inv`` per 128 x 128 block, partial blocks at the edges. Embeddings, norms and
the LM head stay in the model dtype. Activations are quantized at run time in 1 x 128 groups.

Fused projections (qkv, gate_up) stack their checkpoint tensors, so every partition but the last must
fill whole blocks, and a tensor-parallel shard must start at a block boundary (vLLM's rule): the
scales then shard and stack like the weights, a block's row of scales at a time.

On a GPU with FP8 tensor cores (sm_89+) the layer keeps its FP8 weight and runs kernels/fp8_gemm.py;
elsewhere (the CPU) the weight is dequantized once at load, exactly ``weight * scale`` in fp32, and the
layer becomes a plain one. Without an FP8 checkpoint (random weights for benchmarks, or a bf16
checkpoint with ``quantization="fp8"``) each weight is quantized to this format once loaded.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed import tp_size
from nanovllm.layers.quantization.base import ActivationQuant, LinearMethod, QuantizationConfig

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
_SUPPORTED = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
# Lists of modules a checkpoint leaves unquantized: the LM head, embeddings and norms never are here;
# a linear layer left in bf16 is caught at load (its weight is not float8).
_SKIP_LISTS = ("modules_to_not_convert", "ignored_layers")


def quantize_weight_blocks(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8_e4m3fn [N, K], fp32 scales [ceil(N/block), ceil(K/block)]) with
    w ~= q * scale per block: scale = max|w| / 448 over the block (partial blocks at the edges)."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = F.pad(w.float(), (0, kb * block - k, 0, nb * block - n)).view(nb, block, kb, block)
    scale = padded.abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX
    q = (padded / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nb * block, kb * block)[:n, :k].contiguous(), scale


def dequantize_weight_blocks(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """float8 [N, K] with its block scales -> fp32 [N, K] = q * scale."""
    n, k = q.shape
    s = scale.float().repeat_interleave(block, dim=0)[:n].repeat_interleave(block, dim=1)[:, :k]
    return q.float() * s


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked experts [E, N, K] -> (float8_e4m3fn [E, N, K], fp32 [E, ceil(N/128), ceil(K/128)]), an expert
    at a time (`quantize_weight_blocks`)."""
    pairs = [quantize_weight_blocks(w[e]) for e in range(w.shape[0])]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def dequantize_experts(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse: [E, N, K] in dtype, exactly q * scale per block, an expert at a time (no fp32 copy of all)."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    for e in range(q.shape[0]):
        out[e] = dequantize_weight_blocks(q[e], scale[e]).to(dtype)
    return out


@dataclass(frozen=True)
class Fp8Config(QuantizationConfig):
    """Block FP8 with [128, 128] weight blocks and dynamic 1 x 128 activation groups.
    from_checkpoint: the checkpoint stores float8 weights and their scales (else weights are
    quantized once loaded or randomly filled)."""
    from_checkpoint: bool
    name = "fp8"

    @classmethod
    def parse(cls, quantization_config, from_checkpoint: bool) -> "Fp8Config":
        """Validate a checkpoint's quantization_config (a dict): a clear error naming any field we
        cannot honour."""
        qc = quantization_config
        if not isinstance(qc, dict):
            raise ValueError(f"quantization_config must be a mapping, got {qc!r}")
        for key, want in _SUPPORTED.items():
            got = qc.get(key)
            if key == "weight_block_size" and got is not None:
                got = list(got)
            if got != want:
                if key == "weight_block_size" and got is None:
                    raise ValueError("quantization_config.weight_block_size is missing: only block-quantized FP8 "
                                     f"checkpoints are supported (weight_block_size {want}), not per-tensor FP8")
                raise ValueError(f"quantization_config.{key}={qc.get(key)!r} is not supported; supported: {want!r} "
                                 "(block-quantized float8_e4m3fn weights, activations quantized at run time)")
        unknown = sorted(set(qc) - set(_SUPPORTED) - set(_SKIP_LISTS))
        if unknown:
            raise ValueError(f"quantization_config has field(s) {unknown} that this engine does not support; "
                             f"known: {sorted([*_SUPPORTED, *_SKIP_LISTS])}")
        return cls(from_checkpoint)

    def linear_method(self, device: torch.device) -> "Fp8LinearMethod":
        return Fp8LinearMethod(self, device)

    def experts_method(self, device: torch.device) -> "Fp8ExpertsMethod":
        return Fp8ExpertsMethod(self, device)


def fp8_kernels_available(device: torch.device) -> bool:
    """FP8 tensor cores (sm_89+): our W8A8 kernels run there; elsewhere weights are dequantized."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _check_partitions(layer: nn.Module, in_features: int, partitions: list[int]):
    """Shard and fusion boundaries must fall on 128-block boundaries (layer level; models/llama.py's
    `check_block_quantization` names the config fields before any process starts)."""
    n = tp_size()
    where = f" per rank (tensor_parallel_size={n})" if n > 1 else ""
    if layer.shard_dim == 1 and n > 1 and in_features % BLOCK:
        raise ValueError(f"block-FP8 {type(layer).__name__}: its input is split into {in_features} columns per rank "
                         f"(tensor_parallel_size={n}), not a multiple of the weight block size {BLOCK}: a shard "
                         "boundary would fall inside a 128x128 block")
    if layer.shard_dim == 0:
        for size in partitions if n > 1 else partitions[:-1]:
            if size % BLOCK:
                raise ValueError(f"block-FP8 {type(layer).__name__}: an output partition of {size} rows{where} is "
                                 f"not a multiple of the weight block size {BLOCK}: a shard or fused-projection "
                                 "boundary would fall inside a 128x128 block")


class Fp8LinearMethod(LinearMethod):
    def __init__(self, config: Fp8Config, device: torch.device):
        self.config = config
        self.kernels = fp8_kernels_available(device)
        self.input_quant = ActivationQuant(FP8_DTYPE, BLOCK) if self.kernels else None
        self.library = False  # whether prefill-sized products take torch._scaled_mm (set once loaded)
        self.dtype = torch.get_default_dtype()  # the model's activation dtype (build_model sets it)

    def create_weights(self, layer, in_features, out_features, output_partitions):
        _check_partitions(layer, in_features, output_partitions)
        if not self.config.from_checkpoint:  # filled like a plain weight, quantized once loaded
            layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
            layer.weight.weight_loader = layer.weight_loader
            return
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        layer.weight.weight_loader = _fp8_weight_loader(layer)
        scale = torch.empty(-(-out_features // BLOCK), -(-in_features // BLOCK), dtype=torch.float32)
        layer.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        layer.weight_scale_inv.weight_loader = layer.weight_loader
        layer.weight_scale_inv.block_size = BLOCK  # one scale per 128 weight rows and columns

    @torch.no_grad()
    def process_weights_after_loading(self, layer):
        if self.config.from_checkpoint:
            w, scale = layer.weight.data, layer.weight_scale_inv.data
        else:
            w, scale = quantize_weight_blocks(layer.weight.data)
        if not self.kernels:  # a plain layer from here on
            layer.weight = nn.Parameter(dequantize_weight_blocks(w, scale).to(self.dtype), requires_grad=False)
            if self.config.from_checkpoint:
                del layer.weight_scale_inv
            layer.quant_method = None
            return
        layer.weight = nn.Parameter(w.contiguous(), requires_grad=False)
        layer.weight_scale_inv = nn.Parameter(scale.float().contiguous(), requires_grad=False)
        from nanovllm.kernels.fp8_gemm import library_applies
        self.library = library_applies(layer.weight)

    def _quantized(self, x):
        from nanovllm.kernels.fp8_quant import QuantizedActivation, per_token_group_quant
        return x if isinstance(x, QuantizedActivation) else per_token_group_quant(x)

    def apply(self, layer, x, bias, partials_ok=False):
        from nanovllm.kernels import fp8_gemm
        x = self._quantized(x)
        w, scale = layer.weight, layer.weight_scale_inv
        m = x.rows
        if partials_ok and bias is None:
            config = fp8_gemm.fp8_splitk_config(m, w.shape[1])
            if config is not None:
                return fp8_gemm.fp8_partial_linear(x, w, scale, config)
        if self.library and fp8_gemm.library_takes(x):
            return fp8_gemm.library_scaled_mm(x, w, scale, bias)
        y = fp8_gemm.fp8_linear(x, w, scale, fp8_gemm.fp8_dense_config(m, w.shape[0]))
        return y if bias is None else y.add_(bias)

    def apply_swiglu(self, layer, x):
        from nanovllm.kernels import fp8_gemm
        from nanovllm.kernels.fp8_quant import silu_and_mul_quant
        x = self._quantized(x)
        w, scale = layer.weight, layer.weight_scale_inv
        quant_out = layer.quant_out is not None  # down_proj takes block-FP8 input
        if self.library and fp8_gemm.library_takes(x):
            gate_up = fp8_gemm.library_scaled_mm(x, w, scale)
            if quant_out:
                return silu_and_mul_quant(gate_up)
            from nanovllm.layers.activation import silu_and_mul
            return silu_and_mul(gate_up)
        return fp8_gemm.fp8_gated_linear(x, w, scale, fp8_gemm.fp8_gated_config(x.rows), quantize_output=quant_out)


def _fp8_weight_loader(layer: nn.Module):
    """The layer's own loader, for float8 checkpoint tensors only."""
    def load(param, loaded, *shard_id):
        if loaded.dtype != FP8_DTYPE:
            raise ValueError(f"FP8 checkpoint: a {type(layer).__name__} weight is stored as {loaded.dtype}, not "
                             "float8_e4m3fn; linear layers left unquantized in an FP8 checkpoint are not supported")
        layer.weight_loader(param, loaded, *shard_id)
    return load


class Fp8ExpertsMethod:
    """Block-FP8 experts of a fused-MoE layer (layers/fused_moe.py `StackedExperts`): each stacked
    [E, N, K] weight loads as float8 with its [E, ceil(N/128), ceil(K/128)] scales, one expert's
    projection at a time (`StackedExperts.weight_loader` / `scale_loader`). On a GPU with FP8 tensor
    cores the experts stay float8 (`kernels`) and the layer runs the grouped W8A8 GEMMs of
    kernels/moe_gemm.py; elsewhere (the CPU) they are dequantized once loaded, exactly ``weight *
    scale``, into the model dtype, and the layer runs HF's arithmetic. Without an FP8 checkpoint
    (random weights, or a 16-bit one with ``quantization="fp8"``) each expert is quantized once
    loaded (on the CPU rounded through the format in place)."""

    def __init__(self, config: Fp8Config, device: torch.device):
        self.config = config
        self.kernels = fp8_kernels_available(device)
        self.dtype = torch.get_default_dtype()  # the model's activation dtype (build_model sets it)

    def create_weights(self, experts: nn.Module, shapes: dict[str, tuple[int, int, int]]):
        """shapes: stacked parameter name -> [E, N, K] on this rank."""
        for name, (e, n, k) in shapes.items():
            if not self.config.from_checkpoint:
                setattr(experts, name, nn.Parameter(torch.empty(e, n, k), requires_grad=False))
                continue
            setattr(experts, name, nn.Parameter(torch.empty(e, n, k, dtype=FP8_DTYPE), requires_grad=False))
            scale = nn.Parameter(torch.empty(e, -(-n // BLOCK), -(-k // BLOCK), dtype=torch.float32),
                                 requires_grad=False)
            scale.block_size = BLOCK
            setattr(experts, name + "_scale_inv", scale)

    @torch.no_grad()
    def process_weights_after_loading(self, experts: nn.Module):
        for name in ("w13", "w2"):
            param = getattr(experts, name)
            if self.kernels:  # float8 weights and fp32 scales, as the grouped kernels read them
                if self.config.from_checkpoint:
                    q, scale = param.data, getattr(experts, name + "_scale_inv").data.float()
                else:  # the 16-bit weights, then their quantized copy
                    q, scale = quantize_experts(param.data)
                setattr(experts, name, nn.Parameter(q.contiguous(), requires_grad=False))
                setattr(experts, name + "_scale_inv", nn.Parameter(scale.contiguous(), requires_grad=False))
                continue
            if not self.config.from_checkpoint:  # in place, an expert at a time: no second copy
                for e in range(param.shape[0]):
                    param.data[e] = dequantize_weight_blocks(*quantize_weight_blocks(param.data[e])).to(param.dtype)
                continue
            out = dequantize_experts(param.data, getattr(experts, name + "_scale_inv").data, self.dtype)
            setattr(experts, name, nn.Parameter(out, requires_grad=False))
            delattr(experts, name + "_scale_inv")
        if not self.kernels:
            experts.quant_method = None
