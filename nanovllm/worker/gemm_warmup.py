"""Start-up warm-up of the library GEMMs that eager steps meet at sizes the run cannot predict.

cuBLAS picks a kernel per problem size, and the first launch of a kernel it has not used before
costs the host tens of milliseconds. Measured on the H200: the LM head at sampled-row counts met
nowhere before stalled two of bench.py's prefill steps by 60-73 ms in most first runs, and the
last prefill step of a first round of the benchmark's prefills, at a token count met
nowhere before, took 59 ms to launch against ~24 for its neighbours; with this warm-up neither
happens. An eager step runs every projection at its token count
(anything up to max_num_batched_tokens) and the LM head at its sampled-row count (up to
max_num_seqs): this runs them over ladders of those sizes once, so that the kernels a run can
choose have all been launched before the first request.
"""
import torch
import torch.nn.functional as F

from nanovllm.layers.embed_head import ParallelLMHead
from nanovllm.layers.linear import LinearBase

# Token counts past the exhaustive range are met in steps of this many: cuBLAS's choice follows the
# size in coarse tiles, so neighbouring counts share their kernels.
TOKEN_STEP = 64
EXHAUSTIVE_UP_TO = 256


def token_ladder(max_tokens: int) -> list[int]:
    """Every count up to EXHAUSTIVE_UP_TO, then every TOKEN_STEP-th, and max_tokens itself."""
    small = range(1, min(max_tokens, EXHAUSTIVE_UP_TO) + 1)
    large = range(EXHAUSTIVE_UP_TO + TOKEN_STEP, max_tokens + 1, TOKEN_STEP)
    return sorted({*small, *large, max_tokens})


@torch.inference_mode()
def warm_gemms(model: torch.nn.Module, max_tokens: int, max_rows: int, device: torch.device, dtype: torch.dtype):
    """The library path (`F.linear`, as the layers call it past our kernels' sizes) of every distinct
    projection at each count of `token_ladder(max_tokens)`, and of the LM head at 1..max_rows rows.
    Local to this rank (no collectives); inputs are zeros, nothing is kept."""
    projections, heads = {}, {}
    for module in model.modules():
        if isinstance(module, LinearBase):
            projections.setdefault((tuple(module.weight.shape), module.bias is not None), module)
        elif isinstance(module, ParallelLMHead):
            heads.setdefault(tuple(module.weight.shape), module)
    # One zero buffer, viewed as a contiguous [max_tokens, K] input for each K: no more memory than
    # the widest input (the largest step, which sized the KV cache, held more).
    widths = {m.weight.shape[1] for m in (*projections.values(), *heads.values())}
    if not widths:
        return
    flat = torch.zeros(max_tokens * max(widths), dtype=dtype, device=device)
    inputs = {k: flat[:max_tokens * k].view(max_tokens, k) for k in widths}
    for m in token_ladder(max_tokens):
        for module in projections.values():
            x = inputs[module.weight.shape[1]][:m]
            if module.quant_method is not None:  # its own products (block-scaled torch._scaled_mm past our kernel)
                module.quant_method.apply(module, x, module.bias)
            else:
                F.linear(x, module.weight, module.bias)
    for rows in range(1, min(max_rows, max_tokens) + 1):
        for module in heads.values():
            F.linear(inputs[module.weight.shape[1]][:rows], module.weight)
