"""What a launched step hands back (`StepOutput`): its sampled tokens, still on the device until read,
copied into pinned host memory (`PinnedTokenRing`) as the draw ends; or, for a step under grammars,
the forward pass alone, its draw waiting for the masks (`DeferredDraw`, see `ModelRunner.sample`)."""
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import LogprobsLists, SamplerOutput
from nanovllm.layers.sampling_metadata import SamplingMetadata
from nanovllm.worker.inputs import TransferSlots


@dataclass
class DeferredDraw:
    """A launched forward pass whose draw waits for grammar masks (`ModelRunner.sample`)."""
    logits: torch.Tensor
    meta: SamplingMetadata | None       # None: the graphs' default draw
    graph_bs: int | None                # the decode graphs' padded batch, or None (eager)
    forward_done: torch.cuda.Event | None


class StepOutput:
    """What one step sampled, still on the device until `token_ids()` is called."""

    # How to wait for the step's event; a tensor-parallel executor replaces it on its outputs with
    # a wait that watches the workers meanwhile.
    wait_for = staticmethod(torch.cuda.Event.synchronize)

    def __init__(self, seqs: list[Sequence], sampled: SamplerOutput | None, host: SamplerOutput | None = None,
                 event=None, deferred: DeferredDraw | None = None, drafts: list[list[int]] | None = None,
                 rows: np.ndarray | None = None, ring: "PinnedTokenRing | None" = None):
        """Either `sampled` (copied here into `ring`, or fresh pinned memory), or `host` copies already queued
        with the `event` recorded after them, or `deferred`: nothing drawn yet (see `awaits_masks`).
        drafts (a verification step): per sequence the drafts it verified; its rows are then
        len + 1 consecutive rows of token_ids(), one per position. rows: which of the drawn rows
        are the step's, in order (a CUDA graph's padding left out), or None: all."""
        self.seqs = seqs
        self.deferred = deferred
        self.drafts = drafts
        self._rows = rows
        self._complete(sampled, host, event, ring)

    @property
    def awaits_masks(self) -> bool:
        """The step's draw waits for `ModelRunner.sample` (its rows' grammar masks)."""
        return self.deferred is not None

    def _complete(self, sampled: SamplerOutput | None, host: SamplerOutput | None = None, event=None,
                  ring: "PinnedTokenRing | None" = None):
        """ring: where a draw without logprobs copies its tokens (a reused pinned buffer and event)."""
        self._host, self._event = host, event
        if sampled is None:
            return
        if not sampled.token_ids.is_cuda:
            self._host = sampled
        elif ring is not None and sampled.logprobs is None:
            self._host, self._event = ring.copy(sampled.token_ids)
        else:  # logprobs: fresh pinned copies of every field
            self._host = sampled.to_host()
            self._event = torch.cuda.Event()
            self._event.record()

    def token_ids(self) -> list[int]:
        """One token per sequence, or per verified position (see `drafts`)."""
        if self._host is None:
            return []
        if self._event is not None:
            self.wait_for(self._event)
            self._event = None
        if self._rows is not None:
            return self._host.token_ids.numpy()[self._rows].tolist()
        return self._host.token_ids.tolist()

    def logprobs(self) -> LogprobsLists | None:
        """Per-row logprobs (after token_ids()), or None when no sequence of the step asked."""
        return None if self._host is None else self._host.logprobs_lists()


class PinnedTokenRing:
    """Pinned host buffers (with their events) that sampled token ids are copied into, reused in
    rotation: the engine reads a step's tokens one step later, long before a buffer comes round."""

    def __init__(self, max_rows: int, size: int = 4):
        self._buffers = [torch.zeros(max_rows, dtype=torch.int64, pin_memory=True) for _ in range(size)]
        self._slots = TransferSlots(size)

    def copy(self, tokens: torch.Tensor) -> tuple[SamplerOutput, torch.cuda.Event]:
        """Queue the copy of tokens; (their host copy, the event to wait for before reading it)."""
        i = self._slots.take()
        host = self._buffers[i][:tokens.shape[0]]
        if host.shape[0] < tokens.shape[0]:  # start-up's compile batches (up to 8 rows) under a small max_num_seqs
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        return SamplerOutput(host), self._slots.copied(i)
