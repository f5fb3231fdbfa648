"""Block-FP8 checkpoints (the Qwen3-*-FP8 format) and the FP8 KV cache on the CPU: a tiny Qwen3
written as float8 weights with 128x128 block scales (partial blocks at the hidden size's edges)
runs greedy-equal to HF transformers on the dequantized weights, alone and over two ranks; bad
quantization configs and shards that cut a block fail at load with the field named; an FP8 cache
holds twice (fp32: four times) the tokens for the same memory and keeps the greedy tokens."""
import json
import os
import random
import shutil

import pytest
import torch

from helpers import FP8_QUANTIZATION_CONFIG, HFReference, assert_greedy_match, make_fp8_model
from nanovllm import LLM, SamplingParams

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _prompts(seed: int, lengths=(1, 4, 17, 40, 90)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    """(FP8 checkpoint, its dequantized twin, HF reference on the twin)."""
    root = tmp_path_factory.mktemp("fp8")
    path, ref = str(root / "fp8"), str(root / "ref")
    os.makedirs(path)
    make_fp8_model(path, ref)
    return path, ref, HFReference(ref)


def _check_hf(llm, hf, prompts, what):
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert_greedy_match(out["token_ids"], *hf.greedy(p, MAX_NEW), f"{what} prompt len {len(p)}")
    return [o["token_ids"] for o in outs]


def test_fp8_checkpoint_matches_hf_on_the_dequantized_weights(fp8_model):
    path, _, hf = fp8_model
    with LLM(path, dtype="float32", kvcache_block_size=16) as llm:
        assert llm.config.quant_config.name == "fp8" and llm.config.quant_config.from_checkpoint
        model = llm.engine.model_runner.model
        qkv = model.model.layers[0].self_attn.qkv_proj
        # On the CPU the weights are dequantized once at load: plain layers from then on.
        assert qkv.quant_method is None and qkv.weight.dtype == torch.float32 and not hasattr(qkv, "weight_scale_inv")
        first = _check_hf(llm, hf, _prompts(1), "fp8")
        # The prefix cache and chunked prefill change nothing.
        assert _check_hf(llm, hf, _prompts(1), "fp8 prefix hits") == first
    with LLM(path, dtype="float32", kvcache_block_size=16, max_num_batched_tokens=24) as llm:
        assert _check_hf(llm, hf, _prompts(1), "fp8 chunked") == first


def test_fp8_logits_equal_hf(fp8_model):
    path, _, hf = fp8_model
    prompt = _prompts(2)[4]
    with LLM(path, dtype="float32") as llm:
        engine = llm.engine
        engine.add_request("logits", prompt, SamplingParams(temperature=0.0, max_tokens=1))
        runner = engine.model_runner
        from nanovllm.worker.inputs import build_forward_batch
        with torch.inference_mode():
            fb = build_forward_batch(engine.scheduler.schedule(), runner.block_size, runner.device)
            logits = runner.model.compute_logits(runner.model(fb.input_ids, fb.positions, fb.attn))
        engine.abort_request("logits")
    ref = hf.logits(prompt)
    assert (logits.float() - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())


def test_fp8_checkpoint_over_two_ranks(fp8_model):
    """Each rank loads its shards of the weights and of their block scales (q, k, v, gate, up by
    output rows, o and down by input columns: 128-row blocks, never cut)."""
    path, _, hf = fp8_model
    prompts = _prompts(3, lengths=(3, 30))
    with LLM(path, dtype="float32", tensor_parallel_size=2, kvcache_block_size=16, max_model_len=256) as llm:
        _check_hf(llm, hf, prompts, "fp8 tp=2")


def test_a_plain_checkpoint_quantized_at_load(fp8_model):
    """quantization="fp8" on a plain checkpoint (here the dequantized twin): every linear is
    quantized to 128x128 blocks once loaded; block quantization of a block-quantized weight gives
    back its blocks, so the outputs are HF's on the twin."""
    _, ref, hf = fp8_model
    with LLM(ref, dtype="float32", quantization="fp8") as llm:
        assert not llm.config.quant_config.from_checkpoint
        _check_hf(llm, hf, _prompts(4, lengths=(5, 33)), "quantized at load")


def _variant(src: str, dst: str, quantization_config=None, edit_tensors=None) -> str:
    """A copy of checkpoint src with another quantization_config (and tensors changed by edit_tensors)."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    if edit_tensors is not None:
        from safetensors.torch import load_file, save_file
        file = os.path.join(dst, "model.safetensors")
        tensors = load_file(file)
        edit_tensors(tensors)
        save_file(tensors, file)
    return dst


@pytest.mark.parametrize("field,value,match", [
    ("quant_method", "gptq", "quant_method='gptq' is not supported"),
    ("fmt", "e5m2", "quantization_config.fmt='e5m2' is not supported"),
    ("activation_scheme", "static", "quantization_config.activation_scheme='static' is not supported"),
    ("weight_block_size", [64, 64], r"weight_block_size=\[64, 64\] is not supported"),
    ("weight_block_size", None, "weight_block_size is missing"),
    ("kv_cache_scheme", {"strategy": "tensor"}, r"field\(s\) \['kv_cache_scheme'\]"),
])
def test_unsupported_quantization_configs_fail_at_load(fp8_model, tmp_path, field, value, match):
    config = dict(FP8_QUANTIZATION_CONFIG, **{field: value})
    if value is None:
        del config[field]
    path = _variant(fp8_model[0], str(tmp_path / "bad"), config)
    with pytest.raises(ValueError, match=match):
        LLM(path, dtype="float32")


def test_bad_quantization_requests(fp8_model, tmp_path):
    path, ref, _ = fp8_model
    with pytest.raises(ValueError, match="quantization must be None or one of \\['fp8'\\], got 'int4'"):
        LLM(ref, quantization="int4")
    # A linear layer left unquantized in an FP8 checkpoint: caught when its weight loads.
    plain = _variant(path, str(tmp_path / "plain_q"),
                     edit_tensors=lambda t: t.update({"model.layers.0.self_attn.q_proj.weight":
                                                      t["model.layers.0.self_attn.q_proj.weight"].float()}))
    with pytest.raises(ValueError, match="weight is stored as torch.float32, not float8_e4m3fn"):
        LLM(plain, dtype="float32")
    # Block scales of the wrong shape (per-tensor scales are another format).
    per_tensor = _variant(path, str(tmp_path / "per_tensor"),
                          edit_tensors=lambda t: t.update({"model.layers.0.mlp.down_proj.weight_scale_inv":
                                                           torch.ones(1)}))
    with pytest.raises(ValueError, match=r"shape \(1,\) does not fit"):
        LLM(per_tensor, dtype="float32")


def test_shards_that_cut_a_block_fail_before_any_process_starts(tmp_path):
    """intermediate_size 384 over two ranks: 192 rows each, the second rank's gate shard would start
    in the middle of a 128-row block (vLLM refuses the same)."""
    path, ref = str(tmp_path / "fp8"), str(tmp_path / "ref")
    os.makedirs(path)
    make_fp8_model(path, ref, intermediate_size=384)
    with LLM(path, dtype="float32", max_model_len=64) as llm:  # one rank: every block whole
        assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="intermediate_size=384 / tensor_parallel_size=2 = 192 is not a multiple of 128"):
        LLM(path, dtype="float32", tensor_parallel_size=2)
    # Head sizes that do not fill blocks cannot be fused either.
    with pytest.raises(ValueError, match="num_key_value_heads=2 x head_dim=32 = 64 is not a multiple of 128"):
        LLM(ref, dtype="float32", quantization="fp8", hf_config=_with(ref, head_dim=32))


def _with(path, **fields):
    from transformers import AutoConfig
    hf = AutoConfig.from_pretrained(path)
    for key, value in fields.items():
        setattr(hf, key, value)
    return hf


# ---- the FP8 KV cache --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_fp8_cache_holds_more_tokens_in_the_same_memory(fp8_model, dtype):
    _, ref, _ = fp8_model
    budget = 64 << 20
    blocks = {}
    for kv in ("auto", "fp8"):
        with LLM(ref, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory_bytes=budget, kvcache_block_size=16) as llm:
            runner = llm.engine.model_runner
            assert runner.kv_cache.dtype == (torch.float8_e4m3fn if kv == "fp8" else llm.config.torch_dtype)
            blocks[kv] = llm.config.num_kvcache_blocks
    assert blocks["fp8"] == blocks["auto"] * torch.tensor([], dtype=getattr(torch, dtype)).element_size()


# K and V at e4m3 precision (a 2^-4 step) move this tiny random model's logits by up to ~0.9 (measured:
# 0.47-0.93 over the prompts below, logits of magnitude ~11): top-2 gaps under this are ties at FP8 precision.
FP8_KV_TIE = 1.0


def _first_logits(llm, prompt):
    engine = llm.engine
    engine.add_request("logits", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    runner = engine.model_runner
    from nanovllm.worker.inputs import build_forward_batch
    with torch.inference_mode():
        fb = build_forward_batch(engine.scheduler.schedule(), runner.block_size, runner.device)
        logits = runner.model.compute_logits(runner.model(fb.input_ids, fb.positions, fb.attn))
    engine.abort_request("logits")
    return logits[-1].float()


def test_an_fp8_cache_keeps_the_greedy_tokens(fp8_model):
    """Greedy tokens equal HF's (= the fp32 cache's) up to the first step whose reference top-2 gap is a
    tie at FP8 precision; the logits move by less than that tie bound."""
    _, ref, hf = fp8_model
    prompts = _prompts(5, lengths=(2, 9, 17, 40, 64, 100))
    with LLM(ref, dtype="float32", kv_cache_dtype="fp8", kvcache_block_size=16) as llm:
        for p in prompts:
            assert (_first_logits(llm, p) - hf.logits(p)[-1]).abs().max().item() < FP8_KV_TIE
        outs = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        # The prefix cache serves FP8 blocks (the same bytes: the same tokens).
        again = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert again == outs
    for p, ours in zip(prompts, outs):
        tokens, scores = hf.greedy(p, MAX_NEW)
        first = next((i for i, (a, b) in enumerate(zip(ours, tokens)) if a != b), MAX_NEW)
        if first < MAX_NEW:
            top2 = scores[first].topk(2).values
            assert float(top2[0] - top2[1]) < FP8_KV_TIE, f"prompt len {len(p)}: token {first} parts at a gap of {top2}"


def test_an_fp8_cache_is_attention_over_the_quantized_kv(fp8_model):
    """Exactly: the engine with an FP8 cache gives the tokens of the engine with an fp32 cache whose
    stored K/V were rounded to e4m3 (x / 1.0 -> fp8 -> fp32) first."""
    _, ref, _ = fp8_model
    prompts = _prompts(7, lengths=(2, 17, 64))
    with LLM(ref, dtype="float32", kv_cache_dtype="fp8", kvcache_block_size=16) as llm:
        outs = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(ref, dtype="float32", kvcache_block_size=16) as llm:
        backend = llm.engine.model_runner.backend
        store = backend.store_kv

        def fake_quantized(x):
            return x.clamp(-448, 448).to(torch.float8_e4m3fn).float()
        backend.store_kv = lambda k, v, *args, **kw: store(fake_quantized(k), fake_quantized(v), *args, **kw)
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == outs


def test_an_fp8_cache_chunked_and_over_two_ranks(fp8_model):
    """Chunks of a prompt read the earlier chunks' K/V back from the FP8 cache, as a whole prompt
    reads its own: the same tokens; two ranks (each with its KV heads) give one rank's tokens."""
    _, ref, _ = fp8_model
    prompts = _prompts(6, lengths=(3, 50))
    kw = dict(dtype="float32", kv_cache_dtype="fp8", kvcache_block_size=16, max_model_len=256)
    with LLM(ref, **kw) as llm:
        whole = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(ref, max_num_batched_tokens=20, **kw) as llm:
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == whole
    with LLM(ref, tensor_parallel_size=2, **kw) as llm:
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == whole


def test_kv_scales_from_the_checkpoint(tmp_path):
    """A checkpoint's per-head `self_attn.k_scale` / per-tensor `v_scale` reach the layers (a rank
    gets its heads' scales); without an FP8 cache they change nothing."""
    path, ref = str(tmp_path / "fp8"), str(tmp_path / "ref")
    os.makedirs(path)
    scales = {"model.layers.0.self_attn.k_scale": torch.tensor([0.5, 2.0]),
              "model.layers.0.self_attn.v_scale": torch.tensor(0.25)}
    make_fp8_model(path, ref, kv_scales=scales)
    with LLM(path, dtype="float32", kv_cache_dtype="fp8", max_model_len=128) as llm:
        attn = llm.engine.model_runner.model.model.layers[0].self_attn.attn
        assert attn.k_scale.tolist() == [0.5, 2.0] and attn.v_scale.tolist() == [0.25, 0.25]
        assert attn.kv_scales == (attn.k_scale, attn.v_scale)
        out = llm.generate([[4, 5, 6]], GREEDY, use_tqdm=False)[0]["token_ids"]
    with LLM(path, dtype="float32", max_model_len=128) as llm:
        assert llm.engine.model_runner.model.model.layers[0].self_attn.attn.kv_scales is None
    assert len(out) == MAX_NEW
    bad = _variant(path, str(tmp_path / "bad"),
                   edit_tensors=lambda t: t.update({"model.layers.1.self_attn.k_scale": torch.ones(3)}))
    with pytest.raises(ValueError, match="must hold one positive scale or one per KV head"):
        LLM(bad, dtype="float32", max_model_len=128)


def test_kv_cache_dtype_is_validated(fp8_model):
    _, ref, _ = fp8_model
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of \\['auto', 'fp8', 'fp8_e4m3'\\], got 'int8'"):
        LLM(ref, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="only e4m3 FP8 caches are supported"):
        LLM(ref, kv_cache_dtype="fp8_e5m2")
