"""Start-up runs on a GPU's model runner: the step with the most activation memory (which the KV
cache's sizing and the first long prefill rely on), and one run of every kernel variant a workload
meets, so that Triton compiles and CUDA loads them before the first request rather than inside it."""
import numpy as np
import torch

from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams
from nanovllm.worker.gemm_warmup import warm_gemms
from nanovllm.worker.sampling_inputs import build_sampling_metadata


def largest_step_layout(runner, num_tokens: int, num_seqs: int) -> tuple[int, int]:
    """(tokens per sequence, cache blocks per sequence) of `run_largest_step`."""
    per_seq = max(1, min(num_tokens // num_seqs, runner.config.max_model_len - 1))
    return per_seq, -(-per_seq // runner.block_size)


@torch.inference_mode()
def run_largest_step(runner, num_tokens: int, num_seqs: int, num_blocks: int | None = None):
    """Run a step of num_tokens prompt tokens over num_seqs sequences (all sampling): the step
    with the most activation memory. Block ids are taken modulo num_blocks (default: as many
    as it needs); before the first request any block will do."""
    per_seq, blocks_per_seq = largest_step_layout(runner, num_tokens, num_seqs)
    # The sampler's heaviest path: the torch path's full-vocabulary sort (top-p beside top-k rows,
    # which no kernel takes), penalties and logprobs hold several [rows, vocab] fp32 tensors at
    # once, more than the plain draw's peak.
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50 * (i % 2), repetition_penalty=1.1, logprobs=20)
              for i in range(2)]
    seqs = [Sequence([0] * per_seq, params[i % 2], seed=i) for i in range(num_seqs)]
    num_blocks = num_blocks or num_seqs * blocks_per_seq
    for i, seq in enumerate(seqs):
        seq.block_table = [b % num_blocks for b in range(i * blocks_per_seq, (i + 1) * blocks_per_seq)]
    batch = ScheduledBatch(seqs, [per_seq] * num_seqs, num_decodes=num_seqs if per_seq == 1 else 0)
    runner.execute(batch).token_ids()
    runner.forget_sampled()


@torch.inference_mode()
def warmup(runner, num_tokens: int, num_seqs: int) -> int:
    """Run the largest step on a temporary cache. Returns the temporary cache's size in bytes."""
    kv = runner.allocate_kv_cache(num_seqs * largest_step_layout(runner, num_tokens, num_seqs)[1])
    run_largest_step(runner, num_tokens, num_seqs)
    bytes_ = kv.numel() * kv.element_size()
    for attn in runner.model.attention_layers:  # the layers' views would keep the cache alive
        attn.k_cache = attn.v_cache = torch.tensor([])
    del kv
    return bytes_


@torch.inference_mode()
def compile_kernels(runner):
    """Run once the kernel variants a workload meets (prefill tile sizes, decode slices at
    aligned and unaligned offsets, the sampler), so Triton compiles them at start-up rather
    than inside the first requests. The cache is still empty: any blocks will do."""
    # Imported here, on a GPU: importing the kernels defines their @triton.jit functions, which must
    # wait for the tests' TRITON_INTERPRET on the CPU.
    from nanovllm.kernels.decode_plan import decode_launch_variants
    from nanovllm.kernels.fp8 import FP8_DTYPE
    longest = runner.config.max_model_len - 1
    # Triton specialises on pointer alignment (the prefill slice starts after the decodes)
    # and on integers equal to 1 or divisible by 16: cover decode counts mod 4, block-table
    # widths, token totals of each kind and every prefill tile size.
    layouts = [[1, 1, 1, 5, 17, 40, 100, 300], [1, 1, 1, 1, 2, 64, 1000], [1, 1, 600], [1, 1, 1, 900],
               [1] * 5 + [1000, 24], [1] * 6 + [10], [7], [9], [20], [33], [128], [256], [1], [1, 1]]
    # A step with a prefill runs its decode rows' attention outside the graphs, split as their
    # count picks: one decode count per compiled variant (else the first step with, e.g., 9-15
    # decodes beside a prefill waits ~0.3 s for Triton, measured in the multi-turn benchmark).
    most = min(runner.config.max_num_seqs - 1, runner.config.max_num_batched_tokens - 7)
    layouts += [[1] * nd + [7] for nd in decode_launch_variants(
        most, runner.num_q_heads, runner.num_kv_heads, runner.head_dim, runner.device, runner.config.max_model_len,
        kv_fp8=runner.config.kv_cache_torch_dtype == FP8_DTYPE)]
    for lens in layouts:
        lens = [min(n, longest) for n in lens]
        seqs, next_block = [], 0
        for i, n in enumerate(lens):
            seq = Sequence([0] * n, SamplingParams(temperature=0.0 if i % 2 else 1.0), seed=i)
            num = -(-n // runner.block_size)
            seq.block_table = [b % runner.num_blocks for b in range(next_block, next_block + num)]
            next_block += num
            seqs.append(seq)
        runner.execute(ScheduledBatch(seqs, lens, num_decodes=sum(1 for n in lens if n == 1))).token_ids()
    runner.forget_sampled()
    runner.copy_kv_prefixes(np.array([[0], [0], [1]], dtype=np.int64))  # a block onto itself: no change
    warm_gemms(runner.model, runner.config.max_num_batched_tokens, runner.config.max_num_seqs, runner.device,
               runner.config.torch_dtype)
    warm_sampler(runner)
    torch.cuda.synchronize(runner.device)


# The eager sampler's paths use kernels the plain draw does not: the filters' Triton kernels (their
# common variants: top-k, with top-p, with min-p, on the float32 logits penalties leave; top-p; min-p;
# top_k past 128, which ranks the nucleus by bisection), torch ops for top_k past the kernels' 1,024,
# penalties, logprobs, min_tokens bans. CUDA loads (Triton compiles) each on its first call (~0.2 s
# for a top-p batch, measured in bench.py's timed run), which would otherwise land in a request's step.
WARM_SAMPLING = ({"top_k": 50}, {"top_k": 50, "top_p": 0.9}, {"top_p": 0.9}, {"min_p": 0.1},
                 {"top_k": 40, "top_p": 0.95, "min_p": 0.05},
                 {"top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05}, {"top_k": 200, "top_p": 0.9},
                 {"top_k": 2000},
                 {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5},
                 {"logprobs": 5}, {"min_tokens": 4, "stop_token_ids": [1]})


def warm_sampler(runner):
    """Run each of WARM_SAMPLING's paths, and the masked draws, at the row counts that pick the kernels' variants."""
    vocab = runner.config.hf_config.vocab_size
    most = runner.config.max_num_seqs

    def metadata(rows: int, extra: dict):
        seqs = [Sequence([1, 2, 3], SamplingParams(temperature=0.8, **extra), seed=i) for i in range(rows)]
        return build_sampling_metadata(seqs, runner.device, runner.eos_token_ids, vocab, stage=runner.stage)

    for rows in sorted({1, min(16, most), most}):  # library kernels pick their variant by row count
        logits = torch.randn(rows, vocab, device=runner.device).to(runner.config.torch_dtype)
        for extra in WARM_SAMPLING:
            runner.sampler.sample(logits, metadata(rows, extra))
        # Under grammar masks: the fused draw's masked variant, and the kernel writing masks into logits.
        for extra in ({}, {"logprobs": 5}, {"top_k": 50}):
            meta = metadata(rows, extra)
            mask_rows, masks = runner.bitmasks.host()
            mask_rows[:rows] = range(rows)
            masks[:rows] = -1  # every token allowed
            meta.mask_rows, meta.masks, meta.masked_rows = runner.bitmasks.send(rows, rows)
            runner.sampler.sample(logits.clone(), meta)
