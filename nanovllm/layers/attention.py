import torch
from torch import nn

from nanovllm.attention.base import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    """One layer's attention over the paged KV cache. The model runner binds the layer's cache
    slices and the backend once at start-up; the per-step metadata arrives as an argument."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.k_cache = self.v_cache = torch.tensor([])
        self.backend: AttentionBackend | None = None
        # An FP8 cache stores k / k_scale and v / v_scale per KV head of this rank (a checkpoint's
        # `self_attn.k_scale` / `v_scale`, else 1.0); `kv_scales` is (k_scale, v_scale) while the bound
        # cache is FP8, None otherwise (the model runner sets it with the cache).
        self.register_buffer("k_scale", torch.ones(num_kv_heads, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(num_kv_heads, dtype=torch.float32), persistent=False)
        self.kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def fuses_kv_store(self) -> bool:
        return self.backend.fuses_kv_store

    def forward(self, q, k, v, meta: AttentionMetadata, kv_stored: bool = False) -> torch.Tensor:
        # q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq * D]. kv_stored: the caller already wrote the
        # new k/v into (k_cache, v_cache) at meta.slot_mapping (fuses_kv_store); k/v may be None.
        o = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale, kv_stored,
                                 kv_scales=self.kv_scales)
        return o.flatten(-2)
