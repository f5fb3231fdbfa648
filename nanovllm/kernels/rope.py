"""Per-head q/k RMSNorm (Qwen3's q_norm / k_norm) and the rotary embedding (rotate-half layout) in one
launch, optionally writing the new keys and the values straight into the paged KV cache (an FP8 cache:
quantized by its per-head scales on the way).

The arithmetic and its rounding points are the plain-torch layers' (``nanovllm/layers/{layernorm,rotary}.py``),
as in fused_ops.py (whose launch options, without FP contraction, these kernels share): nearly every element is
bit-identical to the eager path. `norm_rope_math` is also the epilogue of the fused qkv projection
(kernels/qkv_rope.py).
"""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fp8 import FP8_DTYPE, quantize_to_fp8
from nanovllm.kernels.fused_ops import _launch_opts
from nanovllm.kernels.pdl import PDL_LAUNCH, pdl_prologue


@triton.jit
def _head_tile(h0, H, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, G: tl.constexpr):
    # (int64 head indices, column indices, mask) of the [G, BLOCK_HALF] tile of heads [h0, h0+G)
    h = h0 + tl.arange(0, G)
    d = tl.arange(0, BLOCK_HALF)
    if BLOCK_HALF == HALF:  # don't mask along the contiguous dim unless it is padded
        mask = (h < H)[:, None]
    else:
        mask = (h < H)[:, None] & (d < HALF)[None, :]
    return h.to(tl.int64)[:, None], d[None, :], mask


@triton.jit
def norm_rope_math(x1, x2, w_ptr, d, cos, sin, eps, IN_TY: tl.constexpr, HAS_NORM: tl.constexpr,
                    HALF: tl.constexpr, ROWS: tl.constexpr, OUT_TY: tl.constexpr):
    # [ROWS, BLOCK_HALF] fp32 halves of ROWS heads (x1 = dims [0, HALF), x2 = [HALF, D)), as read
    # from IN_TY values -> (out1, out2) in fp32, for the caller to round to OUT_TY. Working on the
    # two rotate-half halves separately, the rotation needs no register shuffles.
    if HAS_NORM:
        # RMSNorm over the head dim, rounded like RMSNorm._norm: fp32 normalise -> input dtype
        # -> times weight (exact in fp32) -> rounded to the output dtype; rope then reads that.
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        var = tl.div_rn(ss, tl.full([ROWS], 2 * HALF, tl.float32))  # same shape: see _rms_norm_kernel
        r = tl.rsqrt(var + eps)[:, None]
        wmask = d < HALF
        w1 = tl.load(w_ptr + d, mask=wmask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d, mask=wmask, other=0.0).to(tl.float32)
        x1 = ((x1 * r).to(IN_TY).to(tl.float32) * w1).to(OUT_TY).to(tl.float32)
        x2 = ((x2 * r).to(IN_TY).to(tl.float32) * w2).to(OUT_TY).to(tl.float32)
    # The same fp32 ops as rotary._rotate (no FMA contraction: enable_fp_fusion=False).
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _norm_rope_heads(
    src, dst, w_ptr, stride_h, stride_dh, h0, H, cos, sin, eps, scale_ptr,
    HAS_NORM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, G: tl.constexpr,
    OUT_TY: tl.constexpr, KV_FP8: tl.constexpr,
):
    # Heads [h0, h0+G) of one token. OUT_TY is the dtype of qk_norm_rope's output, where the
    # results are rounded; dst may be a KV cache of another dtype, which then gets that rounded
    # value cast again (as store_kv does), or (KV_FP8) divided by its head's scale_ptr entry in FP8.
    h, d, mask = _head_tile(h0, H, HALF, BLOCK_HALF, G)
    p1 = src + h * stride_h + d
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = norm_rope_math(x1, x2, w_ptr, d, cos, sin, eps, src.dtype.element_ty, HAS_NORM, HALF, G, OUT_TY)
    q1 = dst + h * stride_dh + d
    if KV_FP8:
        s = tl.load(scale_ptr + h, mask=h < H, other=1.0)
        tl.store(q1, quantize_to_fp8(o1.to(OUT_TY).to(tl.float32), s), mask=mask)
        tl.store(q1 + HALF, quantize_to_fp8(o2.to(OUT_TY).to(tl.float32), s), mask=mask)
    else:
        tl.store(q1, o1.to(OUT_TY).to(dst.dtype.element_ty), mask=mask)
        tl.store(q1 + HALF, o2.to(OUT_TY).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _copy_heads(src, dst, stride_h, stride_dh, h0, H, scale_ptr,
                HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, G: tl.constexpr, KV_FP8: tl.constexpr):
    # Heads [h0, h0+G) of one token, cast to dst's dtype (KV_FP8: divided by the head's scale_ptr
    # entry, in FP8); in halves, so it shares the rope tile.
    h, d, mask = _head_tile(h0, H, HALF, BLOCK_HALF, G)
    p1 = src + h * stride_h + d
    q1 = dst + h * stride_dh + d
    if KV_FP8:
        s = tl.load(scale_ptr + h, mask=h < H, other=1.0)
        tl.store(q1, quantize_to_fp8(tl.load(p1, mask=mask).to(tl.float32), s), mask=mask)
        tl.store(q1 + HALF, quantize_to_fp8(tl.load(p1 + HALF, mask=mask).to(tl.float32), s), mask=mask)
    else:
        tl.store(q1, tl.load(p1, mask=mask).to(dst.dtype.element_ty), mask=mask)
        tl.store(q1 + HALF, tl.load(p1 + HALF, mask=mask).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, qw_ptr, kw_ptr, pos_ptr, cs_ptr,
    v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,  # STORE_KV only (the scales: KV_FP8 only)
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    stride_vt, stride_vh, stride_cb, stride_ct, stride_ch, block_size,  # STORE_KV only
    HQ, HKV, eps,
    HAS_NORM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    G: tl.constexpr, NQG: tl.constexpr, STORE_KV: tl.constexpr, KV_FP8: tl.constexpr,
):
    # grid = (T, NQG + NKG): axis 1 picks a group of G heads, the first NQG groups are q's.
    # One launch for q and k; the token's cos/sin row is loaded once per program. Positions and
    # the cos/sin table are step inputs and constants: read before the programmatic-launch wait.
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    cmask = d < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + d, mask=cmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d, mask=cmask, other=0.0).to(tl.float32)[None, :]
    pdl_prologue()
    out_ty = qo_ptr.dtype.element_ty  # q's and k's output dtype (the same)
    if g < NQG:
        _norm_rope_heads(q_ptr + t * stride_qt, qo_ptr + t * stride_qot, qw_ptr, stride_qh, stride_qoh,
                         g * G, HQ, cos, sin, eps, qw_ptr, HAS_NORM, HALF, BLOCK_HALF, G, out_ty, False)
    else:
        h0 = (g - NQG) * G
        if STORE_KV:
            # The attention kernels read keys only from the cache: write them there directly,
            # with the token's values (store_kv_cache's job, saving its launch). int64: slot *
            # stride can exceed 2^31. Slot < 0 marks a padding row of a CUDA-graph batch.
            slot = tl.load(slot_ptr + t).to(tl.int64)
            if slot >= 0:
                row = (slot // block_size) * stride_cb + (slot % block_size) * stride_ct
                _norm_rope_heads(k_ptr + t * stride_kt, kc_ptr + row, kw_ptr, stride_kh, stride_ch,
                                 h0, HKV, cos, sin, eps, ks_ptr, HAS_NORM, HALF, BLOCK_HALF, G, out_ty, KV_FP8)
                _copy_heads(v_ptr + t * stride_vt, vc_ptr + row, stride_vh, stride_ch,
                            h0, HKV, vs_ptr, HALF, BLOCK_HALF, G, KV_FP8)
        else:
            _norm_rope_heads(k_ptr + t * stride_kt, ko_ptr + t * stride_kot, kw_ptr, stride_kh, stride_koh,
                             h0, HKV, cos, sin, eps, kw_ptr, HAS_NORM, HALF, BLOCK_HALF, G, out_ty, False)


def _head_out(out, x, dtype):
    if out is None:
        return torch.empty(x.shape, dtype=dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == dtype and out.stride(-1) == 1, (out.shape, out.dtype)
    return out


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _qk_norm_rope_launch(q, k, positions, cos_sin_cache, q_weight, k_weight, eps, q_out, k_out, kv_store):
    # kv_store: None, or (v, k_cache, v_cache, slot_mapping, k_scale, v_scale) to send k and v to the
    # cache (the scales: an FP8 cache's, else None).
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2]
    assert q.dtype == k.dtype, (q.dtype, k.dtype)
    t, hq, dim = q.shape
    hkv = k.shape[1]
    assert dim % 2 == 0 and cos_sin_cache.shape[-1] == dim, (dim, cos_sin_cache.shape)
    assert positions.numel() == t, (positions.shape, t)
    has_norm = q_weight is not None
    assert has_norm == (k_weight is not None), "pass both q_weight and k_weight, or neither"
    out_dtype = q.dtype
    if has_norm:
        assert q_weight.shape == (dim,) and k_weight.shape == (dim,)
        assert q_weight.dtype == k_weight.dtype, (q_weight.dtype, k_weight.dtype)
        out_dtype = torch.promote_types(q.dtype, q_weight.dtype)
        q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    q, k = _unit_last(q), _unit_last(k)
    q_out = _head_out(q_out, q, out_dtype)
    if kv_store is None:
        k_out = ko = _head_out(k_out, k, out_dtype)
        v = k_cache = v_cache = slots = q  # STORE_KV=False never reads them; any valid pointers
        store_strides = (0,) * 6
        kv_fp8, k_scale, v_scale = False, q, q
    else:
        v, k_cache, v_cache, slots, k_scale, v_scale = kv_store
        kv_fp8 = k_cache.dtype == FP8_DTYPE
        assert not kv_fp8 or (k_scale is not None and v_scale is not None), "an FP8 cache needs k_scale and v_scale"
        if not kv_fp8:
            k_scale = v_scale = q  # KV_FP8=False never reads them
        assert v.shape == k.shape and slots.numel() == t, (v.shape, k.shape, slots.shape)
        assert k_cache.shape[2:] == (hkv, dim) and v_cache.shape == k_cache.shape, (k_cache.shape, v_cache.shape)
        # One set of strides for both caches (the runner makes them as views of one tensor).
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1, (k_cache.stride(), v_cache.stride())
        v, slots = _unit_last(v), slots.reshape(-1).contiguous()
        k_out, ko = None, q_out  # STORE_KV=True never writes ko; any valid pointer
        store_strides = (v.stride(0), v.stride(1), *k_cache.stride()[:3], k_cache.shape[1])
    if t == 0:
        return q_out, k_out
    positions = positions.reshape(-1)
    if positions.stride(0) != 1:
        positions = positions.contiguous()
    assert cos_sin_cache.stride(-1) == 1
    half = dim // 2
    block_half = triton.next_power_of_2(half)
    # ~1024 elements of a [G heads, D] tile per program (Qwen3: 8 heads of 128 -> 3 programs per
    # token), capped by the head count so small-head models don't launch idle lanes.
    g = min(max(1, 1024 // (2 * block_half)), triton.next_power_of_2(max(hq, hkv)))
    nqg, nkg = triton.cdiv(hq, g), triton.cdiv(hkv, g)
    if not has_norm:  # HAS_NORM=False never reads them; any valid pointer will do
        q_weight = k_weight = cos_sin_cache
    _qk_norm_rope_kernel[(t, nqg + nkg)](
        q, k, q_out, ko, q_weight, k_weight, positions, cos_sin_cache,
        v, k_cache, v_cache, slots, k_scale, v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), ko.stride(0), ko.stride(1), cos_sin_cache.stride(0),
        *store_strides,
        hq, hkv, float(eps),
        HAS_NORM=has_norm, HALF=half, BLOCK_HALF=block_half, G=g, NQG=nqg, STORE_KV=kv_store is not None,
        KV_FP8=kv_fp8,
        **_launch_opts(g * block_half), **PDL_LAUNCH,  # sized by one half-tile: 16 B bf16 vectors per thread
    )
    return q_out, k_out


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 1e-6, q_out: torch.Tensor | None = None,
                 k_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Optional per-head RMSNorm (Qwen3 ``q_norm``/``k_norm``) then rotary embedding, in one launch.

    q ``[T, Hq, D]``, k ``[T, Hkv, D]``: may be strided views (e.g. of the fused qkv output), the
    last dim must be unit-stride. positions ``[T]`` (int32/int64). cos_sin_cache ``[max_pos, D]``
    (``RotaryEmbedding.cos_sin_cache``: cos in the first half, sin in the second).
    q_weight/k_weight ``[D]``: both or neither; without them it is rope only (Llama/Qwen2).

    Equals ``RotaryEmbedding(positions, q_norm(q), k_norm(k))`` (or without the norms). Output
    dtype: q's, or ``promote(q.dtype, weight.dtype)`` with norms (as torch would give). Returns new
    contiguous ``[T, H, D]`` tensors, or writes into ``q_out``/``k_out`` (any strides with a
    unit-stride last dim; they may alias q/k for an in-place update: a program reads all of its
    heads before writing them and no two programs touch the same head).
    """
    return _qk_norm_rope_launch(q, k, positions, cos_sin_cache, q_weight, k_weight, eps, q_out, k_out, None)


def qk_norm_rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                          cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, q_weight: torch.Tensor | None = None,
                          k_weight: torch.Tensor | None = None, eps: float = 1e-6,
                          q_out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``qk_norm_rope`` + ``store_kv_cache`` in one launch: returns q (as ``qk_norm_rope``), and
    writes k (normed and roped) and v (as is) into the paged caches ``[num_blocks, block_size,
    Hkv, D]`` at ``slot_mapping`` ``[T]`` (slots < 0 are skipped), cast to the cache dtype (an FP8
    cache: divided by k_scale / v_scale ``[Hkv]`` per head). The cache gets bit-exactly what the two
    separate calls would write; k itself is not modified. v ``[T, Hkv, D]`` may be a strided view like
    k; the two caches must share one set of strides.
    """
    return _qk_norm_rope_launch(q, k, positions, cos_sin_cache, q_weight, k_weight, eps, q_out, None,
                                (v, k_cache, v_cache, slot_mapping, k_scale, v_scale))[0]


__all__ = ["qk_norm_rope", "qk_norm_rope_store_kv"]
