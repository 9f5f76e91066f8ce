"""What a TieredOptimizer tells of its state and its steps: ``stats()``, ``summary()``, ``closed``,
``chunked_state``, ``params``, ``step_counts`` and ``global_step``, read off the parts its layout of the moment is
built of (the ``StateChunks``, ``StepTimes``, ``UnderBackward`` and ``Shards`` that its ``_assemble`` sets, anew
with each layout), and off its finalizer.

``Reports`` is a base class of ``TieredOptimizer`` (optimizer.py) that only reads: the optimizer module keeps to
the torch.optim contract (step, param groups, state dicts, checkpoints) and its own lifecycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..telemetry import summary_line
from .step_stats import StepTimes, optimizer_stats

if TYPE_CHECKING:
    from ..store.owner import OwnedFinalizer, OwnedLock
    from .shards import Shards
    from .state_chunks import StateChunks
    from .under_backward.overlap import UnderBackward

__all__ = ["Reports"]


class Reports:
    """The optimizer's read-only reports (see the module docstring); the attributes below are its subclass's."""

    _lock: OwnedLock
    _finalizer: OwnedFinalizer
    _chunked: StateChunks
    _times: StepTimes
    _under_backward: UnderBackward | None
    _shards: Shards
    state_bytes: int

    def stats(self) -> dict[str, Any]:
        """The layout and the steps as a dict (docs/internals.md, "tiered.optimizer"): ``steps``, ``chunks``,
        ``chunk_bytes`` (the largest record), ``state_bytes``, ``split_chunks``, ``prefetch_depth``; ``last_step``
        and ``total`` (each phase's seconds and bytes: the last step's, and their sums over all steps); ``store``
        (the store's counts); ``telemetry`` (the last step against the disk floor, the bound, the disk's rates, SSD
        ``wear``); ``grad_norm`` (``max_grad_norm``'s last norm, else None); ``grads_kept_bytes`` and
        ``grads_found_bytes`` (gradients kept on the GPU for the update, and those backward had left there);
        ``under_backward`` (None where the update under backward is off); ``rank`` and ``world_size`` under
        torch.distributed."""
        self._lock.check()  # in a forked child: the under-backward's and store's locks may be held for ever
        c = self._chunked
        return optimizer_stats(c.chunks, c.step_count, c.prefetch_depth, c.store, self.state_bytes, self._times,
                               self._under_backward, self._shards.last_norm, self._shards.kept_bytes,
                               self._shards.found_bytes)  # fmt: skip

    @property
    def closed(self) -> bool:
        """Closed by ``close()``, collection or exit; and for good in a process forked after it was made, whose
        every call on the state refuses (``_lock``): the state, threads and folder are the parent's."""
        return not (self._finalizer.alive and self._finalizer.here)

    def summary(self) -> str:
        """The last step in one line: its time against the disk floor, the bound, NVMe traffic, SSD wear."""
        times = self._times
        return summary_line(self.global_step, times.last, times.telemetry) if self.global_step else "no step yet"

    @property
    def chunked_state(self) -> StateChunks:
        """The state as checkpoints, state dicts and the update under backward see it (optim/state_chunks.py)."""
        return self._chunked

    @property
    def params(self) -> tuple[torch.Tensor, ...]:
        """Every parameter, in the optimizer's flat order (``param_names`` names them)."""
        return self._chunked.params

    @property
    def step_counts(self) -> list[int]:
        """Per-parameter AdamW step counts (0 for a parameter that never had a gradient)."""
        return self._chunked.step_counts

    @property
    def global_step(self) -> int:
        """How many times ``step()`` ran an update."""
        return self._chunked.step_count
