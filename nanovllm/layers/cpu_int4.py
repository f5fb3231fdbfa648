"""A GGUF model's 4-bit weights multiplied as they are on the CPU, for decode-sized batches.

At one thread a decode step of the embedded SmolLM2-135M is bound by its weights' bytes streaming from
memory (its 30 layers' bf16 products take 10-13 ms of a ~20 ms step). torch's int4 product
(`_weight_int4pack_mm_for_cpu`, groups of 32 along K: one GGUF block each) reads ~4.5 bits a weight
instead of 16, and beats oneDNN's bf16 product up to INT4_MAX_ROWS rows; larger batches (and prefill)
keep the bf16 weights, which stay loaded.

The kernel takes, per group and output row, a scale s and a zero z in the activations' dtype, as
w = (q - 8) * s + z. A GGUF block's d * q + m is that with s = d, z = m + 8 d, rounded to bf16 here:
the weights differ from the bf16-rounded dequantized ones (the reference path) by about as much as
that rounding does, so greedy tokens agree with the reference for a while, not always.
"""
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

INT4_MAX_ROWS = 2
GROUP = 32


def int4_available() -> bool:
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    y = torch._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_zeros)
    return y if bias is None else y + bias


def pack_int4(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [N, K] (0..15), scale / offset [N, K / 32] (weight = scale * code + offset) -> the kernel's
    packed weight and its [K / 32, N, 2] scales and zeros in dtype."""
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    zero = offset + 8 * scale  # (q - 8) * s + z == s * q + offset
    return packed, torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)


def attach_int4_weights(model: nn.Module, blocks_file: Path, dtype: torch.dtype) -> int:
    """Give each linear layer whose every checkpoint part has 4-bit blocks in blocks_file (q, k, v of a
    fused qkv_proj; gate and up of gate_up_proj) an `int4_weight`. Returns how many got one."""
    if dtype != torch.bfloat16 or not blocks_file.is_file() or not int4_available():
        return 0
    blocks = load_file(str(blocks_file))
    parts_of = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    attached = 0
    for name, module in model.named_modules():
        if not hasattr(module, "int4_weight") or getattr(module, "bias", None) is not None:
            continue
        prefix, _, leaf = name.rpartition(".")
        names = [f"{prefix}.{part}" for part in parts_of.get(leaf, (leaf,))]
        if not all(f"{n}.codes" in blocks for n in names):
            continue
        codes, scale, offset = (torch.cat([blocks[f"{n}.{part}"] for n in names])
                                for part in ("codes", "scale", "offset"))
        module.int4_weight = pack_int4(codes, scale, offset, dtype)
        attached += 1
    return attached
