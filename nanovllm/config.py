"""Engine configuration: the seed's `Config` fields and defaults, plus vLLM-style extensions."""
import os
from dataclasses import dataclass, fields

import torch
from transformers import AutoConfig, PretrainedConfig

_KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


@dataclass
class Config:
    model: str
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    hf_config: PretrainedConfig | None = None
    eos: int = -1
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1
    # Extensions (named as in vLLM where vLLM has the concept).
    device: str = "auto"
    dtype: str = "auto"
    enable_prefix_caching: bool = True
    load_format: str = "auto"
    seed: int = 0
    kv_cache_memory_bytes: int | None = None
    attention_backend: str = "auto"
    # Splits a reasoning model's thinking from its answer (nanovllm.reasoning): constraints apply after it.
    reasoning_parser: str | None = None
    # "auto": the KV cache in the model dtype; "fp8" (or "fp8_e4m3"): float8_e4m3fn, twice the tokens
    # for the same memory, with the checkpoint's k/v scales if it has them (else 1.0).
    kv_cache_dtype: str = "auto"
    # None: as the checkpoint is (its config.json's quantization_config, if any); "fp8": block-FP8
    # weights, quantized once loaded when the checkpoint (or load_format="dummy") has plain ones.
    quantization: str | None = None
    # Speculative decoding (nanovllm.spec_decode), vLLM's dict: {"method": "ngram" | "draft_model",
    # "num_speculative_tokens": k, ...}; a SpeculativeConfig after validation.
    speculative_config: dict | None = None
    # torch's threads per engine process (each tensor-parallel rank); None: on the CPU the physical cores
    # (a tensor-parallel rank: its share of the host's), elsewhere torch's default (`torch_threads`).
    cpu_threads: int | None = None

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a path to a model directory or .gguf file, got {self.model!r}")
        if not os.path.exists(self.model):
            raise FileNotFoundError(f"model path {self.model!r} does not exist")
        if not os.path.isdir(self.model):
            raise ValueError(f"model path {self.model!r} is not a directory (expected a Hugging Face model "
                             "directory with config.json, or a .gguf file)")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"model directory {self.model!r} has no config.json")
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_model_len", self.max_model_len, 2)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_int("kvcache_block_size", self.kvcache_block_size, 16)
        if self.kvcache_block_size % 16:
            raise ValueError(f"kvcache_block_size must be a positive multiple of 16, got {self.kvcache_block_size}")
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kvcache_blocks != -1:
            _check_int("num_kvcache_blocks", self.num_kvcache_blocks, 1)
        if self.cpu_threads is not None:
            _check_int("cpu_threads", self.cpu_threads, 1)
        if self.kv_cache_memory_bytes is not None:
            _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be 'auto', 'safetensors' or 'dummy', got {self.load_format!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {self.attention_backend!r}")
        from nanovllm.reasoning import REASONING_PARSERS
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)} or None, "
                             f"got {self.reasoning_parser!r}")
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            hint = " (only e4m3 FP8 caches are supported)" if self.kv_cache_dtype == "fp8_e5m2" else ""
            raise ValueError(f"kv_cache_dtype must be one of {sorted(_KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
                             + hint)

        self.device = resolve_device(self.device)
        if self.hf_config is None:
            self.hf_config = AutoConfig.from_pretrained(self.model)
        self.torch_dtype = resolve_dtype(self.dtype, self.hf_config, self.device)
        self.kv_cache_torch_dtype = _KV_CACHE_DTYPES[self.kv_cache_dtype] or self.torch_dtype
        from nanovllm.layers.quantization import resolve_quantization  # imported on use, as the model checks below
        self.quant_config = resolve_quantization(self.quantization, self.hf_config, self.load_format)
        from nanovllm.models.registry import check_model_config  # imported on use, like the check below
        check_model_config(self.hf_config, self.quant_config)  # before any process starts (tensor parallelism) or weight loads
        if self.quant_config is not None:
            from nanovllm.models.llama import check_block_quantization
            check_block_quantization(self.hf_config, self.tensor_parallel_size)
        max_pos = getattr(self.hf_config, "max_position_embeddings", None)
        if max_pos:
            self.max_model_len = min(self.max_model_len, max_pos)
        if self.eos == -1:
            self.eos = _eos_from_config(self.hf_config)
        if self.tensor_parallel_size > 1:
            _check_tensor_parallel(self)
        if self.speculative_config is not None:
            from nanovllm.spec_decode.config import parse_speculative_config
            self.speculative_config = parse_speculative_config(self.speculative_config, self.model, self.hf_config,
                                                               self.max_model_len)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


def _check_int(name: str, value, minimum: int):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def resolve_device(device: str) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was requested but CUDA is not available")
    return dev


def _check_tensor_parallel(cfg: "Config"):
    """Fail before any worker process starts if the ranks cannot be placed or the model not split."""
    size = cfg.tensor_parallel_size
    from nanovllm.models.llama import check_tensor_parallel  # imported on use: config.py stays free of model code
    check_tensor_parallel(cfg.hf_config, size)
    if cfg.device.type == "cuda":
        first = cfg.device.index or 0
        available = torch.cuda.device_count() - first
        if size > available:
            raise ValueError(f"tensor_parallel_size={size} needs {size} CUDA devices from cuda:{first} on, "
                             f"but only {available} are visible")
    elif size > (os.cpu_count() or 1):
        raise ValueError(f"tensor_parallel_size={size} exceeds the {os.cpu_count()} CPU cores of this machine")


def physical_cpu_cores() -> int:
    """Physical cores among the CPUs this process may use (hyperthread siblings count once)."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/core_id") as f:
                core = f.read().strip()
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id") as f:
                cores.add((f.read().strip(), core))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def torch_threads(config: "Config") -> int | None:
    """The torch threads of one engine process (None: leave torch's own): `cpu_threads` where given;
    else, on the CPU, a tensor-parallel rank its share of the host's cores (the ranks' spinning threads
    would starve each other) and a single process the physical cores it may use (a hyperthread sibling
    shares its core's vector units and memory path), never more than it was given (a data-parallel
    core's share of the host's)."""
    if config.cpu_threads is not None:
        return config.cpu_threads
    if torch.device(config.device).type != "cpu":
        return None
    if config.tensor_parallel_size > 1:
        return max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)
    return min(physical_cpu_cores(), torch.get_num_threads())


def cpu_supports_bf16() -> bool:
    """bf16 is only worth it on CPUs with native bf16 dot products (AVX512-BF16 / AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype, hf_config: PretrainedConfig, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(set(_DTYPES))}, got {dtype!r}")
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.bfloat16 if cpu_supports_bf16() else torch.float32
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(ckpt, str):
        ckpt = _DTYPES.get(ckpt)
    return ckpt if isinstance(ckpt, torch.dtype) else torch.bfloat16


def _eos_from_config(hf_config: PretrainedConfig) -> int:
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return -1 if eos is None else int(eos)
