"""Which Triton kernels draw a batch whose rows use sampling filters (top-k, top-p, min-p), on
the GPU: `filter_kernel_draw` picks a draw for the batch, or None for the sampler's torch path
(top_k above the kernels' 1,024). Each draw takes the logits as the sampler leaves them after
min_tokens bans and penalties (float32 where penalties ran) and returns the tokens of the torch
path (kernels/sample_top_k.py and sample_top_p.py say up to what). Greedy rows come along in
every draw.
"""
import torch

from nanovllm.layers.sampling_metadata import SamplingMetadata

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def top_k_kernel_serves(dtype: torch.dtype, meta: SamplingMetadata) -> bool:
    """Whether the top-k kernels draw the whole batch: every random row has a top_k they take
    (and maybe top-p, min-p)."""
    from nanovllm.kernels.sample_top_k import MAX_TOP_K
    return (dtype in _DTYPES and meta.top_k_bounded and meta.random_rows_filtered
            and 0 < meta.max_top_k <= MAX_TOP_K)


def top_p_kernel_serves(dtype: torch.dtype, meta: SamplingMetadata) -> bool:
    """Whether the top-p kernel draws the whole batch: top-p or min-p on some rows, top-k on none
    (plain random rows come along)."""
    return dtype in _DTYPES and meta.top_k is None and (meta.top_p is not None or meta.min_p is not None)


def split_kernels_serve(dtype: torch.dtype, meta: SamplingMetadata) -> bool:
    """Whether the batch splits between the two: rows with a top_k the top-k kernels take beside
    random rows without one (e.g. a server's requests from different clients)."""
    from nanovllm.kernels.sample_top_k import MAX_TOP_K
    return dtype in _DTYPES and meta.top_k_rows is not None and meta.max_top_k <= MAX_TOP_K


def _per_row(meta: SamplingMetadata, batch: int):
    """[B] top_k (1 where off), top_p (1.0 where off) and log(min_p) (-inf where off; the torch
    path's own log, so that both cut at the same logit), each None when no row uses it."""
    def spread(values, rows, off):
        if values is None or rows is None:
            return values
        return values.new_full((batch,), off).index_copy_(0, rows, values)
    log_min_p = None if meta.min_p is None else torch.log(meta.min_p)
    return (spread(meta.top_k, meta.filter_rows, 1), spread(meta.top_p, meta.filter_rows, 1.0),
            spread(log_min_p, meta.min_p_rows, float("-inf")))


def _draw_top_k(logits: torch.Tensor, meta: SamplingMetadata, keys: torch.Tensor) -> torch.Tensor:
    from nanovllm.kernels.sample_top_k import sample_top_k_rows
    top_k, top_p, log_min_p = _per_row(meta, logits.shape[0])
    return sample_top_k_rows(logits, meta.temperatures, top_k, top_p, keys, meta.max_top_k, log_min_p=log_min_p)


def _draw_top_p(logits: torch.Tensor, meta: SamplingMetadata, keys: torch.Tensor) -> torch.Tensor:
    from nanovllm.kernels.sample_top_p import sample_top_p_rows
    _, top_p, log_min_p = _per_row(meta, logits.shape[0])
    top_p = meta.temperatures.new_ones(logits.shape[0]) if top_p is None else top_p
    return sample_top_p_rows(logits, meta.temperatures, top_p, keys, log_min_p=log_min_p)


def _draw_split(logits: torch.Tensor, meta: SamplingMetadata, keys: torch.Tensor) -> torch.Tensor:
    """The rows with a top_k through the top-k kernels, the others through the top-p kernel, each
    on its rows' copy of the logits."""
    from nanovllm.kernels.sample_top_k import sample_top_k_rows
    from nanovllm.kernels.sample_top_p import sample_top_p_rows
    batch = logits.shape[0]
    top_k, top_p, log_min_p = _per_row(meta, batch)
    top_p = meta.temperatures.new_ones(batch) if top_p is None else top_p
    tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
    for rows in (meta.top_k_rows, meta.other_rows):
        if rows.numel() == 0:
            continue
        common = (logits[rows], meta.temperatures[rows])
        min_p = None if log_min_p is None else log_min_p[rows]
        if rows is meta.top_k_rows:
            drawn = sample_top_k_rows(*common, top_k[rows], top_p[rows], keys[rows], meta.max_top_k, log_min_p=min_p)
        else:
            drawn = sample_top_p_rows(*common, top_p[rows], keys[rows], log_min_p=min_p)
        tokens.index_copy_(0, rows, drawn)
    return tokens


def filter_kernel_draw(dtype: torch.dtype, meta: SamplingMetadata):
    """The kernels' draw, draw(logits, meta, row_keys) -> tokens, that serves the batch's filters on
    the GPU, or None (the torch path)."""
    if meta.top_k is None and meta.top_p is None and meta.min_p is None:  # no filter: the plain draw
        return None
    if top_k_kernel_serves(dtype, meta):
        return _draw_top_k
    if top_p_kernel_serves(dtype, meta):
        return _draw_top_p
    if split_kernels_serve(dtype, meta):
        return _draw_split
    return None
