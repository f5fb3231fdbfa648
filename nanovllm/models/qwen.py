"""Qwen2/Qwen2.5 (bias on q, k, v) and Qwen3 (per-head RMSNorm on q and k)."""
from nanovllm.models.llama import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def switches(cls, config):
        return dict(qkv_bias=True, o_bias=False, qk_norm=False, mlp_bias=False)


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def switches(cls, config):
        bias = bool(getattr(config, "attention_bias", False))
        return dict(qkv_bias=bias, o_bias=bias, qk_norm=True, mlp_bias=False)
