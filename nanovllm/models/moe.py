"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE (with its shared expert) and Mixtral.

The llama.py decoder, with `SparseMoeBlock` (layers/fused_moe.py) in place of the dense MLP in the
sparse layers. Checkpoints as HF writes them (one tensor per expert and projection,
`...experts.{e}.gate_proj.weight`) load into the stacked expert weights through their weight_loaders
(models/loader.py, `expert_projections`). A config asking for an MoE feature we do not implement is
refused at load, naming the field. Block-FP8 checkpoints load too (Qwen2-MoE's excepted): the attention
and dense projections as in dense models, the experts through `Fp8ExpertsMethod` (grouped W8A8 GEMMs on the
GPU).
"""
from typing import NamedTuple

from nanovllm.layers.fused_moe import MAX_EXPERTS, SparseMoeBlock
from nanovllm.models.llama import DecoderForCausalLM
from nanovllm.models.qwen import Qwen3ForCausalLM


class MoeSpec(NamedTuple):
    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    round_weights: bool
    shared_intermediate_size: int = 0


def _positive_int(config, field: str, minimum: int = 1) -> int:
    value = getattr(config, field, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"config {field}={value!r}: must be an integer >= {minimum}")
    return value


# Routing features of other MoE families that these architectures do not have: a config that sets one
# expects it to apply, and we would silently ignore it (field -> values that mean "off").
_FOREIGN_FEATURES = {
    "scoring_func": (None, "softmax"), "topk_method": (None, "greedy"), "n_group": (None, 0, 1),
    "topk_group": (None, 0, 1), "routed_scaling_factor": (None, 1, 1.0), "n_shared_experts": (None, 0),
    "moe_router_activation_func": (None, "softmax"),
}


class MoeForCausalLM(DecoderForCausalLM):
    # checkpoint expert projection -> (stacked parameter of `experts`, shard: 0 gate, 1 up)
    expert_projections = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}

    supports_quantization = True  # block FP8: the attention and dense projections and the experts

    def __init__(self, config, quant_config=None):
        self.check_config(config)
        super().__init__(config, quant_config)

    @classmethod
    def moe_spec(cls, config) -> MoeSpec:
        raise NotImplementedError

    @classmethod
    def is_sparse(cls, config, layer_idx: int) -> bool:
        """HF's rule for the Qwen MoE families: experts unless the layer is listed in mlp_only_layers,
        in every decoder_sparse_step-th layer."""
        return (layer_idx not in (config.mlp_only_layers or []) and config.num_experts > 0
                and (layer_idx + 1) % config.decoder_sparse_step == 0)

    @classmethod
    def make_mlp(cls, config, layer_idx: int, quant_config=None):
        if not cls.is_sparse(config, layer_idx):
            return None  # the dense MLP
        return SparseMoeBlock(config.hidden_size, *cls.moe_spec(config), quant_config=quant_config)

    @classmethod
    def check_config(cls, config):
        """Refuse, naming the field, what we would otherwise get wrong."""
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config hidden_act={act!r}: only SiLU-gated (SwiGLU) experts are supported")
        for field, off in _FOREIGN_FEATURES.items():
            value = getattr(config, field, None)
            if value not in off:
                raise ValueError(f"config {field}={value!r}: this MoE routing feature is not supported "
                                 f"by {cls.__name__} (supported: {off[-1]!r})")
        # Qwen configs switch the window on with use_sliding_window (sliding_window alone is a default);
        # Mixtral's has only sliding_window.
        uses, window = getattr(config, "use_sliding_window", None), getattr(config, "sliding_window", None)
        if uses or (uses is None and window is not None):
            raise ValueError(f"config sliding_window={window!r}" + ("" if uses is None else " with use_sliding_window=true")
                             + ": sliding-window attention is not supported")
        _positive_int(config, "num_hidden_layers")
        spec = cls.moe_spec(config)
        if spec.num_experts > MAX_EXPERTS:
            raise ValueError(f"config num_experts={spec.num_experts}: at most {MAX_EXPERTS} experts are supported")
        if not 1 <= spec.top_k <= max(spec.num_experts, 1):
            raise ValueError(f"config num_experts_per_tok={spec.top_k}: must be in [1, {spec.num_experts}] "
                             "(the number of experts)")


class Qwen3MoeForCausalLM(MoeForCausalLM):
    @classmethod
    def switches(cls, config):
        return Qwen3ForCausalLM.switches(config)  # q/k norm, optional attention bias

    @classmethod
    def moe_spec(cls, config):
        return MoeSpec(_positive_int(config, "num_experts", 0), _positive_int(config, "num_experts_per_tok"),
                       _positive_int(config, "moe_intermediate_size"), cls._norm_topk_prob(config), True)

    @classmethod
    def _norm_topk_prob(cls, config) -> bool:
        value = getattr(config, "norm_topk_prob", False)
        if not isinstance(value, bool):
            raise ValueError(f"config norm_topk_prob={value!r}: must be true or false")
        return value

    @classmethod
    def check_config(cls, config):
        super().check_config(config)
        _positive_int(config, "decoder_sparse_step")
        layers = config.mlp_only_layers or []
        if not isinstance(layers, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                             for i in layers):
            raise ValueError(f"config mlp_only_layers={config.mlp_only_layers!r}: must be a list of layer indices")


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen1.5/Qwen2-MoE: qkv bias, no q/k norm, and a shared expert in every sparse layer."""
    supports_quantization = False  # the shared expert has no FP8 form

    @classmethod
    def switches(cls, config):
        return dict(qkv_bias=bool(getattr(config, "qkv_bias", True)), o_bias=False, qk_norm=False, mlp_bias=False)

    @classmethod
    def moe_spec(cls, config):
        return Qwen3MoeForCausalLM.moe_spec(config)._replace(
            shared_intermediate_size=_positive_int(config, "shared_expert_intermediate_size"))


class MixtralForCausalLM(MoeForCausalLM):
    """Every layer sparse, top-k always renormalised, routing weights kept in fp32 (HF's Mixtral)."""
    expert_projections = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", 0)}
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}

    @classmethod
    def switches(cls, config):
        return dict(qkv_bias=False, o_bias=False, qk_norm=False, mlp_bias=False)

    @classmethod
    def is_sparse(cls, config, layer_idx):
        return True

    @classmethod
    def moe_spec(cls, config):
        return MoeSpec(_positive_int(config, "num_local_experts"), _positive_int(config, "num_experts_per_tok"),
                       _positive_int(config, "intermediate_size"), True, False)
