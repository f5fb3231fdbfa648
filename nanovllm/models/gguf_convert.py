"""Convert a llama.cpp GGUF file into a Hugging Face-style model directory, cached on disk.

The output (config.json, tokenizer files, generation_config.json, bf16 model.safetensors) loads
with `transformers` and with nanovllm's own safetensors loader, so the rest of the engine only
ever sees HF directories. Conversion dequantizes everything: the engine runs bf16/fp32 weights.
The layers' 4-bit blocks are also kept as they are (gguf_q4.Q4_BLOCKS_FILE), for the CPU's int4 products.
"""
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import xxhash
from gguf import GGML_QUANT_SIZES, GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from nanovllm.models.gguf_q4 import Q4_BLOCKS_FILE, is_q4, q4_blocks

SUPPORTED_ARCHITECTURES = ("llama",)
# Bump whenever the output format changes, so stale cache entries are not reused.
_CONVERTER_VERSION = 2
_HASH_CHUNK = 16 << 20

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_NAME = re.compile(r"blk\.(?P<layer>\d+)\.(?P<kind>\w+)\.weight")

# llama.cpp's Llama-3 pre-tokenizer split (digits in groups of up to three).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> the HF pre-tokenizer that splits text as llama.cpp does.
_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    # SmolLM's tokenizer isolates every digit before the GPT-2 split.
    "smollm": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ]),
    "llama-bpe": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]),
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


# ---------------------------------------------------------------------------------------------
# Public API


def convert_gguf(gguf_path: str) -> str:
    """Convert `gguf_path` into an HF model directory in the cache and return that directory.

    The entry is keyed by the file's content, so a second call returns at once. It is built in a
    temporary sibling folder and renamed into place, so a failure never leaves a partial entry.
    """
    source = Path(gguf_path)
    if not source.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path!r} does not exist")
    root = cache_dir()
    target = root / _content_key(source)
    if target.is_dir():
        return str(target)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        _write_model_dir(_open_gguf(source), tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # not a concurrent conversion finishing first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def cache_dir() -> Path:
    """$NANOVLLM_CACHE_DIR, else $XDG_CACHE_HOME/nanovllm, else ~/.cache/nanovllm."""
    if explicit := os.environ.get("NANOVLLM_CACHE_DIR"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "nanovllm"


# ---------------------------------------------------------------------------------------------
# Reading


def _content_key(path: Path) -> str:
    """Hash of the whole file (xxh3 reads at several GB/s, so this stays cheap on a cache hit)."""
    digest = xxhash.xxh3_128(f"nanovllm-gguf-v{_CONVERTER_VERSION}".encode())
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _open_gguf(path: Path) -> GGUFReader:
    # GGUFReader fails on damaged files with whatever numpy/struct error it hits; give one clear error.
    try:
        return GGUFReader(path)
    except Exception as e:
        raise ValueError(f"{path} is not a valid GGUF file: {type(e).__name__}: {e}") from e


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items()}


def _dequantized(reader: GGUFReader) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (GGUF name, fp32 array shaped [out_features, in_features]) for every tensor."""
    for t in reader.tensors:
        try:
            array = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            supported = ", ".join(_supported_quant_types())
            raise ValueError(f"Tensor {t.name} uses quantization type {t.tensor_type.name}, which cannot be "
                             f"dequantized; supported types: {supported}") from None
        # GGUF lists dimensions fastest-first; numpy wants them slowest-first.
        shape = tuple(int(d) for d in reversed(t.shape))
        if array.size != int(np.prod(shape)):
            raise ValueError(f"Tensor {t.name} has {array.size} values but its shape is {shape}")
        # F32/F16 data can be a read-only view of the memory-mapped file; torch wants its own copy.
        yield t.name, array.reshape(shape) if array.flags.writeable else array.reshape(shape).copy()


def _supported_quant_types() -> list[str]:
    """Names of the types `gguf.quants.dequantize` implements, found by dequantizing one zero block."""
    supported = []
    for qtype, (_, block_bytes) in GGML_QUANT_SIZES.items():
        try:
            dequantize(np.zeros(block_bytes, dtype=np.uint8), qtype)
        except NotImplementedError:
            continue
        supported.append(qtype.name)
    return supported


# ---------------------------------------------------------------------------------------------
# Weights


def hf_state_dict(reader: GGUFReader, config: dict) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, fp32 weight) in HF layout, q/k un-permuted; rejects anything unexpected."""
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for name, array in _dequantized(reader):
        if not np.isfinite(array).all():
            raise ValueError(f"Tensor {name} contains NaN/inf values; the GGUF file is probably corrupted")
        if (base := name.removesuffix(".weight")) in _GLOBAL_TENSORS:
            yield f"{_GLOBAL_TENSORS[base]}.weight", array
            continue
        match = _LAYER_NAME.fullmatch(name)
        if not match or match["kind"] not in _LAYER_TENSORS:
            raise ValueError(f"Unexpected tensor {name!r} in a llama GGUF file; cannot map it to the HF layout")
        if match["kind"] in heads:
            array = _unpermute(array, heads[match["kind"]], config["head_dim"])
        yield f"model.layers.{match['layer']}.{_LAYER_TENSORS[match['kind']]}.weight", array


def hf_q4_blocks(reader: GGUFReader, config: dict) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ("{HF linear name}.codes|scale|offset", array) for every 4-bit layer weight, rows in HF
    order (q/k un-permuted like their dequantized weights)."""
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for t in reader.tensors:
        match = _LAYER_NAME.fullmatch(t.name)
        if not match or match["kind"] not in _LAYER_TENSORS or not is_q4(t):
            continue
        name = f"model.layers.{match['layer']}.{_LAYER_TENSORS[match['kind']]}"
        for part, array in zip(("codes", "scale", "offset"), q4_blocks(t)):
            if match["kind"] in heads:
                array = _unpermute(array, heads[match["kind"]], config["head_dim"])
            yield f"{name}.{part}", np.ascontiguousarray(array)


def _unpermute(weight: np.ndarray, n_head: int, head_dim: int) -> np.ndarray:
    # llama.cpp interleaves each head's rotary halves (its RoPE rotates adjacent pairs);
    # HF rotates the two halves of the head, so put each half back together.
    return weight.reshape(n_head, head_dim // 2, 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _expected_names(config: dict) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        names.add("lm_head.weight")
    for i in range(config["num_hidden_layers"]):
        names.update(f"model.layers.{i}.{hf}.weight" for hf in _LAYER_TENSORS.values())
    return names


# ---------------------------------------------------------------------------------------------
# Config and tokenizer


def build_config(meta: dict[str, Any], tensor_names: set[str]) -> dict:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"Unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks required key {arch}.{name}")
        return value

    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", hidden // heads)
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ValueError("Partial rotary embeddings (rope.dimension_count != head_dim) are not supported")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": key("context_length"),
        "vocab_size": key("vocab_size", len(meta.get("tokenizer.ggml.tokens", []))),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "bfloat16",
    }
    if (scaling := meta.get(f"{arch}.rope.scaling.type", "none")) != "none":
        config["rope_scaling"] = {"rope_type": scaling, "factor": _f32(key("rope.scaling.factor"))}
        if original := meta.get(f"{arch}.rope.scaling.original_context_length"):
            config["rope_scaling"]["original_max_position_embeddings"] = original
    return config


def _f32(value: float) -> float:
    # GGUF stores float32: print 1e-05 rather than its float64 widening 9.999999747378752e-06.
    return float(str(np.float32(value)))


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The byte-level BPE tokenizer llama.cpp calls "gpt2", rebuilt as an HF `tokenizers` object."""
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise ValueError(f"Unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE)")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"Unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(_PRE_TOKENIZERS)}")
    tokens = meta["tokenizer.ggml.tokens"]
    # Byte-level tokens never contain a literal space (it is spelled "Ġ"), so one split suffices.
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    # Control/user-defined tokens must match whole (never split by BPE); control ones are special.
    types = meta.get("tokenizer.ggml.token_type", [])
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                  for i, t in enumerate(types) if t == _CONTROL])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                          for i, t in enumerate(types) if t == _USER_DEFINED])
    if post := _bos_eos_processor(meta):
        tokenizer.post_processor = post
    return tokenizer


def _bos_eos_processor(meta: dict[str, Any]) -> processors.TemplateProcessing | None:
    """Add BOS/EOS around every encoding when the file asks for it (Llama-3 style files do)."""
    tokens = meta["tokenizer.ggml.tokens"]
    ends = {}
    for side in ("bos", "eos"):
        token_id = meta.get(f"tokenizer.ggml.{side}_token_id")
        if meta.get(f"tokenizer.ggml.add_{side}_token") and token_id is not None:
            ends[side] = (tokens[token_id], token_id)
    if not ends:
        return None
    bos = [ends["bos"][0]] if "bos" in ends else []
    eos = [ends["eos"][0]] if "eos" in ends else []
    return processors.TemplateProcessing(single=bos + ["$A"] + eos, pair=bos + ["$A"] + eos + bos + ["$B:1"] + eos,
                                         special_tokens=list(ends.values()))


def build_tokenizer_config(meta: dict[str, Any], tokenizer: Tokenizer, context_length: int) -> dict:
    tokens = meta["tokenizer.ggml.tokens"]

    def token(name: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
        return tokens[token_id] if token_id is not None else None

    added = {
        str(i): {"content": t.content, "special": t.special, "normalized": False,
                 "lstrip": False, "rstrip": False, "single_word": False}
        for i, t in tokenizer.get_added_tokens_decoder().items()
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
        "added_tokens_decoder": added,
    }
    if template := meta.get("tokenizer.chat_template"):
        config["chat_template"] = template
    return config


def build_generation_config(meta: dict[str, Any]) -> dict:
    # End-of-turn tokens (e.g. Llama-3's <|eot_id|>) stop generation just like EOS does.
    stops = [meta.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    stops = list(dict.fromkeys(s for s in stops if s is not None))
    config = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
              "eos_token_id": stops[0] if len(stops) == 1 else stops or None}
    if (pad := meta.get("tokenizer.ggml.padding_token_id")) is not None:
        config["pad_token_id"] = pad
    return config


# ---------------------------------------------------------------------------------------------
# Writing


def _write_model_dir(reader: GGUFReader, out: Path) -> None:
    meta = read_metadata(reader)
    config = build_config(meta, {t.name for t in reader.tensors})
    tokenizer = build_tokenizer(meta)
    weights = {name: torch.from_numpy(array).to(torch.bfloat16) for name, array in hf_state_dict(reader, config)}
    if missing := _expected_names(config) - weights.keys():
        raise ValueError(f"GGUF file lacks tensors for: {', '.join(sorted(missing)[:5])}")

    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", build_generation_config(meta))
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json",
                build_tokenizer_config(meta, tokenizer, config["max_position_embeddings"]))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    if blocks := {name: torch.from_numpy(array) for name, array in hf_q4_blocks(reader, config)}:
        (out / Q4_BLOCKS_FILE).parent.mkdir()
        save_file(blocks, str(out / Q4_BLOCKS_FILE), metadata={"format": "pt"})


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
