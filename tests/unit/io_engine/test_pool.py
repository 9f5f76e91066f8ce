"""Acceptance tests for `PinnedBufferPool` / `PooledBuffer` (docs/internals.md, io_engine).

Blocking behaviour is checked with events and bounded joins, never with elapsed-time assertions: a
broken pool fails a test, it does not hang the suite.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
from helpers import TIMEOUT, run_bounded

from io_engine import IOConfig, PinnedBufferPool, PooledBuffer, pool_bytes
from io_engine.errors import PoolExhaustedError


@pytest.fixture
def pool():
    p = PinnedBufferPool(64 * 1024)
    yield p
    p.close()


def span(buf: PooledBuffer) -> tuple[int, int]:
    start = buf.tensor.data_ptr()
    return start, start + buf.tensor.numel()


# --------------------------------------------------------------------------------------- shape and alignment


@pytest.mark.parametrize("nbytes", [1, 100, 4095, 4096, 4097, 65537, 2**20 + 3])
def test_buffer_is_aligned_uint8_cpu_of_exact_size(nbytes):
    p = PinnedBufferPool(4 * 2**20)
    try:
        buf = p.acquire(nbytes)
        assert isinstance(buf, PooledBuffer)
        t = buf.tensor
        assert t.dtype == torch.uint8 and t.device.type == "cpu"
        assert t.dim() == 1 and t.numel() == nbytes and t.is_contiguous()
        assert t.data_ptr() % 4096 == 0
        t.fill_(7)  # the memory is usable end to end
        assert int(t[-1]) == 7
        buf.release()
    finally:
        p.close()


def test_buffers_held_together_are_aligned_and_disjoint():
    p = PinnedBufferPool(1 * 2**20)
    try:
        bufs = [p.acquire(n) for n in (1, 4097, 12345, 4096, 99999)]
        for b in bufs:
            assert b.tensor.data_ptr() % 4096 == 0
        spans = sorted(span(b) for b in bufs)
        for (_, end), (start, _) in zip(spans[:-1], spans[1:], strict=True):
            assert end <= start, "two live buffers overlap"
    finally:
        p.close()


@pytest.mark.parametrize("alignment", [512, 4096, 8192, 65536])
def test_custom_alignment(alignment):
    # The contract puts no ceiling on alignment. Whatever IOConfig accepts as an alignment (the store
    # hands the config's alignment to its pool), the pool must honour.
    try:
        IOConfig(alignment=alignment, block_size=max(alignment, 2**20))
    except ValueError:
        with pytest.raises(ValueError):
            PinnedBufferPool(2**20, alignment=alignment)
        return
    p = PinnedBufferPool(2**20, alignment=alignment)
    try:
        bufs = [p.acquire(n) for n in (1, 5000, 70000)]
        for b in bufs:
            assert b.tensor.data_ptr() % alignment == 0
    finally:
        p.close()


def test_capacity_attribute_and_in_use_accounting(pool):
    assert pool.capacity == 64 * 1024
    assert pool.in_use == 0
    a = pool.acquire(16384)
    assert pool.in_use >= 16384
    b = pool.acquire(8192)
    assert pool.in_use >= 16384 + 8192
    a.release()
    b.release()
    assert pool.in_use == 0


@pytest.mark.parametrize("bad", [-1, -4096, "lots"])
def test_invalid_capacity_raises(bad):
    with pytest.raises(ValueError):
        PinnedBufferPool(bad)


# --------------------------------------------------------------------------------------------------- budget


def test_budget_is_a_hard_limit(pool):
    a = pool.try_acquire(32 * 1024)
    b = pool.try_acquire(32 * 1024)
    assert a is not None and b is not None
    assert pool.in_use == 64 * 1024
    assert pool.try_acquire(1) is None, "the budget is full: try_acquire must not over-commit"
    a.release()
    c = pool.try_acquire(32 * 1024)
    assert c is not None
    assert pool.in_use <= pool.capacity


def test_acquire_of_exactly_capacity_succeeds_when_empty(pool):
    buf = run_bounded(lambda: pool.acquire(pool.capacity, timeout=TIMEOUT))
    assert buf.tensor.numel() == pool.capacity


@pytest.mark.parametrize("capacity", [10000, 3 * 4096 + 1])
def test_buffers_are_charged_in_whole_pages(capacity):
    # A buffer takes whole pages of memory, and the budget is a hard limit on memory, so a buffer is
    # charged its page-rounded size: in a budget that is not a page multiple, the largest buffer is the
    # budget rounded down to pages, and pool_bytes() says what a set of buffers needs.
    pages = capacity // 4096 * 4096
    p = PinnedBufferPool(capacity)
    try:
        with pytest.raises(ValueError, match="whole pages"):
            p.acquire(capacity)
        buf = run_bounded(lambda: p.acquire(pages - 7, timeout=TIMEOUT))
        assert buf.tensor.numel() == pages - 7
        assert p.in_use == pages <= p.capacity
    finally:
        p.close()
    sizes = [1, 4095, 4097, 12289]
    with PinnedBufferPool(pool_bytes(sizes)) as q:
        held = [q.try_acquire(n) for n in sizes]
        assert all(b is not None for b in held)
        assert q.try_acquire(1) is None


def test_nbytes_larger_than_capacity_raises_value_error_at_once(pool):
    # timeout=None: a pool that waited here would wait forever; run_bounded turns that into a failure.
    with pytest.raises(ValueError):
        run_bounded(lambda: pool.acquire(pool.capacity + 1))


def test_negative_nbytes_raises_value_error(pool):
    with pytest.raises(ValueError):
        run_bounded(lambda: pool.acquire(-1))


def test_timeout_raises_pool_exhausted_which_is_a_timeout_error(pool):
    held = pool.acquire(pool.capacity)
    with pytest.raises(PoolExhaustedError) as info:
        run_bounded(lambda: pool.acquire(4096, timeout=0.05))
    assert isinstance(info.value, TimeoutError)
    assert pool.in_use == pool.capacity, "a failed acquire must not leak budget"
    held.release()
    assert pool.in_use == 0


def test_try_acquire_does_not_block(pool):
    held = pool.acquire(pool.capacity)
    assert run_bounded(lambda: pool.try_acquire(4096)) is None
    held.release()


def test_acquire_blocks_until_another_thread_releases(pool):
    held = pool.acquire(pool.capacity)
    got: dict = {}
    returned = threading.Event()

    def waiter():
        try:
            got["buf"] = pool.acquire(4096, timeout=TIMEOUT)
        except BaseException as exc:  # noqa: BLE001
            got["error"] = exc
        returned.set()

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    # A correct pool never returns here while the budget is held; a broken one returns (or errors) at once.
    assert not returned.wait(0.3), f"acquire returned while the pool was full: {got}"
    held.release()
    assert returned.wait(TIMEOUT), "acquire did not wake up after release"
    thread.join(TIMEOUT)
    assert "error" not in got, got.get("error")
    assert got["buf"].tensor.numel() == 4096
    assert got["buf"].tensor.data_ptr() % 4096 == 0
    got["buf"].release()


def test_a_nudge_ends_a_wait_that_passed_since_and_no_other(pool):
    """``acquire(since=n)`` stops waiting once ``nudge()`` moves ``nudges`` past n (a nudge sent before the call
    counts: no wake is lost between reading ``nudges`` and waiting); a wait without ``since`` sleeps on."""
    held = pool.acquire(pool.capacity)
    stale = pool.nudges
    pool.nudge()
    with pytest.raises(PoolExhaustedError, match="nudged"):  # at once, not after the timeout
        run_bounded(lambda: pool.acquire(4096, timeout=10 * TIMEOUT, since=stale))
    got: dict = {}
    woke = {name: threading.Event() for name in ("since", "plain")}

    def waiter(name: str, **kw) -> None:
        try:
            got[name] = pool.acquire(4096, timeout=TIMEOUT, **kw)
        except BaseException as exc:  # noqa: BLE001 - checked below
            got[name] = exc
        woke[name].set()

    threads = [threading.Thread(target=waiter, args=("since",), kwargs={"since": pool.nudges}, daemon=True),
               threading.Thread(target=waiter, args=("plain",), daemon=True)]  # fmt: skip
    for t in threads:
        t.start()
    assert not woke["since"].wait(0.3), got  # nothing nudged yet: it waits
    pool.nudge()
    assert woke["since"].wait(TIMEOUT) and isinstance(got["since"], PoolExhaustedError)
    assert not woke["plain"].is_set()  # the wait without since still waits for a buffer
    held.release()
    assert woke["plain"].wait(TIMEOUT) and isinstance(got["plain"], PooledBuffer)
    got["plain"].release()
    for t in threads:
        t.join(TIMEOUT)
    assert pool.in_use == 0


def test_concurrent_acquire_release_never_exceeds_budget_or_overlaps():
    capacity = 256 * 1024
    p = PinnedBufferPool(capacity)
    lock = threading.Lock()
    live: dict[int, tuple[int, int, int]] = {}  # id -> (start, end, nbytes), as seen by the test
    violations: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for i in range(150):
            n = rng.randint(1, capacity // 3)
            buf = p.acquire(n, timeout=TIMEOUT)
            start, end = span(buf)
            key = (seed << 20) | i
            with lock:
                total = sum(v[2] for v in live.values()) + n
                if total > capacity:
                    violations.append(f"held {total} > capacity {capacity}")
                for s, e, _ in live.values():
                    if start < e and s < end:
                        violations.append("live buffers overlap")
                if p.in_use > capacity:
                    violations.append(f"in_use {p.in_use} > capacity")
                live[key] = (start, end, n)
            pattern = seed & 0xFF
            buf.tensor.fill_(pattern)
            if not bool((buf.tensor == pattern).all()):
                violations.append("buffer contents changed under its owner")
            with lock:
                del live[key]
            buf.release()

    threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in range(1, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 2)
        assert not t.is_alive(), "a worker hung (deadlock or lost wake-up)"
    assert not violations, violations[:5]
    assert p.in_use == 0
    p.close()


# ---------------------------------------------------------------------------------- release, with, view


def test_release_is_idempotent(pool):
    a = pool.acquire(16384)
    b = pool.acquire(8192)
    a.release()
    a.release()
    a.release()
    assert pool.in_use >= 8192, "a repeated release must not free budget held by another buffer"
    assert pool.try_acquire(pool.capacity - 8192) is not None
    assert pool.try_acquire(1) is None
    b.release()


def test_pooled_buffer_is_a_context_manager(pool):
    buf = pool.acquire(4096)
    with buf as entered:
        assert entered is buf
        assert pool.in_use >= 4096
    assert pool.in_use == 0
    buf.release()  # releasing after the with-block is still harmless
    assert pool.in_use == 0


def test_context_manager_releases_on_exception(pool):
    with pytest.raises(KeyError):
        with pool.acquire(4096):
            raise KeyError("boom")
    assert pool.in_use == 0


def test_view_shares_memory_with_the_buffer(pool):
    buf = pool.acquire(4096)
    v = buf.view(torch.float32, (32, 32))
    assert v.dtype == torch.float32 and tuple(v.shape) == (32, 32)
    assert v.data_ptr() == buf.tensor.data_ptr()
    v.fill_(1.5)
    assert torch.equal(buf.tensor[:4], torch.tensor([0, 0, 192, 63], dtype=torch.uint8))
    b16 = buf.view(torch.bfloat16, (2048,))
    assert b16.numel() == 2048 and b16.data_ptr() == buf.tensor.data_ptr()
    buf.release()


@pytest.mark.parametrize("frees", ["trim", "close", "room_for_another_size"])
def test_a_released_buffer_still_referenced_lets_the_pool_unmap_its_block(frees):
    """A released buffer kept in a variable or a list held its tensor, whose storage holds an export of the block's
    mapping: the pool freeing the block (``trim()``, ``close()``, or room for a buffer of another size) met
    BufferError on its unmap, so the memory stayed resident while the pool counted it freed, past the budget."""
    p = PinnedBufferPool(8 * 4096)
    kept = p.acquire(8 * 4096)
    block = kept._block
    kept.release()
    if frees == "trim":
        p.trim()
    elif frees == "close":
        p.close()
    else:
        p.acquire(4096).release()  # no room beside the idle block: it goes
    assert p.in_use == 0 and p.idle_bytes == (4096 if frees == "room_for_another_size" else 0)
    assert block.mm.closed, "the pool counts the block as freed: its memory must be unmapped, not left behind"
    assert kept.nbytes == 8 * 4096  # the handle lived through it all
    p.close()


def test_a_released_buffers_tensor_raises_and_never_reaches_the_next_loan_of_its_block(pool):
    buf = pool.acquire(8192)
    start = buf.tensor.data_ptr()
    buf.release()
    again = pool.acquire(8192)
    assert again.tensor.data_ptr() == start  # the same block, lent again
    with pytest.raises(ValueError, match="released"):
        buf.tensor  # noqa: B018 - the access itself raises
    with pytest.raises(ValueError, match="released"):
        buf.view(torch.float32)
    again.release()


def test_view_larger_than_buffer_raises(pool):
    # The contract does not say which error; the style guide prefers ValueError at the boundary.
    buf = pool.acquire(4096)
    with pytest.raises((ValueError, RuntimeError)):
        buf.view(torch.float32, (1025,))
    buf.release()


# ----------------------------------------------------------------------------------------------- close


def test_acquire_after_close_raises():
    p = PinnedBufferPool(65536)
    p.close()
    with pytest.raises(RuntimeError):
        run_bounded(lambda: p.acquire(4096))


def test_release_after_close_is_harmless():
    p = PinnedBufferPool(65536)
    buf = p.acquire(4096)
    p.close()
    buf.release()
    buf.release()
    assert p.in_use == 0 and p.idle_bytes == 0  # freed, not kept for reuse by a closed pool


def test_close_wakes_a_blocked_acquire():
    # A thread waiting for budget must not sleep forever once the pool is gone.
    p = PinnedBufferPool(65536)
    p.acquire(65536)
    box: dict = {}
    done = threading.Event()

    def waiter():
        try:
            box["value"] = p.acquire(4096)
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc
        done.set()

    threading.Thread(target=waiter, daemon=True).start()
    assert not done.wait(0.2)
    p.close()
    assert done.wait(TIMEOUT), "acquire stayed blocked after close()"
    assert isinstance(box.get("error"), RuntimeError), box


# ------------------------------------------------------------------------------------------------- pinning


@pytest.mark.gpu
def test_default_pins_when_cuda_is_available():
    p = PinnedBufferPool(65536)
    try:
        buf = p.acquire(4096)
        assert buf.tensor.is_pinned()
        assert buf.tensor.data_ptr() % 4096 == 0
    finally:
        p.close()


@pytest.mark.gpu
def test_pin_false_gives_pageable_memory():
    p = PinnedBufferPool(65536, pin=False)
    try:
        assert not p.acquire(4096).tensor.is_pinned()
    finally:
        p.close()


def test_made_bytes_counts_new_buffers_only_in_whole_pages():
    """``made_bytes``/``made_s``: what mapping (and pinning) new buffers cost; a reused buffer costs nothing."""
    pool = PinnedBufferPool(1 << 20, pin=False)
    assert pool.made_bytes == 0 and pool.made_s == 0.0
    pool.acquire(5000).release()
    assert pool.made_bytes == 8192 and pool.made_s > 0
    made_s = pool.made_s
    pool.acquire(5000).release()  # the idle block of that size comes back
    assert pool.made_bytes == 8192 and pool.made_s == made_s
    pool.acquire(3 * 4096).release()  # a new size: a new block
    assert pool.made_bytes == 8192 + 3 * 4096
    pool.close()
