"""Decode steps on the CPU compiled with torch.compile (inductor's C++ backend): the CPU's
counterpart of the GPU's CUDA graphs.

An eager decode step of a small model costs its op dispatch, not its weights' bytes: SmolLM2-135M
runs ~1,000 small ops per step (norms, rotary, SwiGLU, casts), ~13 of a ~21 ms step on one core,
against ~8 ms for its products. Compiled, each layer's elementwise work becomes a few fused C++ loops
around the same oneDNN products.

One layer function is compiled and reused by every layer (the parameters are its inputs: regional
compilation), so the compile costs one layer's, not the model's; it is traced with dynamic shapes,
so one compile serves every batch size from 2 up (a batch of one gets its own). Compiled code rounds
to bf16 where eager does (`emulate_precision_casts`), so greedy tokens equal the eager path's.
The KV store and the decode attention run as one opaque op (`cpu_decode_attention`), the eager
backend's code: the compiler neither copies the cache it writes nor specializes on context lengths.

Where no C++ compiler exists, or compiling fails, the runner stays eager (and says so once).
"""
import logging
import shutil

import torch
from torch import nn

import torch._dynamo.exc
import torch._inductor.exc

from nanovllm.attention.torch_backend import TorchAttentionBackend, decode_gather, store_kv

logger = logging.getLogger(__name__)
_COMPILE_ERRORS = (torch._dynamo.exc.BackendCompilerFailed, torch._inductor.exc.InductorError)


@torch.library.custom_op("nanovllm::cpu_decode_attention", mutates_args=("kv_cache",))
def cpu_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                         layer: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Store the new k/v [B, Hkv, D] at their slots of the layer's cache, then attend q [B, Hq, D] to
    each row's context (cache rows `rows` [B * S], key mask [B, 1, 1, S]): the torch backend's decode.
    The whole cache [2, layers, ...] and the layer's index (a tensor: an int would make one graph per
    layer) are passed, not the layer's views of it: the compiler would copy a mutated view's base."""
    i = int(layer)
    k_cache, v_cache = kv_cache[0, i], kv_cache[1, i]
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    meta = _DecodeLayout(q.shape[0], (rows, mask))
    return TorchAttentionBackend._decode(q, k_cache, v_cache, meta, scale, None)


@cpu_decode_attention.register_fake
def _(q, k, v, kv_cache, layer, slot_mapping, rows, mask, scale):
    return torch.empty_like(q)


class _DecodeLayout:
    """The fields of AttentionMetadata the torch backend's decode reads."""
    decode_query_len = 1

    def __init__(self, num_decodes: int, decode_gather):
        self.num_decodes, self.decode_gather = num_decodes, decode_gather


def _decode_layer(layer: nn.Module, index, kv_cache, positions, x, residual, slot_mapping, rows, mask):
    """DecoderLayer.forward for a pure decode batch on the CPU, the attention as one opaque op."""
    attn = layer.self_attn
    x, residual = layer.input_layernorm(x, residual)
    q, k, v = attn._qkv_heads(x)
    norms = (attn.q_norm, attn.k_norm) if attn.qk_norm else ()
    q, k = attn.rotary_emb(positions, q, k, *norms)
    o = cpu_decode_attention(q, k, v, kv_cache, index, slot_mapping, rows, mask, attn.attn.scale)
    x = attn.o_proj(o.flatten(-2))
    x, residual = layer.post_attention_layernorm(x, residual)
    return layer.mlp(x), residual


def compiler_available() -> bool:
    """Inductor's CPU backend needs a C++ compiler on the PATH."""
    return any(shutil.which(cc) for cc in ("g++", "c++", "clang++"))


def can_compile(model: nn.Module, config) -> bool:
    """Dense decoder layers of plain weights with a cache in the model dtype, on one CPU process."""
    from nanovllm.models.llama import DecoderMLP
    layers = getattr(getattr(model, "model", None), "layers", None)
    return (layers is not None and config.tensor_parallel_size == 1 and config.quant_config is None
            and config.kv_cache_torch_dtype == config.torch_dtype and config.speculative_config is None
            and all(isinstance(layer.mlp, DecoderMLP) for layer in layers))


class CPUDecodeGraphs:
    """The model's decode forward (embedding to final norm) with each layer compiled, from the
    WARMUP_STEPS-th pure decode step on: shorter runs (most tests, one-line answers) never compile."""
    WARMUP_STEPS = 32

    def __init__(self, model: nn.Module, kv_cache: torch.Tensor):
        import torch._inductor.config as inductor_config
        inductor_config.emulate_precision_casts = True  # round to bf16 where eager does: eager's tokens
        self.model = model
        self.kv_cache = kv_cache  # [2, layers, blocks, block_size, Hkv, D]
        self.block_size = kv_cache.shape[3]
        self._indices = [torch.tensor(i) for i in range(kv_cache.shape[1])]
        self._layer = torch.compile(_decode_layer, dynamic=True, fullgraph=True)
        self.eager_steps = 0
        self.failed = False

    def run(self, fb) -> torch.Tensor | None:
        """Hidden states [B, hidden] of a pure decode step, or None: run it eagerly (still warming
        up, or compiling failed)."""
        if self.failed or self.eager_steps < self.WARMUP_STEPS:
            self.eager_steps += 1
            return None
        meta = fb.attn
        rows, mask = decode_gather(meta, self.block_size)
        inner = self.model.model
        x = inner.embed_tokens(fb.input_ids)
        residual = torch.zeros_like(x)  # adding zeros in fp32 is exact: layer 0's norm sees x alone
        layer_fn = self._layer
        try:
            for layer, index in zip(inner.layers, self._indices):
                x, residual = layer_fn(layer, index, self.kv_cache, fb.positions, x, residual, meta.slot_mapping,
                                       rows, mask)
        except _COMPILE_ERRORS as e:  # a compiler or toolchain failure (at layer 0): the eager step is correct
            logger.warning("compiling the CPU decode step failed (%s: %s); decoding eagerly", type(e).__name__, e)
            self.failed = True
            return None
        x, _ = inner.norm(x, residual)
        return x
