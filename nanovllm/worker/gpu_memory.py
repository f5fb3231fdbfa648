"""Size the KV cache from `gpu_memory_utilization`: measure the peak of a warm-up step at the
largest batch, and give the cache what is left of the allowed fraction of the GPU."""
import torch

from nanovllm.worker.warmup import warmup


def profile_kv_budget(runner) -> int:
    cfg = runner.config
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used_before = total - free  # weights, CUDA context, and anything else on the device
    allocated_before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    num_seqs = min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
    temp_cache_bytes = warmup(runner, cfg.max_num_batched_tokens, num_seqs)
    torch.cuda.synchronize(device)
    peak_extra = torch.cuda.max_memory_allocated(device) - allocated_before - temp_cache_bytes
    torch.cuda.empty_cache()
    budget = int(total * cfg.gpu_memory_utilization - used_before - peak_extra)
    if budget < runner.block_bytes:
        raise RuntimeError(
            f"no GPU memory left for the KV cache: {total / 2**30:.1f} GiB total, {used_before / 2**30:.1f} GiB "
            f"in use, warm-up peak {peak_extra / 2**30:.1f} GiB, gpu_memory_utilization={cfg.gpu_memory_utilization}; "
            "raise gpu_memory_utilization or lower max_num_batched_tokens / max_num_seqs")
    return budget
