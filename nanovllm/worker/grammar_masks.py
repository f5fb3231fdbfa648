"""Where a step's grammar bitmasks travel from the host to the sampler (structured outputs).

`BitmaskBuffers` is one device allocation with pinned host twins in rotation (cuda_graph's
`PackedInputs`): per batch row the index of its mask (-1: none), the batch rows that have one, and
the masks themselves, compact (one per constrained row), last so that a step copies only the rows
it filled: one copy per step. The sampling graphs read the same device buffer. On the CPU the
host arrays are the sampler's tensors.
"""
import time
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.worker.cuda_graph import PackedInputs


@dataclass
class MaskFillStats:
    """What filling the masks cost the steps that needed them (read by bench.py)."""
    steps: int = 0
    rows: int = 0          # masks filled
    seconds: float = 0.0   # host time filling them
    hidden_steps: int = 0  # steps whose forward pass was still running on the device once the masks were ready

    def record(self, seconds: float, rows: int, forward_done: torch.cuda.Event | None):
        self.steps += 1
        self.rows += rows
        self.seconds += seconds
        if forward_done is not None and not forward_done.query():
            self.hidden_steps += 1


class BitmaskBuffers:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device):
        self.words = -(-vocab_size // 32)
        self.device = device
        fields = {"mask_rows": (torch.int32, (max_rows,)), "masked_rows": (torch.int64, (max_rows,)),
                  "masks": (torch.int32, (max_rows, self.words))}
        if device.type == "cuda":
            self._packed = PackedInputs(fields, device)
            self.static = self._packed.device
            self.static["mask_rows"].fill_(-1)
        else:
            self._packed = None
            self.static = {name: torch.zeros(shape, dtype=dtype) for name, (dtype, shape) in fields.items()}
        self._host: dict[str, np.ndarray] | None = None

    def host(self) -> tuple[np.ndarray, torch.Tensor]:
        """(mask_rows [max_rows] int32, masks [max_rows, words] int32 tensor on the CPU) to fill."""
        if self._packed is None:
            views = {name: t.numpy() for name, t in self.static.items()}
        else:
            views = self._packed.host()
        self._host = views
        return views["mask_rows"], torch.from_numpy(views["masks"])

    def send(self, num_rows: int, num_masks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The filled buffers on the device (one copy): (mask_rows [num_rows], masks [num_masks],
        masked_rows [num_masks])."""
        views = self._host
        rows = views["mask_rows"][:num_rows]
        views["masked_rows"][:num_masks] = np.flatnonzero(rows >= 0)
        if self._packed is not None:
            self._packed.send(self._packed.offsets["masks"] + num_masks * self.words * 4)
        s = self.static
        return s["mask_rows"][:num_rows], s["masks"][:num_masks], s["masked_rows"][:num_masks]


def timed_fill(fill_masks, seqs, rows: np.ndarray, masks: torch.Tensor, stats: MaskFillStats,
               forward_done) -> int:
    start = time.perf_counter()
    num = fill_masks(seqs, rows, masks)
    stats.record(time.perf_counter() - start, num, forward_done)
    return num
