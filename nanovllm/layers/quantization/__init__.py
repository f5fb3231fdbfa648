"""Weight quantization behind a small interface (base.py): a `QuantizationConfig` parsed from the
checkpoint's config.json (or asked for with `Config.quantization`) gives each linear layer a
`LinearMethod`; layers without one keep their plain path. Block FP8 (fp8.py) is the one method."""
from nanovllm.layers.quantization.base import ActivationQuant, LinearMethod, QuantizationConfig, input_quant
from nanovllm.layers.quantization.fp8 import Fp8Config

QUANTIZATION_METHODS = {"fp8": Fp8Config}


def resolve_quantization(quantization: str | None, hf_config, load_format: str) -> QuantizationConfig | None:
    """The quantization a model is built with: the checkpoint's `quantization_config` (validated), or
    `quantization` for a checkpoint without one (its weights, or random ones, are quantized once
    loaded). Raises ValueError naming the field or value we cannot honour."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be None or one of {sorted(QUANTIZATION_METHODS)}, got {quantization!r}")
    stored = getattr(hf_config, "quantization_config", None)
    if stored is not None:
        if hasattr(stored, "to_dict"):
            stored = stored.to_dict()
        method = stored.get("quant_method") if isinstance(stored, dict) else None
        if method not in QUANTIZATION_METHODS:
            raise ValueError(f"the checkpoint's quantization_config.quant_method={method!r} is not supported; "
                             f"supported: {sorted(QUANTIZATION_METHODS)}")
        if quantization is not None and quantization != method:
            raise ValueError(f"quantization={quantization!r} was asked for, but the checkpoint is quantized with "
                             f"{method!r}")
        return QUANTIZATION_METHODS[method].parse(stored, from_checkpoint=load_format != "dummy")
    if quantization is None:
        return None
    return QUANTIZATION_METHODS[quantization](from_checkpoint=False)


__all__ = ["ActivationQuant", "LinearMethod", "QuantizationConfig", "QUANTIZATION_METHODS", "input_quant",
           "resolve_quantization"]
