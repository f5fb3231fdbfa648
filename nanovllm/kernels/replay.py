"""Replaying a Triton launch with other tensors: the attention layers of one step.

`fn[grid](...)` goes through `JITFunction.run`: it binds the arguments, specializes every one of
them (type, 16-byte alignment, value 1), hashes that into the cache key and looks the compiled
kernel up, ~20 us of Python a launch. Our wrappers add their own shape checks and launch choices.
On the steps the decode graphs cannot take (prefills, chunks, prefix hits), attention runs
eagerly between the piecewise graphs, two or three launches a layer: on the H200 with 28 layers,
~5 ms of host time a step (BENCHMARKS.md, multi-turn chat), more than the device needs for a
step of a few hundred tokens. Every layer of a step launches the same kernels with the same grid,
constants, strides and step inputs; only its q, caches and output differ, and those are laid out
alike (one cache tensor, static buffers). So the first layer's launches are recorded as
`Relaunch`es (the compiled kernel and its full argument list) and the other layers replay them
with their own tensors in those slots, through the compiled kernel's own launcher.

Under the Triton interpreter (CPU tests) nothing is recorded: every layer launches as usual.
"""
from typing import Callable

import torch


class Relaunch:
    """One recorded launch: `relaunch(*tensors)` launches the same compiled kernel on the same grid
    with `swap(*tensors)` in the argument slots `slots` and every other argument as recorded."""
    __slots__ = ("_runner", "_values", "_slots", "_swap")

    def __init__(self, runner, values: list, slots: list[int], swap: Callable):
        self._runner, self._values, self._slots, self._swap = runner, values, slots, swap

    def __call__(self, *tensors):
        values = self._values.copy()
        for slot, value in zip(self._slots, self._swap(*tensors)):
            values[slot] = value
        self._runner(*values)


def launch(fn, grid: tuple, args: tuple, kwargs: dict, record: list | None = None, swapped: tuple[str, ...] = (),
           swap: Callable | None = None):
    """fn[grid](*args, **kwargs). With `record`, also append a Relaunch of it that takes the
    parameters named `swapped` from swap(*tensors), or None where launches cannot be replayed
    (the interpreter): then the caller must launch as usual."""
    compiled = fn[grid](*args, **kwargs)
    if record is not None:
        record.append(_relaunch(fn, compiled, grid, args, kwargs, swapped, swap))


def _relaunch(fn, compiled, grid, args, kwargs, swapped, swap) -> Relaunch | None:
    getitem = getattr(type(compiled), "__getitem__", None)
    names = getattr(fn, "arg_names", None)
    if getitem is None or names is None or not hasattr(compiled, "function"):
        return None
    # The full argument list, as JITFunction.run hands it to the compiled kernel: every parameter
    # in order, constants included; launch options (num_warps, launch_pdl, ...) are compiled in.
    values = list(args)
    for param in fn.params[len(args):]:
        values.append(kwargs[param.name] if param.name in kwargs else param.default)
    grid = tuple(grid) + (1,) * (3 - len(grid))  # the compiled kernel's launcher takes all three axes
    return Relaunch(compiled[grid], values, [names.index(name) for name in swapped], swap)


def replay_key(q: torch.Tensor, k_cache: torch.Tensor, out: torch.Tensor, kv_scales) -> tuple:
    """What a recorded launch assumes of the tensors it is replayed with: their shapes, strides and
    dtypes (16-byte alignment holds for every tensor laid out alike: the caches are one tensor)."""
    return (q.shape, q.stride(), q.dtype, k_cache.shape, k_cache.stride(), k_cache.dtype, out.shape, out.stride(),
            kv_scales is None)
