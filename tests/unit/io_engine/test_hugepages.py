"""Host buffers for direct I/O come from private anonymous mappings, from a 2 MiB boundary, advised into huge pages
(io_engine/hugepages.py): from Python's default shared mappings the engine moved data at about two thirds of the
rate. Read back from /proc/self/smaps, what the kernel itself says of each mapping."""

from __future__ import annotations

import ctypes
import re
import sys
from pathlib import Path

import pytest

from io_engine import PinnedBufferPool, PinnedSlab, aligned_empty
from io_engine.hugepages import ENV_VAR, HUGE_PAGE, host_mmap

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="smaps and madvise are Linux's")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    try:
        return re.search(r"\[(\w+)\]", THP.read_text()).group(1)  # type: ignore[union-attr]
    except (OSError, AttributeError):
        return None


def mapping_of(address: int) -> dict[str, str]:
    """The smaps entry of the mapping holding ``address``: its permissions and fields."""
    entry: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) (\S+)", line)
        if m:
            if inside:
                break
            inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
            if inside:
                entry["perms"] = m.group(3)
        elif inside and ":" in line:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
    assert entry, f"no mapping holds {address:#x}"
    return entry


def address_of(mm, offset: int) -> int:
    anchor = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(anchor) + offset
    finally:
        del anchor


def test_a_buffer_of_whole_huge_pages_is_private_from_a_2_mib_boundary_and_advised_where_the_kernel_allows():
    mm, offset = host_mmap(3 * HUGE_PAGE + 4096)
    start = address_of(mm, offset)
    assert start % HUGE_PAGE == 0 and len(mm) >= offset + 3 * HUGE_PAGE + 4096
    mm[offset : offset + 3 * HUGE_PAGE] = b"\1" * (3 * HUGE_PAGE)  # touched: the kernel decides its pages now
    entry = mapping_of(start)
    assert entry["perms"].endswith("p"), entry  # private, not shmem
    assert "dc" not in entry["VmFlags"].split()  # not pinned: a forked child still gets it (copied on write)
    if thp_mode() in ("always", "madvise"):
        assert "hg" in entry["VmFlags"].split(), entry  # MADV_HUGEPAGE
        assert entry.get("THPeligible") == "1", entry
    mm.close()


def test_the_environment_turns_the_advice_off_and_the_memory_stays_private(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "0")
    mm, offset = host_mmap(2 * HUGE_PAGE)
    assert offset == 0
    mm[:4096] = b"\1" * 4096
    entry = mapping_of(address_of(mm, 0))
    assert entry["perms"].endswith("p") and "hg" not in entry["VmFlags"].split(), entry
    mm.close()


def test_a_mapping_to_be_pinned_is_left_out_of_forked_children():
    mm, offset = host_mmap(HUGE_PAGE, pinned=True)
    mm[offset : offset + 4096] = b"\1" * 4096
    assert "dc" in mapping_of(address_of(mm, offset))["VmFlags"].split()  # VM_DONTCOPY: MADV_DONTFORK
    mm.close()


def test_small_buffers_are_private_and_not_padded():
    mm, offset = host_mmap(8192)
    assert offset == 0 and len(mm) == 8192
    mm[:1] = b"\1"
    assert mapping_of(address_of(mm, 0))["perms"].endswith("p")
    mm.close()


def test_the_pool_the_slab_and_aligned_empty_hand_out_such_memory():
    with PinnedBufferPool(8 * HUGE_PAGE, pin=False) as pool, pool.acquire(4 * HUGE_PAGE) as buf:
        assert buf.tensor.data_ptr() % HUGE_PAGE == 0
        buf.tensor.fill_(3)
        assert mapping_of(buf.tensor.data_ptr())["perms"].endswith("p")
        assert int(buf.tensor.sum()) == 3 * 4 * HUGE_PAGE
    slab = PinnedSlab(5 * HUGE_PAGE, pin=False)
    a, b = slab.carve(0, HUGE_PAGE), slab.carve(HUGE_PAGE + 4096, 4096)
    assert a.data_ptr() % HUGE_PAGE == 0 and b.data_ptr() == a.data_ptr() + HUGE_PAGE + 4096
    assert slab.holds(a) and slab.holds(b)
    a.fill_(1)
    b.fill_(2)
    assert int(a.sum()) == HUGE_PAGE and int(b.sum()) == 2 * 4096
    slab.close()
    view, owner = aligned_empty(2 * HUGE_PAGE)
    assert len(view) == 2 * HUGE_PAGE and view[0] == 0 and view[-1] == 0
    view[-1] = 9
    assert mapping_of(address_of(owner, 0))["perms"].endswith("p")
