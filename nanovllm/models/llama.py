"""The decoder-only transformer shared by Llama, Qwen2 and Qwen3, with per-family switches."""
import torch
from torch import nn

from nanovllm.attention.base import AttentionMetadata
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.quantization import input_quant
from nanovllm.layers.rotary import RotaryEmbedding, norm_args, rope_parameters


class DecoderAttention(nn.Module):
    def __init__(self, config, qkv_bias: bool, o_bias: bool, qk_norm: bool, quant_config=None):
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, num_heads, num_kv_heads, qkv_bias,
                                          quant_config)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size, o_bias, quant_config)
        theta, scaling = rope_parameters(config)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings, theta, scaling)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm

    def _qkv_heads(self, x: torch.Tensor):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.unflatten(-1, (self.num_heads, self.head_dim)),     # [T, Hq, D]
                k.unflatten(-1, (self.num_kv_heads, self.head_dim)),  # [T, Hkv, D]
                v.unflatten(-1, (self.num_kv_heads, self.head_dim)))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        norms = (self.q_norm, self.k_norm) if self.qk_norm else ()
        if self.attn.fuses_kv_store:
            kv_cache = (self.attn.k_cache, self.attn.v_cache, meta.slot_mapping)
            # Decode batches: one kernel from x to q and the cached k/v; else the rotary kernel
            # writes k and v into the paged cache itself (a launch less per layer either way).
            q = self.qkv_proj.rope_store_kv(x, positions, self.rotary_emb.cos_sin_cache, kv_cache,
                                            *norm_args(*norms), q_out=meta.q_out, kv_scales=self.attn.kv_scales)
            if q is None:
                q, k, v = self._qkv_heads(x)
                q = self.rotary_emb.forward_store_kv(positions, q, k, v, kv_cache, *norms, q_out=meta.q_out,
                                                     kv_scales=self.attn.kv_scales)
            o = self.attn(q, None, None, meta, kv_stored=True)
        else:
            q, k, v = self._qkv_heads(x)
            q, k = self.rotary_emb(positions, q, k, *norms)
            o = self.attn(q, k, v, meta)
        # The output only feeds the post-attention residual-add RMSNorm: partial sums are fine.
        return self.o_proj(o, partials_ok=True)


class DecoderMLP(nn.Module):
    def __init__(self, config, bias: bool, quant_config=None):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only 'silu' is supported")
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias, quant_config)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, quant_config)
        self.gate_up_proj.quant_out = input_quant(self.down_proj)  # the SwiGLU hands down_proj its input form

    def forward(self, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        # Consumed by the next residual-add RMSNorm (next layer's or the final one).
        return self.down_proj(self.gate_up_proj.swiglu(x), partials_ok=True)


class DecoderLayer(nn.Module):
    def __init__(self, config, qkv_bias, o_bias, qk_norm, mlp_bias, quant_config=None, mlp: nn.Module | None = None):
        """mlp: the feed-forward block, if not the dense one (an MoE layer: models/moe.py)."""
        super().__init__()
        self.self_attn = DecoderAttention(config, qkv_bias, o_bias, qk_norm, quant_config)
        self.mlp = mlp if mlp is not None else DecoderMLP(config, mlp_bias, quant_config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Quantized projections take their input quantized by the norm that produces it (one kernel).
        self.input_layernorm.quant_out = input_quant(self.self_attn.qkv_proj)
        self.post_attention_layernorm.quant_out = input_quant(getattr(self.mlp, "gate_up_proj", None))

    def forward(self, positions, x, residual, meta):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        # The step's metadata too: an MoE block routes a CUDA graph's padding rows (slot -1) cheaply.
        return self.mlp(x, meta), residual


class DecoderModel(nn.Module):
    def __init__(self, config, quant_config=None, make_mlp=None, **switches):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, **switches, quant_config=quant_config,
                                                 mlp=make_mlp(config, i, quant_config) if make_mlp else None)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class DecoderForCausalLM(nn.Module):
    # checkpoint projection name -> (fused parameter name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @classmethod
    def switches(cls, config) -> dict:
        raise NotImplementedError

    supports_quantization = True  # layers/quantization's methods for every linear layer

    @classmethod
    def check_config(cls, config):
        """Raise, naming the field, if the config asks for what this model does not implement."""

    @classmethod
    def make_mlp(cls, config, layer_idx: int, quant_config=None) -> nn.Module | None:
        """Layer layer_idx's feed-forward block; None: the dense MLP."""
        return None

    def __init__(self, config, quant_config=None):
        """quant_config: the linear layers' quantization (layers/quantization), None for plain weights;
        the embeddings, norms and LM head stay in the model dtype."""
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, quant_config, self.make_mlp, **self.switches(config))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(hidden, out)

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def kv_cache_shape(self) -> tuple[int, int]:
        """(KV heads on this rank, head_dim)."""
        attn = self.model.layers[0].self_attn
        return attn.num_kv_heads, attn.head_dim


class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def switches(cls, config):
        bias = bool(getattr(config, "attention_bias", False))
        return dict(qkv_bias=bias, o_bias=bias, qk_norm=False, mlp_bias=bool(getattr(config, "mlp_bias", False)))


def check_tensor_parallel(config, size: int):
    """Raise before any process starts if the model cannot be split over `size` ranks."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % size:
        raise ValueError(f"tensor_parallel_size={size} must divide num_attention_heads={heads}")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"tensor_parallel_size={size} and num_key_value_heads={kv_heads}: one must divide the other")
    # The dense MLP's and (MoE models) every expert's and the shared expert's intermediate dimension.
    for field in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        value = getattr(config, field, None)
        if value and value % size:
            raise ValueError(f"tensor_parallel_size={size} must divide {field}={value}")


def check_block_quantization(config, size: int, block: int = 128):
    """Raise before any process starts if a fused projection's partition or a tensor-parallel shard of
    a block-quantized checkpoint would start inside a block of `block` x `block` weights (the scales
    could not be stacked or split). Every fused partition but the last must fill whole blocks (k and v,
    gate and up being of one size here, all of them do), and so must every tensor-parallel shard."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    inter = config.intermediate_size
    per_rank = f" / tensor_parallel_size={size}" if size > 1 else ""
    rows = {  # config expression -> rows (or columns) per rank that must fill whole blocks
        f"num_attention_heads={heads} x head_dim={head_dim}{per_rank}": heads * head_dim // size,
        f"num_key_value_heads={kv_heads} x head_dim={head_dim}{per_rank}": max(1, kv_heads // size) * head_dim,
        f"intermediate_size={inter}{per_rank}": inter // size,
    }
    experts = getattr(config, "moe_intermediate_size", None)  # Qwen MoE experts (Mixtral's: intermediate_size)
    if experts:
        rows[f"moe_intermediate_size={experts}{per_rank}"] = experts // size
    for what, n in rows.items():
        if n % block:
            raise ValueError(f"block-quantized FP8 weights (weight_block_size [{block}, {block}]): {what} = {n} is not "
                             f"a multiple of {block}, so a fused-projection or tensor-parallel shard boundary would fall "
                             "inside a weight block")
