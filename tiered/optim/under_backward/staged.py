"""The state visits HBM around the step: each chunk's record goes up under backward, ``step()`` runs only the
math over it at HBM speed, and the new record comes down into the same pinned buffer under the next forward.

An upload needs no gradients, only room on the GPU, which backward frees as it goes. So at backward's first
gradient hook the worker (overlap.py) stages chunks, in the order their gradients became final in the last
backward, while ``StageRoom`` allows: each record is allocated from the stream backward runs on (so it takes
memory backward freed), and copied up on a side stream after an event recorded on that stream just after the
allocation (so no kernel backward queued before the block was freed can still write it), and after the download
that last wrote the pinned record. At ``step()``, after its clip and step counts, ``run`` updates each staged
chunk where it lies, exactly as a chunk the store keeps in HBM (``DeviceUpdate.update_resident``: the same
kernels on the same inputs as the streamed step, so the same bits, clipped or not), writes the new weights
into the parameters, and queues the record down into its own pinned buffer on another side stream. The
compute stream never waits for those downloads: they run under the next forward, in the order the next
backward stages the chunks, so that its first uploads wait only for the first downloads. After every copy, up
or down, a one-element kernel lets the copy engine serve other streams (``_yield``): a ``loss.item()`` then
waits for one chunk's transfer, not for the whole state's.

Until a download has ended, its pinned record must not be read or written. Each is a ``_Landing`` (the
download's event and the record's store pin), and every reader waits for it: the next upload of that chunk on
the GPU (``up.wait_event``), and on the host ``wait``: the next ``step()``, ``state_dict()``, checkpoints,
``opt.state``, loads, ``add_param_group``, ``close()`` (through ``TieredOptimizer._check_open`` and
``StateChunks.for_each_chunk``) and the update into a spare buffer (aside.py) of a chunk that was not staged
this time. No second host copy of the state is ever made. Only chunks the store keeps resident in host memory
are staged; those it streams from NVMe, and those that find no room on the GPU, take the other paths.

Call order: ``HbmStage(state, strategy, room)``; per backward ``begin(compute_stream)`` at its first hook
(learning the room the first time), ``stage(chunks)`` from the worker; per step ``run(work, clock) -> the work
left``; ``wait(keys)`` before reading pinned records; ``drop()`` when staged records are no longer wanted
(zero_grad, loads); ``close()``.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from dataclasses import dataclass
from typing import Any, cast

import torch

from ...layout.chunking import Chunk
from ..device_update import DeviceUpdate
from ..state_chunks import StateChunks
from ..step_stats import StepClock
from ..transfer import Work

__all__ = ["HbmStage", "StageRoom"]

MARGIN = 20  # staging always leaves free at least 1/MARGIN of the memory the process may use on the device


class StageRoom:
    """How many bytes of staged records the GPU may take. ``budget``: a fixed number of bytes (the CPU twin's
    "device" is the host, where tests set it); None: learned on CUDA, and nothing on a CPU model.

    On CUDA the first backward stages nothing: it learns ``reserve``, what backward needed above its
    allocation at its first gradient hook (``max_memory_allocated`` at ``step()`` minus ``memory_allocated``
    at that hook), at least 1/MARGIN of ``allowed`` (the memory ``set_per_process_memory_fraction`` leaves the
    process). From then on a staging pass may take ``allowed - reserve - memory_allocated()``, and no more than
    the device has free: backward's later needs stay below its first ones. ``hold``: the staged bytes whose
    downloads may run under the next forward, what the first step never used (``allowed - allowed/MARGIN -
    its peak``); ``step()`` waits for the downloads of the rest, so that the next forward finds the memory it
    had before."""

    def __init__(self, device: torch.device, budget: int | None = None) -> None:
        self.device, self.budget = device, budget
        self.cuda = device.type == "cuda" and budget is None
        self.reserve: int | None = None
        self.hold_bytes = budget or 0
        self.peak = 0
        self._first: int | None = None  # memory_allocated at the first hook of the backward that learns

    @property
    def ready(self) -> bool:
        """Whether a backward may stage (a budget of 0: never)."""
        return bool(self.budget) or self.reserve is not None

    def first_hook(self) -> None:
        """A backward made its first gradient final (autograd's thread)."""
        if self.cuda and self.reserve is None and self._first is None:
            self._first = torch.cuda.memory_allocated(self.device)

    def step_began(self) -> None:
        """``step()`` begins: the first backward seen gives what backward needs."""
        if self.cuda and self.reserve is None and self._first is not None:
            allowed = self._allowed()
            self.peak = torch.cuda.max_memory_allocated(self.device)
            self.reserve = max(allowed // MARGIN, self.peak - self._first)
            self.hold_bytes = max(0, allowed - allowed // MARGIN - self.peak)

    def free(self, live: int) -> int:
        """Bytes more that may be staged now, ``live`` being staged already."""
        if self.budget is not None:
            return self.budget - live
        if self.reserve is None:
            return 0
        dev = self.device
        free_device = torch.cuda.mem_get_info(dev)[0]
        allocated, reserved = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
        return min(self._allowed() - self.reserve - allocated, free_device + reserved - allocated)

    def _allowed(self) -> int:
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(self.device)
        return int(fraction * torch.cuda.mem_get_info(self.device)[1])

    def stats(self) -> dict[str, Any]:
        return {"budget": self.budget, "reserve": self.reserve, "hold": self.hold_bytes, "first_peak": self.peak}


@dataclass
class _Staged:
    """A chunk's record on the device, and the pinned record it came from (pinned in the store)."""

    chunk: Chunk
    record: torch.Tensor
    state: torch.Tensor
    pin: contextlib.ExitStack
    uploaded: Any  # CUDA event after the upload (None: done)


@dataclass
class _Landing:
    """A download into ``state`` in flight: after ``event`` the pinned record holds the new state."""

    state: torch.Tensor
    pin: contextlib.ExitStack
    event: Any


class HbmStage:
    """Chunks' records staged in HBM under backward and updated there at ``step()``; see the module doc."""

    def __init__(self, state: StateChunks, strategy: DeviceUpdate, room: StageRoom) -> None:
        self.chunked, self.store, self.strategy, self.room = state, state.store, strategy, room
        cuda = strategy.cuda
        # High priority, as the work stream: the small kernel between two copies (``_yield``) runs as soon as an
        # SM is free, not behind the blocks of backward's or forward's queued GEMMs.
        self.up = torch.cuda.Stream(strategy.device, priority=-1) if cuda else None  # uploads under backward
        self.down = torch.cuda.Stream(strategy.device, priority=-1) if cuda else None  # under the next forward
        # One counter per stream, written by that stream only and read by nobody (``_yield``).
        self._ticks = torch.zeros(2, dtype=torch.int32, device=strategy.device) if cuda else None
        self._lock = threading.Lock()  # staged and landing: the worker stages, step() and readers land
        self.staged: dict[str, _Staged] = {}
        self.landing: dict[str, _Landing] = {}
        self.order = list(range(len(state.chunks)))[::-1]  # backward makes the last chunks' gradients final first
        self._compute: Any = None  # the stream this backward runs on (allocations come from its cache)
        self._queue: collections.deque[Chunk] = collections.deque()  # the worker's: this backward's chunks to stage
        self.counts = {"staged": 0, "staged_bytes": 0, "updated": 0, "unused": 0, "waited_bytes": 0, "no_room": 0}
        self.last: dict[str, int] = {}

    # -------------------------------------------------------------------------------- under backward
    def begin(self, compute: Any) -> bool:
        """Backward's first gradient hook (autograd's thread), ``compute`` the stream it runs on: whether this
        backward stages (the room is known)."""
        self.room.first_hook()
        self._compute = compute
        return self.room.ready

    def has(self, key: str) -> bool:
        with self._lock:
            return key in self.staged

    def stage(self, chunks: list[Chunk] | None = None) -> None:
        """On the worker: stage queued chunks in order while the room allows; the first that does not fit stops
        the pass. ``chunks``: a backward's first pass, its candidates in order (those staged already, or not
        resident in host memory, are not queued); None: a later pass, on the same queue."""
        if chunks is not None:
            self._queue = collections.deque(c for c in chunks if not self.has(c.key) and self._stageable(c.key))
        if not self._queue:
            return
        with self._lock:
            live = sum(s.chunk.nbytes for s in self.staged.values())
        room = self.room.free(live)  # once a pass: the allocator's statistics are not free to read
        while self._queue:
            chunk = self._queue[0]
            if chunk.nbytes > room:
                self.counts["no_room"] += 1
                return
            self._stage(chunk)
            self._queue.popleft()
            room -= chunk.nbytes

    def _stageable(self, key: str) -> bool:
        return self.store.info(key).tier == "host" and self.store.is_resident(key)

    def _stage(self, chunk: Chunk) -> None:
        with self._lock:
            land = self.landing.pop(chunk.key, None)
        if land is None:
            pin = contextlib.ExitStack()
            state = pin.enter_context(self.store.pin(chunk.key, tier="host"))
            after = None
        else:  # its last download may still be in flight: the upload waits for it on the GPU
            state, pin, after = land.state, land.pin, land.event
        try:
            record, uploaded = self._upload(state, after)
        except BaseException:
            with self._lock:  # give the landing back, so that it is waited for before anyone reads it
                self.landing[chunk.key] = _Landing(state, pin, after)
            raise
        with self._lock:
            self.staged[chunk.key] = _Staged(chunk, record, state, pin, uploaded)
            self.counts["staged"] += 1
            self.counts["staged_bytes"] += chunk.nbytes

    def _upload(self, state: torch.Tensor, after: Any) -> tuple[torch.Tensor, Any]:
        if not self.strategy.cuda:
            return state.clone(), None  # the CPU twin: the "device" is the host
        compute, up = self._compute, cast(torch.cuda.Stream, self.up)
        with torch.cuda.stream(compute):  # from memory backward freed on its own stream
            record = torch.empty(state.shape, dtype=state.dtype, device=self.strategy.device)
        allocated = torch.cuda.Event()
        allocated.record(compute)  # after every kernel queued before the block was freed
        with torch.cuda.stream(up):
            up.wait_event(allocated)
            if after is not None:
                up.wait_event(after)
            record.copy_(state, non_blocking=True)
            self.strategy.link.add(state, record)
            record.record_stream(up)
            uploaded = torch.cuda.Event()
            uploaded.record(up)
            self._yield(0)
        return record, uploaded

    def _yield(self, stream: int) -> None:
        """A one-element kernel on the current stream (``stream``: 0 the uploads', 1 the downloads'), queued
        after each copy. A copy engine runs the copies of one stream back to back while the next is ready, and
        turns to another stream's copy only when this one has none ready: without it the 9.5 GB of a step's
        downloads, all ready once the fast math is done, held the device-to-host engine for their whole 0.17 s,
        and a 4-byte ``loss.item()`` (or any copy down) the training loop made meanwhile waited for all of them
        before the host could queue the next forward. After the kernel, the copies of other streams go first:
        such a copy now waits for one chunk's transfer at most (64 MiB: ~1.2 ms at 55 GB/s)."""
        cast(torch.Tensor, self._ticks)[stream : stream + 1].add_(1)

    # -------------------------------------------------------------------------------------- at step()
    def run(self, work: Work, clock: StepClock) -> Work:
        """After ``step()``'s clip and step counts: update the staged chunks of ``work`` where they lie, their
        new weights into the parameters, their records queued down into their pinned buffers; returns the work
        left. Staged chunks without gradients are dropped. The downloads beyond ``room.hold`` are waited for."""
        with self._lock:
            staged, self.staged = self.staged, {}
        if not staged:
            return work
        rank = {ci: n for n, ci in enumerate(self.order)}
        index = {c.key: ci for ci, c in enumerate(self.chunked.chunks)}
        todo = sorted((w for w in work if w[0].key in staged), key=lambda w: rank.get(index[w[0].key], 0))
        wanted = {c.key for c, _ in todo}
        self._release([s for k, s in staged.items() if k not in wanted])
        if not todo:
            return work
        tr, store = self.strategy, self.store
        wait_for = sum(c.nbytes for c, _ in todo) - self.room.hold_bytes if tr.cuda else 0
        last_waited, waited = None, 0
        done: set[str] = set()
        with clock.timed("update_s"):
            tr.begin_step()  # after the gradients, the clip and any write the compute stream made
            if tr.cuda:
                cast(torch.cuda.Stream, tr.work_stream).wait_stream(cast(torch.cuda.Stream, self.up))
            try:
                for chunk, js in todo:
                    s = staged[chunk.key]
                    tr.update_resident(chunk, js, s.record)
                    store.mark_dirty(chunk.key)
                    event = self._download(s)
                    done.add(chunk.key)
                    with self._lock:
                        self.landing[chunk.key] = _Landing(s.state, s.pin, event)
                    if waited < wait_for:
                        last_waited, waited = event, waited + chunk.nbytes
            except BaseException:
                if tr.cuda:
                    torch.cuda.synchronize(tr.device)  # nothing reads the records or their pinned buffers now
                self._release([s for k, s in staged.items() if k in wanted and k not in done])
                raise
            finally:
                tr.end_step()  # the next forward waits for the new weights, never for the downloads
        if last_waited is not None:
            with clock.timed("h2d_s"):
                last_waited.synchronize()  # one stream: the downloads before it have ended too
        self.counts["updated"] += len(todo)
        self.counts["waited_bytes"] += waited
        self.last = {"staged": len(todo), "staged_bytes": sum(c.nbytes for c, _ in todo), "waited_bytes": waited}
        clock.add("under_backward_bytes", self.last["staged_bytes"])
        return [w for w in work if w[0].key not in wanted]

    def _download(self, s: _Staged) -> Any:
        """``s``'s record, updated on the work stream, down into its pinned buffer; the event after it."""
        tr = self.strategy
        if not tr.cuda:
            s.state.copy_(s.record)
            return None
        work, down = cast(torch.cuda.Stream, tr.work_stream), cast(torch.cuda.Stream, self.down)
        s.record.record_stream(work)
        down.wait_stream(work)
        with torch.cuda.stream(down):
            s.state.copy_(s.record, non_blocking=True)
            tr.link.add(s.record, s.state)
            s.record.record_stream(down)  # the block goes back to backward's stream once this copy ends
            event = torch.cuda.Event()
            event.record(down)
            self._yield(1)
        return event

    # ------------------------------------------------------------------------------------- readers
    def wait(self, keys: list[str] | None = None) -> None:
        """Wait for the downloads into the pinned records of ``keys`` (None: all), then unpin them. A record
        staged again since its download (``_stage`` took its landing) is waited for through its upload, which
        the GPU ran after that download: a reader of the pinned record then sees the download's bytes."""
        with self._lock:
            picked = list(self.landing) if keys is None else [k for k in keys if k in self.landing]
            lands = [(k, self.landing.pop(k)) for k in picked]
            restaged = [s.uploaded for k, s in self.staged.items() if keys is None or k in keys]
        for uploaded in restaged:
            if uploaded is not None:
                uploaded.synchronize()
        failed: BaseException | None = None
        for key, land in lands:
            try:
                if land.event is not None:
                    land.event.synchronize()
            except BaseException as e:  # every pin goes back, whatever fails
                failed = failed or e
            finally:
                land.pin.close()
                with contextlib.suppress(Exception):
                    self.store.retire(key)
        if failed is not None:
            raise failed

    def drop(self) -> None:
        """Forget the staged records (their uploads ended first), as when no step uses them."""
        with self._lock:
            staged, self.staged = self.staged, {}
        self._release(list(staged.values()))

    def _release(self, items: list[_Staged]) -> None:
        """Unpin staged records no step updates (their uploads ended first); their device copies go with them."""
        for s in items:
            try:
                if s.uploaded is not None:
                    s.uploaded.synchronize()  # the upload read the pinned record: it ends before the unpin
            finally:
                s.pin.close()
            self.counts["unused"] += 1

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "last_step": dict(self.last), "room": self.room.stats()}

    def close(self) -> None:
        try:
            self.drop()
        finally:
            self.wait()
