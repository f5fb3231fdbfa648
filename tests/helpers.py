"""Shared test utilities: tiny random models and greedy parity with HF transformers."""
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, LlamaConfig, MixtralConfig, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "Hello, world! How are you today?",
    "list all prime numbers within 100", "introduce yourself", "What is the capital of France?",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "2 3 5 7 11 13 17 19 23 29 31 37 41 43 47 53 59 61 67 71 73 79 83 89 97",
    "def main():\n    print('hello')\n", "Über café naïve — ünïcödé 東京 🚀",
] * 20


# A Qwen3-like chat template, trimmed: tools listed in the system turn, assistant tool calls as
# <tool_call> blocks, tool results as <tool_response> user turns, and enable_thinking=False closing
# an empty <think> block in the generation prompt.
QWEN3_LIKE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}"
    "\n</tool_response><|im_end|>\n{% elif m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}\n<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}")
REASONING_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


def make_tokenizer(path: str, vocab_size: int = 400, extra_tokens=(), chat_template: str = CHATML):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None)
    fast.add_tokens(list(extra_tokens))  # plain (not special) added tokens, as Qwen3's <think>
    fast.chat_template = chat_template
    fast.save_pretrained(path)
    return fast


ARCHS = {
    # head_dim 32 != hidden/heads = 16; GQA ratio 2; tied embeddings.
    "qwen3": lambda: Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                 max_position_embeddings=1024, tie_word_embeddings=True, rope_theta=10000.0),
    # GQA ratio 3 with qkv bias; untied.
    "qwen2": lambda: Qwen2Config(vocab_size=512, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                 num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024,
                                 tie_word_embeddings=False, rope_theta=1000000.0),
    # A single KV head (ratio 4), Llama-3 rope scaling, untied.
    "llama": lambda: LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=1024,
                                 tie_word_embeddings=False, rope_theta=500000.0,
                                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
    # Multi-head attention (ratio 1), tied.
    "llama_mha": lambda: LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                                     tie_word_embeddings=True),
    # Mixtures of experts. Qwen3-MoE: 8 experts, 2 per token, renormalised; layer 1 dense (mlp_only_layers).
    "qwen3_moe": lambda: Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                                        max_position_embeddings=1024, tie_word_embeddings=False, rope_theta=1000000.0),
    # Not renormalised, 3 of 6 experts, only every second layer sparse (decoder_sparse_step); tied.
    "qwen3_moe_sparse2": lambda: Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=96,
                                                moe_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                                                num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=3,
                                                norm_topk_prob=False, decoder_sparse_step=2,
                                                max_position_embeddings=1024, tie_word_embeddings=True),
    # Mixtral: 4 experts, 2 per token, routing weights kept in fp32.
    "mixtral": lambda: MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=1024, tie_word_embeddings=False),
    # Qwen2-MoE: qkv bias, a sigmoid-gated shared expert beside 6 routed experts.
    "qwen2_moe": lambda: Qwen2MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                        shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, num_experts=6, num_experts_per_tok=2,
                                        max_position_embeddings=1024, tie_word_embeddings=False),
}


def make_model(path: str, arch: str, with_tokenizer: bool = True, seed: int = 0) -> str:
    config = ARCHS[arch]()
    config.initializer_range = 0.25  # peaked distributions: fewer greedy near-ties than HF's 0.02
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    os.makedirs(path, exist_ok=True)
    if with_tokenizer:
        tok = make_tokenizer(path)
        model.config.eos_token_id = tok.eos_token_id
        model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_reasoning_model(path: str) -> str:
    """The tiny random Qwen3 with <think>, </think>, <tool_call>, </tool_call> as single tokens and
    the Qwen3-like template."""
    make_model(path, "qwen3")
    make_tokenizer(path, extra_tokens=REASONING_TOKENS, chat_template=QWEN3_LIKE)
    return path


class HFReference:
    """Greedy continuations and logits from HF transformers (fp32, CPU), cached per model."""

    def __init__(self, path: str):
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self._cache = {}

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new_tokens: int):
        key = (tuple(prompt), max_new_tokens)
        if key not in self._cache:
            out = self.model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                      eos_token_id=None, pad_token_id=0, output_scores=True,
                                      return_dict_in_generate=True, min_new_tokens=max_new_tokens)
            tokens = out.sequences[0, len(prompt):].tolist()
            scores = [s[0].float() for s in out.scores]
            self._cache[key] = (tokens, scores)
        return self._cache[key]

    @torch.no_grad()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([token_ids])).logits[0].float()


NEAR_TIE = 1e-4  # top-2 logit gap (fp32) under which a greedy divergence is a tie, not a bug


def assert_greedy_match(ours: list[int], hf_tokens: list[int], hf_scores: list[torch.Tensor], what: str = ""):
    """Token-exact, except that at a near-tie in the reference the two may pick either token;
    after such a divergence the continuations are no longer comparable."""
    for i, (a, b) in enumerate(zip(ours, hf_tokens)):
        if a == b:
            continue
        top2 = hf_scores[i].topk(2)
        gap = float(top2.values[0] - top2.values[1])
        tied = gap < NEAR_TIE and a in top2.indices.tolist()
        assert tied, (f"{what}: token {i} differs (ours {a}, HF {b}); HF top-2 gap {gap:.3g} is not a near-tie\n"
                      f"ours {ours}\nHF   {hf_tokens}")
        return
    assert len(ours) == len(hf_tokens), f"{what}: lengths differ: {len(ours)} vs {len(hf_tokens)}"


def check_block_manager(bm, live):
    """A BlockManager's invariants, given the sequences that hold blocks: reference counts equal
    the block tables (plus the pinned copy sources); the free list holds exactly the unreferenced
    blocks; the prefix index is sorted and agrees with the blocks."""
    refs = [0] * bm.num_blocks
    for seq in live:
        for b in seq.block_table:
            refs[b] += 1
    for b in bm._pinned:
        refs[b] += 1
    assert [blk.ref_count for blk in bm.blocks] == refs
    assert set(bm.free_blocks) == {i for i, r in enumerate(refs) if r == 0}
    indexed = set()
    for parent, entries in bm.children.items():
        assert entries == sorted(entries) and entries
        for tokens, b in entries:
            blk = bm.blocks[b]
            assert blk.token_ids == tokens and blk.parent == parent and b not in indexed
            indexed.add(b)
    assert indexed == {blk.block_id for blk in bm.blocks if blk.token_ids is not None}
    assert all(bm.blocks[b].hash == h and len(bm.blocks[b].token_ids) == bm.block_size
               for h, b in bm.hash_to_block.items())


# ---- processes, from /proc (psutil-free) ------------------------------------------------------
def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process."""
    table = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        table[int(entry)] = (int(fields[1]), fields[0])
    return table


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    state = _process_table().get(pid)
    return state is not None and state[1] != "Z"


def children(pid: int) -> list[int]:
    """pid's live children."""
    return sorted(p for p, (parent, state) in _process_table().items() if parent == pid and state != "Z")


def descendants(pid: int) -> list[int]:
    """Every live process below pid: its children, their children, ..."""
    table = _process_table()
    found, frontier = [], {pid}
    while frontier:
        frontier = {p for p, (parent, state) in table.items() if parent in frontier and state != "Z"}
        found += sorted(frontier)
    return found



def whitespace_token_ids(tokenizer) -> list[int]:
    """Tokens whose text is only whitespace: a random model under a JSON grammar (which allows any
    whitespace between elements) can loop on them; `logit_bias` keeps it from doing so in tests."""
    return [i for i in range(len(tokenizer)) if (t := tokenizer.decode([i])) and not t.strip()]


def script_model(engine, token_ids: list[int]):
    """Make the engine's model "write" token_ids, then eos: at output position i the logits of
    token_ids[i] get +1000, so a greedy request follows the script wherever a grammar mask allows
    it (and its own logits decide where not). For tests of output parsing."""
    sampler = engine.model_runner.sampler
    script = torch.tensor(list(token_ids) + [engine.config.eos])
    inner = getattr(sampler, "_unscripted", sampler.sample)
    sampler._unscripted = inner

    def sample(logits, meta):
        pos = meta.offsets.clamp(max=len(script) - 1)
        logits = logits.clone()
        logits[torch.arange(len(pos)), script.to(logits.device)[pos]] += 1000.0
        return inner(logits, meta)
    sampler.sample = sample


# ---- block-FP8 checkpoints ---------------------------------------------------------------------
FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [128, 128]}
# A tiny Qwen3 whose linears quantize into 128x128 blocks, with partial blocks at the hidden size's
# edges (200 = 128 + 72). Fused partitions fill whole blocks (q 4x128, k/v 2x128, gate/up 256), also
# per rank under tensor_parallel_size=2 (vLLM's rule for block-quantized shards).
FP8_QWEN3 = dict(vocab_size=512, hidden_size=200, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=128, max_position_embeddings=1024, tie_word_embeddings=False,
                 rope_theta=10000.0)
_FP8_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# A tiny Qwen3-MoE in the same format: experts of 128 rows (gate and up each one block), hidden 200
# (partial blocks), layer 1 dense (mlp_only_layers); the router stays in the model dtype, as the
# Qwen3-*-FP8 releases leave it.
FP8_QWEN3_MOE = dict(FP8_QWEN3, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                     mlp_only_layers=[1], decoder_sparse_step=1)


def make_fp8_model(path: str, ref_path: str, seed: int = 0, kv_scales: dict | None = None, moe: bool = False,
                   **overrides) -> str:
    """A random Qwen3 (moe: Qwen3-MoE) written as a block-FP8 checkpoint at `path` (float8 weights +
    weight_scale_inv, quantization_config in config.json, a tokenizer), and the same model with those
    weights dequantized (weight * scale, fp32) as a plain checkpoint at `ref_path`, HF transformers'
    reference. kv_scales: optional extra tensors (e.g. `model.layers.0.self_attn.k_scale`) for the FP8
    checkpoint."""
    import json

    from safetensors.torch import load_file, save_file
    config = (Qwen3MoeConfig(**{**FP8_QWEN3_MOE, **overrides}) if moe else Qwen3Config(**{**FP8_QWEN3, **overrides}))
    config.initializer_range = 0.25
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tok = make_tokenizer(path)
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    quantized = _round_through_fp8(model)
    model.save_pretrained(ref_path, safe_serialization=True)
    tensors = {}
    for name, tensor in load_file(os.path.join(ref_path, "model.safetensors")).items():
        if name in quantized:
            q, scale = quantized.pop(name)
            assert torch.equal(tensor, _dequantize(q, scale)), name  # the checkpoint names we assumed
            tensors[name], tensors[name + "_scale_inv"] = q.contiguous(), scale.contiguous()
        else:
            tensors[name] = tensor
    assert not quantized, sorted(quantized)[:4]
    tensors.update(kv_scales or {})
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(ref_path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def _dequantize(q, scale):
    from nanovllm.layers.quantization.fp8 import dequantize_weight_blocks
    return dequantize_weight_blocks(q, scale)


@torch.no_grad()
def _round_through_fp8(model) -> dict:
    """Every projection of an HF model rounded through block FP8 in place; returns (float8 weight,
    scales) by checkpoint tensor name. transformers holds a MoE layer's experts fused ([E, 2I, H]
    gate_up_proj, [E, H, I] down_proj) and saves them one tensor per expert and projection."""
    from nanovllm.layers.quantization.fp8 import quantize_weight_blocks
    out = {}
    for name, param in model.named_parameters():
        if name.rsplit(".", 2)[-2] in _FP8_PROJECTIONS:
            q, scale = quantize_weight_blocks(param)
            param.copy_(_dequantize(q, scale))
            out[name] = (q, scale)
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            prefix, fused = name.rsplit(".", 1)
            for e in range(param.shape[0]):
                q, scale = quantize_weight_blocks(param[e])
                param[e].copy_(_dequantize(q, scale))
                if fused == "down_proj":
                    out[f"{prefix}.{e}.down_proj.weight"] = (q, scale)
                    continue
                rows, blocks = q.shape[0] // 2, scale.shape[0] // 2  # gate, then up: whole blocks each
                out[f"{prefix}.{e}.gate_proj.weight"] = (q[:rows], scale[:blocks])
                out[f"{prefix}.{e}.up_proj.weight"] = (q[rows:], scale[blocks:])
    return out


def long_context_copy(model_dir: str, dest: str, positions: int = 8192) -> str:
    """A copy of a tiny model that allows `positions` positions (rotary weights do not depend on the
    length): requests long enough that no machine finishes them within a test's time window."""
    import json
    import shutil
    shutil.copytree(model_dir, dest)
    with open(f"{dest}/config.json") as f:
        config = json.load(f)
    config["max_position_embeddings"] = positions
    with open(f"{dest}/config.json", "w") as f:
        json.dump(config, f)
    return dest



def prefilled_sequences(runner, prompts: list[list[int]], room: int) -> list:
    """Greedy sequences whose prompts but the last token are in the runner's KV cache (as after a
    prefill), each with blocks for `room` more tokens: the inputs of a hand-built verification step."""
    from nanovllm import SamplingParams
    from nanovllm.engine.scheduler import ScheduledBatch
    from nanovllm.engine.sequence import Sequence
    seqs, next_block = [], 0
    for i, prompt in enumerate(prompts):
        seq = Sequence(list(prompt), SamplingParams(temperature=0.0), seed=i)
        num = -(-(len(prompt) + room) // runner.block_size)
        seq.block_table = list(range(next_block, next_block + num))
        next_block += num
        seqs.append(seq)
    runner.execute(ScheduledBatch(seqs, [len(p) - 1 for p in prompts], num_decodes=0)).token_ids()
    for seq in seqs:
        seq.num_computed_tokens = seq.num_tokens - 1
    return seqs
