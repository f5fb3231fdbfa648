"""Batched sampling on the device: one call for the whole batch, per-request parameters as tensors.

Random draws use the exponential-race form of sampling (argmax of p / E with E ~ Exp(1) equals a
draw from p) with noise that is a pure function of (request seed, output position, token id),
so a request's tokens do not depend on which other requests share its batch, or their order.
Every step below is row-wise, so filters and penalties keep that property.

Order of operations (vLLM v1's): min_tokens bans and penalties on the raw logits, greedy argmax,
temperature, min_p, top_k, top_p (on the distribution left by the previous filters), then the
draw. top-k and top-p cut a ranking by logit where equal logits rank by lowest token id (bf16
logits hold long runs of equal values), so a cut through such a run falls the same way on every
path, torch or kernel, whatever else shares the batch. Logprobs are those of the raw model
distribution (vLLM's default "raw_logprobs").

Each optional stage runs only when a host-side field of the metadata says some row needs it, and
only on those rows (`*_rows`, None meaning every row), so a batch that uses none pays nothing.

Grammar bitmasks (structured outputs) come first: the plain draw on the GPU applies them inside its
one pass; every other path writes them into the logits as -inf first (so logprobs are those of the
constrained distribution, as in vLLM, where the mask is applied before the sampler). logit_bias is
added with the min_tokens bans, before penalties.
"""
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from nanovllm.layers.filter_kernels import filter_kernel_draw
from nanovllm.layers.penalties import apply_penalties_
from nanovllm.layers.sampling_metadata import SamplingMetadata

_M32 = 0xFFFFFFFF


class LogprobsLists(NamedTuple):
    """Host copies of SamplerOutput's logprobs; row(i) is what OutputProcessor.append takes."""
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def row(self, i: int) -> tuple[list[int], list[float], int]:
        return self.token_ids[i], self.logprobs[i], self.ranks[i]


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                          # [B] int64
    logprob_token_ids: torch.Tensor | None = None    # [B, 1 + k]: the sampled token, then the top k
    logprobs: torch.Tensor | None = None             # [B, 1 + k] float32
    sampled_ranks: torch.Tensor | None = None        # [B] int64: 1 + number of more likely tokens

    def to_host(self) -> "SamplerOutput":
        """Copies in pinned host memory, queued on the current stream without waiting: read them
        only once an event recorded after this call has completed. The CPU keeps self."""
        if not self.token_ids.is_cuda:
            return self

        def pinned(t):
            if t is None:
                return None
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)
        return SamplerOutput(pinned(self.token_ids), pinned(self.logprob_token_ids), pinned(self.logprobs),
                             pinned(self.sampled_ranks))

    def logprobs_lists(self) -> LogprobsLists | None:
        if self.logprobs is None:
            return None
        return LogprobsLists(self.logprob_token_ids.tolist(), self.logprobs.tolist(), self.sampled_ranks.tolist())


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors that hold uint32 values."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


_arange_cache: dict[tuple[int, torch.device], torch.Tensor] = {}


def _vocab_ids(vocab_size: int, device: torch.device) -> torch.Tensor:
    key = (vocab_size, device)
    ids = _arange_cache.get(key)
    if ids is None:
        ids = _arange_cache[key] = torch.arange(vocab_size, device=device, dtype=torch.int32)
    return ids


def row_keys(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[B] per-row hash keys from which every token's noise derives (uint32 values in int64)."""
    return _mix32((seeds & _M32) ^ _mix32(((seeds >> 32) & _M32) ^ ((offsets * 0x9E3779B9) & _M32)))


_SERIES_BELOW = 1.0 / 32  # the series' relative error there is below 2^-22


def exponential_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws from uniform uint32 hashes (int64 values, or int32 bit patterns), as float32 in
    (0, 17).

    E = -log(1 - w) with w = (k + 0.5) / 2^23, k the top 23 bits: w is exact in float32 and never 0
    or 1, and the small E that win the race (w near 0) come from a series rather than from the log
    of a number that rounds to 1. (`u = (k + 0.5) / 2^24` rounded k = 2^24 - 1 to u = 1, E = -0.0:
    in ~1% of the rows the Gumbel form -log(E) made one token win regardless of its probability.)"""
    # The mask makes the shift logical for int32 bit patterns. In place from here: on the CPU
    # every fresh [B, V] tensor costs page faults as well as its pass.
    w = ((bits >> 9) & 0x7FFFFF).to(torch.float32).add_(0.5).mul_(1.0 / (1 << 23))
    # -log(1 - w) to ~w^5 / 5, as w * (1 + w * (1/2 + w * (1/3 + w / 4))).
    series = (w * 0.25).add_(1.0 / 3.0).mul_(w).add_(0.5).mul_(w).add_(1.0).mul_(w)
    return series.where(w < _SERIES_BELOW, torch.rsub(w, 1.0).log_().neg_())


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the same bits as int32."""
    return (x - ((x >> 31) << 32)).to(torch.int32)


_C1, _C2 = 0x85EBCA6B - (1 << 32), 0xC2B2AE35 - (1 << 32)  # murmur3's constants as int32


def _mix32_int32_(x: torch.Tensor) -> torch.Tensor:
    """`_mix32` in place on int32 bit patterns: products wrap modulo 2^32 as uint32 ones do, and
    each shift is masked to be logical. Half the bytes of the int64 form, and only the shifts make
    temporaries."""
    x ^= (x >> 16) & 0xFFFF
    x *= _C1
    x ^= (x >> 13) & 0x7FFFF
    x *= _C2
    x ^= (x >> 16) & 0xFFFF
    return x


def _noise_bits(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """[F, K] hashes (int32 bit patterns) of the token ids of each row ([F] int64 keys, [F, K] or
    [1, K] ids): `_mix32(_mix32(key ^ id) ^ (key >> 7))`, as kernels/sample.py computes it."""
    keys = _to_int32(keys)[:, None]
    x = _mix32_int32_(keys ^ token_ids.to(torch.int32))
    x ^= (keys >> 7) & 0x1FFFFFF
    return _mix32_int32_(x)


def exponential_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int,
                      keys: torch.Tensor | None = None) -> torch.Tensor:
    """[B, V] float32 Exp(1) draws determined by (seed, offset, token id) alone (keys: their
    `row_keys`, if already computed)."""
    cols = _vocab_ids(vocab_size, seeds.device)
    return exponential_from_bits(_noise_bits(row_keys(seeds, offsets) if keys is None else keys, cols[None, :]))


def draw_with_kernels(draw, logits: torch.Tensor, meta: SamplingMetadata, keys: torch.Tensor) -> torch.Tensor:
    """A `filter_kernels` draw on the logits as the bans and penalties leave them: penalties on
    float32 logits, as on the torch path; bans alone as -inf in a copy in the logits' own dtype
    (the float32 path's -inf: the same draws)."""
    x = (processed_logits(logits, meta) if meta.penalties is not None or meta.bias_ids is not None
         else _banned(logits, meta))
    return draw(x, meta, keys)


def _min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p): no softmax needed.
    threshold = x.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]
    return x.masked_fill_(x < threshold, float("-inf"))


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                 max_top_k: int) -> torch.Tensor:
    """In place on x [F, V]. Tokens rank by logit, equal logits by lowest id (TOKEN ORDER): top-k
    keeps exactly the k first, top-p the shortest prefix reaching p, so that ties at either cut
    fall the same way on every path (the kernels' order) whatever the batch."""
    vocab_size = x.shape[-1]
    if top_p is None:  # top-k alone: a partial top-k instead of a full sort
        vals, ids = _top_candidates(x, min(max_top_k, vocab_size))
        rank = torch.arange(vals.shape[-1], device=x.device)
        kept = vals.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
        return x.fill_(float("-inf")).scatter_(1, ids, kept)
    srt, idx = x.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size)
        srt.masked_fill_(torch.arange(vocab_size, device=x.device)[None, :] >= k[:, None], float("-inf"))
    probs = srt.softmax(dim=-1)
    before = probs.cumsum(dim=-1).sub_(probs)  # mass of the tokens ranked before
    # Keep the smallest prefix reaching p; the top token always stays (before = 0 < p). Rows with
    # p = 1 are excluded outright, so cumsum rounding cannot touch their tail.
    drop = (before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    srt.masked_fill_(drop, float("-inf"))
    return x.scatter_(1, idx, srt)


def _top_candidates(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `width` tokens of each row of x [F, V] in token order (see `_top_k_top_p`): their
    logits, descending, and ids. torch.topk finds the values; which of several logits equal to the
    last one it returns, and in what order, is unspecified, so those ids are taken again, lowest
    first."""
    vals, ids = x.topk(width, dim=-1)  # the ones above the last value come first
    kth = vals[:, -1:]
    num_above = (vals > kth).sum(dim=-1, keepdim=True)
    vocab = torch.arange(x.shape[-1], dtype=torch.int32, device=x.device)
    lowest_equal = torch.where(x == kth, vocab, x.shape[-1]).topk(width, dim=-1, largest=False).values
    j = torch.arange(width, device=x.device)
    ids = torch.where(j < num_above, ids, lowest_equal.gather(1, (j - num_above).clamp_(min=0)).long())
    ids = ids.sort(dim=-1).values
    vals, order = x.gather(1, ids).sort(dim=-1, descending=True, stable=True)
    return vals, ids.gather(1, order)


def _gumbel(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel noise -log(E) at the given token ids of each row ([F] keys, [F, K] ids): the values
    `exponential_noise` gives those tokens, so a draw among candidates matches the full draw."""
    return -torch.log(exponential_from_bits(_noise_bits(keys, token_ids)))


def _sample_top_k(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None, max_top_k: int,
                  keys: torch.Tensor) -> torch.Tensor:
    """Draw from rows that all have top_k > 0: top-k, then top-p over the renormalised top k, then
    the draw, on [F, max_top_k] candidates instead of the vocabulary (in token order)."""
    vals, idx = _top_candidates(x, min(max_top_k, x.shape[-1]))
    rank = torch.arange(vals.shape[-1], device=x.device)
    vals = vals.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
    if top_p is not None:
        probs = vals.softmax(dim=-1)
        before = probs.cumsum(dim=-1).sub_(probs)
        vals = vals.masked_fill((before >= top_p[:, None]) & (top_p < 1.0)[:, None], float("-inf"))
    choice = (vals + _gumbel(keys, idx)).argmax(dim=-1, keepdim=True)
    return idx.gather(1, choice).squeeze(1)


def _banned(x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """x with the min_tokens bans' (row, id) pairs at -inf: a copy in x's dtype, or x itself."""
    if meta.banned_ids is None:
        return x
    return x.index_put((meta.banned_rows, meta.banned_ids), x.new_full((), float("-inf")))


def processed_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """min_tokens bans, logit_bias and penalties, in float32: the logits that greedy rows take the
    argmax of. Returns logits itself (no copy) when they are float32 and the batch uses none."""
    x = _banned(logits.float(), meta)
    if meta.bias_ids is not None:  # in place where x is already a copy (of 16-bit logits, or by the bans)
        x = x if x is not logits else x.clone()
        x.index_put_((meta.bias_rows, meta.bias_ids), meta.bias_values, accumulate=True)
    if meta.penalties is not None:
        x = apply_penalties_(x if x is not logits else x.clone(), meta.penalties)
    return x


def unpack_bitmask(masks: torch.Tensor, vocab_size: int, allowed: bool = True) -> torch.Tensor:
    """[K, ceil(V / 32)] int32 bitmasks (on the CPU) -> [K, V] bool, True where a token is allowed
    (or, with allowed=False, where it is not)."""
    words = masks.numpy().view(np.uint8)  # little-endian: byte i of word w holds tokens 32w + 8i ...
    bits = np.unpackbits(words if allowed else ~words, axis=1, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_))[:, :vocab_size]


def apply_token_bitmask(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """In place: -inf wherever a row's grammar mask forbids a token."""
    if logits.is_cuda:
        from nanovllm.kernels.sample import apply_token_bitmask_
        return apply_token_bitmask_(logits, meta.masks, meta.masked_rows)
    forbidden = unpack_bitmask(meta.masks, logits.shape[1], allowed=False)
    if forbidden.shape[0] == logits.shape[0]:  # every row (the masked rows are all, in order)
        return logits.masked_fill_(forbidden, float("-inf"))
    for k, row in enumerate(meta.masked_rows.tolist()):  # in place on each row: no gather of rows
        logits[row].masked_fill_(forbidden[k], float("-inf"))
    return logits


def _on_rows(x: torch.Tensor, rows: torch.Tensor | None, fn) -> torch.Tensor:
    if rows is None:
        return fn(x)
    return x.index_copy_(0, rows, fn(x.index_select(0, rows)))


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """logits: [B, V] -> sampled token ids [B] (int64)."""
        return self.sample(logits, meta).token_ids

    def process_logits(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        return processed_logits(logits, meta)

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Grammar masks (meta.masks) are written into logits, except where the fused draw takes them."""
        filters = meta.min_p is not None or meta.top_k is not None or meta.top_p is not None
        keys = meta.row_keys if meta.row_keys is not None else row_keys(meta.seeds, meta.offsets)
        kernel_draw = filter_kernel_draw(logits.dtype, meta) if logits.is_cuda else None
        fused = logits.is_cuda and not filters
        masks_in_draw = fused and meta.max_num_logprobs is None
        if meta.masks is not None and not masks_in_draw:
            logits = apply_token_bitmask(logits, meta)
        if kernel_draw is not None:  # the filters and the draw in Triton kernels: no vocabulary sort
            tokens = draw_with_kernels(kernel_draw, logits, meta, keys)
            if meta.max_num_logprobs is None:
                return SamplerOutput(tokens)
            return self._with_logprobs(logits.float(), tokens, meta.max_num_logprobs)
        if fused:
            # One fused pass over the logits (kernels/sample.py) replaces the float copy, softmax,
            # noise tensor and division of the general path; the same draws up to float rounding.
            from nanovllm.kernels.sample import sample_rows
            plain = meta.banned_ids is None and meta.penalties is None and meta.bias_ids is None
            x = logits if plain else self.process_logits(logits, meta)
            masks = meta.masks if masks_in_draw else None
            tokens = sample_rows(x, meta.temperatures, keys, mask_rows=meta.mask_rows, masks=masks)
            if meta.max_num_logprobs is None:
                return SamplerOutput(tokens)
            return self._with_logprobs(logits.float(), tokens, meta.max_num_logprobs)
        raw = logits.float()
        x = self.process_logits(raw, meta)
        greedy = None if meta.all_random else x.argmax(dim=-1)
        if meta.all_greedy:
            tokens = greedy
        else:
            temps = torch.where(meta.temperatures > 0, meta.temperatures, 1.0)
            x = x / temps[:, None]  # a fresh tensor: the filters below may work in place
            if meta.min_p is not None:
                x = _on_rows(x, meta.min_p_rows, lambda t: _min_p(t, meta.min_p))
            filtered = None
            if meta.top_k is not None and meta.top_k_bounded:
                # Every filtered row keeps at most k tokens: draw among its k best only, with the
                # noise those tokens get in a full-vocabulary draw (same result, no vocabulary sort).
                xf, kf = (x, keys) if meta.filter_rows is None else (x[meta.filter_rows], keys[meta.filter_rows])
                filtered = _sample_top_k(xf, meta.top_k, meta.top_p, meta.max_top_k, kf)
            elif meta.top_k is not None or meta.top_p is not None:
                x = _on_rows(x, meta.filter_rows,
                             lambda t: _top_k_top_p(t, meta.top_k, meta.top_p, meta.max_top_k))
            if filtered is not None and meta.filter_rows is None:
                tokens = filtered  # every row was a filtered (random) row
            else:
                tokens = self._draw(x, meta, keys, greedy)
                if filtered is not None:
                    tokens = tokens.index_copy(0, meta.filter_rows, filtered)
        if meta.max_num_logprobs is None:
            return SamplerOutput(tokens)
        return self._with_logprobs(raw, tokens, meta.max_num_logprobs)

    @staticmethod
    def _draw(x: torch.Tensor, meta: SamplingMetadata, keys: torch.Tensor, greedy: torch.Tensor | None):
        """The draw from already temperature-scaled (and filtered) logits."""
        if x.is_cuda:
            from nanovllm.kernels.sample import sample_rows
            return sample_rows(x, (meta.temperatures > 0).float(), keys)
        noise = exponential_noise(meta.seeds, meta.offsets, x.shape[-1], keys)
        sampled = x.softmax(dim=-1).div_(noise).argmax(dim=-1)
        return sampled if meta.all_random else torch.where(meta.temperatures > 0, sampled, greedy)

    @staticmethod
    def _with_logprobs(raw: torch.Tensor, tokens: torch.Tensor, k: int) -> SamplerOutput:
        logprobs = torch.log_softmax(raw, dim=-1)
        chosen = logprobs.gather(1, tokens[:, None])
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        ids, values = tokens[:, None], chosen
        k = min(k, raw.shape[-1])
        if k > 0:
            top = logprobs.topk(k, dim=-1)
            ids = torch.cat([ids, top.indices], dim=1)
            values = torch.cat([values, top.values], dim=1)
        return SamplerOutput(tokens, ids, values, ranks)
