"""The movement a stored record is in (``Move``), and the one table of the moves it may make.

A ``Record`` (records.py) makes at most one movement at a time: ``Record.kind`` names it and ``Record.op`` is
its future, which exists exactly while the record is not ``IDLE``. The store's tiers change ``kind`` only
through ``Record.begin`` (leave ``IDLE``: a new future), ``Record.advance`` (go on to the next step of the same
movement: the same future) and ``Record.end`` (back to ``IDLE``: the caller resolves the future), each checked
against ``TRANSITIONS``::

    IDLE      -> ACQUIRING  a load starts: it waits for a host buffer          (HostTier.begin)
              -> WRITE      a write-back starts: buf -> NVMe                    (HostTier.write_locked)
              -> MOVE       a synchronous move in a caller's thread: a copy-in (put), a GPU move (GpuTier),
                            the flush of an HBM record
    QUEUED    -> ACQUIRING  its room came (HostTier.drain), or a blocking call takes the prefetch over
              -> IDLE       the queued prefetch is cancelled (retire, evict, delete, close, a failed write-back)
    ACQUIRING -> LOAD       the buffer is taken: the read starts                (HostTier._start_load)
              -> QUEUED     no room yet, but write-backs in flight will free it
              -> IDLE       no room and none coming, or taking a buffer failed
    LOAD      -> IDLE       the read landed (checksum verified) or failed
    WRITE     -> IDLE       the write landed or failed
    MOVE      -> IDLE       the move is over

``WRITE`` carries the flags: ``Record.releasing`` (the write-back frees the buffer once written) and
``Record.keep`` (someone wants the record in host memory meanwhile, so it keeps the buffer after all); leaving
``WRITE`` clears both. ``releasing`` alone also marks the ``MOVE`` of an explicit NVMe put while it writes its record
from its buffer (store/replace.py ``write_placed``): that buffer, too, is room on its way (``HostTier.releasing``);
ending the move clears it. An illegal move is a bug in the store, never a user's error: ``TransitionError``.
Pure logic: no I/O, tensors or locks (the caller holds the store's lock).
"""

from __future__ import annotations

import enum

__all__ = ["Move", "TRANSITIONS", "TransitionError", "check_transition"]


class Move(enum.Enum):
    """The one movement a record is in; ``IDLE`` when none."""

    IDLE = "idle"
    QUEUED = "queued"  # a prefetch waiting for room that write-backs in flight will free
    ACQUIRING = "acquiring"  # a load waiting for a host buffer
    LOAD = "load"  # NVMe -> buf
    WRITE = "write"  # buf -> NVMe; the buffer stays readable
    MOVE = "move"  # a synchronous move in a caller's thread

    def __repr__(self) -> str:
        return f"Move.{self.name}"


TRANSITIONS: dict[Move, frozenset[Move]] = {
    Move.IDLE: frozenset({Move.ACQUIRING, Move.WRITE, Move.MOVE}),
    Move.QUEUED: frozenset({Move.ACQUIRING, Move.IDLE}),
    Move.ACQUIRING: frozenset({Move.LOAD, Move.QUEUED, Move.IDLE}),
    Move.LOAD: frozenset({Move.IDLE}),
    Move.WRITE: frozenset({Move.IDLE}),
    Move.MOVE: frozenset({Move.IDLE}),
}


class TransitionError(AssertionError):
    """A record was asked to make a move ``TRANSITIONS`` does not allow: a bug in the store."""


def check_transition(old: Move, new: Move) -> None:
    """Raise ``TransitionError`` unless a record in ``old`` may go to ``new``."""
    if not isinstance(new, Move) or new not in TRANSITIONS[old]:
        allowed = ", ".join(sorted(m.name for m in TRANSITIONS[old]))
        raise TransitionError(f"a record cannot go from {old!r} to {new!r} (allowed: {allowed})")
