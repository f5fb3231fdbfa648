"""bench.py's roofline: the ideal time of a recorded schedule from the bytes each step must move (weights,
and for a mixture of experts only the experts the step routed to, plus the KV its decode rows read) and the
FLOPs of its prompt tokens, over the bandwidth and matmul rate measured in the same run."""
import math

import torch


def _matrix_bytes(shapes, dtype_bytes: int, fp8: bool) -> float:
    """Bytes of weight matrices [N, K]: block FP8 is one byte a value plus an fp32 scale per 128x128 block."""
    if fp8:
        return sum(n * k + 4 * -(-n // 128) * -(-k // 128) for n, k in shapes)
    return sum(n * k for n, k in shapes) * dtype_bytes


def architecture_costs(cfg, dtype_bytes: int = 2, fp8_weights: bool = False, kv_dtype_bytes: int | None = None) -> dict:
    """Per-step weight bytes and per-token FLOPs of the architecture in config.json. A mixture of experts
    splits its weights into what every step reads (attention, routers, dense layers, shared experts, the
    LM head) and one expert's weights, read once per step for each (layer, expert) the step routes to.
    fp8_weights: the projections (and experts) are block FP8; the routers, norms and LM head stay 16-bit.
    kv_dtype_bytes: the KV cache's bytes per value (default: dtype_bytes)."""
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or h // heads
    attention = [((heads + 2 * kv_heads) * d, h), (h, heads * d)]  # [N, K] each
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if "num_local_experts" in cfg:  # Mixtral: every layer sparse, experts of intermediate_size
        sparse, expert_inter = layers, cfg["intermediate_size"]
    else:  # the Qwen MoE families' rule (models/moe.py)
        only = set(cfg.get("mlp_only_layers") or [])
        step = cfg.get("decoder_sparse_step", 1)
        sparse = sum(1 for i in range(layers) if experts and i not in only and (i + 1) % step == 0)
        expert_inter = cfg.get("moe_intermediate_size", 0)
    top_k = cfg.get("num_experts_per_tok", 0) if sparse else 0
    shared_inter = cfg.get("shared_expert_intermediate_size", 0) if sparse else 0
    mlp = lambda inter: [(2 * inter, h), (h, inter)]  # gate+up, down
    shared = (mlp(shared_inter) if shared_inter else [])
    shared_gate = h if shared_inter else 0  # Qwen2-MoE's sigmoid gate of the shared expert
    expert_params = 3 * h * expert_inter
    dense_params = (layers * (sum(n * k for n, k in attention)) + (layers - sparse) * 3 * h * cfg["intermediate_size"]
                    + sparse * (experts * h + sum(n * k for n, k in shared) + shared_gate))
    active_params = dense_params + sparse * top_k * expert_params  # per token, without the LM head
    dense_bytes = (layers * _matrix_bytes(attention, dtype_bytes, fp8_weights)
                   + (layers - sparse) * _matrix_bytes(mlp(cfg["intermediate_size"]), dtype_bytes, fp8_weights)
                   + sparse * (_matrix_bytes(shared, dtype_bytes, fp8_weights) + (experts * h + shared_gate) * dtype_bytes)
                   + vocab * h * dtype_bytes)
    return {"dense_weight_bytes": dense_bytes,
            "expert_bytes": _matrix_bytes(mlp(expert_inter), dtype_bytes, fp8_weights) if expert_inter else 0,
            "sparse_layers": sparse, "num_experts": experts, "active_params": active_params,
            "kv_bytes_per_token": 2 * layers * kv_heads * d * (kv_dtype_bytes or dtype_bytes),
            "layers": layers, "heads": heads, "head_dim": d}


def roofline(cfg, steps, bandwidth: float, flops: float, dtype_bytes: int = 2,
             routed_experts: list[int] | None = None, fp8_weights: bool = False, kv_dtype_bytes: int | None = None,
             fp8_flops: float | None = None) -> dict:
    """Ideal time of the recorded schedule: bytes every step must move over the measured bandwidth,
    plus prefill FLOPs over the measured matmul rate (the projections' at fp8_flops when the weights
    are FP8 and it was measured). routed_experts: per step, the (layer, expert) pairs its router
    chose, summed over the MoE layers; without it every expert counts every step."""
    c = architecture_costs(cfg, dtype_bytes, fp8_weights, kv_dtype_bytes)
    layers, heads, d = c["layers"], c["heads"], c["head_dim"]
    linear_rate = fp8_flops if fp8_weights and fp8_flops and not math.isnan(fp8_flops) else flops
    if routed_experts is None:
        routed_experts = [c["sparse_layers"] * c["num_experts"]] * len(steps)
    assert len(routed_experts) == len(steps), (len(routed_experts), len(steps))
    decode_bytes = prefill_flops = prefill_time = 0.0
    step_ideal = []
    for (num_decodes, new, ctx, computed), routed in zip(steps, routed_experts):
        # Memory: the weights once per step (of the experts routed to), plus the KV every decode row reads.
        step_bytes = c["dense_weight_bytes"] + c["expert_bytes"] * routed + c["kv_bytes_per_token"] * sum(ctx[:num_decodes])
        linear_flops = attention_flops = 0.0
        for n, start in zip(new[num_decodes:], computed[num_decodes:]):
            linear_flops += 2 * c["active_params"] * n
            # causal attention: QK^T and PV over each new token's context
            attention_flops += 4 * layers * heads * d * (n * start + n * (n + 1) / 2)
        step_compute = linear_flops / linear_rate + attention_flops / flops
        decode_bytes += step_bytes
        prefill_flops += linear_flops + attention_flops
        prefill_time += step_compute
        step_ideal.append(step_bytes / bandwidth + step_compute)
    t_mem = decode_bytes / bandwidth
    return {"weight_bytes_per_step": c["dense_weight_bytes"] + c["expert_bytes"] * c["sparse_layers"] * c["num_experts"],
            "kv_bytes_per_token": c["kv_bytes_per_token"], "bytes_moved": decode_bytes, "prefill_flops": prefill_flops,
            "ideal_time_s": t_mem + prefill_time, "steps": len(steps), "step_ideal_s": step_ideal}


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
