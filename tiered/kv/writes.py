"""PageWrites: the writes of filled pages to the store, and the pages whose write failed, until they are written.

A page that fills is written once (``submit``): by the mover, after the appends that filled it land, or at once in
the caller's thread for the serial twin. Its device copy (``Page.fresh``) stays until the write lands, and loads
read it meanwhile; once it lands, a page the store keeps in host memory for good is pinned and held (``Page.host``).
The writes in flight hold at most ``limit`` device bytes, which the window sets (``fit``) from what ``gpu_budget``
leaves it, at most ``_IN_FLIGHT``, but never below the floor it gives (two layers' pages, so that the writes stay
asynchronous where the budget leaves them nothing): past it the oldest is waited for. Each ``submit`` lands the
writes that finished.

A write that fails (a full disk, an I/O error) never raises mid-pass: its error is kept and raised once, by the
next ``settle`` that checks (the start of the next forward, a swap), before anything of that forward is appended,
so the forward can simply be run again. That settle first lands every write in flight: the other writes of the
failed forward, which a full disk fails too, raise nothing of their own then, nor at the forward run again once the
cause is fixed. Their pages keep their device copies, which loads read, so every sequence stays exact; they are
counted in ``nbytes`` until written, and the next checking settle after the one that raised (the forward run
again) writes them all again, raising again if that fails too. So a swap, which settles first, finds every page of
its sequence in the store. A settle that does not check (``stats``, ``free``, taking a broken pass back) lands what
finished, and neither raises nor writes again.
"""

from __future__ import annotations

from collections import deque

import torch

from ..store import TieredStore
from .mover import Mover
from .pages import Page

__all__ = ["PageWrites"]

_IN_FLIGHT = 512 << 20  # device bytes of filled pages waiting for their write, at most


def _nbytes(page: Page) -> int:
    assert page.fresh is not None  # a page is written from its device copy
    return page.fresh.numel() * page.fresh.element_size()


class PageWrites:
    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.mover: Mover | None = None  # set at the first forward with prefetch (None: the serial twin)
        self._writes: deque[Page] = deque()  # in flight, in submission order
        self._in_flight = 0  # their bytes
        self._retry: list[Page] = []  # pages whose write failed: on the device only, written again later
        self._failed: Exception | None = None  # the first failure not raised yet
        self.limit = _IN_FLIGHT  # device bytes of writes in flight, at most (``fit``)

    @property
    def nbytes(self) -> int:
        """Device bytes of pages not in the store yet: writes in flight and writes that failed."""
        return self._in_flight + sum(_nbytes(p) for p in self._retry)

    def submit(self, pages: list[Page]) -> None:
        """Write ``pages`` (just filled, in order)."""
        if self.mover is None:
            for i, page in enumerate(pages):
                try:
                    self.store.put(page.key, page.fresh)  # type: ignore[arg-type]
                except Exception as e:  # raised at the next settle, as the mover's are: not mid-pass
                    self._failed = self._failed or e
                    self._retry += pages[i:]
                    return
                self._landed(page)
            return
        jobs = [(p.key, p.fresh) for p in pages]
        fut = self.mover.submit(self._write, jobs, after=self.mover.event())
        for page in pages:
            page.write = fut
            self._writes.append(page)
            self._in_flight += _nbytes(page)
        self._land(False)  # the writes that finished drop their device copies now, not at the next forward
        self._cap()

    def fit(self, room: int, floor: int) -> None:
        """At most ``room`` device bytes of writes in flight from now on (and at most ``_IN_FLIGHT``), but never
        less than ``floor``: the oldest waited for until they fit."""
        self.limit = max(floor, min(_IN_FLIGHT, room))
        self._cap()

    def settle(self, *, wait: bool, check: bool = True) -> None:
        """Land the writes that finished (all of them, waiting, with ``wait``). With ``check``: the first that failed
        since the last check raises here, once, after every write in flight has landed (so the others that failed
        raise nothing, and are written again with it); with none to raise, the pages whose write failed are written
        again (waited for with ``wait``, and raising if that fails)."""
        self._land(wait)
        if not check:
            return
        if self._failed is not None:
            # The writes still in flight are of the forwards that failed, and fail too where the cause is the same
            # (a full disk): landed only later, each would raise at the next try, the disk since freed. Landed
            # now, they are written again with the others when the forward runs again.
            self._land(True)
        self._raise_failed()
        if not self._retry:
            return
        pages, self._retry = self._retry, []
        if self.mover is not None:
            self.submit(pages)
            if wait:
                self._land(True)
                self._raise_failed()
            return
        for i, page in enumerate(pages):
            try:
                self.store.put(page.key, page.fresh)  # type: ignore[arg-type]
            except BaseException:
                self._retry = pages[i:] + self._retry
                raise
            self._landed(page)

    def forget(self, pages: list[Page]) -> None:
        """``pages`` are gone (their sequence freed, their pass taken back; after a settle): not to be written. A
        failure none of whose pages is left is not raised either."""
        gone = {id(p) for p in pages}
        self._retry = [p for p in self._retry if id(p) not in gone]
        if not self._retry and not self._writes:
            self._failed = None

    # ------------------------------------------------------------------------------------------ helpers
    def _write(self, jobs: list[tuple[str, torch.Tensor]]) -> None:
        for key, t in jobs:
            self.store.put(key, t)

    def _raise_failed(self) -> None:
        failed, self._failed = self._failed, None
        if failed is not None:
            raise failed

    def _cap(self) -> None:
        while self._in_flight > self.limit and self._writes:  # the device holds them meanwhile
            self._settle_one()

    def _land(self, wait: bool) -> None:
        while self._writes and (wait or self._writes[0].write is None or self._writes[0].write.done()):
            self._settle_one()

    def _settle_one(self) -> None:
        page = self._writes[0]
        # Waited for while still in flight: a Ctrl-C in the wait leaves the page where it was, not lost to both lists.
        failed = page.write.exception() if page.write is not None else None
        self._writes.popleft()
        self._in_flight -= _nbytes(page)
        if failed is None:
            self._landed(page)
            return
        # Later writes of the same batch share its future: they failed with it (the batch stopped at its first
        # failure; any it wrote before are written again, identically).
        batch, page.write = page.write, None
        self._retry.append(page)
        while self._writes and self._writes[0].write is batch:
            other = self._writes.popleft()
            other.write = None
            self._in_flight -= _nbytes(other)
            self._retry.append(other)
        if isinstance(failed, Exception):
            self._failed = self._failed or failed
        else:  # KeyboardInterrupt and the like on the mover thread: not kept for later
            raise failed

    def _landed(self, page: Page) -> None:
        """The page is in the store: drop its device copy; hold it pinned if the store keeps it in host memory."""
        page.fresh, page.write = None, None
        if self.store.is_resident(page.key):
            hold = self.store.pin(page.key, tier="host")
            page.host = hold.__enter__()
            page.hold = hold
