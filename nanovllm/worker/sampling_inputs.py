"""Per-request sampling parameters gathered into batch tensors for the sampler."""
import numpy as np
import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import SamplingMetadata
from nanovllm.worker.inputs import _to_device


def build_sampling_metadata(seqs: list[Sequence], device: torch.device) -> SamplingMetadata:
    temps = np.fromiter((s.sampling_params.temperature for s in seqs), dtype=np.float32, count=len(seqs))
    seeds = np.fromiter((s.seed for s in seqs), dtype=np.int64, count=len(seqs))
    offsets = np.fromiter((s.num_completion_tokens for s in seqs), dtype=np.int64, count=len(seqs))
    greedy = temps < 1e-5
    return SamplingMetadata(
        temperatures=_to_device(np.where(greedy, 0.0, temps).astype(np.float32), device),
        seeds=_to_device(seeds, device),
        offsets=_to_device(offsets, device),
        all_greedy=bool(greedy.all()),
        all_random=not bool(greedy.any()),
    )
