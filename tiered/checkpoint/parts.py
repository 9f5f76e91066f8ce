"""The ranks' parts in a collective save's temp folder (checkpoint/sharded.py): checked by rank 0 before it commits,
and removed after a failure, by each rank as far as it can see them, so no hidden folder is left anywhere."""

from __future__ import annotations

import os
import shutil

from .errors import CheckpointNotSharedError
from .manifest import MANIFEST
from .shardmap import rank_dir

__all__ = ["check_parts", "lost_part", "discard_part"]


def check_parts(temp: str, final: str, world: int) -> None:
    """Every rank's part, with its manifest, is in ``temp`` as rank 0 sees it, or CheckpointNotSharedError."""
    missing = [k for k in range(world) if not os.path.isfile(os.path.join(temp, rank_dir(k), MANIFEST))]
    if missing:
        raise CheckpointNotSharedError(final, missing)


def lost_part(temp: str, rank: int) -> None:
    """After a collective of a save failed on this rank (a rank gone): rank 0, which alone commits, removes the temp
    folder. Another rank leaves its part there: its collective may fail where rank 0's succeeded (a rank that died
    in the middle of it), and rank 0 then commits the folder, or removes it; if rank 0 died, the next save on its
    host sweeps the folder (fsops.sweep)."""
    if rank == 0:
        shutil.rmtree(temp, ignore_errors=True)


def discard_part(temp: str, rank: int) -> None:
    """After a failed save: rank 0 removes the temp folder; another rank removes its own part, and the temp folder
    if that leaves it empty (on a disk of its own node, where rank 0 could not remove it), so no hidden folder is
    left anywhere."""
    if rank == 0:
        shutil.rmtree(temp, ignore_errors=True)
        return
    shutil.rmtree(os.path.join(temp, rank_dir(rank)), ignore_errors=True)
    try:
        os.rmdir(temp)
    except OSError:
        pass  # not empty (shared: rank 0 removes it) or gone already
