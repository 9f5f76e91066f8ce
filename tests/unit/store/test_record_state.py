"""A record's movement state (tiered/store/record_state.py, Record in tiered/store/records.py), without any I/O.

Records are built directly and driven through their moves by ``begin`` / ``advance`` / ``end``: no store, no
engine, no files, no pool (a host buffer is a stand-in holding a tensor). The table of legal moves is written
out again here, on purpose: changing ``TRANSITIONS`` must change this test too.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from tiered.store.record_state import TRANSITIONS, Move, TransitionError, check_transition
from tiered.store.records import Record

LEGAL = {
    (Move.IDLE, Move.ACQUIRING),  # a load starts: waiting for a host buffer
    (Move.IDLE, Move.WRITE),  # a write-back starts
    (Move.IDLE, Move.MOVE),  # a synchronous move: copy-in, GPU move, flush of an HBM record
    (Move.QUEUED, Move.ACQUIRING),  # its room came, or a blocking call takes the prefetch over
    (Move.QUEUED, Move.IDLE),  # the queued prefetch is cancelled
    (Move.ACQUIRING, Move.LOAD),  # the buffer is taken: the read starts
    (Move.ACQUIRING, Move.QUEUED),  # no room yet, but write-backs in flight will free it
    (Move.ACQUIRING, Move.IDLE),  # no room and none coming, or taking a buffer failed
    (Move.LOAD, Move.IDLE),
    (Move.WRITE, Move.IDLE),
    (Move.MOVE, Move.IDLE),
}
# From a new (IDLE) record to each state, by legal moves only.
PATH = {
    Move.IDLE: [],
    Move.ACQUIRING: [Move.ACQUIRING],
    Move.QUEUED: [Move.ACQUIRING, Move.QUEUED],
    Move.LOAD: [Move.ACQUIRING, Move.LOAD],
    Move.WRITE: [Move.WRITE],
    Move.MOVE: [Move.MOVE],
}


def record(nbytes: int = 16) -> Record:
    return Record("k", "/nonexistent/records/k.bin", (nbytes // 4,), torch.float32, nbytes)


def buffer(nbytes: int = 16) -> SimpleNamespace:
    """A stand-in for a pool buffer: the record only needs its ``tensor``."""
    return SimpleNamespace(tensor=torch.zeros(nbytes, dtype=torch.uint8))


def step(rec: Record, new: Move) -> Future[None] | None:
    """Drive ``rec`` to ``new`` through the Record API the tiers use."""
    if new is Move.IDLE:
        return rec.end()
    if rec.idle:
        return rec.begin_write(release=True) if new is Move.WRITE else rec.begin(new)
    rec.advance(new)
    return rec.op


def drive(rec: Record, to: Move) -> Record:
    for m in PATH[to]:
        step(rec, m)
    assert rec.kind is to
    return rec


def check_invariants(rec: Record) -> None:
    assert (rec.op is None) == (rec.kind is Move.IDLE), "a record has a future exactly while it moves"
    assert rec.idle == (rec.kind is Move.IDLE)
    if rec.kind is not Move.WRITE:
        assert not rec.keep and not rec.releasing, "keep and releasing belong to a write-back only"


# --------------------------------------------------------------------------------------------- the table
def test_the_table_is_the_documented_one():
    assert set(TRANSITIONS) == set(Move), "every state has a row"
    assert {(a, b) for a, bs in TRANSITIONS.items() for b in bs} == LEGAL


def test_every_state_is_reachable_and_every_movement_can_end():
    reach, frontier = {Move.IDLE}, [Move.IDLE]
    while frontier:
        nxt = [b for a in frontier for b in TRANSITIONS[a] if b not in reach]
        reach |= set(nxt)
        frontier = nxt
    assert reach == set(Move)
    assert all(Move.IDLE in TRANSITIONS[m] for m in Move if m is not Move.IDLE)
    assert Move.IDLE not in TRANSITIONS[Move.IDLE], "ending a movement that never began is a bug"


@pytest.mark.parametrize(("old", "new"), list(itertools.product(Move, Move)), ids=lambda m: m.name)
def test_check_transition_allows_exactly_the_table(old, new):
    if (old, new) in LEGAL:
        check_transition(old, new)
    else:
        with pytest.raises(TransitionError, match=f"{old.name}.*{new.name}") as info:
            check_transition(old, new)
        assert isinstance(info.value, AssertionError), "an illegal move is a bug in the store"


def test_the_old_string_kinds_are_refused():
    with pytest.raises(TransitionError):
        check_transition(Move.IDLE, "load")  # type: ignore[arg-type]
    assert repr(Move.LOAD) == "Move.LOAD"


# --------------------------------------------------------------------------------------------- a Record
def test_a_new_record_is_idle_on_nvme():
    rec = record()
    assert rec.kind is Move.IDLE and rec.idle and rec.op is None
    assert not rec.keep and not rec.releasing
    assert (rec.tier, rec.in_host, rec.evictable) == ("nvme", False, False)


def test_a_load_acquires_queues_loads_and_ends_with_one_future():
    rec = record()
    fut = rec.begin(Move.ACQUIRING)
    assert isinstance(fut, Future) and rec.op is fut and not fut.done() and fut.running()
    rec.advance(Move.QUEUED)  # no room yet
    rec.advance(Move.ACQUIRING)  # the room came
    rec.buf = buffer()
    rec.advance(Move.LOAD)
    assert rec.op is fut, "the steps of one movement share its future"
    assert (rec.tier, rec.in_host, rec.evictable) == ("nvme", False, False), "a buffer being read holds nothing yet"
    assert rec.end() is fut and not fut.done(), "the caller resolves the future, outside the lock"
    assert rec.idle and rec.op is None
    assert (rec.tier, rec.in_host, rec.evictable) == ("host", True, True)
    assert torch.equal(rec.view(), torch.zeros(4))
    rec.pins = 1
    assert rec.in_host and not rec.evictable, "a pinned record stays"


def test_a_prefetch_that_finds_no_room_ends_without_loading():
    rec = record()
    fut = rec.begin(Move.ACQUIRING)
    assert rec.end() is fut and rec.idle and rec.tier == "nvme"
    fut2 = rec.begin(Move.ACQUIRING)
    rec.advance(Move.QUEUED)
    assert rec.end() is fut2 and fut2 is not fut, "a cancelled prefetch; a new movement gets a new future"


def test_a_write_back_keeps_the_bytes_readable_and_its_flags_end_with_it():
    rec = record()
    rec.buf, rec.on_disk, rec.dirty = buffer(), True, True
    fut = rec.begin_write(release=True)
    assert rec.kind is Move.WRITE and rec.op is fut and rec.releasing and not rec.keep
    assert not rec.on_disk, "until the write lands the file may be half old, half new"
    assert (rec.tier, rec.in_host, rec.evictable) == ("host", True, False)
    rec.want_in_host()
    assert rec.keep, "someone wants it in host: the write-back keeps the buffer"
    assert rec.end() is fut
    assert rec.idle and not rec.keep and not rec.releasing
    assert rec.evictable
    rec.begin_write(release=False)
    assert not rec.releasing
    rec.end()


def test_want_in_host_changes_nothing_outside_a_write_back():
    for kind in Move:
        if kind is Move.WRITE:
            continue
        rec = drive(record(), kind)
        rec.want_in_host()
        assert not rec.keep, kind


def test_a_synchronous_move_hides_the_record_from_eviction_and_host_hits():
    rec = record()
    rec.buf = buffer()
    fut = rec.begin(Move.MOVE)
    assert (rec.tier, rec.in_host, rec.evictable) == ("nvme", False, False), "its bytes are on the move"
    rec.buf, rec.gpu = None, torch.zeros(4)  # a GPU move up landed
    assert rec.tier == "gpu"
    assert rec.end() is fut and rec.tier == "gpu" and not rec.in_host and not rec.evictable


# What each state says about a record, with a host buffer, an HBM tensor, or only its file.
IN_HOST_WITH_BUF = {Move.IDLE, Move.WRITE}  # the buffer holds the bytes (a write-back only reads them)
EVICTABLE_WITH_BUF = {Move.IDLE}


@pytest.mark.parametrize("kind", list(Move), ids=lambda m: m.name)
@pytest.mark.parametrize("where", ["buf", "gpu", "file"])
def test_in_host_evictable_and_tier_in_each_state(kind, where):
    rec = drive(record(), kind)
    if where == "buf":
        rec.buf = buffer()
    elif where == "gpu":
        rec.gpu = torch.zeros(4)
    in_host = where == "buf" and kind in IN_HOST_WITH_BUF
    assert rec.in_host == in_host
    assert rec.evictable == (where == "buf" and kind in EVICTABLE_WITH_BUF)
    assert rec.tier == ("gpu" if where == "gpu" else "host" if in_host else "nvme")
    rec.pins = 2
    assert not rec.evictable and rec.in_host == in_host, "pins hold a record, whatever its state"


@pytest.mark.parametrize(
    ("start", "call"),
    [
        (Move.IDLE, lambda r: r.begin(Move.LOAD)),  # a load starts by acquiring a buffer
        (Move.IDLE, lambda r: r.begin(Move.QUEUED)),  # only a load that found no room is queued
        (Move.IDLE, lambda r: r.advance(Move.LOAD)),
        (Move.IDLE, lambda r: r.end()),  # nothing to end
        (Move.LOAD, lambda r: r.begin(Move.MOVE)),  # one movement at a time
        (Move.WRITE, lambda r: r.begin_write(release=False)),
        (Move.WRITE, lambda r: r.advance(Move.LOAD)),
        (Move.MOVE, lambda r: r.advance(Move.QUEUED)),
        (Move.QUEUED, lambda r: r.advance(Move.LOAD)),  # a queued prefetch acquires its buffer first
        (Move.LOAD, lambda r: r.advance(Move.QUEUED)),
    ],
)
def test_illegal_moves_raise_and_change_nothing(start, call):
    rec = drive(record(), start)
    before = (rec.kind, rec.op, rec.keep, rec.releasing, rec.on_disk)
    with pytest.raises(TransitionError):
        call(rec)
    assert (rec.kind, rec.op, rec.keep, rec.releasing, rec.on_disk) == before
    check_invariants(rec)


@pytest.mark.parametrize("start", [Move.QUEUED, Move.ACQUIRING, Move.LOAD, Move.WRITE, Move.MOVE], ids=lambda m: m.name)
def test_advance_never_ends_a_movement(start):
    rec = drive(record(), start)
    with pytest.raises(ValueError, match="end()"):
        rec.advance(Move.IDLE)
    assert rec.kind is start


def test_every_legal_walk_keeps_the_invariants():
    # Every sequence of up to six legal moves from a new record, through the API the tiers use.
    walks = [[Move.IDLE]]
    seen = 0
    for _ in range(6):
        walks = [w + [b] for w in walks for b in TRANSITIONS[w[-1]]]
        for w in walks:
            rec, futures = record(), []
            for m in w[1:]:
                fut = step(rec, m)
                check_invariants(rec)
                assert rec.kind is m
                if m is not Move.IDLE:
                    futures.append(fut)
                    assert fut is rec.op
                else:
                    assert fut is futures[-1], "end() hands back the future the movement began with"
            seen += 1
    assert seen > 50
