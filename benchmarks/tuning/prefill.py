"""Sweep the paged-prefill kernel's tile configuration on the benchmark's prefill batches.

    python scripts/tune.py prefill     (GPU)

First the batch bench.py's first prefill step holds: whole prompts of randint(100, 1024) tokens
(random.seed(0), as nano-vllm's workload) packed up to 16,384 tokens; then 8 x 2048, 1 x 8192 and
chunks on a cached prefix with the leading candidates. Qwen3-0.6B's attention (16 query heads, 8 KV
heads, head_dim 128, cache blocks of 256), each tile shape with K/V by pointer loads and through TMA
descriptors. Each configuration's output is checked against the default's; TFLOP/s counts the causal
part of QK^T and PV. For comparison, torch's `varlen_attn` (FlashAttention, contiguous K/V, no cache)
on the first batch, where this torch has it.
"""
import argparse
import random

import torch
import triton.testing

from nanovllm.kernels import reference as ref
from nanovllm.kernels.paged_prefill import _prefill_config, paged_prefill_attention

HQ, HKV, D, PAGE, BUDGET = 16, 8, 128, 256, 16384
# (BLOCK_M, BLOCK_N, warps, stages), K/V through TMA descriptors or pointer loads
CONFIGS = [((256, 64, 16, 3), False), ((256, 64, 16, 3), True), ((256, 64, 16, 2), True), ((256, 64, 16, 4), True),
           ((128, 64, 8, 3), False), ((128, 64, 8, 3), True), ((128, 64, 8, 2), True), ((128, 128, 8, 2), True),
           ((64, 64, 4, 3), False), ((64, 64, 4, 3), True), ((64, 64, 4, 4), True)]


def make_case(q_lens, seq_lens):
    """Shuffled paged caches holding the sequences (the kernel tests' builder), queries, layout."""
    dev, dt = "cuda", torch.bfloat16
    k_cache, v_cache, tables = ref.random_paged_kv(seq_lens, HKV, D, PAGE, dt, dev, poison=False)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=dev)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    q = torch.randn(sum(q_lens), HQ, D, dtype=dt, device=dev)
    return q, k_cache, v_cache, cu, lens, tables


def sweep(name, q_lens, seq_lens, configs):
    q, k_cache, v_cache, cu, lens, tables = make_case(q_lens, seq_lens)
    scale, max_q = D ** -0.5, max(q_lens)
    # the causal part of QK^T and PV: query i of a sequence with prefix p sees p + i + 1 keys
    flops = sum(2 * 2 * HQ * D * (ql * (n - ql) + ql * (ql + 1) / 2) for ql, n in zip(q_lens, seq_lens))
    print(f"{name}: {len(q_lens)} sequences, {sum(q_lens)} query tokens, {flops / 1e12:.3f} TFLOP; "
          f"default config {_prefill_config(D, HQ // HKV, max_q, kv_desc=True)} with K/V through TMA")
    expect = paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, max_q, scale)
    for cfg, desc in configs:
        fn = lambda: paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, max_q, scale,  # noqa: E731
                                             _config=cfg, _kv_desc=desc)
        try:
            out = fn()
            ms = triton.testing.do_bench(fn, rep=100)
        except Exception as e:  # noqa: BLE001 (a config the compiler rejects)
            print(f"  {cfg} {'TMA' if desc else 'pointers'}: {type(e).__name__} {str(e)[:100]}")
            continue
        err = (out.float() - expect.float()).abs().max().item()
        print(f"  BLOCK_M, BLOCK_N, warps, stages = {cfg}, K/V {'TMA     ' if desc else 'pointers'}: {ms * 1e3:7.1f} us  "
              f"{flops / ms / 1e9:6.1f} TFLOP/s  max|diff| {err:.3g}", flush=True)
    return q, k_cache, v_cache, cu, tables, expect


def main(argv=None, prog=None):
    argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0]).parse_args(argv)  # no options: --help
    random.seed(0)
    lens = [random.randint(100, 1024) for _ in range(256)]
    batch, total = [], 0
    for n in lens:
        if total + n > BUDGET:
            break
        batch.append(n)
        total += n
    q, k_cache, v_cache, cu, tables, expect = sweep("benchmark prefill", batch, batch, CONFIGS)
    short = CONFIGS[:6]
    sweep("8 x 2048", [2048] * 8, [2048] * 8, short)
    sweep("1 x 8192", [8192], [8192], short)
    sweep("4 x 512 on a 3584-token prefix", [512] * 4, [4096] * 4, short)
    flops = sum(2 * 2 * HQ * D * n * (n + 1) / 2 for n in batch)
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        print("varlen_attn: not in this torch")
        return
    params = inspect.signature(varlen_attn).parameters
    print(f"varlen_attn{inspect.signature(varlen_attn)}")
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    # contiguous K/V of the same tokens (what a prefill without cached prefix could pass)
    k = torch.cat([ref.gather_kv(k_cache, tables[i], n) for i, n in enumerate(batch)])
    v = torch.cat([ref.gather_kv(v_cache, tables[i], n) for i, n in enumerate(batch)])
    for name, kk, vv in (("GQA", k, v), ("K/V repeated to 16 heads", k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))):
        try:
            fn = lambda: varlen_attn(q, kk, vv, cu, cu, max(batch), max(batch), **causal)  # noqa: E731
            out = fn()
            ms = triton.testing.do_bench(fn, rep=100)
            err = (out.float() - expect.float()).abs().max().item()
            print(f"  varlen_attn ({name}): {ms * 1e3:7.1f} us  {flops / ms / 1e9:6.1f} TFLOP/s  max|diff| {err:.3g}")
        except Exception as e:  # noqa: BLE001
            print(f"  varlen_attn ({name}): {type(e).__name__} {str(e)[:200]}")
