"""Rotary position embeddings (the rotate-half layout of HF Llama/Qwen), with Llama-3 scaling."""
import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from either transformers 4.x or 5.x style configs."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    theta = getattr(hf_config, "rope_theta", None) or params.get("rope_theta") or scaling.get("rope_theta") or 10000.0
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return float(theta), (merged if rope_type != "default" else None)


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = _inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float)
        freqs = torch.outer(t, inv_freq)
        # [max_position, head_dim]: cos in the first half, sin in the second.
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                q_norm: nn.Module | None = None, k_norm: nn.Module | None = None):
        """q: [T, Hq, D], k: [T, Hkv, D]; q_norm/k_norm: per-head RMSNorms applied first (Qwen3)."""
        if q.is_cuda:  # norms and rotation of q and k in one kernel
            from nanovllm.kernels.rope import qk_norm_rope
            return qk_norm_rope(q, k, positions, self.cos_sin_cache, *norm_args(q_norm, k_norm))
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def forward_store_kv(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                         q_norm: nn.Module | None = None, k_norm: nn.Module | None = None,
                         q_out: torch.Tensor | None = None, kv_scales: tuple | None = None) -> torch.Tensor:
        """forward(), but the new keys and the values v [T, Hkv, D] go straight into the paged cache
        kv_cache = (k_cache, v_cache, slot_mapping) (slots < 0 skipped); returns q (in q_out when
        given). One Triton launch instead of rope + the attention backend's K/V store, for backends
        that read keys only from the cache (AttentionBackend.fuses_kv_store). kv_scales: an FP8
        cache's (k_scale, v_scale)."""
        from nanovllm.kernels.rope import qk_norm_rope_store_kv
        k_scale, v_scale = kv_scales or (None, None)
        return qk_norm_rope_store_kv(q, k, v, positions, self.cos_sin_cache, *kv_cache, *norm_args(q_norm, k_norm),
                                     q_out=q_out, k_scale=k_scale, v_scale=v_scale)


def norm_args(q_norm: nn.Module | None = None, k_norm: nn.Module | None = None) -> tuple:
    """(q_weight, k_weight, eps) of the fused kernels; (None, None, any) without norms."""
    if q_norm is None:
        return None, None, 1e-6
    return q_norm.weight, k_norm.weight, q_norm.eps


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
