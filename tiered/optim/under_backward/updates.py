"""One chunk's update started under backward (overlap.py): the buffers it holds, what it read, and why
``step()`` may not keep it.

The update read the gradients and the parameters (a fingerprint of the bits of each), each parameter's version
and step count, and the group's hyperparameters; ``stale`` says which of these changed since, the fingerprints
aside (those are compared on the device, all at once: ``UnderBackward._judge``). The parameters' fingerprint
sees every write, as their version counters miss those through ``.data``; a moved counter redoes the update
too, same bits or not, since it changes what a split chunk's update does (``forget_low_halves``). Its new
record waits in a spare pinned buffer, and a split chunk's new bf16 weights wait in a row on the GPU or in a
pinned buffer; ``release`` gives them all back, kept or dropped.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from io_engine import PooledBuffer

from ...layout.chunking import Chunk
from ..state_chunks import StateChunks

__all__ = ["StartedUpdate", "bf16_weights", "hyperparameters", "release_buffers"]

_HYPER = ("lr", "betas", "eps", "weight_decay", "maximize")


@dataclass
class StartedUpdate:
    """One chunk's update started under backward."""

    chunk: Chunk
    js: list[int]
    pin: contextlib.ExitStack  # the record pinned in host memory until kept or dropped
    out: PooledBuffer | None  # the new record; None once it is the record's own buffer (kept)
    weights: PooledBuffer | torch.Tensor | None  # a split chunk's new bf16 weights: a row on the GPU, or pinned
    event: Any  # after which out and weights hold the result
    printed: torch.Tensor  # int64 [4]: grad_fingerprint of the gradients it read, then of the parameters' bits
    versions: dict[int, int]  # param -> its version then
    steps: dict[int, int]  # param -> the step count it used
    hyper: tuple[Any, ...]
    done: bool = False  # kept or dropped: nothing of it is held any more

    def stale(self, opt: StateChunks, js: list[int] | None, clipped: bool) -> str:
        """Why ``step()`` over ``opt`` (an optimizer's state, its gradients on pieces ``js`` of this chunk, its
        own clip ``clipped`` or not) cannot keep this update, the fingerprints aside ("": it may)."""
        params = opt.params
        if js != self.js:
            return "gradients missing"
        if clipped:
            return "clipped"
        if any(opt.steps[p] != s for p, s in self.steps.items()):
            return "step counts"
        if (
            any(params[p]._version != v for p, v in self.versions.items())
            or hyperparameters(opt, self.chunk) != self.hyper
        ):
            return "parameters or hyperparameters changed"
        return ""

    def release(self) -> None:
        """Give back what it holds (after the copies into its buffers ended): done."""
        release_buffers(self.out, self.weights)
        self.weights = None
        self.pin.close()
        self.done = True


def bf16_weights(weights: PooledBuffer | torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` bf16 weights of a row on the GPU or of a pinned buffer."""
    return weights[:n] if isinstance(weights, torch.Tensor) else weights.view(torch.bfloat16)[:n]


def release_buffers(*buffers: PooledBuffer | torch.Tensor | None) -> None:
    """Pinned buffers go back to the pool; a row on the GPU goes back to the caching allocator once its last
    reference is dropped (by the caller)."""
    for b in buffers:
        if isinstance(b, PooledBuffer):
            b.release()


def hyperparameters(opt: StateChunks, chunk: Chunk) -> tuple[Any, ...]:
    """The hyperparameters of ``chunk``'s group in ``opt`` that its update reads."""
    g = opt.param_groups[chunk.group]
    return tuple(g.get(k) for k in _HYPER)
