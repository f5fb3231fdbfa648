"""bench.py's roofline: the ideal time of a recorded schedule from the bytes each step must move (weights,
and for a mixture of experts only the experts the step routed to, plus the KV its decode rows read) and the
FLOPs of its prompt tokens, over the bandwidth and matmul rate measured in the same run."""
import torch


def architecture_costs(cfg, dtype_bytes: int = 2) -> dict:
    """Per-step weight bytes and per-token FLOPs of the architecture in config.json. A mixture of experts
    splits its weights into what every step reads (attention, routers, dense layers, shared experts, the
    LM head) and one expert's weights, read once per step for each (layer, expert) the step routes to."""
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or h // heads
    attention = h * (heads + 2 * kv_heads) * d + heads * d * h
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if "num_local_experts" in cfg:  # Mixtral: every layer sparse, experts of intermediate_size
        sparse, expert_inter = layers, cfg["intermediate_size"]
    else:  # the Qwen MoE families' rule (models/moe.py)
        only = set(cfg.get("mlp_only_layers") or [])
        step = cfg.get("decoder_sparse_step", 1)
        sparse = sum(1 for i in range(layers) if experts and i not in only and (i + 1) % step == 0)
        expert_inter = cfg.get("moe_intermediate_size", 0)
    top_k = cfg.get("num_experts_per_tok", 0) if sparse else 0
    shared = 3 * h * cfg.get("shared_expert_intermediate_size", 0) + h if sparse and "shared_expert_intermediate_size" in cfg else 0
    expert_params = 3 * h * expert_inter
    dense_mlp = 3 * h * cfg["intermediate_size"]
    dense_params = layers * attention + (layers - sparse) * dense_mlp + sparse * (experts * h + shared)
    active_params = dense_params + sparse * top_k * expert_params  # per token, without the LM head
    return {"dense_weight_bytes": (dense_params + vocab * h) * dtype_bytes, "expert_bytes": expert_params * dtype_bytes,
            "sparse_layers": sparse, "num_experts": experts, "active_params": active_params,
            "kv_bytes_per_token": 2 * layers * kv_heads * d * dtype_bytes, "layers": layers, "heads": heads, "head_dim": d}


def roofline(cfg, steps, bandwidth: float, flops: float, dtype_bytes: int = 2,
             routed_experts: list[int] | None = None) -> dict:
    """Ideal time of the recorded schedule: bytes every step must move over the measured bandwidth,
    plus prefill FLOPs over the measured matmul rate. routed_experts: per step, the (layer, expert)
    pairs its router chose, summed over the MoE layers; without it every expert counts every step."""
    c = architecture_costs(cfg, dtype_bytes)
    layers, heads, d = c["layers"], c["heads"], c["head_dim"]
    if routed_experts is None:
        routed_experts = [c["sparse_layers"] * c["num_experts"]] * len(steps)
    assert len(routed_experts) == len(steps), (len(routed_experts), len(steps))
    decode_bytes = prefill_flops = 0.0
    step_ideal = []
    for (num_decodes, new, ctx, computed), routed in zip(steps, routed_experts):
        # Memory: the weights once per step (of the experts routed to), plus the KV every decode row reads.
        step_bytes = c["dense_weight_bytes"] + c["expert_bytes"] * routed + c["kv_bytes_per_token"] * sum(ctx[:num_decodes])
        step_flops = 0.0
        for n, start in zip(new[num_decodes:], computed[num_decodes:]):
            step_flops += 2 * c["active_params"] * n
            # causal attention: QK^T and PV over each new token's context
            step_flops += 4 * layers * heads * d * (n * start + n * (n + 1) / 2)
        decode_bytes += step_bytes
        prefill_flops += step_flops
        step_ideal.append(step_bytes / bandwidth + step_flops / flops)
    t_mem = decode_bytes / bandwidth
    t_compute = prefill_flops / flops
    return {"weight_bytes_per_step": c["dense_weight_bytes"] + c["expert_bytes"] * c["sparse_layers"] * c["num_experts"],
            "kv_bytes_per_token": c["kv_bytes_per_token"], "bytes_moved": decode_bytes, "prefill_flops": prefill_flops,
            "ideal_time_s": t_mem + t_compute, "steps": len(steps), "step_ideal_s": step_ideal}


class RoutingRecord:
    """The router's choices over a run, from the MoE layers' device-side records (layers/fused_moe.py's
    RoutingStats, on with NANOVLLM_RECORD_ROUTING=1 before the engine starts; rank 0's under tensor
    parallelism, whose router sees the same inputs): per forward pass since `start()`, the distinct
    experts each layer routed to, read once at the end."""

    def __init__(self, llm):
        from nanovllm.layers.fused_moe import SparseMoeBlock
        runner = llm.engine.model_runner
        model = getattr(runner, "runner", runner).model  # a tensor-parallel executor holds rank 0's runner
        self.blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock) and m.routing_stats is not None]
        self._start = self._end = None

    def _steps(self) -> list[int]:
        return [int(b.routing_stats.step) for b in self.blocks]

    def start(self):
        self._start = self._steps()

    def stop(self):
        self._end = self._steps()

    def per_step(self) -> list[int] | None:
        """Per forward pass between start() and stop(), the distinct experts summed over the layers."""
        if not self.blocks:
            return None
        counts = []
        for block, first, last in zip(self.blocks, self._start, self._end):
            ring = block.routing_stats.distinct
            assert last - first <= ring.numel(), "more forward passes than the record's ring holds"
            counts.append(ring[torch.arange(first, last) % ring.numel()].tolist())
        assert len({len(c) for c in counts}) == 1, "MoE layers recorded different numbers of passes"
        return [sum(col) for col in zip(*counts)]
