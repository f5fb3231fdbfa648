"""How a paged-decode launch is laid out (kernels/paged_decode.py), decided on the host from shapes
alone, so that a CUDA graph captured for a batch size replays the same launch: the tile table,
the number of KV splits per sequence, the compiled variants a run meets (for the start-up
warm-up), and the split partials' workspace."""
import functools

import torch
import triton

# Splitting heuristics (see choose_num_splits).
_TWO_SPLITS_ITEMS_PER_SM = 4  # items (sequence x KV head) up to this many per SM get at least two splits
_ONE_WAVE_PROGRAMS_PER_SM = 2.4  # else aim for about this many programs: one wave, all resident at once
_MIN_KEYS_PER_SPLIT = 128  # below this a split is mostly launch/merge overhead
_MAX_SPLITS = 64
_FP8_TWO_WARPS_PROGRAMS_PER_SM = 3  # over an FP8 cache, launches of at least this many programs per SM use 2 warps


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 8  # interpreter / CPU: any small number keeps the split path exercised


def decode_config(head_dim: int, group: int, query_len: int = 1, kv_fp8: bool = False,
                   programs_per_sm: float = 0.0):
    """(BLOCK_G, BLOCK_N, num_warps, num_stages, PREFETCH_BLOCKS); a fixed table, no autotuning,
    so the first call inside a CUDA-graph capture doesn't benchmark anything. The rows of a tile
    are the query_len x group (token, head) pairs of one KV head; programs_per_sm: the launch's
    programs (KV heads x head blocks x batch x splits) per SM."""
    block_g = min(max(16, triton.next_power_of_2(group * query_len)), 64)
    block_d = triton.next_power_of_2(head_dim)
    if block_d <= 64:
        return block_g, 128, 4, 3, False
    if block_d <= 128:
        # Block ids one tile ahead: the pipeliner then keeps two K/V tiles in flight instead of one
        # (read off the compiled kernel's IR); measured on the H200 at 96-102% of copy bandwidth from 96
        # sequences up, and 3-25% faster than without below that (scripts/tune.py decode --buckets).
        # Over an FP8 cache the tile's conversions, not its bytes, set the pace: two warps a program
        # (twice the programs resident) took 256 ragged sequences from 192.0 to 179.6 us and 32 long
        # ones from 58.8 to 44.5 us (scripts/tune.py decode --kv-fp8, 2026-12-04); but a launch of one
        # wave of few programs (8 sequences of 3-4k keys: ~2.4 per SM) ran 38.0 us with two warps, 33.0
        # with four.
        two_warps = kv_fp8 and programs_per_sm >= _FP8_TWO_WARPS_PROGRAMS_PER_SM
        return block_g, 64, 2 if two_warps else 4, 3, True
    return block_g, 32, 4, 2, False


def merge_variant(num_splits: int, block_d: int) -> tuple[int, int]:
    """The merge kernel's compiled variant for num_splits: (BLOCK_S, num_warps)."""
    return triton.next_power_of_2(num_splits), 4 if block_d * num_splits <= 4096 else 8


def decode_launch_variants(max_batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                           device: torch.device, max_seq_len_hint: int | None = None, kv_fp8: bool = False) -> list[int]:
    """One batch size (the smallest) per compiled variant that a decode launch of 1..max_batch
    sequences picks through choose_num_splits: direct output, or split with the merge kernel's
    (BLOCK_S, num_warps), each with the split kernel's warps. A warm-up running these compiles every
    variant at start-up, so that no step of a running workload waits for Triton (a compile takes
    hundreds of ms, the whole batch waits)."""
    first: dict = {}
    for batch in range(1, max_batch + 1):
        first.setdefault(decode_variant(batch, num_q_heads, num_kv_heads, head_dim, device, max_seq_len_hint, kv_fp8),
                         batch)
    return sorted(first.values())


def decode_variant(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
                   max_seq_len_hint: int | None = None, kv_fp8: bool = False) -> tuple:
    """What tells a decode launch of `batch` sequences' compiled kernels apart: (the merge kernel's
    (BLOCK_S, num_warps), None without a merge; the split kernel's warps)."""
    splits = choose_num_splits(batch, num_q_heads, num_kv_heads, head_dim, device, max_seq_len_hint)
    merge = None if splits == 1 else merge_variant(splits, triton.next_power_of_2(head_dim))
    return merge, launch_config(batch, num_q_heads, num_kv_heads, head_dim, device, splits, kv_fp8=kv_fp8)[2]


def launch_config(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
                  num_splits: int, query_len: int = 1, kv_fp8: bool = False) -> tuple:
    """decode_config's tile for a launch of `batch` sequences in num_splits splits: its programs
    (KV heads x head blocks x batch x splits) per SM pick the warps over an FP8 cache."""
    group = num_q_heads // num_kv_heads
    head_blocks = triton.cdiv(group * query_len, decode_config(head_dim, group, query_len)[0])
    programs_per_sm = num_kv_heads * head_blocks * batch * num_splits / device_sms(device)
    return decode_config(head_dim, group, query_len, kv_fp8, programs_per_sm)


def choose_num_splits(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                      device: torch.device, max_seq_len_hint: int | None = None, query_len: int = 1) -> int:
    """Number of KV splits per sequence; depends only on host-side shapes.

    Few items (sequence x KV head): about _ONE_WAVE_PROGRAMS_PER_SM programs per SM, one wave that
    runs at once. Measured in the engine's decode graph on the H200 (contexts
    of ~1,400-1,500 keys), ms per step against the earlier rule (~4 programs per SM, 1.3-1.6 waves):
    8 sequences 1.291 (5 splits) vs 1.357 (9), 16: 1.621 (2) vs 1.697 (5), 24 in the 32-row graph:
    2.007 (2) vs 2.164 (3). Why: with equal programs, 1.3 waves
    read at 3.3-3.6 TB/s, one wave of ~2 per SM at 3.9-4.3. Up to _TWO_SPLITS_ITEMS_PER_SM items per SM
    at least two splits (48-64 sequences: 2.812 / 3.559 ms with two, 2.904 / 3.637 with one: ragged
    lengths in one wave wait for the longest). Never a split of fewer than ~_MIN_KEYS_PER_SPLIT keys
    of the longest possible sequence (``max_seq_len_hint``; unknown -> assume long). For CUDA graphs
    pass the same hint at capture and replay. ``query_len``: query tokens per sequence (their
    (token, head) rows share a program, as the heads of a group do).
    """
    group = num_q_heads // num_kv_heads
    block_g = decode_config(head_dim, group, query_len)[0]
    head_blocks = triton.cdiv(group * query_len, block_g)
    items = max(1, batch * num_kv_heads * head_blocks)
    sms = device_sms(device)
    splits = max(round(_ONE_WAVE_PROGRAMS_PER_SM * sms / items), 2 if items <= _TWO_SPLITS_ITEMS_PER_SM * sms else 1)
    if max_seq_len_hint is not None:
        splits = min(splits, triton.cdiv(max(max_seq_len_hint, 1), _MIN_KEYS_PER_SPLIT))
    return max(1, min(splits, _MAX_SPLITS))


def alloc_decode_workspace(max_batch: int, num_q_heads: int, head_dim: int, num_splits: int,
                           device: torch.device):
    """Preallocated stage-1 buffers (for CUDA graphs): (partial outputs, partial lse)."""
    part_o = torch.empty(max_batch * num_q_heads * num_splits * head_dim,
                         dtype=torch.float32, device=device)
    part_lse = torch.empty(max_batch * num_q_heads * num_splits, dtype=torch.float32, device=device)
    return part_o, part_lse
