"""What runs under backward: each chunk's state goes up to the GPU where there is room (staged.py), else its
update starts into a spare buffer as soon as backward has made its gradients final, which ``step()`` keeps when
nothing it read has changed since.

Backward produces gradients last layer first. A post-accumulate-grad hook (under FSDP2 it fires after the
reduce-scatter) marks, per chunk, the parameters whose gradients are final in this backward; when a chunk's are all
final, the hook records a CUDA event on the stream that made them and hands the chunk to a worker thread, so that
backward's own thread only ever does that much. At backward's first hook the worker is first asked to stage
records in HBM (``HbmStage``, staged.py): an upload needs no gradients, so it stages every chunk the GPU has room
for, in the order the last backward made them final; ``step()`` then runs only the math over them, exact by
construction, clipped or not. A chunk it could not stage by the time its gradients are final, while the switch
(switch.py) is on, takes a spare pinned buffer from the host budget (``store.spare``): ``AsideUpdate.update``
(aside.py) queues its record up, updates it and brings it down into that buffer behind the gradients' event,
while backward goes on. A split chunk's new bf16 weights wait in a row on the GPU (``AsideUpdate.weights_row``),
or come down too; the others' are the new record's master row. Nothing the user can see changes: the record,
the parameters and the gradients are as they were.

Such an update is speculative: another micro-batch may add to the gradients, the user (or HF Trainer,
accelerate, Lightning) may clip or unscale them, a scheduler may change the learning rate, a parameter may be
written. So ``step()`` keeps it only if everything it read is the same now (updates.py, ``StartedUpdate.stale``):

- the gradients' and the parameters' fingerprints (``grad_fingerprint``: exact integer sums over their bits,
  taken from the very rows the update read) equal those now. Never trusted to version counters: GradScaler
  unscales in place without bumping them, and a write through ``.data`` (``p.data.copy_(x)``, ``p.data =
  p.data * 0.9``, an EMA swap), which the plain step keeps, moves none. A clip by exactly 1 keeps the bits;
- ``max_grad_norm``, if set, does not scale (the optimizer's own clip runs first);
- each parameter's version and step count, and the group's hyperparameters, are those the update used.

Kept (``commit``, updates.py): the spare buffer becomes the record's (``store.exchange``), the old one goes back to the
pool, and the new weights go into the parameters. Redone: the spare buffer goes back, and the chunk updates in
``step()`` as it would have anyway, at the cost of idle PCIe and GPU time only. A new backward before ``step()``
drops what the last one started, and so does a read of the state before it where part of the state is not kept
in host memory (``give_room``: the read needs room those buffers may hold); ``zero_grad``, loads, a layout again
and ``close`` drop it and the staged records too. The count of backwards per step is learned, so that under
gradient accumulation only the last backward before a step (as the last step saw it) stages or starts anything.

A chunk whose record is on NVMe is read first: the worker asks the store to read it without waiting (now, or
once write-backs in flight free room; refused when there is none), and takes it again when the read ends, unless
``step()`` has begun, which then streams it as usual: neither waits for the other's room.
``stats()["under_backward"]`` says what was staged, read, kept and redone, and why.

Hooks run on autograd's threads; this module's lock guards its state. Neither the hooks nor the worker take the
optimizer's lock, which ``step(closure)`` holds while the closure's backward runs: that backward stages and starts
updates too (Lightning steps that way), and the same ``step()`` uses them. ``step()`` first waits for the worker
to have queued everything it was handed.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from typing import Any, cast

import torch

from io_engine import PooledBuffer
from io_engine.condition import Condition

from ...layout.chunking import Chunk
from ..device_update import DeviceUpdate
from ..pipeline import synchronize
from ..state_chunks import StateChunks
from ..step_stats import StepClock
from ..transfer import Work
from .aside import AsideUpdate
from .staged import HbmStage, StageRoom
from .switch import UnderBackwardSwitch
from .updates import Counts, StartedUpdate, bf16_weights, commit, hyperparameters, release_buffers, tell_short

__all__ = ["UnderBackward", "hook_backward"]

_IN_HBM = "in HBM: step() updates it in place"
PARAMS_WRITTEN = "parameters' bits changed"  # no version counter moved: a write through .data, say


def hook_backward(state: StateChunks, setting: bool | str, resources: list[Any]) -> UnderBackward | None:
    """The update under backward over ``state`` (a TieredOptimizer's), hooked on every parameter; None when
    ``setting`` (its ``update_in_backward``) is off. ``state`` holds the optimizer weakly (the hooks live as long
    as the model); the update is appended to ``resources``, so the optimizer's finalizer closes it first. FSDP2
    runs the hooks after its reduce-scatter; DDP's all-reduce runs after them, so under DDP and ZeRO-1 only
    staging pays (it reads no gradients): every update started into a spare buffer is redone."""
    if setting is False:
        return None
    strategy = cast(DeviceUpdate, state.strategy)  # update_in_backward needs update_on="device" (config.py)
    early = UnderBackward(state, strategy, UnderBackwardSwitch(setting, cuda=strategy.cuda))
    resources.append(early)
    state.landed = early.landed  # every reader of the state waits for the last step's downloads
    return early


class UnderBackward:
    """Starts chunks' updates from gradient hooks and keeps or drops them at ``step()``; see the module doc."""

    def __init__(self, state: StateChunks, strategy: DeviceUpdate, switch: UnderBackwardSwitch):
        """``state``: the optimizer's (its chunks, parameters, step counts, versions and groups are read; its
        shards' parameters are hooked); ``strategy``: its device update; ``switch``: whether the hooks start
        updates (optim/under_backward/switch.py)."""
        self.chunked, self.store, self.strategy, self.switch = state, state.store, strategy, switch
        self.shards = state.shards
        self.aside = AsideUpdate(strategy)  # the strategy's update into spare buffers, its inputs fingerprinted
        # Records staged in HBM under backward, updated there at step() (staged.py): tried first for every chunk.
        self.staging = HbmStage(state, strategy, StageRoom(strategy.device))
        self._lock = threading.RLock()  # an RLock: a Ctrl-C cannot interrupt a wait's re-take (io_engine/condition.py)
        self._idle = Condition(self._lock)
        self._pending = 0  # chunks handed to the worker and not yet queued on the device
        # (chunk, its gradients' event, the generation it was handed over in, whether read from NVMe since); a
        # chunk None asks the worker for a staging pass
        self._todo: queue.SimpleQueue[tuple[Chunk | None, Any, int, bool] | None] = queue.SimpleQueue()
        self._generation = 0  # reads that finish in a later generation are the step's to stream
        self._worker: threading.Thread | None = None
        # The parameters' versions the updater's written set was taken at, once it holds this backward's step counts
        self._begun: list[tuple[int, int]] | None = None
        self._early: dict[str, StartedUpdate] = {}
        self._final: set[int] = set()  # parameters whose gradients this backward has made final
        self._of_param: dict[int, list[int]] = {}  # parameter -> the chunks holding a piece of it
        self._queued_for: int | None = None  # the backward (autograd's graph task id) its end callback is queued for
        self._staging = False  # this backward stages records in HBM
        self._order: dict[int, None] = {}  # the chunks this backward made final, in that order
        self.backwards = 0  # backwards since the last step
        self.per_step = 0  # backwards the last step had (0: not known yet)
        self.counts = Counts()
        self._short = 0  # spare host bytes the chunks skipped for want of them needed, this step
        self._told = False  # the warning that host_budget holds too little spare room was given
        self.last: dict[str, Any] = {}
        self._in_host: bool | None = None  # the whole state is kept in host memory (give_room), once known
        for ci, c in enumerate(state.chunks):  # the layout as built; add_param_group makes a new UnderBackward
            for pc in c.pieces:
                self._of_param.setdefault(pc.param, []).append(ci)
        self._handles = [p.register_post_accumulate_grad_hook(lambda _, i=i: self.final(i))
                         for i, p in enumerate(state.shards.params)
                         if p.requires_grad]  # a frozen parameter cannot be hooked, and holds no state  # fmt: skip

    # -------------------------------------------------------------------------------- under backward
    def final(self, i: int) -> None:
        """Parameter ``i``'s gradient is final for this backward: start the chunks it completes."""
        with self._lock:
            if self.chunked.closed or i not in self._of_param:
                return
            last = not (self.per_step and self.backwards + 1 < self.per_step)  # not mid-accumulation, as last seen
            if self._queued_for != (task := torch._C._current_graph_task_id()):  # a new backward: one that raised
                self._final, self._order = set(), {}  # never ran its callback (nor cleared what it made final)
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
                self._queued_for = task
                self.switch.backward_began()
                compute = torch.cuda.current_stream(self.strategy.device) if self.strategy.cuda else None
                self._staging = last and self.staging.begin(compute)  # the stream backward runs on
                if self._staging:  # uploads need no gradients: start them all now, as far as the room goes
                    self._hand_over(None)
            self._final.add(i)
            for ci in self._of_param[i]:
                chunk = self.chunked.chunks[ci]
                if not all(pc.param in self._final for pc in chunk.pieces):
                    continue
                self._order[ci] = None
                if not last or not (self.switch.engaged or self._staging):
                    continue
                if self.store.gpu_budget and self.store.info(chunk.key).tier == "gpu":
                    self.counts.skipped[_IN_HBM] += 1  # no event, no worker: it updates in place in step()
                else:
                    self._hand_over(chunk)

    def _hand_over(self, chunk: Chunk | None) -> None:  # lock held
        event = None
        if self.strategy.cuda and chunk is not None:  # the gradients are ready once the stream that made them gets here
            event = torch.cuda.Event()
            event.record()
        self._pending += 1
        self._todo.put((chunk, event, self._generation, False))
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="tiered-under-backward", daemon=True)
            self._worker.start()

    def _work(self) -> None:
        """The worker: starts the updates handed over, in order, until ``close`` hands it None."""
        torch.set_grad_enabled(False)  # thread-local; DTensor.to_local then returns the local tensor itself
        if self.strategy.cuda:
            torch.cuda.set_device(self.strategy.device)
        while (item := self._todo.get()) is not None:
            chunk, ready, generation, was_read = item
            if was_read:  # its read from NVMe ended: still wanted if no step has begun since its backward
                with self._lock:
                    if generation != self._generation:
                        continue
                    self._pending += 1
            t0 = time.perf_counter()
            try:
                self._start(chunk, ready, generation, was_read)
            except Exception as e:  # noqa: BLE001 - the step updates the chunk itself and meets the error there
                with self._lock:
                    self.counts.skipped[f"{type(e).__name__}: {e}"] += 1
                logging.getLogger("tiered").warning("an update under backward failed (step() redoes it): %s", e)
            finally:
                with self._lock:
                    self.counts.worker_s += time.perf_counter() - t0
                    self._pending -= 1
                    if not self._pending:
                        self._idle.notify_all()

    def drain(self, clock: StepClock | None = None) -> None:
        """Wait until the worker has queued on the device every chunk handed to it (the wait: ``clock``'s ``drain_s``).
        ``stop_reads`` first leaves the chunks whose reads from NVMe are still in flight to the step."""
        with contextlib.nullcontext() if clock is None else clock.timed("drain_s"), self._lock:
            self._idle.wait_for(lambda: not self._pending)

    def _backward_done(self) -> None:
        with self._lock:
            if self._order:  # the next backward stages in this order, the chunks it did not see last
                seen = list(self._order)
                self.staging.order = seen + [c for c in self.staging.order if c not in self._order]
                self._order = {}
            self._final.clear()
            self._queued_for = None
            self.switch.backward_ended()
            self.backwards += 1
            self._begun = None  # the next backward's updates read the parameters' versions afresh

    def _start(self, chunk: Chunk | None, ready: Any, generation: int, was_read: bool) -> None:
        """On the worker: stage what the room allows (``chunk`` None, or not staged yet); else chunk's update into
        a spare buffer, queued behind ``ready`` (its gradients' event); for a chunk on NVMe, its read first
        (``_read``), after which the worker comes back here (``was_read``)."""
        chunked, store = self.chunked, self.store
        if chunk is None or (self._staging and not self.staging.has(chunk.key)):
            if chunked.broken is None:
                self.staging.stage([chunked.chunks[ci] for ci in self.staging.order] if chunk is None else None)
                with self._lock:  # started into spare buffers by an earlier backward: staged now instead
                    stale = [self._early.pop(k) for k in list(self._early) if self.staging.has(k)]
                for e in stale:
                    self._drop(e, "another backward")
            if chunk is None:
                return
        if self.staging.has(chunk.key) or not self.switch.engaged:
            return  # staged: step() updates it where it lies; else it waits for step()
        with self._lock:
            old = self._early.pop(chunk.key, None)
        if old is not None:  # started by an earlier backward: its gradients have changed since
            self._drop(old, "another backward")
        rec = store.info(chunk.key)
        if chunked.broken is not None:
            self._skip("the optimizer is broken")
            return
        if rec.tier == "nvme" and not was_read:
            self._read(chunk, ready, generation)
            return
        if rec.tier != "host":
            self._skip(_IN_HBM if rec.tier == "gpu" else "evicted or failed to read before its update")
            return
        out = store.spare(rec.nbytes)
        weights: PooledBuffer | torch.Tensor | None = None
        if out is not None and chunk.split:
            weights = self.aside.weights_row(chunk.numel)
            if weights is None:
                weights = store.spare(chunk.numel * 2)
        if out is None or (chunk.split and weights is None):
            release_buffers(out, weights)
            self._skip("no spare host memory", rec.nbytes + (chunk.numel * 2 if chunk.split else 0))
            return
        steps = {pc.param: chunked.steps[pc.param] + 1 for pc in chunk.pieces}  # as step() will count them
        self.staging.wait([chunk.key])  # the download a step staged it for ended
        pin = contextlib.ExitStack()
        try:
            state = pin.enter_context(store.pin(chunk.key, tier="host"))
            if (begun := self._begun) is None:  # this step's counts: one upload a backward
                # The versions before the written set: a write after them moves a counter past them (redone), though
                # the updates after it do not see it as written (a split chunk's masters keep their low halves).
                begun = self._begun = [chunked.version(i) for i in range(len(chunked.steps))]
                chunked.updater.begin([s + 1 for s in chunked.steps], chunked.written_now())
            versions = {pc.param: begun[pc.param] for pc in chunk.pieces}  # as the update's written set saw them
            self.shards.bind_grads([pc.param for pc in chunk.pieces])
            w = None if weights is None else bf16_weights(weights, chunk.numel)
            js = list(range(len(chunk.pieces)))
            hyper = hyperparameters(chunked, chunk)  # what the update reads: a value set meanwhile redoes it
            event, printed = self.aside.update(chunk, js, state, out.view(state.dtype, state.shape), w, hyper, ready)
        except BaseException:
            pin.close()
            release_buffers(out, weights)
            raise
        early = StartedUpdate(chunk, js, pin, out, weights, event, printed, versions, steps, hyper)
        with self._lock:
            self._early[chunk.key] = early
            self.counts.started += 1

    def _read(self, chunk: Chunk, ready: Any, generation: int) -> None:
        """Start reading an NVMe-resident chunk into host memory, without waiting: the store starts it now or
        queues it behind write-backs in flight, or refuses when there is no room. The worker takes the chunk
        again when the read ends, if no step has begun since its backward (``stop_reads`` starts a new
        ``generation``): neither the worker nor ``step()`` ever waits for the other's room."""
        started = self.store.prefetch([chunk.key])
        if not started:
            self._skip("no host memory to read into")
            return
        with self._lock:
            self.counts.read += 1
        started[0].add_done_callback(lambda _: self._todo.put((chunk, ready, generation, True)))

    def _skip(self, why: str, short: int = 0) -> None:
        """``short``: the spare host bytes the chunk would have needed, where that is why."""
        with self._lock:
            self.counts.skipped[why] += 1
            self._short += short

    # ------------------------------------------------------------------------------------- at step()
    def settle(self, work: Work, clipped: bool, clock: StepClock) -> Work:
        """At ``step()``, after its clip and step counts: keep each early update whose inputs are unchanged
        (``clipped``: the optimizer's own clip scaled the gradients, so none is); drop the rest; then update the
        chunks staged in HBM (staged.py). Returns the work the step still has to do; ``settle_s`` and
        ``under_backward_bytes`` go into ``clock``. Whatever fails, nothing stays pinned or on loan."""
        t0 = time.perf_counter()
        self.drain()
        with self._lock:
            early, self._early = self._early, {}
            self.per_step, self.backwards, self._begun = max(self.backwards, 1), 0, None
        try:
            keep = self._judge(early, work, clipped)
            on_gpu = sum(isinstance(e.weights, torch.Tensor) for e in keep)
            commit(keep, self.store, self.strategy, self.aside)
        finally:
            left = [e for e in early.values() if not e.done]
            if left and self.strategy.cuda:
                torch.cuda.synchronize(self.strategy.device)  # no copy still reads or fills their buffers
            for e in left:
                with contextlib.suppress(Exception):
                    self._drop(e, "the step failed")
        clock.add("under_backward_bytes", kept := sum(e.chunk.nbytes for e in keep))
        with self._lock:
            self.counts.kept += len(keep)
            self.counts.kept_bytes += kept
            self.counts.weights_on_gpu += on_gpu
            self.last = {"kept": len(keep), "kept_bytes": kept, "redone": len(early) - len(keep)}
            short, self._short = self._short, 0
        if short and not self._told:
            self._told = True
            tell_short(all(self.store.is_resident(c.key) for c in self.chunked.chunks), short)
        clock.add("settle_s", time.perf_counter() - t0)
        done = {e.chunk.key for e in keep}
        todo = [w for w in work if w[0].key not in done]
        rest = self.staging.run(todo, clock)  # nothing speculative: the same inputs as the step's own update
        self.switch.judged(len(keep) + len(todo) - len(rest), len(early) - len(keep))
        return rest

    def step_began(self, clock: StepClock) -> None:
        """``step()`` begins, before it changes step counts or clips: the updates handed over are all queued
        (``drain``, its wait ``clock``'s ``drain_s``), and no more start."""
        self.switch.step_began()  # "auto" times the step (optim/under_backward/switch.py)
        self.staging.room.step_began()  # the first step tells the room backward needs (staged.py)
        self.stop_reads()
        self.drain(clock)

    def started(self) -> bool:
        """Whether updates backward started wait to be judged at this ``step()`` (after ``step_began``)."""
        with self._lock:
            return bool(self._early)

    def stop_reads(self) -> None:
        """Reads from NVMe that end from now on are the step's (or the next backward's): nothing waits for one."""
        with self._lock:
            self._generation += 1

    def step_ended(self) -> None:
        self.switch.step_ended()

    def _judge(self, early: dict[str, StartedUpdate], work: Work, clipped: bool) -> list[StartedUpdate]:
        """The early updates that may be kept; the others are dropped."""
        wanted = {c.key: js for c, js in work}
        check: list[StartedUpdate] = []
        for e in early.values():
            why = e.stale(self.chunked, wanted.get(e.chunk.key), clipped)
            if why:
                self._drop(e, why)
            else:
                check.append(e)
        if not check:
            return []
        # Compare the gradients and the parameters as they are with what the early updates read, one sync for all.
        if self.strategy.cuda:
            self.strategy.begin_step()  # after what the compute stream did to them (a clip, a write through .data)
        sames = self.aside.same_fingerprints([(e.chunk, e.js, e.printed) for e in check])
        keep = []
        for e, (grads, params) in zip(check, sames):
            if grads and params:
                keep.append(e)
            else:
                self._drop(e, "gradients changed" if not grads else PARAMS_WRITTEN)
        return keep

    def _drop(self, e: StartedUpdate, why: str) -> None:
        synchronize(e.event)  # the copies into out and weights must end before the pool reuses them
        e.release()
        with self._lock:  # the worker drops too
            self.counts.redone[why] += 1

    def give_room(self, why: str) -> None:
        """Before a read of the state between backward and ``step()`` (``state_dict()``, checkpoints, ``opt.state``):
        where part of the state is not kept in host memory, the read must bring records there, into room the
        updates started into spare buffers may hold (those buffers, and the records they read, pinned) until
        ``step()``: it would wait for ever. They are dropped then, and ``step()`` redoes them from the same inputs,
        as stale ones: nothing of theirs is in the state yet. Staged records hold only resident records: kept."""
        if self._in_host is None:  # the tiers are those of the layout, which this update lives as long as
            store = self.store
            self._in_host = all(
                store.is_resident(c.key) and store.info(c.key).tier == "host" for c in self.chunked.chunks
            )
        if not self._in_host:
            self._drop_early(why)

    def _drop_early(self, why: str) -> None:
        self.stop_reads()
        self.drain()
        with self._lock:
            early, self._early = self._early, {}
        for e in early.values():
            self._drop(e, why)

    def drop_all(self, why: str, *, landed: bool = True) -> None:
        """Forget every early update and staged record (``zero_grad``, a load, a layout again, ``close``): none is in
        the state or the parameters before ``step()`` keeps it, so a step then updates those chunks itself, each
        once. ``landed``: also wait for the downloads of the last step's staged records (``landed``)."""
        self._drop_early(why)
        with self._lock:
            self._final.clear()
            self._begun = None
            self.backwards = 0  # the gradients are gone (a step GradScaler skipped is no accumulation)
        self.staging.drop()
        if landed:
            self.landed()

    def landed(self) -> None:
        """Wait until the pinned records hold what the last step wrote in HBM, before the host uses them."""
        self.staging.wait()

    def stats(self) -> dict[str, Any]:
        """What was started, kept, redone and skipped, once the worker has started what it was handed."""
        self.drain()
        c = self.counts
        return {"started": c.started, "read": c.read, "kept": c.kept, "kept_bytes": c.kept_bytes,
                "weights_on_gpu": c.weights_on_gpu, "redone": dict(c.redone), "skipped": dict(c.skipped),
                "worker_s": round(c.worker_s, 4), "last_step": dict(self.last), "staged": self.staging.stats(),
                "switch": self.switch.stats()}  # fmt: skip

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.drop_all("closed")
        if self._worker is not None:
            self._todo.put(None)
            self._worker.join()
            self._worker = None
