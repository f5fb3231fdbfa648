"""A GGUF file's 4-bit blocks (Q4_0, Q4_1) as they are, for the CPU's int4 products (layers/cpu_int4.py).

A block holds 32 consecutive weights of a row: fp16 scale d (Q4_1: and fp16 minimum m), then 16 bytes
of 4-bit codes q, weight j in the low nibble of byte j and weight j + 16 in the high one. The weight
is d * q + m (Q4_1) or d * (q - 8) (Q4_0), which `gguf.quants.dequantize` computes the same way.
"""
import numpy as np

BLOCK = 32
# In a converted model, beside (not among) its *.safetensors weights: "{HF linear name}.codes|scale|offset"
Q4_BLOCKS_FILE = "gguf_q4/blocks.safetensors"
# GGMLQuantizationType's values (Q4_0 = 2, Q4_1 = 3) rather than the enum: the model runner imports this
# module, and an engine that loads safetensors must not need the gguf package.
_Q4_0, _Q4_1 = 2, 3
_HEADER_BYTES = {_Q4_0: 2, _Q4_1: 4}


def is_q4(tensor) -> bool:
    return tensor.tensor_type in _HEADER_BYTES


def q4_blocks(tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes uint8 [N, K] in 0..15, scale fp32 [N, K / 32], offset fp32 [N, K / 32]): weight [n, k] =
    scale[n, k // 32] * codes[n, k] + offset[n, k // 32], exactly as the file's dequantization."""
    header = _HEADER_BYTES[tensor.tensor_type]
    n, k = int(tensor.shape[1]), int(tensor.shape[0])  # GGUF lists dimensions fastest-first
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(n, k // BLOCK, header + BLOCK // 2)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if tensor.tensor_type == _Q4_1:
        offset = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        offset = -8 * scale
    packed = blocks[..., header:]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(n, k)
    return codes, scale, offset
