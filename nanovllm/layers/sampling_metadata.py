"""What the sampler needs to know about a batch: per-row parameters as device tensors, and host-side
flags that say which optional stages any row needs (a batch that uses none pays nothing). Built by
worker/sampling_inputs.py, read by layers/sampler.py and layers/filter_kernels.py."""
from dataclasses import dataclass

import torch

from nanovllm.layers.penalties import PenaltyInputs


@dataclass
class SamplingMetadata:
    temperatures: torch.Tensor   # [B] float32; 0 means greedy
    seeds: torch.Tensor          # [B] int64
    offsets: torch.Tensor        # [B] int64: index of the token being drawn among the outputs
    all_greedy: bool
    all_random: bool
    row_keys: torch.Tensor | None = None      # [B] int64: row_keys(seeds, offsets), if precomputed
    # top-k / top-p, over the random rows that use either.
    filter_rows: torch.Tensor | None = None   # [F]; None: all rows (only read when top_k or top_p is set)
    top_k: torch.Tensor | None = None         # [F] int64, 0 = off; None when no row uses top-k
    top_p: torch.Tensor | None = None         # [F] float32, 1.0 = off; None when no row uses top-p
    max_top_k: int = 0
    top_k_bounded: bool = False               # every filtered row has top_k > 0 (candidates suffice)
    random_rows_filtered: bool = False        # every random row is a filtered row (the rest are greedy)
    # Where some random rows have a top_k and others none: the rows with one, and all the others.
    top_k_rows: torch.Tensor | None = None
    other_rows: torch.Tensor | None = None
    # min-p, over the random rows that use it.
    min_p_rows: torch.Tensor | None = None
    min_p: torch.Tensor | None = None         # [M] float32; None when no row uses min-p
    penalties: PenaltyInputs | None = None
    # (row, token id) pairs whose logits are -inf: eos and stop ids of rows still under min_tokens.
    banned_rows: torch.Tensor | None = None
    banned_ids: torch.Tensor | None = None
    max_num_logprobs: int | None = None       # largest `logprobs` of the batch; None: no row wants any
    # logit_bias: (row, token id, bias) triples added to the logits.
    bias_rows: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None   # float32
    # Grammar bitmasks (structured outputs), one per constrained row: the sampler draws row
    # masked_rows[k] only from the tokens masks[k] allows (kernels/sample.py's layout);
    # mask_rows[i] = k, or -1 for a row without one. None: no row of the batch has a mask.
    masks: torch.Tensor | None = None          # [K, ceil(V / 32)] int32
    mask_rows: torch.Tensor | None = None      # [B] int32
    masked_rows: torch.Tensor | None = None    # [K] int64
