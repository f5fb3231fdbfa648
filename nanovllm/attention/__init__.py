from nanovllm.attention.base import AttentionBackend, AttentionMetadata
from nanovllm.attention.registry import get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
