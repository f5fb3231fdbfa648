"""Picks the attention backend for a device: above the backends, so that imports run one way
(registry -> backends -> base)."""
import torch

from nanovllm.attention.base import AttentionBackend

BACKENDS = ("torch", "triton")


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from nanovllm.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend()
    if name == "triton":
        if device.type != "cuda":
            raise ValueError("attention_backend='triton' needs a CUDA device")
        from nanovllm.attention.triton_backend import TritonAttentionBackend  # imports Triton: only on a GPU
        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose 'auto', 'torch' or 'triton'")
