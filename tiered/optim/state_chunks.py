"""The optimizer's chunked state, as one object: ``StateChunks``.

Checkpoints (``tiered.checkpoint``, through its ``plan.ChunkedState`` protocol, which this class implements),
state dicts (state_dicts.py), a layout carried over to new tensors (param_set.py) and the update under backward
(under_backward/) are handed this object and nothing else of the optimizer: its parameters and their names,
the groups, the chunks and their store, the update strategy and ``ChunkUpdater``, and the step counts it owns.
``TieredOptimizer`` builds one per layout (``opt.chunked_state``) and steps through it, so a reader of any of
those modules sees every field it may touch declared here, typed.

The optimizer's own condition (closed, broken) reaches it through one bound method, held weakly: holding the
optimizer itself would be the reach into its privates this module exists to end, and would keep it alive.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..layout.chunking import Chunk
from ..progress import progress
from ..store.checksum import crc32
from ..store.scan import scan
from .whole_load import NO_GUARD

if TYPE_CHECKING:
    from ..store import TieredStore
    from .groups import Groups
    from .shards import Shards
    from .strategy import UpdateStrategy
    from .update import ChunkUpdater

__all__ = ["StateChunks"]


class StateChunks:
    """Per-chunk reads and writes of the state, its layout and its step counts (see the module docstring)."""

    def __init__(self, *, shards: Shards, param_names: list[str], groups: Groups, chunks: list[Chunk],
                 store: TieredStore, strategy: UpdateStrategy, updater: ChunkUpdater, prefetch_depth: int,
                 chunk_bytes: int, host_budget: int, workdir: str, global_step: int,
                 status: Callable[[], tuple[bool, str | None]]):  # fmt: skip
        """Lists are shared with the optimizer (``add_param_group`` extends them in place); ``groups`` holds its
        ``param_groups`` of now, whatever list was last assigned to it (groups.py). ``status``: a bound method of
        the optimizer giving (closed, why broken or None), held weakly: the update under backward holds this
        object from the model's gradient hooks, which must not keep the optimizer alive."""
        self.shards, self.param_names, self.groups, self.chunks = shards, param_names, groups, chunks
        self.store, self.strategy, self.updater = store, strategy, updater
        self.prefetch_depth, self.chunk_bytes, self.host_budget, self.workdir = (
            prefetch_depth, chunk_bytes, host_budget, workdir,
        )  # fmt: skip
        self._params = shards.locals  # the tensors the state is laid out on (under FSDP2 this rank's shards)
        self.steps = [0] * len(self._params)  # per-parameter AdamW step counts, as torch keeps them
        self.step_count = global_step  # how many times step() ran an update, across layouts
        # Each parameter's version counters as the optimizer last wrote or read them: a later change is the user's.
        self.versions = [shards.version(i) for i in range(len(self._params))]
        # A split parameter's bf16 weights as a load set them: {param: (version, {start: (stop, crc32)})}, one
        # crc a piece, the version once the load synced it (None until then). A rewrite of the same values
        # after the load (torch's set_state_dict loads the model after the optimizer) is then no write, and the
        # masters keep their low halves (``written_now``). Steps never add to it: training pays nothing.
        self.loaded_weights: dict[int, tuple[tuple[int, int] | None, dict[int, tuple[int, int]]]] = {}
        self._status = weakref.WeakMethod(status)  # type: ignore[arg-type]
        # Waits until every pinned record holds what the last step wrote to it: a step that updated records
        # staged in HBM leaves their downloads running (under_backward/staged.py, which sets this).
        self.landed: Callable[[], None] = lambda: None
        self.guard = NO_GUARD  # the load under way, told before each chunk it replaces (whole_load.py)

    # -------------------------------------------------------------------------------- what is read
    def _now(self) -> tuple[bool, str | None]:
        status = self._status()
        return (True, None) if status is None else status()  # the optimizer is gone: closed

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's ``param_groups`` as they are now (an assigned list included: groups.py)."""
        return self.groups.now

    @property
    def closed(self) -> bool:
        return self._now()[0]

    @property
    def broken(self) -> str | None:
        """Why the state is torn (a step failed part-way), or None."""
        return self._now()[1]

    @property
    def params(self) -> tuple[torch.Tensor, ...]:
        """Every parameter, in the optimizer's flat order (``param_names`` names them)."""
        return tuple(self._params)

    @property
    def step_counts(self) -> list[int]:
        """Per-parameter AdamW step counts (0 for a parameter that never had a gradient)."""
        return list(self.steps)

    @property
    def global_step(self) -> int:
        """How many times ``step()`` ran an update."""
        return self.step_count

    def version(self, i: int) -> tuple[int, int]:
        """Parameter ``i``'s version counters, which any write to it moves (``Shards.version``: under FSDP2 an
        in-place op on the DTensor moves its counter, not its local tensor's)."""
        return self.shards.version(i)

    def versions_as_now(self) -> None:
        """Every parameter's versions as they are now: the optimizer set them (its initial state)."""
        self.versions[:] = [self.version(i) for i in range(len(self._params))]

    def written_now(self) -> set[int]:
        """Parameters written since the optimizer last set them, as their version counters tell, but for a split
        parameter written with the very bf16 weights a load left it (``same_as_loaded``)."""
        moved = [i for i, v in enumerate(self.versions) if self.version(i) != v]
        return {i for i in moved if not self.same_as_loaded(i)}

    def same_as_loaded(self, i: int) -> bool:
        """Whether parameter ``i``, its version moved, holds the bf16 weights the last load set it to and no write
        since changed (``loaded_weights``): then it is synced again. Compares only where a load left crcs, so
        once a load and a write after it: the parameter's bits are read (copied down from a GPU) once."""
        tag, pieces = self.loaded_weights.pop(i, (None, {}))
        if tag is None or tag != self.versions[i]:
            return False  # no load's crcs, or they are of weights a step or a write changed since
        flat = self._params[i].detach().reshape(-1)
        if sum(stop - start for start, (stop, _) in pieces.items()) != flat.numel():
            return False
        bits = flat.cpu()
        if any(crc32(bits[start:stop]) != crc for start, (stop, crc) in pieces.items()):
            return False
        version = self.versions[i] = self.version(i)
        self.loaded_weights[i] = (version, pieces)
        return True

    def for_each_chunk(self, chunks: list[Chunk], fn: Callable[[Chunk, torch.Tensor], None], what: str, *,
                       writes: bool = False) -> None:  # fmt: skip
        """``fn(chunk, record)`` for each chunk in turn, its record in host memory (``writes``: ``fn`` changes
        it; scan.pinned_in_host), reads running ahead within the budget (scan.py); each chunk is retired
        (streamed out again, unless resident). ``what`` names the work on the progress bar a long walk shows."""
        self.landed()
        with progress(sum(c.nbytes for c in chunks), f"tiered: {what}") as bar:

            def one(i: int, record: torch.Tensor) -> None:
                fn(chunks[i], record)
                bar.update(chunks[i].nbytes)

            scan(self.store, [c.key for c in chunks], self.prefetch_depth, one, writes=writes)

    def chunk_state_rows(self, chunk: Chunk, record: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(master, exp_avg, exp_avg_sq) of a pinned chunk record, each fp32 [chunk.numel]. The master is a new
        tensor holding what was written to the parameters since the last step (update.py); the moments are
        views of the record (fp32 moments) or fp32 copies (bf16 moments; 8-bit moments decoded)."""
        self.landed()
        bits = None
        if chunk.split:
            bits = self.strategy.gather_params(chunk, torch.empty(chunk.numel, dtype=torch.bfloat16))  # blocking
        return self.updater.state_rows(chunk, record, bits, self.written_now())

    def seen_over(self, shards: Shards) -> StateChunks:
        """This state as a load checks a checkpoint against before the state is laid out again over ``shards``
        (param_set.lay_out_checkpointed): the same names, groups and step counts, ``shards``' tensors as its
        parameters. Nothing is installed into it: its chunks are this layout's."""
        view = copy.copy(self)
        view.shards, view._params = shards, shards.locals
        return view

    # ------------------------------------------------------------------------------- what is written
    def mark_synced(self, chunk: Chunk, only: int | None = None) -> None:
        """A load just set the chunk's parameters, or left them as the masters' high halves: a later write to them
        is the user's. ``only``: that parameter's alone (a one-parameter load): another's write stays a write, to be
        taken in at the next step in its other chunks too, which the load did not touch."""
        for pc in chunk.pieces:
            if only is not None and pc.param != only:
                continue
            version = self.versions[pc.param] = self.version(pc.param)
            if pc.param in self.loaded_weights:
                self.loaded_weights[pc.param] = (version, self.loaded_weights[pc.param][1])

    def remember_weights(self, chunk: Chunk, weights: torch.Tensor, only: int | None = None) -> None:
        """A load gives a split chunk's parameters the bf16 ``weights`` (its row layout, host memory), or finds
        them there: their crc32 a piece, until ``mark_synced`` dates them (``loaded_weights``). ``only``: as
        for ``mark_synced``."""
        for pc in chunk.pieces:
            if only is not None and pc.param != only:
                continue
            tag, pieces = self.loaded_weights.get(pc.param, (None, {}))
            if tag is not None and tag != self.versions[pc.param]:
                pieces = {}  # of weights changed since: this load's pieces alone
            pieces[pc.param_start] = (pc.in_param.stop, crc32(weights[pc.in_chunk]))
            self.loaded_weights[pc.param] = (None, pieces)

    def grown(self, first: int) -> None:
        """Parameters from ``first`` on were just added (``add_param_group``): no steps yet, versions as now."""
        self.steps.extend([0] * (len(self._params) - first))
        self.versions.extend(self.version(i) for i in range(first, len(self._params)))

    def set_step_counts(self, counts: list[int], global_step: int) -> None:
        """Restore step counts (a checkpoint load): one count per parameter, in ``params`` order."""
        if len(counts) != len(self._params) or any(int(c) < 0 for c in counts) or global_step < 0:
            raise ValueError(f"need {len(self._params)} step counts >= 0 and a global step >= 0")
        self.steps[:] = [int(c) for c in counts]
        self.step_count = int(global_step)

    def install_chunk_rows(self, chunk: Chunk, rows: torch.Tensor) -> Any:
        """Replace a chunk's state with fp32 rows (3, numel) (a checkpoint load) and set its parameters from
        the masters. Returns a CUDA event after which ``rows`` may be reused, or None."""
        self.landed()
        self.guard.chunk()  # may stop the load here (a Ctrl-C); from here the state is changed
        self.store.put(chunk.key, chunk.fmt.pack(rows))  # copies: the caller's buffer is free again once put returns
        if chunk.split:  # the bf16 weights the parameters get, as their cast rounds them
            self.remember_weights(chunk, rows[0].to(torch.bfloat16))
        event = self.push_chunk_params(chunk, rows[0])
        self.mark_synced(chunk)
        return event

    def push_chunk_params(self, chunk: Chunk, master: torch.Tensor) -> Any:
        """Copy a chunk's fp32 master row into its parameters (cast to their dtype).

        Returns a CUDA event after which ``master`` may be reused, or None (CPU parameters: done).
        """
        # Outside a step (a load): the side stream that writes them first waits for what the compute stream has
        # queued (a forward, a user's write), which would otherwise read or write them out of order.
        self.strategy.begin_step()
        return self.strategy.push_params(chunk, master, list(range(len(chunk.pieces))))
