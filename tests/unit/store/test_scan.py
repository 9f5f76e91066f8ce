"""The chunk scan (tiered.store.scan): the read-ahead rule against its serial twin, and ``windowed``, the one loop
every pass over the chunks runs (the step, a checkpoint's save and load, state dicts): its order, its serial
twin, and its single failure path."""

from __future__ import annotations

import pytest
import torch

from tiered.store import TieredStore
from tiered.store.scan import ReadAhead, SerialReadAhead, read_ahead, scan, spread_disk, windowed


class RecordingStore:
    """What the read-ahead asks of a store: which keys are resident, and the prefetches it starts."""

    def __init__(self, resident: set[str]):
        self.resident, self.prefetched = resident, []

    def is_resident(self, key: str) -> bool:
        return key in self.resident

    def prefetch(self, keys):
        self.prefetched.extend(keys)


KEYS = [f"c{i}" for i in range(8)]


def test_read_ahead_keeps_depth_disk_reads_in_flight_and_skips_resident_chunks():
    store = RecordingStore(resident={"c1", "c2", "c5"})
    reads = read_ahead(store, KEYS, 2)
    assert isinstance(reads, ReadAhead) and not isinstance(reads, SerialReadAhead)
    reads.through(-1)
    assert store.prefetched == ["c0", "c3"]  # the first two chunks that live on disk, c1 and c2 being resident
    reads.through(0)
    assert store.prefetched == ["c0", "c3", "c4"]  # two on-disk chunks ahead of c0: c3, c4
    reads.through(2)  # a resident chunk in use moves nothing past what is in flight
    assert store.prefetched == ["c0", "c3", "c4"]
    reads.through(3)
    reads.through(3)  # asked twice: no read started twice
    assert store.prefetched == ["c0", "c3", "c4", "c6"]
    for i in range(4, len(KEYS)):
        reads.through(i)
    assert store.prefetched == ["c0", "c3", "c4", "c6", "c7"]  # every on-disk chunk once, in order
    reads.next_step()  # the next pass's first reads, during forward and backward
    assert store.prefetched[-2:] == ["c0", "c3"]


@pytest.mark.parametrize("n,resident", [(8, 5), (8, 2), (10, 9), (10, 1), (7, 3), (40, 31), (6, 0), (6, 6), (0, 0)])
def test_spread_disk_spreads_the_on_disk_chunks_evenly_among_the_resident_ones(n, resident):
    keys = [f"c{i}" for i in range(n)]
    store = RecordingStore(resident=set(keys[:resident]))  # the scan policy keeps the first chunks put
    order = spread_disk(store, keys)
    assert sorted(order) == list(range(n))  # every chunk once
    disk = [i for i in order if keys[i] not in store.resident]
    held = [i for i in order if keys[i] in store.resident]
    assert disk == sorted(disk) and held == sorted(held)  # each kind in its own order
    if not disk or not held:
        assert order == list(range(n))  # nothing to spread: the put order
        return
    assert keys[order[0]] not in store.resident  # its read ran ahead under forward and backward
    # no run of resident chunks longer than their share between two on-disk ones, rounded up, and back
    at = [p for p, i in enumerate(order) if keys[i] not in store.resident] + [n]
    longest = max(b - a - 1 for a, b in zip(at, at[1:]))
    assert longest <= -(-len(held) // len(disk)), order


def test_the_serial_twin_reads_nothing_ahead():
    store = RecordingStore(resident=set())
    reads = read_ahead(store, KEYS, 0)
    assert isinstance(reads, SerialReadAhead)
    for i in range(-1, len(KEYS)):
        reads.through(i)
    reads.next_step()
    assert store.prefetched == []


def trace(n: int, hold: int, fail_open: int | None = None) -> list[tuple]:
    events: list[tuple] = []

    def open_item(i: int) -> str:
        events.append(("open", i))
        if i == fail_open:
            raise OSError(5, f"open {i}")
        return f"item{i}"

    def close_item(i: int, item: str, failed: bool) -> None:
        assert item == f"item{i}"
        events.append(("close", i, failed))

    windowed(n, hold, open_item, close_item, ahead=lambda i: events.append(("ahead", i)))
    return events


def test_windowed_with_two_open_closes_each_item_after_the_next_opens():
    assert trace(3, 2) == [
        ("ahead", -1), ("ahead", 0), ("open", 0),
        ("ahead", 1), ("open", 1), ("close", 0, False),
        ("ahead", 2), ("open", 2), ("close", 1, False),
        ("close", 2, False),
    ]  # fmt: skip


def test_windowed_serial_twin_closes_each_item_before_the_next_opens():
    assert trace(3, 1) == [
        ("ahead", -1), ("ahead", 0), ("open", 0), ("close", 0, False),
        ("ahead", 1), ("open", 1), ("close", 1, False),
        ("ahead", 2), ("open", 2), ("close", 2, False),
    ]  # fmt: skip


@pytest.mark.parametrize("hold", [1, 2, 3])
def test_a_failed_open_closes_every_open_item_once_oldest_first_then_raises(hold):
    with pytest.raises(OSError, match="open 3"):
        trace(6, hold, fail_open=3)
    events: list[tuple] = []

    def open_item(i):
        events.append(("open", i))
        if i == 3:
            raise OSError(5, "open 3")
        return i

    with pytest.raises(OSError, match="open 3"):
        windowed(6, hold, open_item, lambda i, item, failed: events.append(("close", i, failed)))
    closes = [e for e in events if e[0] == "close"]
    assert [e[1] for e in closes] == [0, 1, 2]  # each item that opened closed exactly once, in order
    closed_before = 3 - (hold - 1) if hold <= 3 else 0  # closed in the normal course before item 3 failed
    assert [e[2] for e in closes] == [False] * closed_before + [True] * (3 - closed_before)
    assert ("open", 4) not in events  # nothing opens after the failure


def test_a_failed_close_closes_the_rest_as_failed_and_raises_the_first_error():
    recorded: list[tuple] = []

    def close_item(i, item, failed):
        recorded.append((i, failed))
        if not failed:
            raise OSError(5, f"close {i}")

    with pytest.raises(OSError, match="close 0"):
        windowed(5, 2, lambda i: i, close_item)
    assert recorded == [(0, False), (1, True)]  # item 2 never opened: the scan stops at the first error


def test_windowed_refuses_an_empty_window():
    with pytest.raises(ValueError, match="hold"):
        windowed(3, 0, lambda i: i, lambda i, item, failed: None)


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_scan_over_a_store_matches_its_serial_twin(tmp_path, depth):
    """Records partly on disk (a host budget of three of ten): every pass, read ahead or serial, sees each
    record once, in order, with its bytes; a pass that writes leaves the same store behind."""
    values = {f"k{i}": torch.arange(4096, dtype=torch.float32) + 1000 * i for i in range(10)}

    def passes(folder, d):
        seen = []
        with TieredStore(nvme_path=str(folder), host_budget=3 * 4096 * 4) as store:
            for key, v in values.items():
                store.put(key, v.clone())
            keys = list(values)

            def add(i, record):
                seen.append((i, record.clone()))
                record.add_(1)
                store.mark_dirty(keys[i])

            scan(store, keys, d, add, writes=True)
            after = {key: store.get(key).clone() for key in keys}
        return seen, after

    serial = passes(tmp_path / "serial", 0)
    ahead = passes(tmp_path / f"d{depth}", depth)
    assert [i for i, _ in ahead[0]] == list(range(10))
    for (_, a), (_, b), v in zip(ahead[0], serial[0], values.values()):
        assert torch.equal(a, b) and torch.equal(a, v)
    for key in values:
        assert torch.equal(ahead[1][key], serial[1][key])
        assert torch.equal(ahead[1][key], values[key] + 1)
