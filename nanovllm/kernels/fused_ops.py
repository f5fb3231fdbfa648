"""Fused elementwise kernels for the decoder layer: RMSNorm (with the residual add), SiLU-and-mul,
and per-head q/k RMSNorm + rotary embedding (optionally storing the new K/V into the paged cache).

Why: a CUDA-graph decode step of a small model is dominated by launches of tiny elementwise
kernels (fp32 casts, pow, mean, rsqrt, mul, chunk/cat for rope, ...). Each function here does
the work of one layer in one launch and reproduces the plain-torch layer math
(``nanovllm/layers/{layernorm,activation,rotary}.py``) including *where* results are rounded
to the activation dtype, so nearly every element is bit-identical to the eager path. What is
left: the fp32 summation order of the variance and Triton's rsqrt/exp approximations, which can
flip the rounding of an intermediate (normalised value, silu) by 1 ulp -> <= 2 ulp in the result.

All kernels are launched with ``enable_fp_fusion=False``: torch eager rounds every product
separately, and letting the compiler contract ``a*b - c*d`` into an FMA would change the last
fp32 bit (and occasionally the rounded bf16 result). These kernels are memory bound, so the
lost FMAs cost nothing.

Every function takes optional output buffers (poisoned in tests, reusable under CUDA graphs);
without them outputs come from ``torch.empty``. Aliasing rules are given per function.
"""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fp8 import FP8_DTYPE, quantize_to_fp8
from nanovllm.kernels.pdl import PDL_LAUNCH, pdl_prologue
from nanovllm.kernels.gemm import SplitKOutput


def _launch_opts(block: int) -> dict:
    # ~8 elements per thread (16 B of bf16) per row; more warps only for wide rows.
    return dict(num_warps=max(1, min(16, block // 256)), enable_fp_fusion=False)


# --------------------------------------------------------------------------------------------
# RMSNorm (optionally with the residual add fused in)
# --------------------------------------------------------------------------------------------
@triton.jit
def rms_norm_row(x_ptr, res_ptr, res_out_ptr, w, row, cols, mask, stride_x, stride_r, stride_ro, stride_part, eps,
                 N: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr, NUM_PARTS: tl.constexpr):
    """One row's RMSNorm (after the residual add, whose sum it stores): returns ``xn * w`` in fp32, for
    the caller to round to the output dtype (`_rms_norm_kernel`; kernels/fp8_quant.py quantizes it)."""
    if NUM_PARTS > 0:
        # The projection's output = the sum of its partials, rounded as a GEMM would round it.
        x = tl.zeros([BLOCK], tl.float32)
        for s in tl.static_range(NUM_PARTS):
            x += tl.load(x_ptr + s * stride_part + row * stride_x + cols, mask=mask, other=0.0)
        x = x.to(res_ptr.dtype.element_ty).to(tl.float32)
    else:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        # x.float() + residual.float(), the new residual is that fp32 sum rounded once.
        x += tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_out_ptr + row * stride_ro + cols, x.to(res_out_ptr.dtype.element_ty), mask=mask)
    # variance = mean(x^2) in fp32; div_rn = the IEEE division torch does (Triton's "/" is
    # approximate). div_rn wants two fp32 tensors of one shape, hence keep_dims and tl.full.
    var = tl.div_rn(tl.sum(x * x, axis=0, keep_dims=True), tl.full([1], N, tl.float32))
    # HF order: normalise in fp32, round to the input dtype, THEN multiply by the weight. The
    # product of two 16-bit floats is exact in fp32, so computing it in fp32 and rounding once is
    # exactly torch's bf16/fp16 multiply (it also covers an fp32 weight, which promotes to fp32).
    # (res_ptr has the activation dtype: it is x_ptr itself without a residual, and x_ptr holds
    # fp32 partials with NUM_PARTS > 0.)
    xn = (x * tl.rsqrt(var + eps)).to(res_ptr.dtype.element_ty).to(tl.float32)
    return xn * w


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr,
    stride_x, stride_r, stride_y, stride_ro,  # row strides; the hidden dim has unit stride
    stride_part,  # NUM_PARTS > 0: x holds that many fp32 split-K partials, this far apart
    eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr, NUM_PARTS: tl.constexpr,
):
    # One program per token row; the whole row lives in registers (BLOCK = next_pow2(N)).
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride can exceed 2^31 at long prefills
    cols = tl.arange(0, BLOCK)
    mask = cols < N  # N is constexpr: when BLOCK == N the mask folds away (vector accesses)
    # The weight is no predecessor's output: read it before the programmatic-launch wait.
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_prologue()
    y = rms_norm_row(x_ptr, res_ptr, res_out_ptr, w, row, cols, mask, stride_x, stride_r, stride_ro, stride_part,
                     eps, N, BLOCK, HAS_RES, NUM_PARTS)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """[..., n] -> [rows, n] with unit stride along n (a view whenever possible)."""
    t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 or t.shape[0] == 0 else t.contiguous()


def _out_rows(out, shape, dtype, device, n):
    """(the output tensor, its [rows, n] view the kernel writes through)."""
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=device)
    assert out.shape == shape and out.dtype == dtype, (out.shape, out.dtype, shape, dtype)
    rows = out.view(-1, n)  # a view, never a copy (raises otherwise): the kernel writes through it
    assert rows.stride(-1) == 1 or rows.shape[0] == 0
    return out, rows


def norm_input(x, residual, weight):
    """What an RMSNorm kernel reads of x: (x2 [rows, n] (a SplitKOutput's first partial), x's shape,
    its dtype, the number of partials to sum and their stride; 0, 0 for a plain tensor)."""
    num_parts = stride_part = 0
    if isinstance(x, SplitKOutput):
        assert residual is not None and x.parts.is_contiguous()
        num_parts, stride_part = x.parts.shape[0], x.parts.stride(0)
        shape, dtype, x2 = x.shape, x.dtype, x.parts[0]
    else:
        shape, dtype, x2 = x.shape, x.dtype, _rows(x, x.shape[-1])
    assert weight.shape == (shape[-1],), (weight.shape, shape[-1])
    return x2, shape, dtype, num_parts, stride_part


def _rms_norm_launch(x, residual, weight, eps, out, residual_out):
    x2, shape, dtype, num_parts, stride_part = norm_input(x, residual, weight)
    n = shape[-1]
    weight = weight.contiguous()
    # `weight * y` with y in x's dtype: the result has the promoted dtype (== x.dtype in the model).
    y_dtype = torch.promote_types(weight.dtype, dtype)
    y, y2 = _out_rows(out, shape, y_dtype, x2.device, n)
    rows = x2.shape[0]
    if residual is not None:
        assert residual.shape == shape and residual.dtype == dtype, (residual.shape, residual.dtype)
        r2 = _rows(residual, n)
        r_out, ro2 = _out_rows(residual_out, shape, dtype, x2.device, n)
    else:
        r2, r_out, ro2 = x2, None, y2  # unused (HAS_RES=False); any valid pointers
    if rows == 0:
        return y, r_out
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        x2, r2, weight, y2, ro2,
        x2.stride(0), r2.stride(0), y2.stride(0), ro2.stride(0), stride_part,
        float(eps),
        N=n, BLOCK=block, HAS_RES=residual is not None, NUM_PARTS=num_parts, **_launch_opts(block), **PDL_LAUNCH,
    )
    return y, r_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """``RMSNorm.forward(x)``: ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``.

    x: ``[..., H]`` (any leading shape; the hidden dim must be unit-stride or it is copied).
    weight: ``[H]``. Returns a new tensor of dtype ``promote(x.dtype, weight.dtype)`` (x's dtype
    in the model), or writes into ``out`` (which may alias ``x``: each row is read before written).
    """
    return _rms_norm_launch(x, None, weight, eps, out, None)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float = 1e-6, out: torch.Tensor | None = None,
                       residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm.forward(x, residual)``: ``s = x.float() + residual.float()``; returns
    ``(rms_norm(s) as in rms_norm, s.to(x.dtype))``. x may be a `SplitKOutput` (the partials of
    the projection that produced it): they are summed, and rounded to x.dtype, on the way in.

    In place: pass ``out=x, residual_out=residual`` (each program reads its whole row before it
    writes, so aliasing either input is safe). Otherwise new tensors are allocated.
    """
    return _rms_norm_launch(x, residual, weight, eps, out, residual_out)


# --------------------------------------------------------------------------------------------
# SiLU-and-mul (SwiGLU on a fused [gate | up] projection)
# --------------------------------------------------------------------------------------------
@triton.jit
def silu_mul(gate, up, DTYPE: tl.constexpr):
    """silu(gate) * up for gate/up read from DTYPE values, in fp32 for the caller to round to DTYPE.
    F.silu computes x / (1 + exp(-x)) in fp32 and rounds to the dtype; then `silu * up` in the dtype
    = the exact fp32 product of two 16-bit values rounded once."""
    silu = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(DTYPE).to(tl.float32)
    return silu * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, stride_x, stride_y, I, BLOCK: tl.constexpr):
    pdl_prologue()
    # grid = (rows, cdiv(I, BLOCK)): rows on axis 0, whose limit is 2^31-1 (axis 1 allows 65535).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    src = x_ptr + row * stride_x + cols
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + I, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, silu_mul(gate, up, y_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty),
             mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``SiluAndMul``: x ``[..., 2I]`` -> ``F.silu(x[..., :I]) * x[..., I:]`` of shape ``[..., I]``.

    Returns a new tensor (x's dtype) or writes into ``out`` (may alias ``x[..., :I]``).
    """
    two_i = x.shape[-1]
    assert two_i % 2 == 0, x.shape
    i = two_i // 2
    shape = (*x.shape[:-1], i)
    y, y2 = _out_rows(out, shape, x.dtype, x.device, i)
    x2 = _rows(x, two_i)
    if x2.shape[0] == 0 or i == 0:
        return y
    block = min(1024, triton.next_power_of_2(i))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(i, block))](
        x2, y2, x2.stride(0), y2.stride(0), i, BLOCK=block, **_launch_opts(block), **PDL_LAUNCH,
    )
    return y


# --------------------------------------------------------------------------------------------
# Per-head q/k RMSNorm (Qwen3) + rotary embedding (rotate-half layout), optionally writing the
# new keys (and values) straight into the paged KV cache
# --------------------------------------------------------------------------------------------
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


__all__ = ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "qk_norm_rope", "qk_norm_rope_store_kv"]
