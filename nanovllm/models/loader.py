"""Build a model from config.json and fill it from *.safetensors (or with random weights), then let
quantized layers finish their weights (`process_weights_after_loading`)."""
import glob
import os
import re

import torch
from safetensors import safe_open
from torch import nn

from nanovllm.distributed import tp_rank, tp_size
from nanovllm.models.registry import get_model_class

# An FP8 KV cache's per-layer scales, as checkpoints name them (vLLM's `self_attn.k_scale` / `v_scale`).
_KV_SCALE_SUFFIXES = (".self_attn.k_scale", ".self_attn.v_scale")
# `...experts.{e}.{projection}.weight` (and a block-FP8 checkpoint's `.weight_scale_inv`): one expert's
# projection, bound for a stacked parameter (or its scales).
_EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.(\w+)\.(weight|weight_scale_inv)$")


def build_model(hf_config, dtype: torch.dtype, device: torch.device, quant_config=None) -> nn.Module:
    model_cls = get_model_class(hf_config)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = model_cls(hf_config, quant_config=quant_config)
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


@torch.no_grad()
def process_weights_after_loading(model: nn.Module):
    """Quantized layers turn what was loaded into their run-time form (layers/quantization)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)


def _load_kv_scale(model: nn.Module, buffers: dict, name: str, tensor: torch.Tensor):
    """`model.layers.N.self_attn.k_scale` (one value, or one per KV head) -> that layer's attention
    buffer, this rank's heads."""
    target = name.replace(".self_attn.", ".self_attn.attn.")
    buf = buffers.get(target)
    if buf is None:
        raise ValueError(f"checkpoint tensor {name!r} has no matching attention layer in {type(model).__name__}")
    tensor = tensor.float().flatten()
    heads = getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads
    if tensor.numel() not in (1, heads) or not bool(torch.isfinite(tensor).all() and (tensor > 0).all()):
        raise ValueError(f"checkpoint tensor {name!r} must hold one positive scale or one per KV head ({heads}), "
                         f"got shape {tuple(tensor.shape)}")
    if tensor.numel() == 1:
        buf.fill_(tensor.item())
    else:
        start = tp_rank() * heads // tp_size()  # as QKVParallelLinear places this rank's (or replicated) heads
        buf.copy_(tensor[start:start + buf.numel()])


def load_weights(model: nn.Module, path: str):
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r} (use load_format='dummy' for random weights)")
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    packed = getattr(model, "packed_modules_mapping", {})
    # MoE models: checkpoint module names of ours (Mixtral's block_sparse_moe), and each expert projection's
    # stacked parameter and shard (models/moe.py); every shard of a stacked parameter must arrive.
    renames = getattr(model, "checkpoint_renames", {})
    experts = getattr(model, "expert_projections", {})
    shards: dict[str, set] = {}
    loaded: set[str] = set()
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name:
                    continue
                if name == "lm_head.weight" and getattr(model, "tie_word_embeddings", False):
                    continue
                if name.endswith(_KV_SCALE_SUFFIXES):
                    _load_kv_scale(model, buffers, name, f.get_tensor(name))
                    continue
                target, shard_id = name, None
                for old, new in renames.items():
                    target = target.replace(old, new)
                expert = _EXPERT_TENSOR.search(target) if experts else None
                if expert is not None and expert.group(2) in experts:
                    stacked, which = experts[expert.group(2)]
                    suffix = "" if expert.group(3) == "weight" else "_scale_inv"
                    target = f"{target[:expert.start()]}.experts.{stacked}{suffix}"
                    shard_id = (int(expert.group(1)), which)
                else:
                    for ckpt_name, (fused_name, sid) in packed.items():
                        if f".{ckpt_name}." in target:
                            target, shard_id = target.replace(f".{ckpt_name}.", f".{fused_name}."), sid
                            break
                param = params.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
                tensor = f.get_tensor(name)
                loader = getattr(param, "weight_loader", None)
                if loader is None:
                    param.data.copy_(tensor)
                elif shard_id is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard_id)
                loaded.add(target)
                if hasattr(param, "num_shards"):
                    shards.setdefault(target, set()).add(shard_id)
    missing = [n for n in params if n not in loaded and not (n == "lm_head.weight" and model.tie_word_embeddings)]
    missing += [f"{n} ({p.num_shards - len(shards[n])} of its {p.num_shards} expert shards)" for n, p in params.items()
                if n in shards and len(shards[n]) < p.num_shards]
    if missing:
        raise ValueError(f"checkpoint in {path!r} lacks weights for: {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int):
    """Random weights for benchmarks: small normals for matrices, ones for norms, zero biases."""
    gen_device = next(model.parameters()).device
    gen = torch.Generator(device=gen_device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.normal_(0.0, 0.02, generator=gen)
