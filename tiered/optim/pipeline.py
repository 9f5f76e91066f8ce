"""One optimizer step's stream of chunks through the store: read ahead, pin, update, push, retire.

The pipeline owns the schedule; the strategy ``update_on`` chose does, for one chunk, what it is told
(``UpdateStrategy``, strategy.py, numbers the calls). ``prefetch_depth`` chunks are read ahead (scan.py).
The chunks on disk are spread among the resident ones (``scan.spread_disk``) so that the disk works throughout.
Each chunk is pinned in host memory, updated by the strategy, and retired (written back unless resident)
once the next chunk's update is under way; after chunk i's update, chunk i + ``strategy.slots`` is staged
(``stage_ahead``):

    host    HostUpdate.update(chunk i)          grads down (staged ahead), fused AdamW on the CPU over the
                                                pinned record, new weights up on a side CUDA stream
    device  DeviceUpdate.update(chunk i)        record up, updated where the parameters are, weights
                                                scattered, record down: no gradient or weight crosses PCIe

The loop is the chunk scan every pass runs (``tiered.store.scan.windowed``): the strategy's ``in_flight`` chunks
open (the host's two: one being updated while the last one's copies finish; the device's three: one going up,
one updating, one coming down). With ``prefetch_depth == 0`` (the serial twin) one: every chunk is
read, updated, written back and waited for before the next; nothing is in flight but the one gradient copy
the host strategy's single slot holds. A failure unpins what is pinned at once, after the copies that read
it have finished, so that the optimizer can still be closed or reloaded.

Call order: ``StepPipeline(...)`` once; per step ``updater.begin(...)``, then ``run(work, clock, sigint)``
(``clock``: the step's ``StepClock``, step_stats.py), whose returned read-ahead's ``next_step()`` the caller
starts after taking the step's counters.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ..interrupts import Sigint
from ..layout.chunking import Chunk
from ..store import TieredStore
from ..store.scan import ReadAhead, read_ahead, spread_disk, windowed
from .step_stats import StepClock
from .strategy import UpdateStrategy
from .transfer import Work

__all__ = ["StepPipeline", "synchronize"]


class StepPipeline:
    def __init__(self, store: TieredStore, strategy: UpdateStrategy, prefetch_depth: int):
        """``strategy``: where chunks update (an ``UpdateStrategy``: host_update.py or device_update.py)."""
        self.store, self.strategy, self.depth = store, strategy, prefetch_depth

    def run(self, work: Work, clock: StepClock, sigint: Sigint) -> ReadAhead:
        """Update the chunks of ``work``: those the store keeps in HBM (gpu_budget) where they are, while the
        first reads of the rest run; then the rest stream through host memory, reads running ahead.
        Returns the read-ahead."""
        in_hbm = {c.key for c, _ in work if self.store.gpu_budget and self.store.info(c.key).tier == "gpu"}
        streamed = [w for w in work if w[0].key not in in_hbm]
        if in_hbm:
            self.store.prefetch([c.key for c, _ in streamed[: self.depth]])  # reads run meanwhile
            with clock.timed("update_s"):
                self.strategy.begin_step()  # the device strategy's work stream waits for the gradients
                try:
                    for chunk, js in work:
                        if chunk.key in in_hbm:
                            self.update_in_place(chunk, js)
                except BaseException:
                    self.strategy.end_step()
                    raise
        return self._stream(streamed, clock, sigint)

    def _stream(self, work: Work, clock: StepClock, sigint: Sigint) -> ReadAhead:
        """The chunk scan (scan.windowed) over ``work``: opening chunk i pins it, updates it and stages chunk
        i + ``slots``; closing it waits for the copies that read its pinned buffer (weights or the record to the
        GPU), unpins it and retires it (written back). ``strategy.in_flight`` chunks open (the host update's 2:
        chunk i is retired once chunk i+1's update is under way; the device update's 3); one in the serial twin,
        which also waits for every write. The chunks on disk are spread among the resident ones (scan.spread_disk),
        so that the disk works through the whole scan; the serial twin keeps the put order."""
        tr = self.strategy
        if self.depth:
            work = [work[i] for i in spread_disk(self.store, [c.key for c, _ in work])]
        reads = read_ahead(self.store, [c.key for c, _ in work], self.depth)

        def open_item(i: int) -> tuple[str, Any, contextlib.ExitStack]:
            if sigint.pressed() >= 2:  # a second Ctrl-C: stop here rather than finish the step
                raise KeyboardInterrupt
            chunk, hold, event = work[i][0], contextlib.ExitStack(), None
            try:
                with clock.timed("read_wait_s"):
                    state = hold.enter_context(self.store.pin(chunk.key, tier="host"))
                event = tr.update(work, i, state, clock)
                self.store.mark_dirty(chunk.key)
                with clock.timed("h2d_s"):  # launching the next stage counts with this chunk's pushes
                    if i + tr.slots < len(work):  # chunk i's update is done with the stage it held
                        tr.stage_ahead(work, i + tr.slots)
            except BaseException:
                close_item(i, (chunk.key, event, hold), True)
                raise
            return chunk.key, event, hold

        def close_item(i: int, item: tuple[str, Any, contextlib.ExitStack], failed: bool) -> None:
            key, event, hold = item
            if failed:  # unpin now, not when the traceback is collected (a pinned record cannot be deleted,
                try:  # so close() would fail), once the copies that read it are done
                    synchronize(event)
                finally:
                    hold.close()
                return
            with clock.timed("h2d_s"):
                self._retire(key, event, hold)

        tr.begin_step()  # first: the side streams wait for backward's last kernels before any copy reads a gradient
        try:
            for j in range(min(tr.slots, len(work))):  # the first chunks' stages, before their reads
                tr.stage_ahead(work, j)
            windowed(len(work), tr.in_flight if self.depth else 1, open_item, close_item, ahead=reads.through)
        finally:
            tr.end_step()
        return reads

    def update_in_place(self, chunk: Chunk, js: list[int]) -> None:
        """Update a chunk where the store keeps it (HBM): gradients and parameters are already there. The GPU
        tier moves records on a side stream that waits for the compute stream, which ``end_step`` orders
        after this update: the record cannot move while it is still being written."""
        with self.store.pin(chunk.key) as state:
            self.strategy.update_resident(chunk, js, state)
            self.store.mark_dirty(chunk.key)

    def _retire(self, key: str, event: Any, hold: contextlib.ExitStack) -> None:
        try:
            synchronize(event)  # the H2D copy read this chunk's pinned buffer; it must finish first
        finally:
            hold.close()  # unpin
        fut = self.store.retire(key)
        if fut is not None and not self.depth:
            fut.result()  # the serial twin waits for every write


def synchronize(event: Any) -> None:
    """Wait for a CUDA event; None (CPU work, already done) waits for nothing."""
    if event is not None:
        event.synchronize()
