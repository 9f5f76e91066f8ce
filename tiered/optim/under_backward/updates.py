"""One chunk's update started under backward (overlap.py): the buffers it holds, what it read, and why
``step()`` may not keep it.

The update read the gradients and the parameters (a fingerprint of the bits of each), each parameter's version
and step count, and the group's hyperparameters; ``stale`` says which of these changed since, the fingerprints
aside (those are compared on the device, all at once: ``UnderBackward._judge``). The parameters' fingerprint
sees every write, as their version counters miss those through ``.data``; a moved counter redoes the update
too, same bits or not, since it changes what a split chunk's update does (``forget_low_halves``). Its new
record waits in a spare pinned buffer, and a split chunk's new bf16 weights wait in a row on the GPU or in a
pinned buffer; ``release`` gives them all back, kept or dropped. ``commit`` makes the kept ones' new records the
records and their new weights the parameters'.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from io_engine import PooledBuffer, format_size

from ...layout.chunking import Chunk
from ...store import TieredStore
from ..device_update import DeviceUpdate
from ..pipeline import synchronize
from ..state_chunks import StateChunks
from .aside import AsideUpdate

__all__ = ["Counts", "StartedUpdate", "bf16_weights", "commit", "hyperparameters", "release_buffers", "tell_short"]

_HYPER = ("lr", "betas", "eps", "weight_decay", "maximize")


@dataclass
class Counts:
    """What the update under backward started, kept, redid and skipped, over the run."""

    started: int = 0
    read: int = 0  # chunks read from NVMe for an early update
    kept: int = 0
    kept_bytes: int = 0
    weights_on_gpu: int = 0  # kept chunks whose new weights waited on the GPU rather than in host memory
    worker_s: float = 0.0  # the worker's time starting updates (host side: launching them)
    redone: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)


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
    versions: dict[int, tuple[int, int]]  # param -> its version counters then (StateChunks.version)
    steps: dict[int, int]  # param -> the step count it used
    hyper: dict[str, Any]  # the group it read (``hyperparameters``), taken before it began
    done: bool = False  # kept or dropped: nothing of it is held any more

    def stale(self, opt: StateChunks, js: list[int] | None, clipped: bool) -> str:
        """Why ``step()`` over ``opt`` (an optimizer's state, its gradients on pieces ``js`` of this chunk, its
        own clip ``clipped`` or not) cannot keep this update, the fingerprints aside ("": it may)."""
        if js != self.js:
            return "gradients missing"
        if clipped:
            return "clipped"
        if any(opt.steps[p] != s for p, s in self.steps.items()):
            return "step counts"
        if any(opt.version(p) != v for p, v in self.versions.items()) or hyperparameters(opt, self.chunk) != self.hyper:
            return "parameters or hyperparameters changed"
        return ""

    def release(self) -> None:
        """Give back what it holds (after the copies into its buffers ended): done."""
        release_buffers(self.out, self.weights)
        self.weights = None
        self.pin.close()
        self.done = True


def commit(keep: list[StartedUpdate], store: TieredStore, tr: DeviceUpdate, aside: AsideUpdate) -> None:
    """The kept updates' new records become the records, their new weights go up into the parameters (``tr``:
    the optimizer's device update; ``aside``: its update into spare buffers, which holds the rows on the GPU)."""
    if tr.cuda:
        tr.begin_step()  # the compute stream is done with the parameters before they are written
    # The new records came down on the download stream, which the fingerprints UnderBackward._judge waited for on
    # the work stream did not wait for: each is read below (exchanged into the store, its weights pushed up).
    for e in keep:
        synchronize(e.event)
    event, rows = None, []
    for e in keep:
        info = store.info(e.chunk.key)
        assert e.out is not None
        new = e.out.view(info.dtype, info.shape)
        store.exchange(e.chunk.key, e.out).release()  # the pre-step record goes back to the pool
        e.out = None  # the record's own buffer now
        if isinstance(e.weights, torch.Tensor):
            rows.append((e.chunk, e.weights[: e.chunk.numel], e.js))
        else:  # up from host memory: wait for it below
            n = e.chunk.numel
            event = tr.push_params(e.chunk, new[0, :n] if e.weights is None else bf16_weights(e.weights, n), e.js)
    # One stream: the last copy from host memory ends after every earlier one. Rows on the GPU need no
    # wait: only the work stream uses them, and the compute stream waits for it (end_step).
    synchronize(event)
    aside.push_rows(rows)
    if tr.cuda:
        tr.end_step()
    for e in keep:
        e.release()
        store.retire(e.chunk.key)


def bf16_weights(weights: PooledBuffer | torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` bf16 weights of a row on the GPU or of a pinned buffer."""
    return weights[:n] if isinstance(weights, torch.Tensor) else weights.view(torch.bfloat16)[:n]


def release_buffers(*buffers: PooledBuffer | torch.Tensor | None) -> None:
    """Pinned buffers go back to the pool; a row on the GPU goes back to the caching allocator once its last
    reference is dropped (by the caller)."""
    for b in buffers:
        if isinstance(b, PooledBuffer):
            b.release()


def hyperparameters(opt: StateChunks, chunk: Chunk) -> dict[str, Any]:
    """The hyperparameters of ``chunk``'s group in ``opt`` that its update reads, as they are now: a group of their
    values alone, which the update reads in place of the group (``AsideUpdate.update``), so that what ``step()``
    compares is what the update used, whatever the main thread sets meanwhile."""
    g = opt.param_groups[chunk.group]
    return {k: _value(g[k]) for k in _HYPER if k in g}


def _value(v: Any) -> Any:
    """Values, not objects: a tensor lr that a scheduler fill_()s in place stays the same object, and so do tensor
    betas, in a tuple that compares them by identity. A numpy array (betas, a 0-d lr) is changed in place the same
    way, and two of them compare elementwise, which ``!=`` of the dicts cannot take. A tensor or array of two betas
    is a pair of them; one element is its number."""
    if isinstance(v, (tuple, list)):
        return tuple(_value(x) for x in v)
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else _value(v.tolist())
    if callable(getattr(v, "tolist", None)) and getattr(v, "size", None) is not None:  # numpy's arrays and scalars
        return v.item() if v.size == 1 else _value(v.tolist())
    return v


def tell_short(all_resident: bool, short: int) -> None:
    """Warn that chunks waited for ``step()`` for want of ``short`` spare host bytes, and what would fix it."""
    if all_resident:
        fix = f"host_budget about {format_size(short)} larger would let every chunk start under backward"
    else:  # more budget would first hold more of the state
        fix = "part of the state lives on NVMe, so only the stream reserve's room is spare"
    logging.getLogger("tiered").warning(
        "the update under backward found no spare host memory for %s of state; those chunks waited for "
        "step() (it needs room for a second copy of what it updates, unless the GPU has room to stage it): %s",
        format_size(short), fix)  # fmt: skip
