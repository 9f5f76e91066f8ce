"""How ``host_budget`` is spent: gradient staging, the read-ahead depth, the resident set, the stream reserve.

Pure arithmetic over chunk sizes: no tensors, no I/O. ``plan_budget`` answers, for one optimizer:

- ``staging``: pinned bytes for gradient and weight copies (the host update of CUDA parameters only);
- ``prefetch_depth``: the read-ahead, never more chunks than the rest of the budget holds beside the chunks the
  step's pipeline keeps open (``in_flight``: the update strategy's window, 2 on the host, 3 on the device);
- ``resident``: how many of the first chunks stay in host memory for good (the scan policy's resident
  set), and ``stream_reserve``, the room that leaves the rest to stream through;
- ``disk_bytes``: what must live on NVMe (the free-space check counts only that: state kept in host
  memory needs no disk, so capacity is DDR + NVMe).

``in_hbm`` says which chunks ``gpu_budget`` keeps in HBM; the caller plans the host budget for the others.
"""

from __future__ import annotations

from dataclasses import dataclass

from io_engine import format_size, pool_bytes

__all__ = ["BudgetPlan", "plan_budget", "least_host_budget", "plan_residency", "budget_for_disk", "in_hbm"]


@dataclass(frozen=True)
class BudgetPlan:
    staging: int
    prefetch_depth: int
    resident: int
    stream_reserve: int
    disk_bytes: int
    in_flight: int = 2  # the chunks the step keeps open beside the read-ahead (the update strategy's window)


def plan_budget(chunk_bytes: list[int], host_budget: int, staging: int, prefetch_depth: int, *,
                smallest: bool = False, in_flight: int = 2) -> BudgetPlan:  # fmt: skip
    """The plan for chunks of ``chunk_bytes`` (scan order) under ``host_budget``, ``staging`` bytes of which
    go to copies, for a pipeline that keeps ``in_flight`` chunks open; raises ValueError when not even one chunk
    fits beside the staging, naming both fixes, or where the chunks are already the ``smallest`` any
    ``chunk_bytes`` makes (ROW_ALIGN elements), the host_budget needed."""
    largest, need = max(chunk_bytes, default=0), least_host_budget(chunk_bytes, staging)
    if host_budget < need:
        fix = (f"raise host_budget to at least {-(-need >> 10)}KiB (chunk_bytes already gives the smallest chunks)"
               if smallest else "raise host_budget or lower chunk_bytes")  # fmt: skip
        raise ValueError(
            f"host_budget {format_size(host_budget)} cannot hold one state chunk ({format_size(largest)}, "
            f"{format_size(pool_bytes([largest]))} in whole pages) plus "
            f"gradient staging ({format_size(staging)}): {fix}"
        )
    room = host_budget - staging
    # The pipeline never needs more chunks in memory than the budget holds: the read-ahead window and the
    # chunks open (updating, coming down, retiring). One more than the room would have the read-ahead evict
    # chunks read but not yet updated, and read them again.
    depth = min(prefetch_depth, max(0, room // max(largest, 1) - in_flight))
    # Without a read-ahead the step is the serial twin, one chunk open at a time: two chunks' room, as ever.
    in_flight = in_flight if depth else 2
    sizes = [pool_bytes([n]) for n in chunk_bytes]  # what each takes of the budget: whole pages
    resident, reserve = plan_residency(sizes, room, depth + in_flight)
    return BudgetPlan(staging, depth, resident, reserve, sum(sizes[resident:]), in_flight)


def least_host_budget(chunk_bytes: list[int], staging: int) -> int:
    """The least ``host_budget`` ``plan_budget`` takes for chunks of ``chunk_bytes``: one chunk beside the staging,
    in the whole pages the store takes for it (the raw bytes passed here, then failed the first step's load)."""
    return staging + (pool_bytes([max(chunk_bytes)]) if chunk_bytes else 0)


def in_hbm(chunk_bytes: list[int], gpu_budget: int) -> list[bool]:
    """Which chunks (in put order) the store keeps in HBM under ``gpu_budget``: each that fits beside those
    before it, as ``TieredStore.put`` places them. They take nothing of host_budget and nothing of the disk."""
    used, out = 0, []
    for n in chunk_bytes:
        fits = 0 < gpu_budget and used + n <= gpu_budget
        used += n if fits else 0
        out.append(fits)
    return out


def plan_residency(sizes: list[int], budget: int, in_flight: int) -> tuple[int, int]:
    """How many of the first chunks (``sizes``, host bytes each, in scan order) stay in host memory, and the
    stream reserve that leaves them exactly that room: ``(resident, stream_reserve)``.

    The chunks that stream need room for ``in_flight`` of them at once (read-ahead, update, write-back),
    but never more than there are: with two streamed chunks, two chunks' room is enough, and with none the
    whole budget holds state. The most chunks that fit beside that room stay resident.
    """
    largest = max(sizes, default=0)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    for r in range(len(sizes), -1, -1):
        room = min(in_flight, len(sizes) - r) * largest
        if prefix[r] + room <= budget:
            return r, budget - prefix[r]
    return 0, budget


def budget_for_disk(chunk_bytes: list[int], staging: int, prefetch_depth: int, disk_free: int,
                    in_flight: int = 2) -> int:  # fmt: skip
    """The least ``host_budget`` (a multiple of the largest chunk's footprint, past what one chunk needs) whose
    plan leaves at most ``disk_free`` bytes of state on disk: what a refusal for want of disk can suggest."""
    step = max((pool_bytes([n]) for n in chunk_bytes), default=1)
    lo, hi = 1, len(chunk_bytes) + prefetch_depth + in_flight + 1  # in steps above staging: hi holds everything
    while lo < hi:  # disk_bytes only falls as the budget grows
        mid = (lo + hi) // 2
        if (
            plan_budget(chunk_bytes, staging + mid * step, staging, prefetch_depth, in_flight=in_flight).disk_bytes
            <= disk_free
        ):
            hi = mid
        else:
            lo = mid + 1
    return staging + lo * step
