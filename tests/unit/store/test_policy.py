"""The placement policies on their own: pure logic, no store, no I/O."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiered.policy import LRUPolicy, Policy, ScanPolicy, make_policy


def test_lru_victims_oldest_access_first():
    p = LRUPolicy()
    for k in "abcd":
        p.insert(k, 10)
    p.access("a")  # order now b, c, d, a
    assert p.victims(["a", "b", "c", "d"]) == ["b", "c", "d", "a"]
    p.access("c")
    assert p.victims(["a", "b", "c", "d"]) == ["b", "d", "a", "c"]


def test_lru_victims_only_candidates_never_incoming():
    p = LRUPolicy()
    for k in "abc":
        p.insert(k, 10)
    assert p.victims(["c", "a"], incoming="a") == ["c"]
    p.prefetched("a")  # under LRU a prefetch counts as a use
    assert p.victims(["a", "b", "c"]) == ["b", "c", "a"]
    p.remove("a")
    p.remove("zz")  # unknown keys are ignored
    assert p.victims(["a", "b", "c"]) == ["b", "c", "a"]  # unknown to the policy: last


def test_lru_places_everything_in_host_and_never_retires():
    p = LRUPolicy()
    p.insert("a", 1 << 40)
    assert p.placement("a") == "host"
    assert p.retire("a") is False
    assert p.promote_on_get("a") is True


def test_scan_resident_set_is_admission_order_first_fit():
    p = ScanPolicy()
    p.bind(host_budget=100, stream_reserve=30)  # 70 bytes resident
    for k, n in [("a", 30), ("b", 30), ("c", 20), ("d", 10), ("e", 5)]:
        p.insert(k, n)
    # a + b = 60; c (20) would make 80 > 70: streams; d fits (70); e does not.
    assert [k for k in "abcde" if p.is_resident(k)] == ["a", "b", "d"]
    assert p.placement("a") == "host" and p.placement("c") == "nvme"
    assert p.retire("c") and not p.retire("a")
    assert p.promote_on_get("a") and not p.promote_on_get("c")
    assert p.stats()["resident_bytes"] == 70


def test_scan_residency_is_stable_under_access():
    p = ScanPolicy(resident_bytes=20)
    for k in "abcd":
        p.insert(k, 10)
    for _ in range(3):
        for k in "dcba":
            p.access(k)
    assert [k for k in "abcd" if p.is_resident(k)] == ["a", "b"]


def test_scan_victims_stream_first_most_recently_used_first_residents_only_when_urgent():
    p = ScanPolicy(resident_bytes=20)
    for k in "abcdef":
        p.insert(k, 10)  # a, b resident; c, d, e, f stream
    p.access("c")  # uses: d, e, f, c
    p.prefetched("d")  # announced, not used: d stays the least recently used
    cands = list("abcde")
    assert p.victims(cands, incoming="f") == ["c", "e", "d"]  # just used goes first: needed last
    assert p.victims(cands, incoming="f", urgent=True) == ["c", "e", "d", "b", "a"]


def test_scan_remove_frees_resident_room_for_later_inserts():
    p = ScanPolicy(resident_bytes=20)
    for k in "abc":
        p.insert(k, 10)
    assert not p.is_resident("c")
    p.remove("a")
    assert not p.is_resident("c")  # existing records keep their role: the scan split stays stable
    p.insert("z", 10)
    assert p.is_resident("z")


def test_scan_reinsert_replaces():
    p = ScanPolicy(resident_bytes=20)
    p.insert("a", 10)
    p.insert("a", 30)  # a re-put with a bigger size no longer fits
    assert not p.is_resident("a")
    assert p.stats()["resident_bytes"] == 0


def test_make_policy():
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("scan"), ScanPolicy)
    mine = LRUPolicy()
    assert make_policy(mine) is mine
    with pytest.raises(ValueError, match="'lfu'.*'scan'"):
        make_policy("lfu")
    with pytest.raises(ValueError, match="resident_bytes"):
        ScanPolicy(resident_bytes=-1)


def _simulate_scan_reads(policy: Policy, sizes: list[int], budget: int, scans: int) -> int:
    """Reads (in records) of the last scan over ``sizes`` with ``budget`` of host memory.

    A tiny model of the store: the policy's residency plus its victims; a record is read when it is
    not in memory at its turn, and retired after its turn when the policy says so.
    """
    keys = [f"k{i}" for i in range(len(sizes))]
    held: dict[str, int] = {}
    for k, n in zip(keys, sizes, strict=True):
        policy.insert(k, n)
    reads = 0
    for _ in range(scans):
        reads = 0
        for k, n in zip(keys, sizes, strict=True):
            policy.access(k)
            if k not in held:
                reads += 1
                for v in policy.victims(list(held), incoming=k, urgent=True):
                    if sum(held.values()) + n <= budget:
                        break
                    del held[v]
                held[k] = n
            if policy.retire(k):
                del held[k]
    return reads


@given(n=st.integers(4, 40), resident=st.integers(0, 40))
def test_scan_saves_the_resident_fraction_lru_saves_nothing(n, resident):
    resident = min(resident, n - 2)  # the scan stays larger than the budget
    budget = (resident + 1) * 10  # room for `resident` records plus one streaming slot
    scan = ScanPolicy()
    scan.bind(host_budget=budget, stream_reserve=10)
    assert _simulate_scan_reads(scan, [10] * n, budget, scans=3) == n - resident
    # The same budget under LRU, with the scan larger than the cache: every access misses.
    assert _simulate_scan_reads(LRUPolicy(), [10] * n, budget, scans=3) == n
