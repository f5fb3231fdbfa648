"""The grouped GEMMs of a mixture-of-experts layer over the pairs `moe_routing.route` sorted by
expert: each program computes one BM-row block of one expert's pairs against a BN-column tile of
that expert's weights (vLLM's fused-MoE scheme; weights stacked [E, N, K], K contiguous).

- `moe_gate_up`: act[flat] = silu(x[t] @ gate_e^T) * (x[t] @ up_e^T) for every pair flat = (t, j)
  routed to expert e, with w13 = [gate | up] stacked along N ([E, 2I, H]): gate and up tiles are
  multiplied side by side and the [N, 2I] product never reaches memory. Rounded as the unfused pair
  (GEMM output, then SiLU-and-mul) rounds: gate and up to the activation dtype, then the SiLU, then
  the product.
- `moe_down`: parts[j, t] = weight[t, j] * (act[flat] @ down_e^T), one [T, H] slice per choice j:
  the sum over the k experts is left to the consumer, the next residual-add RMSNorm, which sums
  split-K partials as it loads a row (`gemm.SplitKOutput`), so the combine costs no kernel and no
  atomics (each output element is written once: deterministic). Parts are fp32 up to
  PARTS_FP32_MAX_BYTES (decode batches up to 128 rows of Qwen3-30B-A3B), past that in the activation
  dtype, as vLLM's combine buffer: at 256 rows fp32 parts would add ~2.5% to the step's bytes.

Block-FP8 experts (W8A8, `w_scale` given): the weights float8 with [E, ceil(N/128), ceil(K/128)] scales, the
activations a `QuantizedActivation` in 1 x 128 groups (the caller quantizes x, and the SwiGLU output
between the two GEMMs); each K step is one 128-deep block whose product is scaled by the rows' and the
tile's scales into the fp32 accumulator (as kernels/fp8_gemm.py), so a tile spans at most one
128-row block (BN divides 128) and takes one weight scale per step.

Programs past `num_padded` (the grid is sized for the worst case) return at once. Tiles come from
`moe_config`, a fixed host-side table by token count (no autotuning: CUDA graphs capture the
launches); every block of a step shares one BM, the align kernel's.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanovllm.kernels.moe_routing import Routing
from nanovllm.kernels.pdl import PDL_LAUNCH, pdl_prologue

PARTS_FP32_MAX_BYTES = 8 << 20
_FP8_BLOCK = tl.constexpr(128)  # block-FP8 weights' (and activation groups') block size


class MoeTile(NamedTuple):
    bn: int
    bk: int
    num_warps: int = 4
    num_stages: int = 3
    # Weight tiles through a TMA tensor descriptor (Hopper) instead of pointer loads: 10-25% faster for
    # the dense decode GEMMs (gemm.py); for these, where the activation rows are gathered by pointer
    # beside them, not yet measured (scripts/gpu_kernels.py moe --sweep times both), so off in the table.
    tma: bool = False


class MoeConfig(NamedTuple):
    block_m: int
    gate_up: MoeTile  # bn counts gate columns: each program reads 2 * bn weight rows
    down: MoeTile


# (max tokens, config) for 16-bit activations. From vLLM's tuned H200 table for 128 experts of
# intermediate size 768 (Qwen3-30B-A3B; its N counts gate and up rows apart, so our gated BN is half
# its BN), with one pipeline depth more at decode sizes, where the kernels stream weights from HBM.
# BM follows the tokens per expert (T * 8 / 128): one block for most experts up to ~BM tokens.
_TABLE = (
    (32, MoeConfig(16, MoeTile(32, 128, 4, 4), MoeTile(64, 128, 4, 4))),
    (128, MoeConfig(16, MoeTile(64, 128, 4, 3), MoeTile(128, 128, 4, 3))),
    (256, MoeConfig(32, MoeTile(64, 128, 4, 3), MoeTile(128, 128, 4, 3))),
    (768, MoeConfig(64, MoeTile(64, 64, 4, 3), MoeTile(128, 64, 4, 3))),
    (None, MoeConfig(128, MoeTile(128, 64, 8, 4), MoeTile(256, 64, 8, 4))),
)
# fp32 (reference runs, tests): IEEE products in small tiles that fit shared memory.
_FP32 = MoeConfig(16, MoeTile(32, 32, 4, 2), MoeTile(32, 32, 4, 2))


def _fit(tile: MoeTile, n: int, k: int) -> MoeTile:
    """The tile clamped to small layers (tests): BN and BK no wider than the padded dimension."""
    return tile._replace(bn=min(tile.bn, max(16, triton.next_power_of_2(n))),
                         bk=min(tile.bk, max(16, triton.next_power_of_2(k))))


def moe_config(num_tokens: int, hidden: int, intermediate: int, dtype: torch.dtype, fp8: bool = False) -> MoeConfig:
    """The tiles for a step of num_tokens tokens through experts of [intermediate, hidden]. fp8: block-FP8
    experts, whose tiles span one 128-deep K block and at most one 128-row block (one scale a tile)."""
    config = _FP32 if dtype == torch.float32 else next(c for m, c in _TABLE if m is None or num_tokens <= m)
    config = config._replace(gate_up=_fit(config.gate_up, intermediate, hidden),
                             down=_fit(config.down, hidden, intermediate))
    if fp8:
        config = config._replace(gate_up=_fp8_tile(config.gate_up), down=_fp8_tile(config.down))
    return config


def _fp8_tile(tile: MoeTile) -> MoeTile:
    """Not yet timed on a GPU: the 16-bit table's tile, one K block deep, by pointer loads."""
    return tile._replace(bn=min(tile.bn, _FP8_BLOCK.value), bk=_FP8_BLOCK.value, tma=False)


def parts_dtype(num_tokens: int, hidden: int, num_parts: int, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if num_tokens * hidden * num_parts * 4 <= PARTS_FP32_MAX_BYTES else dtype


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 operands: no TF32 rounding


@triton.jit
def _weight_tile(w, expert, row0, k0, rk, K: tl.constexpr, ROWS_PER_EXPERT: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, W_TMA: tl.constexpr, stride_we, stride_wn):
    """The [BK, BN] tile of expert's weight rows row0 .. row0 + BN at columns k0 .. k0 + BK (zeros past
    K). Rows past the expert's (only in columns the caller does not store) read the neighbours' rows
    (TMA) or wrap onto its own (pointers), so every load stays inside the tensor."""
    if W_TMA:  # w: a descriptor over the weights as [E * ROWS_PER_EXPERT, K]
        tile = w.load([(expert * ROWS_PER_EXPERT + row0).to(tl.int32), k0]).T
    else:
        rn = (row0 + tl.arange(0, BN)) % ROWS_PER_EXPERT
        ptrs = w + expert * stride_we + rn.to(tl.int64)[None, :] * stride_wn + (k0 + rk)[:, None]
        if K % BK == 0:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=(k0 + rk < K)[:, None], other=0.0)
    return tile


@triton.jit
def _block_scale(ws_ptr, expert, row0, kb, stride_wse, stride_wsn):
    """A block-FP8 weight's scale for the tile at rows row0 .. (within one 128-row block) of K block kb."""
    return tl.load(ws_ptr + expert * stride_wse + (row0 // _FP8_BLOCK) * stride_wsn + kb)


@triton.jit(do_not_specialize=["num_valid", "stride_xs"])
def _moe_gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
                        num_valid, stride_xm, stride_we, stride_wn, stride_om,
                        xs_ptr, ws_ptr, stride_xs, stride_wse, stride_wsn,  # FP8 only: the block scales
                        I: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, W_TMA: tl.constexpr, PRECISION: tl.constexpr,
                        FP8: tl.constexpr):
    pdl_prologue()
    num_n = (I + BN - 1) // BN
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    if pid_m * BM >= tl.load(num_padded_ptr):
        return
    flat = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
    row_ok = flat < num_valid
    token = flat // TOP_K
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    n0 = pid_n * BN
    rk = tl.arange(0, BK)
    a_ptrs = x_ptr + token.to(tl.int64)[:, None] * stride_xm + rk[None, :]
    acc_g = tl.zeros([BM, BN], tl.float32)
    acc_u = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        if K % BK == 0:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=row_ok[:, None] & (k0 + rk < K)[None, :], other=0.0)
        # gate rows [n0, n0 + BN) of the expert, and up rows I further down
        g = _weight_tile(w_ptr, expert, n0, k0, rk, K, 2 * I, BN, BK, W_TMA, stride_we, stride_wn)
        u = _weight_tile(w_ptr, expert, I + n0, k0, rk, K, 2 * I, BN, BK, W_TMA, stride_we, stride_wn)
        if FP8:  # one K block: the products scaled by the rows' and the tile's block scales into fp32
            a_s = tl.load(xs_ptr + (k0 // BK) * stride_xs + token, mask=row_ok, other=0.0)[:, None]
            g_s = _block_scale(ws_ptr, expert, n0, k0 // BK, stride_wse, stride_wsn)
            u_s = _block_scale(ws_ptr, expert, I + n0, k0 // BK, stride_wse, stride_wsn)
            acc_g += tl.dot(a, g) * (a_s * g_s)
            acc_u += tl.dot(a, u) * (a_s * u_s)
        else:
            acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        a_ptrs += BK
    dtype = out_ptr.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)
    up = acc_u.to(dtype).to(tl.float32)
    silu = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(dtype).to(tl.float32)  # F.silu, rounded
    rn = n0 + tl.arange(0, BN)
    out = out_ptr + flat.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, (silu * up).to(dtype), mask=row_ok[:, None] & (rn < I)[None, :])


@triton.jit(do_not_specialize=["num_valid", "num_tokens", "stride_as"])
def _moe_down_kernel(act_ptr, w_ptr, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
                     num_valid, num_tokens, stride_am, stride_we, stride_wn,
                     as_ptr, ws_ptr, stride_as, stride_wse, stride_wsn,  # FP8 only: the block scales
                     H: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, W_TMA: tl.constexpr, PRECISION: tl.constexpr,
                     FP8: tl.constexpr):
    pdl_prologue()
    num_n = (H + BN - 1) // BN
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    if pid_m * BM >= tl.load(num_padded_ptr):
        return
    flat = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
    row_ok = flat < num_valid
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    n0 = pid_n * BN
    rk = tl.arange(0, BK)
    a_ptrs = act_ptr + flat.to(tl.int64)[:, None] * stride_am + rk[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        if K % BK == 0:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=row_ok[:, None] & (k0 + rk < K)[None, :], other=0.0)
        w = _weight_tile(w_ptr, expert, n0, k0, rk, K, H, BN, BK, W_TMA, stride_we, stride_wn)
        if FP8:
            a_s = tl.load(as_ptr + (k0 // BK) * stride_as + flat, mask=row_ok, other=0.0)[:, None]
            acc += tl.dot(a, w) * (a_s * _block_scale(ws_ptr, expert, n0, k0 // BK, stride_wse, stride_wsn))
        else:
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BK
    acc = acc * tl.load(weights_ptr + flat, mask=row_ok, other=0.0)[:, None]
    # parts[j, t, :] for flat = t * TOP_K + j: contiguous [parts, T, H]
    rn = n0 + tl.arange(0, BN)
    row = (flat % TOP_K).to(tl.int64) * num_tokens + flat // TOP_K
    out = out_ptr + row[:, None] * H + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (rn < H)[None, :])


def _weights(w: torch.Tensor, tile: MoeTile):
    """The stacked weights [E, N, K] as the kernels read them: a pointer, or a TMA descriptor over [E * N, K]."""
    if tile.tma:
        return TensorDescriptor.from_tensor(w.view(-1, w.shape[-1]), [tile.bn, tile.bk])
    return w


def _grid(routing: Routing, n: int, tile: MoeTile) -> tuple[int]:
    return (routing.block_expert.numel() * triton.cdiv(n, tile.bn),)


def _fp8_operands(x, w: torch.Tensor, w_scale: torch.Tensor | None, tile: MoeTile):
    """(data, row scales, their stride, weight scales) of a block-FP8 product, or plain placeholders.
    x: a `QuantizedActivation` (1 x 128 groups) when w_scale [E, ceil(N/128), ceil(K/128)] is given."""
    if w_scale is None:
        return x, x, 0, w
    assert tile.bk == _FP8_BLOCK.value and _FP8_BLOCK.value % tile.bn == 0 and not tile.tma, tile  # a scale per tile
    assert x.data.dtype == w.dtype and w_scale.is_contiguous() and w_scale.shape[0] == w.shape[0], w_scale.shape
    return x.data, x.scale, x.scale.stride(0), w_scale


def moe_gate_up(x, w13: torch.Tensor, routing: Routing, tile: MoeTile,
                w_scale: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of every routed pair: x [T, H], w13 [E, 2I, H] -> [T * top_k, I] (row flat).
    Block FP8 (w_scale given): x a `QuantizedActivation`, w13 float8 with its block scales; the output
    in x's dtype."""
    data, x_scale, stride_xs, ws = _fp8_operands(x, w13, w_scale, tile)
    t, h = (x.rows, x.data.shape[1]) if w_scale is not None else x.shape
    e, two_i, h_w = w13.shape
    assert h == h_w and two_i % 2 == 0 and data.stride(-1) == 1 and w13.is_contiguous() and data.dtype == w13.dtype
    inter = two_i // 2
    assert w_scale is None or inter % _FP8_BLOCK.value == 0, inter  # up's blocks start at a block
    out = torch.empty(t * routing.top_k, inter, dtype=x.dtype, device=data.device)
    if t == 0:
        return out
    _moe_gate_up_kernel[_grid(routing, inter, tile)](
        data, _weights(w13, tile), out, routing.sorted_ids, routing.block_expert, routing.num_padded,
        t * routing.top_k, data.stride(0), w13.stride(0), w13.stride(1), out.stride(0),
        x_scale, ws, stride_xs, ws.stride(0), ws.stride(1) if ws.dim() > 1 else 0,
        I=inter, K=h, TOP_K=routing.top_k, BM=routing.block_m, BN=tile.bn, BK=tile.bk, W_TMA=tile.tma,
        PRECISION=_precision(x.dtype), FP8=w_scale is not None, num_warps=tile.num_warps,
        num_stages=tile.num_stages, **PDL_LAUNCH)
    return out


def moe_down(act, w2: torch.Tensor, routing: Routing, tile: MoeTile, parts: torch.Tensor,
             w_scale: torch.Tensor | None = None):
    """parts[j, t] = weight[t, j] * act[t * top_k + j] @ down_e^T for w2 [E, H, I]; parts is
    [>= top_k, T, H] contiguous (slices past top_k are left to the caller). Block FP8 (w_scale
    given): act a `QuantizedActivation`, w2 float8 with its block scales."""
    data, a_scale, stride_as, ws = _fp8_operands(act, w2, w_scale, tile)
    n, inter = (act.rows, act.data.shape[1]) if w_scale is not None else act.shape
    e, h, inter_w = w2.shape
    t, k = routing.num_tokens, routing.top_k
    assert inter == inter_w and n == t * k and data.is_contiguous() and w2.is_contiguous() and data.dtype == w2.dtype
    assert parts.is_contiguous() and parts.shape[0] >= k and parts.shape[1:] == (t, h)
    if t == 0:
        return parts
    _moe_down_kernel[_grid(routing, h, tile)](
        data, _weights(w2, tile), parts, routing.weights, routing.sorted_ids, routing.block_expert, routing.num_padded,
        n, t, data.stride(0), w2.stride(0), w2.stride(1),
        a_scale, ws, stride_as, ws.stride(0), ws.stride(1) if ws.dim() > 1 else 0,
        H=h, K=inter, TOP_K=k, BM=routing.block_m, BN=tile.bn, BK=tile.bk, W_TMA=tile.tma,
        PRECISION=_precision(act.dtype), FP8=w_scale is not None, num_warps=tile.num_warps,
        num_stages=tile.num_stages, **PDL_LAUNCH)
    return parts
