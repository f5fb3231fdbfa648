from nanovllm.models.llama import DecoderForCausalLM, LlamaForCausalLM
from nanovllm.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from nanovllm.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def get_model_class(hf_config) -> type[DecoderForCausalLM]:
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(f"unsupported model architecture {archs or '(none in config.json)'}; "
                     f"supported: {', '.join(sorted(MODEL_REGISTRY))}")


def check_model_config(hf_config, quant_config=None):
    """Raise, naming the field, before anything is built if this config cannot be served as written."""
    model_cls = get_model_class(hf_config)
    model_cls.check_config(hf_config)
    if quant_config is not None and not model_cls.supports_quantization:
        raise ValueError(f"quantization={quant_config.name!r}: {model_cls.__name__} has no quantized layers yet "
                         "(Qwen2-MoE's shared expert has no FP8 form); serve the 16-bit checkpoint")
