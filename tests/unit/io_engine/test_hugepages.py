"""Host buffers for direct I/O come from private anonymous mappings, from a 2 MiB boundary, advised into huge pages
and wiped in forked children (io_engine/hugepages.py): from Python's default shared mappings the engine moved data
at about two thirds of the rate. Read back from /proc/self/smaps, what the kernel itself says of each mapping, and
from forked children (each under a watchdog), what a DataLoader worker or a helper process sees of them."""

from __future__ import annotations

import ctypes
import errno
import gc
import mmap
import os
import re
import select
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from io_engine import PAGE, PinnedBufferPool, PinnedSlab, aligned_empty, hugepages
from io_engine.hugepages import ENV_VAR, HUGE_PAGE, host_mmap

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="smaps, madvise and fork are Linux's")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
CHILD_TIMEOUT = 60  # seconds: reached only when a child hangs


def thp_mode() -> str | None:
    try:
        return re.search(r"\[(\w+)\]", THP.read_text()).group(1)  # type: ignore[union-attr]
    except (OSError, AttributeError):
        return None


def mapping_of(address: int, pid: int | str = "self") -> dict[str, str]:
    """The smaps entry of the mapping holding ``address``: its permissions and fields."""
    entry: dict[str, str] = {}
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
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


def flags_at(address: int) -> list[str]:
    return mapping_of(address)["VmFlags"].split()


def assert_huge_only_inside(mm, lo: int, hi: int) -> None:
    """Bytes ``[lo, hi)`` of the mapping (whole 2 MiB pages) advised huge (``hg``) where the kernel has transparent
    huge pages, every other byte ``nh`` (MADV_NOHUGEPAGE: no huge page even under ``always``), all of it ``wf``."""
    inside = (lo, hi - 1) if hi > lo else ()
    outside = [at for at in (0, lo - 1, hi, len(mm) - 1) if 0 <= at < len(mm) and not lo <= at < hi]
    for at in inside:
        flags = flags_at(address_of(mm, at))
        assert "nh" not in flags and "wf" in flags, (at, lo, hi, len(mm), flags)
        if thp_mode() in ("always", "madvise"):
            assert "hg" in flags, (at, lo, hi, len(mm), flags)
    for at in outside:
        flags = flags_at(address_of(mm, at))
        assert "nh" in flags and "hg" not in flags and "wf" in flags, (at, lo, hi, len(mm), flags)


def address_of(mm, offset: int) -> int:
    anchor = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(anchor) + offset
    finally:
        del anchor


class FakeCudart:
    """cudaHostRegister as on a CUDA machine that accepts it: the pinned path of the pool and the slab, on a CPU."""

    def cudaHostRegister(self, *args):  # noqa: N802 - CUDA's name
        return 0

    def cudaHostUnregister(self, *args):  # noqa: N802
        return 0


@pytest.fixture(params=[False, True], ids=["pageable", "pinned"])
def pin(request, monkeypatch) -> bool:
    """Both paths of the pool and the slab: pageable, and page-locked (cudaHostRegister faked)."""
    if request.param:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    return request.param


class Child:
    """``body()`` run in a forked child under a watchdog; ``result()`` is what it returned (a str), and fails the
    test with how the child ended otherwise (a signal: SIGSEGV; an exception; a hang, ended by the watchdog).
    The child leaves by ``os._exit``, so it never returns into pytest. ``body`` must not run torch's parallel ops:
    GNU OpenMP does not survive fork; numpy views of the tensors do the work."""

    def __init__(self, body, *, hold: bool = False) -> None:
        out_r, out_w = os.pipe()
        self._go_r, self._go_w = os.pipe() if hold else (-1, -1)
        self.pid = os.fork()
        if self.pid == 0:
            code, message = 1, ""
            try:
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                signal.alarm(CHILD_TIMEOUT)  # the watchdog: SIGALRM ends a hung child
                os.close(out_r)
                if hold:
                    os.close(self._go_w)
                    os.read(self._go_r, 1)  # the parent looks at this child first (release())
                message = str(body())
                code = 0
            except BaseException as e:  # noqa: BLE001 - handed to the parent
                message = f"{type(e).__name__}: {e}"
            finally:
                try:
                    os.write(out_w, message.encode())
                finally:
                    os._exit(code)
        os.close(out_w)
        if hold:
            os.close(self._go_r)
        self._out = out_r

    def release(self) -> None:
        """Let a child made with ``hold`` run its body."""
        os.write(self._go_w, b"x")

    def result(self) -> str:
        if self._go_w >= 0:
            os.close(self._go_w)  # a child still held reads EOF and goes on
        deadline = time.monotonic() + CHILD_TIMEOUT + 30
        chunks = []
        while True:  # the pipe ends with the child (its watchdog ends a hang)
            ready, _, _ = select.select([self._out], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(self.pid, signal.SIGKILL)
                break
            chunk = os.read(self._out, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(self._out)
        _, status = os.waitpid(self.pid, 0)
        message = b"".join(chunks).decode()
        if os.WIFSIGNALED(status):
            pytest.fail(f"the forked child died of {signal.Signals(os.WTERMSIG(status)).name}: {message}")
        assert os.WEXITSTATUS(status) == 0, f"the forked child failed: {message}"
        return message


def in_child(body) -> str:
    return Child(body).result()


def what_is_there(array: np.ndarray, parents: int) -> str:
    if not array.any():
        return "zeros"
    return "the parent's data" if (array == parents).all() else f"other bytes: {np.unique(array)[:8]}"


# --- the mappings, as the kernel reports them


def test_a_buffer_of_whole_huge_pages_is_private_from_a_2_mib_boundary_and_advised_where_the_kernel_allows():
    mm, offset = host_mmap(3 * HUGE_PAGE + 4096)
    start = address_of(mm, offset)
    assert start % HUGE_PAGE == 0 and len(mm) >= offset + 3 * HUGE_PAGE + 4096
    mm[offset : offset + 3 * HUGE_PAGE] = b"\1" * (3 * HUGE_PAGE)  # touched: the kernel decides its pages now
    entry = mapping_of(start)
    assert entry["perms"].endswith("p"), entry  # private, not shmem
    if thp_mode() in ("always", "madvise"):
        assert "hg" in entry["VmFlags"].split(), entry  # MADV_HUGEPAGE
        assert entry.get("THPeligible") == "1", entry
    mm.close()


def test_every_mapping_is_wiped_in_forked_children_never_left_out_of_them():
    """``dc`` (MADV_DONTFORK) left a hole in the child; ``wf`` (MADV_WIPEONFORK) gives it fresh memory there."""
    for nbytes in (4096, HUGE_PAGE - 4096, HUGE_PAGE, 3 * HUGE_PAGE + 4096):
        mm, offset = host_mmap(nbytes)
        for at in (0, offset, len(mm) - 1):  # the whole mapping, the bytes before the boundary too
            flags = flags_at(address_of(mm, at))
            assert "wf" in flags and "dc" not in flags, (nbytes, at, flags)
        mm.close()


def test_the_environment_turns_the_advice_off_and_the_memory_stays_private_and_wiped_on_fork(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "0")
    mm, offset = host_mmap(3 * HUGE_PAGE + 4096)
    assert offset == 0 and len(mm) == 3 * HUGE_PAGE + 4096  # no boundary sought: not one byte more
    mm[:4096] = b"\1" * 4096
    entry = mapping_of(address_of(mm, 0))
    assert entry["perms"].endswith("p") and "hg" not in entry["VmFlags"].split(), entry
    assert "wf" in entry["VmFlags"].split(), entry
    assert_huge_only_inside(mm, 0, 0)  # off under transparent huge pages `always` too: NOHUGEPAGE, all of it
    mm.close()


@pytest.mark.parametrize("value", ["false", "False", "OFF", "no", " No\n", " 0 "])
def test_every_usual_way_of_saying_off_turns_the_advice_off(monkeypatch, value):
    """Only ``0`` turned huge pages off: ``false``, ``off``, ``no`` left them on, silently."""
    monkeypatch.setenv(ENV_VAR, value)
    mm, offset = host_mmap(3 * HUGE_PAGE + 4096)
    assert offset == 0 and len(mm) == 3 * HUGE_PAGE + 4096
    assert_huge_only_inside(mm, 0, 0)
    mm.close()


@pytest.mark.parametrize("value", ["1", "true", "On", " YES ", ""])
def test_every_usual_way_of_saying_on_and_an_empty_value_leave_the_advice_on(monkeypatch, value):
    monkeypatch.setenv(ENV_VAR, value)
    mm, offset = host_mmap(3 * HUGE_PAGE + 4096)
    assert address_of(mm, offset) % HUGE_PAGE == 0
    assert_huge_only_inside(mm, offset, offset + 3 * HUGE_PAGE)
    mm.close()


@pytest.mark.parametrize("value", ["00", "2", "disable", "of"])
def test_a_value_neither_on_nor_off_raises_naming_the_variable_and_what_it_takes(monkeypatch, value):
    """A typo must not leave huge pages on (or off) unnoticed: raised at the first buffer, small or not, as a bad
    $TIERED_IO_CONFIG is; the pool charges nothing for the buffer it could not make."""
    monkeypatch.setenv(ENV_VAR, value)
    for nbytes in (4096, 3 * HUGE_PAGE):
        with pytest.raises(ValueError, match=rf"\${ENV_VAR}={value!r}.*0, false, off, no.*1, true, on, yes"):
            host_mmap(nbytes)
    pool = PinnedBufferPool(4 * HUGE_PAGE, pin=False)
    with pytest.raises(ValueError, match=ENV_VAR):
        pool.acquire(HUGE_PAGE)
    assert pool.in_use == 0 and pool.idle_bytes == 0
    monkeypatch.delenv(ENV_VAR)
    pool.acquire(HUGE_PAGE).release()  # unset: on, and the pool works
    pool.close()


def test_small_buffers_are_private_and_not_padded():
    mm, offset = host_mmap(8192)
    assert offset == 0 and len(mm) == 8192
    mm[:1] = b"\1"
    assert mapping_of(address_of(mm, 0))["perms"].endswith("p")
    mm.close()


@pytest.mark.parametrize("nbytes", [8192, HUGE_PAGE - 4096, HUGE_PAGE + 4096, 3 << 20, 5 * HUGE_PAGE - 4096])
def test_no_byte_outside_a_buffers_whole_huge_pages_may_take_a_huge_page_even_under_thp_always(nbytes):
    """Under transparent huge pages ``always`` (RHEL's default) the kernel gives huge pages to any anonymous mapping
    not advised MADV_NOHUGEPAGE, not only the range advised MADV_HUGEPAGE: a padded 3 MiB buffer's 1 MiB tail
    (with the padding past it) held a 2 MiB-aligned range, and writing the tail faulted in a whole huge page, 1 MiB
    more than the buffer asked for and its pool charged. Now only the whole 2 MiB pages inside the buffer may be
    huge: the head before the boundary, the tail past them, the padding and a buffer below 2 MiB are ``nh``."""
    for _ in range(4):  # several: where the kernel places a mapping decides its padding
        mm, offset = host_mmap(nbytes)
        assert address_of(mm, offset) % HUGE_PAGE == 0 or nbytes < HUGE_PAGE
        assert_huge_only_inside(mm, offset, offset + nbytes // HUGE_PAGE * HUGE_PAGE)
        mm.close()


def test_where_the_padding_does_not_fit_the_buffer_is_mapped_at_its_size(monkeypatch):
    """Under ``ulimit -v`` (or ``vm.overcommit_memory=2``'s commit limit) with room for a buffer but not for its
    padding, the padded mapping raised ENOMEM where Python's own mapping fitted. Now the buffer is mapped at its
    size and used from its start: the whole 2 MiB pages that happen to fall on boundaries inside it advised huge,
    the rest not."""
    nbytes, real = 3 << 20, hugepages._private

    def tight(size: int) -> mmap.mmap:
        if size > nbytes:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return real(size)

    monkeypatch.setattr(hugepages, "_private", tight)
    for _ in range(4):
        mm, offset = host_mmap(nbytes)
        assert offset == 0 and len(mm) == nbytes
        lo = -address_of(mm, 0) % HUGE_PAGE
        assert_huge_only_inside(mm, lo, lo + (nbytes - lo) // HUGE_PAGE * HUGE_PAGE)
        mm[:] = b"\1" * nbytes
        mm.close()


def test_under_an_address_space_limit_a_buffer_that_fits_unpadded_is_mapped():
    """The same under a real ``ulimit -v`` (RLIMIT_AS, set in a forked child): room for the buffer and 2 MiB less
    two pages, one page short of the padded mapping."""
    import resource

    nbytes = 3 << 20

    def vmsize() -> int:
        return int(re.search(r"VmSize:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) << 10  # type: ignore[union-attr]

    def child() -> str:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        fitted = off_boundary = 0
        for _ in range(8):
            resource.setrlimit(resource.RLIMIT_AS, (vmsize() + nbytes + HUGE_PAGE - 2 * PAGE, hard))
            try:
                mm, offset = host_mmap(nbytes)
            finally:
                resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
            fitted += len(mm) - offset >= nbytes
            off_boundary += address_of(mm, offset) % HUGE_PAGE != 0
            mm.close()
        return f"fitted {fitted}/8, {off_boundary} off a boundary"

    assert in_child(child).startswith("fitted 8/8")


def test_a_buffer_of_whole_huge_pages_takes_no_more_address_space_where_the_kernel_aligns_it():
    """Each block mapped 2 MiB more than it holds: 100 buffers of 2 MiB took 400 MiB of ``ulimit -v`` (and of
    ``vm.overcommit_memory=2``'s commit limit). Linux 6.7 and later start such a mapping on a 2 MiB boundary."""
    probe = mmap.mmap(-1, 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    aligned = address_of(probe, 0) % HUGE_PAGE == 0
    probe.close()
    if not aligned:
        pytest.skip("this kernel does not start a private mapping of whole 2 MiB pages on a 2 MiB boundary")
    for nbytes in (HUGE_PAGE, 5 * HUGE_PAGE):
        mm, offset = host_mmap(nbytes)
        assert (offset, len(mm)) == (0, nbytes) and address_of(mm, 0) % HUGE_PAGE == 0
        mm.close()
    mm, offset = host_mmap(HUGE_PAGE + 4096)  # off a boundary: longer, by less than a huge page
    assert len(mm) < HUGE_PAGE + 4096 + HUGE_PAGE and address_of(mm, offset) % HUGE_PAGE == 0
    mm.close()


def test_where_the_kernel_refuses_to_wipe_on_fork_the_buffer_is_a_shared_mapping_as_before(monkeypatch):
    """A kernel before 4.14 answers MADV_WIPEONFORK with EINVAL, as every kernel answers an advice it does not
    know: then a private mapping would be copied into children, so the buffer is shared, as before the change."""
    monkeypatch.setattr(hugepages, "_WIPEONFORK", 4321)  # no such advice: EINVAL
    for nbytes in (8192, 3 * HUGE_PAGE + 4096):
        mm, offset = host_mmap(nbytes)
        assert offset == 0 and len(mm) == nbytes
        entry = mapping_of(address_of(mm, 0))
        assert entry["perms"].endswith("s") and "wf" not in entry["VmFlags"].split(), entry
        mm.close()
    with PinnedBufferPool(4 * HUGE_PAGE, pin=False) as pool, pool.acquire(HUGE_PAGE) as buf:
        mine = buf.tensor.numpy()
        mine[:] = 5

        def child() -> str:
            seen = what_is_there(mine, 5)
            mine[:] = 6  # shared: the parent sees it, as before the change
            return seen

        assert in_child(child) == "the parent's data"
        assert (mine == 6).all()


def test_the_pool_and_aligned_empty_hand_out_such_memory():
    with PinnedBufferPool(8 * HUGE_PAGE, pin=False) as pool, pool.acquire(4 * HUGE_PAGE) as buf:
        assert buf.tensor.data_ptr() % HUGE_PAGE == 0
        buf.tensor.fill_(3)
        assert mapping_of(buf.tensor.data_ptr())["perms"].endswith("p")
        assert int(buf.tensor.sum()) == 3 * 4 * HUGE_PAGE
    view, owner = aligned_empty(2 * HUGE_PAGE)
    assert len(view) == 2 * HUGE_PAGE and view[0] == 0 and view[-1] == 0
    view[-1] = 9
    entry = mapping_of(address_of(owner, 0))
    assert entry["perms"].endswith("p") and "wf" in entry["VmFlags"].split(), entry


def test_a_pool_buffers_storage_is_the_buffer_itself_not_the_mapping_around_it():
    """A padded block's tensor was a view into a storage over the whole mapping, from before the 2 MiB boundary the
    buffer (and its cudaHostRegister'd range) starts at: torch's ``Tensor.is_pinned()``, which asks of the storage's
    start, said False on a GPU machine for a page-locked buffer, and ``torch.save`` of a view wrote the padding too.
    Now the storage starts at the buffer and ends with it, as the slab's carved tensors do."""
    padded = 0
    with PinnedBufferPool(16 * HUGE_PAGE, pin=False) as pool:
        bufs = [pool.acquire(n) for n in (8192, 3 << 20, 3 << 20, 3 << 20, HUGE_PAGE + 4096, 2 * HUGE_PAGE)]
        for buf in bufs:
            block = buf._block
            padded += block.offset > 0
            storage = buf.tensor.untyped_storage()
            start, length = storage.data_ptr(), storage.nbytes()  # ints: a failure's message, not a storage's repr
            assert start == buf.tensor.data_ptr() == address_of(block.mm, block.offset), (block.offset, block.size)
            assert length == block.size, (length, block.size)
            buf.release()
    if not padded:
        pytest.skip("the kernel placed every mapping on a 2 MiB boundary: no padded buffer to look at")


def test_a_freed_block_with_a_live_view_stays_readable_and_its_mapping_closes_once_the_view_is_gone():
    pool = PinnedBufferPool(8 * HUGE_PAGE, pin=False)
    buf = pool.acquire(3 << 20)
    view = buf.view(torch.float32)
    view.fill_(1.5)
    block = buf._block
    buf.release()
    pool.close()  # frees the block: close() of its mapping meets the view (BufferError), and leaves it mapped
    assert block.tensor is None and not block.mm.closed
    assert float(view.sum()) == 1.5 * view.numel()
    del view, buf
    gc.collect()
    block.mm.close()  # no export of the mapping is left behind the tensors


# --- forked children


@pytest.mark.parametrize("nbytes", [64 << 10, 3 * HUGE_PAGE + 4096], ids=["small", "huge"])
def test_a_forked_child_reads_zeros_from_the_parents_pool_block_and_its_writes_stay_its_own(pin, nbytes):
    """Pinned: the child died of SIGSEGV reading the tensor (the range left out of it). Pageable: it read the
    parent's data, a copy on write of every page the parent then rewrote. Now a child holds fresh memory of its
    own there, zero-filled, and what it writes stays in it."""
    with PinnedBufferPool(2 * nbytes + 4 * HUGE_PAGE, pin=pin) as pool, pool.acquire(nbytes) as buf:
        assert buf.pinned == pin
        block = buf.tensor.numpy()
        block[:] = 7

        def child() -> str:
            seen = what_is_there(block, 7)
            block[:] = 1
            assert (block == 1).all(), "the child's own writes did not stay"
            return seen

        assert in_child(child) == "zeros"
        assert (block == 7).all(), "the child's writes reached the parent"


@pytest.mark.parametrize("nbytes", [64 << 10, 3 * HUGE_PAGE + 4096], ids=["small", "huge"])
def test_a_forked_child_reads_the_parents_weights_from_a_slab(pin, nbytes):
    """An offloaded model's weights and gradients live in slabs, and a state dict taken in the parent holds views
    of them, which a fork-based background checkpoint saves in a child. A slab wiped on fork read as zeros there,
    and the checkpoint held zeros, silently. A slab is a shared mapping, as before huge pages: its bytes move only
    between host and GPU, never straight to disk, so a private mapping bought it nothing."""
    slab = PinnedSlab(nbytes, pin=pin)
    carved = slab.carve(4096, nbytes - 4096)
    assert slab.pinned == pin
    weights = carved.numpy()
    weights[:] = 9
    entry = mapping_of(carved.data_ptr())
    assert entry["perms"].endswith("s") and "wf" not in entry["VmFlags"].split(), entry
    assert in_child(lambda: what_is_there(weights, 9)) == "the parent's data"
    slab.close()


def test_a_child_that_drops_its_copy_of_the_parents_slab_keeps_its_own_buffers(pin):
    """The review's hole: a slab page-locked in the parent was left out of the child (MADV_DONTFORK); the child's
    own pool blocks were mapped into that hole, and when the child dropped its copy of the parent's slab (an
    offloaded model's copy collected), its close unmapped them: SIGSEGV at the child's next use of its own memory."""
    slab = PinnedSlab(8 << 20, pin=pin)
    lo = slab.carve(0, 4096).data_ptr()

    def child() -> str:
        nonlocal slab
        pool = PinnedBufferPool(64 << 20, pin=False)  # the child's own model or optimizer buffers
        bufs = [pool.acquire(8 << 20) for _ in range(8)]
        for i, b in enumerate(bufs):
            b.tensor.numpy()[:] = i + 1
        placed = sum(lo <= b.tensor.data_ptr() < lo + (8 << 20) for b in bufs)
        slab.close()  # the child drops its copy of the parent's slab: its mapping closed
        slab = None
        gc.collect()
        intact = all((b.tensor.numpy() == i + 1).all() for i, b in enumerate(bufs))
        for b in bufs:
            b.release()
        pool.close()
        return f"own buffers intact: {intact} ({placed} inside the parent's slab's range)"

    assert in_child(child).startswith("own buffers intact: True")
    slab.close()


def test_a_long_lived_child_shares_no_page_of_the_parents_buffers_so_the_parents_rewrites_copy_nothing():
    """A persistent DataLoader worker beside a pageable pool: the private pages were shared copy-on-write with the
    child, so each one the parent rewrote in its next step was copied, and the pair held the buffer twice for the
    child's life. Now the parent's pages are its own alone: nothing to copy."""
    with PinnedBufferPool(8 * HUGE_PAGE, pin=False) as pool, pool.acquire(4 * HUGE_PAGE) as buf:
        buf.tensor.numpy()[:] = 1
        child = Child(lambda: "done", hold=True)  # alive, touching nothing, while the parent looks
        try:
            entry = mapping_of(buf.tensor.data_ptr())
        finally:
            child.release()
            assert child.result() == "done"
        shared_kb = int(entry["Shared_Dirty"].split()[0]) + int(entry["Shared_Clean"].split()[0])
        assert shared_kb == 0, f"the parent's buffer has {shared_kb} KiB of pages shared with the child: {entry}"
