"""The update under backward: each chunk updates as soon as backward has made its gradients final, into a
spare buffer, and ``step()`` keeps the result when nothing it depended on has changed since.

Backward produces gradients last layer first. A post-accumulate-grad hook counts, per chunk, the parameters
whose gradients are final in this backward; when a chunk's count is full and its record is in host memory,
``DeviceUpdate.update_aside`` queues its update on the side streams, while backward goes on: the record goes
up, updates, and comes down into a spare pinned buffer from the host budget (``store.spare``); the new
weights come down too (a split chunk's bf16 weights; the others' are the master row). Nothing the user can
see changes: the record, the parameters and the gradients are as they were.

That update is speculative, because what ``step()`` will do is not known until it runs: another micro-batch
may add to the gradients, the user (or HF Trainer, accelerate, Lightning) may clip or unscale them, a
scheduler may change the learning rate, a parameter may be written. So ``step()`` keeps a chunk's result only
if everything its update read is the same now:

- every gradient is the same tensor at the same version, or its fingerprint (``grad_fingerprint``: exact
  integer sums over the bits) equals that of the gradients the update read: a clip by a factor of 1 is kept;
- ``max_grad_norm``, if set, does not scale (the optimizer's own clip runs first);
- each parameter's version and step count, and the group's hyperparameters, are those the update used.

Kept (``commit``): the spare buffer becomes the record's (``store.exchange``), the old one goes back to the
pool, and the new weights go up into the parameters. Redone: the spare buffer goes back, and the chunk
updates in ``step()`` as it would have anyway. A redo costs the work done under backward, which ran on
otherwise idle PCIe and GPU time, and nothing else: the step is then as long as without this. A new
backward before ``step()`` drops what the last one started; ``zero_grad``, loads and ``close`` drop it too.
The count of backwards per step is learned, so that under gradient accumulation only the last backward
before a step (as the last step saw it) starts updates.

Only chunks whose records are in host memory start early (those on NVMe stream in ``step()``), and only as
many as the spare host budget holds. ``stats()["under_backward"]`` says how many chunks were kept and redone,
and why. Hooks run on autograd's threads; this module's lock guards its state, never the optimizer's (a
``step(closure)`` holds that while backward runs).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from io_engine import PooledBuffer

from .chunking import Chunk
from .device_update import DeviceUpdate
from .pipeline import synchronize
from .store import TieredStore

__all__ = ["UnderBackward"]

_HYPER = ("lr", "betas", "eps", "weight_decay", "maximize")


@dataclass
class _Early:
    """One chunk's update started under backward."""

    chunk: Chunk
    js: list[int]
    pin: contextlib.ExitStack  # the record pinned in host memory until kept or dropped
    out: PooledBuffer  # the new record
    weights: PooledBuffer | None  # a split chunk's new bf16 weights
    event: Any  # after which out and weights hold the result
    printed: torch.Tensor  # grad_fingerprint of the gradients it read
    grads: dict[int, tuple[int, int]]  # param -> (id, version) of its gradient then
    versions: dict[int, int]  # param -> its version then
    steps: dict[int, int]  # param -> the step count it used
    hyper: tuple[Any, ...]


@dataclass
class _Counts:
    started: int = 0
    kept: int = 0
    kept_bytes: int = 0
    redone: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)


class UnderBackward:
    """Starts chunks' updates from gradient hooks and keeps or drops them at ``step()``; see the module doc."""

    def __init__(self, opt: Any, store: TieredStore, strategy: DeviceUpdate, hooked: list[torch.Tensor]):
        """``opt``: the TieredOptimizer (its chunks, parameters, step counts, versions and groups are read);
        ``hooked``: the tensors whose gradient hooks mark the parameters final, in the optimizer's order."""
        self.opt, self.store, self.strategy = opt, store, strategy
        self._lock = threading.Lock()
        self._early: dict[str, _Early] = {}
        self._final: set[int] = set()  # parameters whose gradients this backward has made final
        self._of_param: dict[int, list[int]] = {}  # parameter -> the chunks holding a piece of it
        self._queued = False  # the end-of-backward callback is queued for this backward
        self.backwards = 0  # backwards since the last step
        self.per_step = 0  # backwards the last step had (0: not known yet)
        self.enabled = True  # False while step() runs (a closure's backward starts nothing)
        self.counts = _Counts()
        self.last: dict[str, Any] = {}
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(hooked)]
        self.rebuild()

    def rebuild(self) -> None:
        """Re-read the chunk layout (after ``add_param_group``)."""
        with self._lock:
            self._of_param = {}
            for ci, c in enumerate(self.opt.chunks):
                for pc in c.pieces:
                    self._of_param.setdefault(pc.param, []).append(ci)

    def _hook(self, i: int) -> Any:
        def hook(_: torch.Tensor) -> None:
            self.final(i)

        return hook

    # -------------------------------------------------------------------------------- under backward
    def final(self, i: int) -> None:
        """Parameter ``i``'s gradient is final for this backward: start the chunks it completes."""
        with self._lock:
            if not self.enabled or self.opt.closed or i not in self._of_param:
                return
            if not self._queued:
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
                self._queued = True
            self._final.add(i)
            if self.per_step and self.backwards + 1 < self.per_step:
                return  # a micro-batch in the middle of an accumulation, as the last step saw it
            for ci in self._of_param[i]:
                chunk = self.opt.chunks[ci]
                if all(pc.param in self._final for pc in chunk.pieces):
                    self._start(chunk)

    def _backward_done(self) -> None:
        with self._lock:
            self._final.clear()
            self._queued = False
            self.backwards += 1

    def _start(self, chunk: Chunk) -> None:
        old = self._early.pop(chunk.key, None)
        if old is not None:  # started by an earlier backward: its gradients have changed since
            self._drop(old, "another backward")
        opt, store = self.opt, self.store
        if opt._broken is not None or store.info(chunk.key).tier != "host":
            self.counts.skipped["not in host memory"] += 1
            return
        rec = store.info(chunk.key)
        out = store.spare(rec.nbytes)
        weights = store.spare(chunk.numel * 2) if out is not None and chunk.split else None
        if out is None or (chunk.split and weights is None):
            for b in (out, weights):
                if b is not None:
                    b.release()
            self.counts.skipped["no spare host memory"] += 1
            return
        pin = contextlib.ExitStack()
        try:
            state = pin.enter_context(store.pin(chunk.key, tier="host"))
            params = opt._params
            js = list(range(len(chunk.pieces)))
            steps = {pc.param: opt._steps[pc.param] + 1 for pc in chunk.pieces}
            opt._updater.begin([steps.get(p, s) for p, s in enumerate(opt._steps)], opt._written_now())
            if self.strategy.cuda:  # the gradients were made on the autograd stream: the side streams wait
                self.strategy.begin_step()
            w = None if weights is None else weights.view(torch.bfloat16)[: chunk.numel]
            event, printed = self.strategy.update_aside(chunk, js, state, out.view(state.dtype, state.shape), w)
        except BaseException:
            pin.close()
            out.release()
            if weights is not None:
                weights.release()
            raise
        g = {pc.param: (id(params[pc.param].grad), params[pc.param].grad._version) for pc in chunk.pieces}
        self._early[chunk.key] = _Early(
            chunk, js, pin, out, weights, event, printed, g,
            {pc.param: params[pc.param]._version for pc in chunk.pieces}, steps, _hyper(opt, chunk),
        )  # fmt: skip
        self.counts.started += 1

    # ------------------------------------------------------------------------------------- at step()
    def settle(self, work: list[tuple[Chunk, list[int]]], clipped: bool) -> set[str]:
        """At ``step()``, after its clip and step counts: keep each early update whose inputs are unchanged
        (``clipped``: the optimizer's own clip scaled the gradients, so none is); drop the rest. Returns the
        keys kept, which the step leaves out."""
        with self._lock:
            early, self._early = self._early, {}
            self.per_step, self.backwards = max(self.backwards, 1), 0
        keep: dict[str, _Early] = {}
        wanted = {c.key: js for c, js in work}
        check: list[_Early] = []
        for key, e in early.items():
            why = self._stale(e, wanted.get(key), clipped)
            if why == "gradients touched":
                check.append(e)
            elif why:
                self._drop(e, why)
            else:
                keep[key] = e
        if check:  # compare the gradients as they are with what the early update read, one sync for all
            if self.strategy.cuda:
                self.strategy.begin_step()  # after what the compute stream did to them (a clip, say)
            now = torch.stack([self.strategy.fingerprint_grads(e.chunk, e.js) for e in check])
            then = torch.stack([e.printed.to(now.device) for e in check])
            for e, same in zip(check, (now == then).all(dim=1).tolist()):
                if same:
                    keep[e.chunk.key] = e
                else:
                    self._drop(e, "gradients changed")
        self._commit(list(keep.values()))
        kept = sum(e.chunk.nbytes for e in keep.values())
        self.counts.kept += len(keep)
        self.counts.kept_bytes += kept
        self.last = {"kept": len(keep), "kept_bytes": kept, "redone": len(early) - len(keep)}
        return set(keep)

    def _stale(self, e: _Early, js: list[int] | None, clipped: bool) -> str:
        """Why an early update cannot be kept ("" if it can; "gradients touched": compare fingerprints)."""
        opt, params = self.opt, self.opt._params
        if js != e.js:
            return "gradients missing"
        if clipped:
            return "clipped"
        if any(opt._steps[p] != s for p, s in e.steps.items()):
            return "step counts"
        if any(params[p]._version != v for p, v in e.versions.items()) or _hyper(opt, e.chunk) != e.hyper:
            return "parameters or hyperparameters changed"
        for p, (ident, version) in e.grads.items():
            g = params[p].grad
            if g is None:
                return "gradients missing"
            if id(g) != ident or g._version != version:
                return "gradients touched"
        return ""

    def _commit(self, keep: list[_Early]) -> None:
        """The kept updates' new records become the records, their new weights go up into the parameters."""
        tr = self.strategy
        if tr.cuda:
            tr.begin_step()  # the compute stream is done with the parameters before they are written
        event = None
        for e in keep:
            synchronize(e.event)
            info = self.store.info(e.chunk.key)
            new = e.out.view(info.dtype, info.shape)
            self.store.exchange(e.chunk.key, e.out).release()  # the pre-step record goes back to the pool
            n = e.chunk.numel
            weights = new[0, :n] if e.weights is None else e.weights.view(torch.bfloat16)[:n]
            event = tr.commit_weights(e.chunk, weights, e.js)
        synchronize(event)  # one stream: the last upload's end is every upload's
        if tr.cuda:
            tr.end_step()
        for e in keep:
            if e.weights is not None:
                e.weights.release()
            e.pin.close()
            self.store.retire(e.chunk.key)

    def _drop(self, e: _Early, why: str) -> None:
        synchronize(e.event)  # the copies into out and weights must end before the pool reuses them
        e.out.release()
        if e.weights is not None:
            e.weights.release()
        e.pin.close()
        self.counts.redone[why] += 1

    def drop_all(self, why: str) -> None:
        """Forget every early update (``zero_grad``, a load, ``close``)."""
        with self._lock:
            early, self._early = self._early, {}
            self._final.clear()
        for e in early.values():
            self._drop(e, why)

    def stats(self) -> dict[str, Any]:
        c = self.counts
        return {"started": c.started, "kept": c.kept, "kept_bytes": c.kept_bytes, "redone": dict(c.redone),
                "skipped": dict(c.skipped), "last_step": dict(self.last)}  # fmt: skip

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.drop_all("closed")


def _hyper(opt: Any, chunk: Chunk) -> tuple[Any, ...]:
    g = opt.param_groups[chunk.group]
    return tuple(g.get(k) for k in _HYPER)
