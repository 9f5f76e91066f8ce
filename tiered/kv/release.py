"""What closing a TieredCache releases, in one function: its finalizer's, which holds these and never the cache.

This module exists so that cache.py keeps the sequences, the public calls and each layer's update; the order of
the release and what may not stop it part-way are read here in one sitting.
"""

from __future__ import annotations

import contextlib

from ..interrupts import deferred_sigint
from ..store import TieredStore
from ..store.lock import FolderLock
from ..store.workdir import remove_workdir
from .pages import Slot
from .swap import Swapper
from .window import Window

__all__ = ["release"]


def release(store: TieredStore, win: Window, slots: dict[int, list[Slot]], swap: Swapper,
             lock: FolderLock) -> None:  # fmt: skip
    """Close what a cache holds: its loads and writes settled, its mover stopped, its page holds released, its
    records deleted, its store closed, its folder removed, then the folder's ``lock`` released. The folder is a
    working area: nothing is written (the store is closed with ``discard``). The cache's finalizer: it holds
    these, never the cache, so a dropped cache is collected, and then released.

    It runs once (the cache reads closed from its start), so nothing may stop it part-way and leave the store's
    threads and folder lock for good: a Ctrl-C is held until all is released (interrupts.py), and the store is
    closed and the folder removed whatever stops the rest (a SIGTERM handler's ``SystemExit``), with no write of
    the pages left (on a full disk its failure would take the interrupt's place)."""
    with deferred_sigint():
        try:
            with contextlib.suppress(BaseException):
                win.settle(check=False)
            win.close()
            for seq_slots in slots.values():
                for slot in seq_slots:
                    for page in slot.pages:
                        with contextlib.suppress(BaseException):
                            page.release()
            for key in store.keys():
                with contextlib.suppress(KeyError, ValueError):
                    store.delete(key)
            slots.clear()
            swap.close()
        finally:
            try:
                store.close(discard=True)
            finally:
                remove_workdir(lock.folder, lock)
