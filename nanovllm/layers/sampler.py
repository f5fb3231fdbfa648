"""Batched sampling on the device: one call for the whole batch, per-request parameters as tensors.

Random draws use the exponential-race form of sampling (argmax of p / E with E ~ Exp(1) equals a
draw from p) with noise that is a pure function of (request seed, output position, token id),
so a request's tokens do not depend on which other requests share its batch, or their order.
"""
from dataclasses import dataclass

import torch
from torch import nn

_M32 = 0xFFFFFFFF


@dataclass
class SamplingMetadata:
    temperatures: torch.Tensor   # [B] float32; 0 means greedy
    seeds: torch.Tensor          # [B] int64
    offsets: torch.Tensor        # [B] int64: index of the token being drawn among the outputs
    all_greedy: bool
    all_random: bool


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors that hold uint32 values."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def exponential_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 Exp(1) draws determined by (seed, offset, token id) alone."""
    row = _mix32((seeds & _M32) ^ _mix32(((seeds >> 32) & _M32) ^ ((offsets * 0x9E3779B9) & _M32)))
    cols = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _mix32(_mix32(row[:, None] ^ cols[None, :]) ^ (row[:, None] >> 7))
    u = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return -torch.log(u)


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """logits: [B, V] -> sampled token ids [B] (int64)."""
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy
        temps = torch.where(meta.temperatures > 0, meta.temperatures, 1.0)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        noise = exponential_noise(meta.seeds, meta.offsets, logits.shape[-1])
        sampled = (probs / noise).argmax(dim=-1)
        if meta.all_random:
            return sampled
        return torch.where(meta.temperatures > 0, sampled, greedy)
