"""One optimizer step's stream of chunks through the store: read ahead, pin, update, push, retire.

``prefetch_depth`` chunks are read ahead (scan.py). Each chunk is pinned in host memory, updated where
``update_on`` says, and retired (written back unless resident) once the next chunk's update is under way:

    host    transfer.grads(chunk i)             GPU grads -> fp32 -> pinned slot, started depth + 1 ahead
            updater.update(chunk i)             torch's fused AdamW on the CPU over the pinned record
            transfer.push_params / push_bf16    new weights -> parameters, on a side CUDA stream
    device  transfer.upload(record)             pinned record -> device copy, on one side stream
            updater.update(device record)       where the parameters are: no gradient or weight crosses PCIe
            transfer.scatter, download          new weights -> parameters; record -> pinned, for write-back

With ``prefetch_depth == 0`` (the serial twin) every chunk is read, updated, written back and waited for
before the next: nothing is in flight. A failure unpins what is pinned at once, after the copies that
read it have finished, so that the optimizer can still be closed or reloaded.

Call order: ``StepPipeline(...)`` once; per step ``updater.begin(...)``, then ``run(work, phases, sigint)``,
whose returned read-ahead's ``next_step()`` the caller starts after taking the step's counters.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from .chunking import Chunk
from .interrupts import Sigint
from .scan import ReadAhead, read_ahead
from .store import TieredStore
from .transfer import Transfer
from .update import ChunkUpdater

__all__ = ["StepPipeline", "synchronize"]

Work = list[tuple[Chunk, list[int]]]  # chunks with gradients, and the indices of their pieces that have them


class StepPipeline:
    def __init__(self, store: TieredStore, transfer: Transfer, updater: ChunkUpdater, prefetch_depth: int,
                 param_groups: list[dict[str, Any]]):  # fmt: skip
        self.store, self.transfer, self.updater = store, transfer, updater
        self.depth, self.param_groups = prefetch_depth, param_groups

    def run(self, work: Work, ph: dict[str, float], sigint: Sigint) -> ReadAhead:
        """Stream the chunks of ``work`` through their update, reads running ahead. Returns the read-ahead."""
        tr = self.transfer
        if tr.on_device:
            update_chunk = self._device_update
        else:  # the first gradient copies start now; each update starts the one prefetch_depth + 1 ahead
            for i in range(min(self.depth + 1, len(work))):
                tr.launch_grads(work[i][0], i % tr.slots)
            update_chunk = self._host_update
        reads = read_ahead(self.store, [c.key for c, _ in work], self.depth)
        tr.begin_step()
        reads.through(-1)
        # A chunk stays pinned until the copies that read its buffer (weights or the record to the GPU)
        # have finished; it is retired (written back) after the next chunk's update is under way.
        pending: tuple[str, Any, contextlib.ExitStack] | None = None
        hold = contextlib.ExitStack()
        try:
            for i, (chunk, _) in enumerate(work):
                if sigint.pressed() >= 2:  # a second Ctrl-C: stop here rather than finish the step
                    raise KeyboardInterrupt
                reads.through(i)
                t0 = time.perf_counter()
                hold = contextlib.ExitStack()
                state = hold.enter_context(self.store.pin(chunk.key, tier="host"))
                t1 = time.perf_counter()
                event = update_chunk(work, i, state, ph)
                self.store.mark_dirty(chunk.key)
                t2 = time.perf_counter()
                if pending is not None:
                    done, pending = pending, None
                    self._retire(*done)
                pending = (chunk.key, event, hold)
                if not self.depth:  # the serial twin: nothing stays in flight
                    done, pending = pending, None
                    self._retire(*done)
                ph["read_wait_s"] += t1 - t0
                ph["h2d_s"] += time.perf_counter() - t2
            if pending is not None:
                done, pending = pending, None
                self._retire(*done)
        finally:
            # On failure: unpin what is still pinned now, not when the traceback is collected (a pinned
            # record cannot be deleted, so close() would fail), once the copies that read it are done.
            tr.end_step()
            if pending is not None:
                synchronize(pending[1])
                pending[2].close()
            hold.close()
        return reads

    def _host_update(self, work: Work, i: int, state: torch.Tensor, ph: dict) -> Any:
        """``update_on="host"``: fused AdamW on the CPU over the pinned record; new weights sent up."""
        chunk, js = work[i]
        tr, k, group = self.transfer, self.depth, self.param_groups[chunk.group]
        t0 = time.perf_counter()
        grads = tr.grads(chunk, i % tr.slots, js)
        t1 = time.perf_counter()
        if chunk.split:
            weights = tr.up_buffer(chunk)
            self.updater.update_split(chunk, js, state, grads, group, tr.param_bits(chunk, i % tr.slots), weights)
        else:
            self.updater.update(chunk, js, state, grads, group)
        t2 = time.perf_counter()
        if chunk.split:
            event = tr.push_bf16(chunk, weights, js)
        else:
            event = tr.push_params(chunk, state[0, : chunk.numel], js)
        if i + k + 1 < len(work):  # its grad slot is free now: chunk i's update is done
            tr.launch_grads(work[i + k + 1][0], (i + k + 1) % tr.slots)
        ph["grad_d2h_s"] += t1 - t0
        ph["update_s"] += t2 - t1
        ph["h2d_s"] += time.perf_counter() - t2
        return event

    def _device_update(self, work: Work, i: int, state: torch.Tensor, ph: dict) -> Any:
        """``update_on="device"``: the record goes up, updates where the parameters are, comes back; all
        queued on one side stream. ``update_s`` is the queueing; waiting for it shows in ``h2d_s``."""
        chunk, js = work[i]
        tr, group = self.transfer, self.param_groups[chunk.group]
        t0 = time.perf_counter()
        with tr.on_stream():
            record = tr.upload(state)
            grads = tr.device_grads(chunk, js)
            if chunk.split:
                bits, weights = tr.device_bits(chunk)
                self.updater.update_split(chunk, js, record, grads, group, bits, weights)
            else:
                self.updater.update(chunk, js, record, grads, group)
                weights = record[0, : chunk.numel]
            tr.scatter(chunk, weights, js)
            event = tr.download(record, state)
        ph["update_s"] += time.perf_counter() - t0
        return event

    def update_in_place(self, chunk: Chunk, js: list[int]) -> None:
        """Update a chunk where the store keeps it (HBM): gradients and parameters are already there."""
        params = self.transfer.params
        with self.store.pin(chunk.key) as state:
            pieces = [chunk.pieces[j] for j in js]
            grads = [
                params[p.param]
                .grad.reshape(-1)[p.param_start : p.param_start + p.numel]
                .to(state.device, torch.float32)
                for p in pieces
            ]
            self.updater.update(chunk, js, state, grads, self.param_groups[chunk.group])
            self.store.mark_dirty(chunk.key)
            self.transfer.scatter(chunk, state[0], js)

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
