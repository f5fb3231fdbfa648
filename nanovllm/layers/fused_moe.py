"""The mixture-of-experts feed-forward block (Qwen3-MoE, Qwen2-MoE, Mixtral), behind the dense MLP's
seam: x [T, H] in, the layer's output for the next residual-add RMSNorm out.

Router `gate` (replicated [E, H]) -> softmax -> top-k -> optional renormalisation -> each token
through its k experts (`experts.w13` = [gate | up] [E, 2I, H] and `experts.w2` [E, H, I], every
expert's I split across tensor-parallel ranks like the dense MLP) -> the routing-weighted sum; Qwen2-MoE
adds a shared expert scaled by sigmoid(shared_expert_gate(x)). One all-reduce per layer.

- GPU: Triton kernels (kernels/moe_routing.py, kernels/moe_gemm.py) with static shapes and no host
  sync, so both graph kinds capture the block; on one rank the output is the k (+ shared) weighted
  slices as a `SplitKOutput`, summed by the next RMSNorm as it loads them.
- CPU: HF transformers' arithmetic op for op (its eager experts loop: experts in ascending id, each
  token's weighted output added in the activation dtype), so greedy output matches it token for token.
- Block-FP8 checkpoints (Qwen3-30B-A3B-FP8): the experts load as float8 with their block scales
  (layers/quantization/fp8.py `Fp8ExpertsMethod`); on the GPU the grouped GEMMs take them as they are,
  the activations quantized in 1 x 128 groups (W8A8), on the CPU they are dequantized once loaded. The
  router stays 16-bit.
"""
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed import all_reduce, tp_rank, tp_size
from nanovllm.layers.activation import silu_and_mul
from nanovllm.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear

MAX_EXPERTS = 1024  # the top-k kernel holds a token block's E probabilities in registers


def record_routing() -> bool:
    """NANOVLLM_RECORD_ROUTING=1 (bench.py sets it before the engine starts; tensor-parallel workers
    inherit it): count, per forward pass and MoE layer, the distinct experts the router chose, for a
    roofline that reads the weights of those experts only."""
    return os.environ.get("NANOVLLM_RECORD_ROUTING", "0") == "1"


class RoutingStats(NamedTuple):
    """The record of the router's choices on the layer's device: per forward pass the number of
    distinct experts routed to, in a ring of `distinct.numel()` entries, the next at `step % ring`
    (written by the align kernel on the GPU, so CUDA graphs record too)."""
    distinct: torch.Tensor  # [ring] int32
    step: torch.Tensor      # [1] int32: forward passes recorded so far

    @classmethod
    def create(cls, ring: int = 1 << 14) -> "RoutingStats":
        """On the default device (the model is built inside its device's context)."""
        return cls(torch.zeros(ring, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))

    def record(self, ids: torch.Tensor):
        """The torch path's record (CPU)."""
        step = int(self.step)
        self.distinct[step % self.distinct.numel()] = torch.unique(ids).numel()
        self.step.add_(1)


class StackedExperts(nn.Module):
    """Every expert's weights in two tensors; checkpoint tensors (one per expert and projection)
    land in their slice through the parameters' `weight_loader(param, tensor, (expert, shard))`.
    With a quantization config its experts method creates the parameters (block-FP8: float8 weights
    and their `w13_scale_inv` / `w2_scale_inv` block scales, loaded by `scale_loader`) and finishes
    them once loaded (`quant_method.process_weights_after_loading`, as for linear layers)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, quant_config=None):
        super().__init__()
        if intermediate_size % tp_size():
            raise ValueError(f"{intermediate_size} is not divisible by tensor_parallel_size={tp_size()}")
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size // tp_size()  # this rank's share
        shapes = {"w13": (num_experts, 2 * self.intermediate_size, hidden_size),
                  "w2": (num_experts, hidden_size, self.intermediate_size)}
        self.quant_method = None if quant_config is None else quant_config.experts_method(torch.get_default_device())
        if self.quant_method is None:
            for name, shape in shapes.items():
                setattr(self, name, nn.Parameter(torch.empty(shape), requires_grad=False))
        else:
            self.quant_method.create_weights(self, shapes)
        for name, shards in (("w13", 2), ("w2", 1)):
            for param, loader in ((getattr(self, name), self.weight_loader),
                                  (getattr(self, name + "_scale_inv", None), self.scale_loader)):
                if param is not None:
                    param.weight_loader = loader
                    param.num_shards = num_experts * shards  # the loader checks that every one arrived

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int]):
        """shard_id = (expert, 0 for gate / 1 for up); w2 takes (expert, 0)."""
        if param.dtype == torch.float8_e4m3fn and loaded.dtype != param.dtype:
            raise ValueError(f"expert {shard_id[0]} weight is {loaded.dtype}, expected float8_e4m3fn with its "
                             "weight_scale_inv: experts left unquantized in an FP8 checkpoint are not supported")
        self._load_slice(param is self.w13, param, loaded, shard_id, self.intermediate_size, self.hidden_size,
                         "weight", "hidden_size x the experts' intermediate size in the config")

    def scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int]):
        """One expert projection's block scales ([ceil(N/128), ceil(K/128)] of its [N, K] weight) into
        `w13_scale_inv` / `w2_scale_inv`, this rank's blocks: the intermediate size per rank fills
        whole blocks (models/llama.py `check_block_quantization`), so gate, up and the shards stack."""
        block = param.block_size
        self._load_slice(param is self.w13_scale_inv, param, loaded, shard_id, self.intermediate_size // block,
                         -(-self.hidden_size // block), "weight_scale_inv",
                         f"one scale per {block}x{block} block of the expert's weight")

    def _load_slice(self, gate_up: bool, param, loaded, shard_id, local: int, hidden: int, what: str, why: str):
        """This rank's `local` rows (gate_up: of the gate or up half, by shard) or columns (down) of one
        expert's checkpoint tensor, [local * ranks, hidden] or [hidden, local * ranks], into param[expert]."""
        expert, which = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint has expert {expert}, but the config has num_experts={self.num_experts}")
        full = local * tp_size()
        if gate_up:
            expected, dim, dst = (full, hidden), 0, param.data[expert, which * local:(which + 1) * local]
        else:
            expected, dim, dst = (hidden, full), 1, param.data[expert]
        if tuple(loaded.shape) != expected:
            raise ValueError(f"expert {expert} {what} has shape {tuple(loaded.shape)}, expected {expected} ({why})")
        dst.copy_(loaded.narrow(dim, tp_rank() * local, local))


class SharedExpert(nn.Module):
    """Qwen2-MoE's always-on expert: a SwiGLU MLP whose down projection stays a rank-local partial,
    summed with the routed experts' in the block's one all-reduce."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.library_linear(self.gate_up_proj.swiglu(x), None)


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 round_weights: bool, shared_intermediate_size: int = 0, quant_config=None):
        """round_weights: the routing weights are rounded to the activation dtype before they scale
        the experts' outputs (HF's Qwen routers; Mixtral's stay fp32). quant_config: the experts'
        (the router stays in the model dtype, as quantized checkpoints leave it)."""
        super().__init__()
        self.top_k, self.renormalize, self.round_weights = top_k, renormalize, round_weights
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size, quant_config)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_expert = SharedExpert(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1)
        self.routing_stats = RoutingStats.create() if record_routing() else None

    def forward(self, x: torch.Tensor, meta=None):
        """meta: the step's AttentionMetadata; on the GPU its slot_mapping tells a CUDA graph's padding
        rows (slot -1), which then read no expert that a real row does not."""
        logits = self.gate(x)  # [T, E] in the activation dtype
        if x.is_cuda:
            return self._forward_kernels(x, logits, None if meta is None else meta.slot_mapping)
        weights, ids = self.route_torch(logits)
        if self.routing_stats is not None:
            self.routing_stats.record(ids)
        out = self.experts_torch(x, weights, ids)
        if self.shared_expert is not None:
            out = out + self._shared(x)
        return all_reduce(out)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    # ---- CPU: HF's arithmetic ------------------------------------------------------------
    def route_torch(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return (weights.to(logits.dtype) if self.round_weights else weights), ids

    def experts_torch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.experts.w13, self.experts.w2
        out = torch.zeros_like(x)
        for expert in torch.unique(ids).tolist():
            slot, token = torch.where((ids == expert).T)  # HF's order: by slot, then token
            gate_up = F.linear(x[token], w13[expert])
            h = F.linear(silu_and_mul(gate_up), w2[expert]) * weights[token, slot, None]
            out.index_add_(0, token, h.to(out.dtype))
        return out

    # ---- GPU: Triton kernels ------------------------------------------------------------
    def _forward_kernels(self, x: torch.Tensor, logits: torch.Tensor, slots: torch.Tensor | None = None):
        from nanovllm.kernels.gemm import SplitKOutput
        from nanovllm.kernels.moe_gemm import moe_config, moe_down, moe_gate_up, parts_dtype
        from nanovllm.kernels.moe_routing import route
        t, h = x.shape
        experts = self.experts
        fp8 = experts.quant_method is not None  # block-FP8 experts: W8A8, activations in 1 x 128 groups
        config = moe_config(t, h, experts.intermediate_size, x.dtype, fp8)
        routing = route(logits, self.top_k, config.block_m, self.renormalize, self.round_weights,
                        self.routing_stats, slots)
        num_parts = self.top_k + (self.shared_expert is not None)
        parts = torch.empty(num_parts, t, h, dtype=parts_dtype(t, h, num_parts, x.dtype), device=x.device)
        if fp8:
            from nanovllm.kernels.fp8_quant import per_token_group_quant
            act = moe_gate_up(per_token_group_quant(x), experts.w13, routing, config.gate_up, experts.w13_scale_inv)
            moe_down(per_token_group_quant(act), experts.w2, routing, config.down, parts, experts.w2_scale_inv)
        else:
            act = moe_gate_up(x, experts.w13, routing, config.gate_up)
            moe_down(act, experts.w2, routing, config.down, parts)
        if self.shared_expert is not None:
            parts[self.top_k].copy_(self._shared(x))
        if tp_size() > 1:
            return all_reduce(parts.sum(0, dtype=torch.float32).to(x.dtype))
        return SplitKOutput(parts, x.dtype)
