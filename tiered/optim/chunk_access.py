"""The optimizer's chunked state as checkpoints, converters and state dicts see it: ``ChunkAccess``, a base of
``TieredOptimizer`` that gives it the calls of ``checkpoint/plan.py``'s ``ChunkedState`` protocol (and of
``state_dicts.OptimizerView``), so that those never reach into the optimizer's privates.

It reads what the optimizer sets up in its constructor: ``_params``, ``_steps``, ``_step_count``,
``_versions``, ``store``, ``prefetch_depth``, ``_strategy`` (the update strategy), ``_updater`` (the
``ChunkUpdater``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..layout.chunking import Chunk
from ..progress import progress
from ..store.scan import scan

if TYPE_CHECKING:
    from ..store import TieredStore
    from .strategy import UpdateStrategy
    from .update import ChunkUpdater

__all__ = ["ChunkAccess"]


class ChunkAccess:
    """Per-chunk reads and writes of the state, its layout and step counts (see the module docstring)."""

    _params: list[torch.Tensor]
    _steps: list[int]
    _step_count: int
    _versions: list[int]
    store: TieredStore
    prefetch_depth: int
    _strategy: UpdateStrategy
    _updater: ChunkUpdater

    def _written_now(self) -> set[int]:
        """Parameters written since the optimizer last set them, as their version counters tell."""
        return {i for i, (p, v) in enumerate(zip(self._params, self._versions)) if p._version != v}

    def for_each_chunk(self, chunks: list[Chunk], fn: Callable[[Chunk, torch.Tensor], None], what: str, *,
                       writes: bool = False) -> None:  # fmt: skip
        """``fn(chunk, record)`` for each chunk in turn, its record in host memory (``writes``: ``fn`` changes
        it; scan.pinned_in_host), reads running ahead within the budget (scan.py); each chunk is retired
        (streamed out again, unless resident). ``what`` names the work on the progress bar a long walk shows."""
        with progress(sum(c.nbytes for c in chunks), f"tiered: {what}") as bar:

            def one(i: int, record: torch.Tensor) -> None:
                fn(chunks[i], record)
                bar.update(chunks[i].nbytes)

            scan(self.store, [c.key for c in chunks], self.prefetch_depth, one, writes=writes)

    def mark_synced(self, chunk: Chunk) -> None:
        """The chunk's parameters were just set from its masters: a later write to them is the user's."""
        for pc in chunk.pieces:
            self._versions[pc.param] = self._params[pc.param]._version

    @property
    def params(self) -> tuple[torch.Tensor, ...]:
        """Every parameter, in the optimizer's flat order (``param_names`` names them)."""
        return tuple(self._params)

    @property
    def step_counts(self) -> list[int]:
        """Per-parameter AdamW step counts (0 for a parameter that never had a gradient)."""
        return list(self._steps)

    @property
    def global_step(self) -> int:
        """How many times ``step()`` ran an update."""
        return self._step_count

    def set_step_counts(self, counts: list[int], global_step: int) -> None:
        """Restore step counts (a checkpoint load): one count per parameter, in ``params`` order."""
        if len(counts) != len(self._params) or any(int(c) < 0 for c in counts) or global_step < 0:
            raise ValueError(f"need {len(self._params)} step counts >= 0 and a global step >= 0")
        self._steps = [int(c) for c in counts]
        self._step_count = int(global_step)

    def chunk_state_rows(self, chunk: Chunk, record: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(master, exp_avg, exp_avg_sq) of a pinned chunk record, each fp32 [chunk.numel]. The master is a new
        tensor holding what was written to the parameters since the last step (update.py); the moments are
        views of the record (fp32 moments) or fp32 copies (bf16 moments; 8-bit moments decoded)."""
        bits = None
        if chunk.split:
            bits = self._strategy.gather_params(chunk, torch.empty(chunk.numel, dtype=torch.bfloat16))  # blocking
        return self._updater.state_rows(chunk, record, bits, self._written_now())

    def install_chunk_rows(self, chunk: Chunk, rows: torch.Tensor) -> Any:
        """Replace a chunk's state with fp32 rows (3, numel) (a checkpoint load) and set its parameters from
        the masters. Returns a CUDA event after which ``rows`` may be reused, or None."""
        self.store.put(chunk.key, chunk.fmt.pack(rows))  # copies: the caller's buffer is free again once put returns
        event = self.push_chunk_params(chunk, rows[0])
        self.mark_synced(chunk)
        return event

    def push_chunk_params(self, chunk: Chunk, master: torch.Tensor) -> Any:
        """Copy a chunk's fp32 master row into its parameters (cast to their dtype).

        Returns a CUDA event after which ``master`` may be reused, or None (CPU parameters: done).
        """
        return self._strategy.push_params(chunk, master, list(range(len(chunk.pieces))))
