"""Placement policies for TieredStore: which records belong in host memory and which leave first.

A policy is pure bookkeeping over keys and byte counts: no I/O, no tensors, no clocks, no locks. The
store calls it under its own lock and asks it questions; the store alone moves bytes. That keeps the
policy testable on its own and lets a user pass their own ``Policy`` subclass.

Call order (the store's): ``bind(host_budget=..., stream_reserve=...)`` once, then any sequence of
``insert`` / ``access`` / ``prefetched`` / ``remove`` as records come, get used and go, interleaved with the questions
``placement``, ``victims``, ``retire`` and ``promote_on_get``. A key is inserted at most once until it
is removed; sizes are the record's host footprint in bytes (what the buffer pool charges for it).

Two policies ship:

- ``LRUPolicy``: the textbook cache. Right for random access; wrong for an optimizer, whose step is a
  cyclic scan over every chunk: with a cache smaller than the scan, LRU evicts each chunk just before
  it is needed again and misses every time.
- ``ScanPolicy``: a resident set. The first records admitted (in ``insert`` order) that fit within
  ``host_budget - stream_reserve`` stay in host memory for good; the rest stream through the reserve,
  leaving as soon as the scan is done with them (``retire``). A budget that holds a fraction f of
  the data then saves a fraction f of the disk reads of every scan.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, Literal

Placement = Literal["host", "nvme"]

__all__ = ["Policy", "LRUPolicy", "ScanPolicy", "make_policy"]


class Policy(ABC):
    """The interface TieredStore drives. Subclasses keep their own state; see the module docstring."""

    name: str = "policy"

    def bind(self, *, host_budget: int, stream_reserve: int) -> None:  # noqa: B027 - optional hook
        """Told once, before any insert, the host budget and the part of it kept for streaming."""

    @abstractmethod
    def insert(self, key: str, nbytes: int) -> None:
        """A new record of ``nbytes`` (host footprint) exists; it counts as just accessed."""

    @abstractmethod
    def access(self, key: str) -> None:
        """The record was used (get, pin, fetch)."""

    def prefetched(self, key: str) -> None:
        """The record was named in a prefetch: a use announced ahead. Default: the same as a use."""
        self.access(key)

    @abstractmethod
    def remove(self, key: str) -> None:
        """The record was deleted (or replaced: a re-put is remove + insert). Unknown keys are ignored."""

    @abstractmethod
    def victims(self, candidates: Iterable[str], *, incoming: str | None = None, urgent: bool = False) -> list[str]:
        """Order in which to evict ``candidates`` (evictable host records) to make room for ``incoming``.

        The store evicts from the front until enough bytes are free or on their way. A policy may
        leave out keys it will not evict for this request; ``urgent`` means the caller blocks and has
        no other way forward (a pin or a put), so leaving keys out would fail the call.
        """

    def placement(self, key: str) -> Placement:
        """Where a put with no explicit tier puts ``key`` (when it fits the host budget at all)."""
        return "host"

    def retire(self, key: str) -> bool:
        """True: the scan is done with ``key`` and it should leave host memory now."""
        return False

    def is_resident(self, key: str) -> bool:
        """True: ``key`` stays in host memory from one scan to the next. Default: no such promise."""
        return False

    def promote_on_get(self, key: str) -> bool:
        """True: a ``get`` of ``key`` from NVMe should leave a copy in host memory."""
        return True

    def stats(self) -> dict[str, Any]:
        """Figures for ``TieredStore.stats()['policy']``."""
        return {"name": self.name}


class LRUPolicy(Policy):
    """Least recently used leaves first. Every record is welcome in host memory."""

    name = "lru"

    def __init__(self) -> None:
        # Ordered oldest -> newest access; move_to_end is O(1).
        self._order: OrderedDict[str, int] = OrderedDict()

    def insert(self, key: str, nbytes: int) -> None:
        self._order[key] = nbytes
        self._order.move_to_end(key)

    def access(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: str) -> None:
        self._order.pop(key, None)

    def victims(self, candidates: Iterable[str], *, incoming: str | None = None, urgent: bool = False) -> list[str]:
        cand = set(candidates)
        cand.discard(incoming)  # type: ignore[arg-type]
        # Walk the recency order rather than sorting: O(records), and keys the policy never saw
        # (there should be none) go last rather than raising.
        out = [k for k in self._order if k in cand]
        if len(out) < len(cand):
            out += sorted(cand.difference(out))
        return out

    def stats(self) -> dict[str, Any]:
        return {"name": self.name, "records": len(self._order)}


class ScanPolicy(Policy):
    """A resident set for cyclic scans: admission order decides who stays; everything else streams.

    ``resident_bytes`` (default: ``host_budget - stream_reserve`` at ``bind``) caps the resident set.
    A record is resident when, at insert, it fits within what the resident records leave of that cap
    (first fit: a large record that does not fit does not stop a later small one). A removal frees its
    room for records inserted later; residency of existing records never changes, so a scan sees the
    same split every step.

    Streaming victims go most recently *used* first: in a scan, the chunk just used is the one needed
    furthest in the future, and a chunk prefetched but not yet used is needed soonest (Belady's rule).
    So a prefetch is not a use here: it must not make the chunk about to be needed look stale.
    """

    name = "scan"

    def __init__(self, resident_bytes: int | None = None) -> None:
        if resident_bytes is not None and (
            isinstance(resident_bytes, bool) or not isinstance(resident_bytes, int) or resident_bytes < 0
        ):
            raise ValueError(f"resident_bytes must be an int >= 0 or None, got {resident_bytes!r}")
        self.resident_bytes = resident_bytes
        self._resident: dict[str, int] = {}  # insertion (admission) order
        self._resident_used = 0
        self._streaming: OrderedDict[str, int] = OrderedDict()  # oldest -> newest use

    def bind(self, *, host_budget: int, stream_reserve: int) -> None:
        if self.resident_bytes is None:
            self.resident_bytes = max(0, host_budget - stream_reserve)

    def is_resident(self, key: str) -> bool:
        return key in self._resident

    def insert(self, key: str, nbytes: int) -> None:
        cap = self.resident_bytes if self.resident_bytes is not None else 0
        if key in self._resident or key in self._streaming:
            self.remove(key)
        if self._resident_used + nbytes <= cap:
            self._resident[key] = nbytes
            self._resident_used += nbytes
        else:
            self._streaming[key] = nbytes

    def access(self, key: str) -> None:
        if key in self._streaming:
            self._streaming.move_to_end(key)

    def prefetched(self, key: str) -> None:
        pass

    def remove(self, key: str) -> None:
        n = self._resident.pop(key, None)
        if n is not None:
            self._resident_used -= n
        self._streaming.pop(key, None)

    def victims(self, candidates: Iterable[str], *, incoming: str | None = None, urgent: bool = False) -> list[str]:
        cand = set(candidates)
        cand.discard(incoming)  # type: ignore[arg-type]
        out = [k for k in reversed(self._streaming) if k in cand]
        if urgent:
            # Last resort only: evicting a resident costs a re-read every later scan until it is
            # back. Take the most recently admitted first, the edge of the resident set.
            out += [k for k in reversed(self._resident) if k in cand]
        return out

    def placement(self, key: str) -> Placement:
        return "host" if key in self._resident else "nvme"

    def retire(self, key: str) -> bool:
        return key not in self._resident

    def promote_on_get(self, key: str) -> bool:
        return key in self._resident

    def stats(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "resident_records": len(self._resident),
            "resident_bytes": self._resident_used,
            "resident_cap": self.resident_bytes,
            "streaming_records": len(self._streaming),
            "streaming_bytes": sum(self._streaming.values()),
        }


def make_policy(policy: str | Policy) -> Policy:
    """``"lru"`` / ``"scan"`` / a ``Policy`` instance -> a fresh or the given policy."""
    if isinstance(policy, Policy):
        return policy
    if policy == "lru":
        return LRUPolicy()
    if policy == "scan":
        return ScanPolicy()
    raise ValueError(
        f"policy must be 'lru', 'scan' or a tiered.policy.Policy instance, got {policy!r}; "
        "use 'scan' for an optimizer's cyclic pass over its chunks, 'lru' otherwise"
    )
