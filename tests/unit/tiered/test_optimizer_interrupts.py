"""Ctrl-C at the edges of TieredOptimizer's calls: a step that a Ctrl-C let finish, and what it leaves of the dicts
``opt.state[p]`` handed out before it; ``close()``, which runs once, so must not stop part-way; and reads of the
state on NVMe (``state_dict()``), whose waits must not swallow the interrupt. And the preemption signals (SIGTERM,
SIGUSR1, ...), whose handlers save: held until the step or load ends, as a Ctrl-C is.

Real signals sent from inside the call, as in test_optimizer_lifecycle.py's step tests and test_optimizer_loads.py;
the loads' own Ctrl-C case is there.
"""

from __future__ import annotations

import errno
import itertools
import os
import signal
import sys
import threading

import pytest
import torch
from helpers import run_script
from test_optimizer_lifecycle import KW, backward, mlp, train  # the same small model and loop

from tiered import TieredOptimizer, TieredStore, interrupts
from tiered.interrupts import Sigint, deferred_sigint
from tiered.optimizer import OptimizerBrokenError

# Signals go to the main thread itself: one sent to the process may be taken by another thread (the I/O threads), and
# Python then runs its handler a little later, when the main thread next looks, after the line that checks it.
MAIN = threading.main_thread().ident


def ctrl_c() -> None:
    signal.pthread_kill(MAIN, signal.SIGINT)  # a real Ctrl-C: Python raises it in the main thread unless it is held


def test_a_step_a_ctrl_c_let_finish_still_leaves_the_dicts_read_before_it_stale(tmp_path, monkeypatch):
    # The Ctrl-C is raised as the step ends: a dict read before it must be stale all the same, its write after the
    # step refused by name, not loaded over the step's state (it undid the step's update of exp_avg, silently).
    ref, model = mlp(), mlp()
    with (
        TieredOptimizer(ref, tmp_path / "ref", **KW) as ref_opt,
        TieredOptimizer(model, tmp_path / "nvme", **KW) as opt,
    ):
        train(ref, ref_opt, range(2))
        train(model, opt, range(1))
        held = opt.state[model[0].weight]
        real = opt.chunked_state.updater.update

        def update_and_interrupt(*a, **k):
            monkeypatch.setattr(opt.chunked_state.updater, "update", real)
            ctrl_c()
            return real(*a, **k)

        monkeypatch.setattr(opt.chunked_state.updater, "update", update_and_interrupt)
        backward(model, 1)
        with pytest.raises(KeyboardInterrupt):
            opt.step()
        assert opt.global_step == 2
        opt.zero_grad()
        held["exp_avg"].mul_(0.5)
        with pytest.raises(RuntimeError, match="before the last step"):
            opt.state[model[0].weight]
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(opt.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"])  # the write was not applied


def test_every_press_inside_a_nested_block_counts_in_the_outer_one():
    # A block inside another (a store load's hand-over inside a step) handed the outer one a single press however
    # many it held: two Ctrl-Cs there read as one, and the step they should have stopped ran to its end.
    with pytest.raises(KeyboardInterrupt):
        with deferred_sigint() as outer:
            with deferred_sigint() as inner:
                ctrl_c()
                ctrl_c()
                assert inner.pressed() == 2
            assert outer.pressed() == 2


def test_a_block_letting_signals_through_holds_them_again_first_thing_in_its_finally(handler_for):
    # The store's releases (a pin's end after its body, a flush's after its writes) opened a hold of their own in a
    # finally: a press pending there raised before it was in place, and the release never ran. One block, opened
    # before the try, lets signals through as if nothing held them, and holds them again from an assignment.
    ran = []
    handler_for(signal.SIGTERM, lambda signum, frame: ran.append(signum))
    released = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_sigint(lets_through=True) as sigint:
            try:
                sigint.through = True
                signal.pthread_kill(MAIN, signal.SIGTERM)
                assert ran == [signal.SIGTERM], "held where the block lets signals through"
                with deferred_sigint() as inner:  # a block inside holds on its own
                    ctrl_c()
                    assert inner.pressed() == 1 and inner is not sigint
                pytest.fail("the inner block's press was not raised")
            finally:
                sigint.through = False
                ctrl_c()
                ctrl_c()
                released.append(sigint.pressed())
    assert released == [2]
    with pytest.raises(KeyboardInterrupt):
        with deferred_sigint() as outer:
            with deferred_sigint(lets_through=True) as nested:
                nested.through = True  # nested in a block that holds: changes nothing of the outer's
                ctrl_c()
                assert outer.pressed() == 1 and not outer.through
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


class PressAtCall:
    """A ``sys.setprofile`` hook: a real Ctrl-C at the ``k``-th call (Python's or C's) after ``undo_whole``'s own,
    unless a block holds Ctrl-C by then (``fired`` stays False: the sweep has passed the hold's opening)."""

    def __init__(self, k: int) -> None:
        self.k, self.fired = k, False

    def __call__(self, frame, event, arg) -> None:
        if event not in ("call", "c_call") or frame.f_code is interrupts.undo_whole.__code__:
            return
        if isinstance(getattr(signal.getsignal(signal.SIGINT), "__self__", None), Sigint):
            sys.setprofile(None)  # held from here on
        elif self.k == 0:
            sys.setprofile(None)
            self.fired = True
            ctrl_c()  # Python raises it here, at the call
        else:
            self.k -= 1


def test_an_undo_runs_whole_when_a_ctrl_c_is_pending_as_it_begins():
    # A pin taken on a worker and released on the main thread has no block of this thread to hold its release: the
    # hold opened there comes too late for a press already pending, which raised before it was in place, and the
    # release never ran. Swept over every call from the helper's first to the hold in place.
    for k in range(1000):
        undone, hook = [], PressAtCall(k)
        try:
            sys.setprofile(hook)
            interrupts.undo_whole(undone.append, "released")
        except KeyboardInterrupt:
            assert hook.fired, "a Ctrl-C nobody pressed"
        else:
            assert not hook.fired, "the press was lost"
        finally:
            sys.setprofile(None)
        assert undone == ["released"], f"pressed at call {k}"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        if not hook.fired:
            break
    assert k > 0 and not hook.fired, "the sweep never reached the hold"


def test_a_ctrl_c_during_an_undo_is_raised_once_it_has_run():
    undone = []

    def undo():
        ctrl_c()
        ctrl_c()
        undone.append("released")

    with pytest.raises(KeyboardInterrupt):
        interrupts.undo_whole(undo)
    assert undone == ["released"]
    with pytest.raises(OSError, match="the undo's own"):  # and its own error is raised, the undo not run again
        interrupts.undo_whole(lambda: (undone.append("again"), _raise(OSError("the undo's own"))))
    assert undone == ["released", "again"]


def _raise(e: BaseException) -> None:
    raise e


def test_a_second_ctrl_c_during_a_reads_hand_over_still_stops_the_step(tmp_path, monkeypatch):
    # README: a second Ctrl-C in the same step stops it at the next chunk boundary, the optimizer broken. Both
    # presses landing while a record's read was handed to the I/O threads (a wait for queue room) counted as one.
    model = mlp()
    with TieredOptimizer(model, tmp_path, **KW) as opt:
        train(model, opt, range(1))
        # The first step's write-backs land first: with no read left queued behind them, the step's first on-disk
        # chunk (spread_disk puts one first) is read from the main thread as the step begins, not from a mover
        # thread or at the step's end (on a loaded machine the presses came after the last chunk boundary, or in close)
        opt.store._state.settle()
        io = opt.store._state.io
        real, pressed = io.pread, []

        def pread(*a, **k):
            if not pressed and threading.current_thread() is threading.main_thread():
                pressed.append(1)
                ctrl_c()
                ctrl_c()
            return real(*a, **k)

        monkeypatch.setattr(io, "pread", pread)
        backward(model, 1)
        with pytest.raises(KeyboardInterrupt):
            opt.step()
        assert pressed
        assert opt.global_step == 1  # stopped, not run to its end
        with pytest.raises(OptimizerBrokenError, match="stopped part-way"):
            opt.step()


@pytest.mark.parametrize("interrupt", ["Ctrl-C", "SystemExit"])
def test_an_interrupt_inside_close_still_releases_everything(tmp_path, monkeypatch, interrupt):
    # close() runs once (the optimizer reads closed from its start; a second close() and the exit hook do nothing):
    # stopped part-way, it left the folder with the state files and ~35 I/O threads for good. A Ctrl-C is held until
    # all is released; another interrupt (a SIGTERM handler's SystemExit) is raised once all is.
    before = set(threading.enumerate())
    model = mlp()
    opt = TieredOptimizer(model, tmp_path, **KW)
    train(model, opt, range(1))
    real, hit = TieredStore.delete, []

    def delete(self, key):
        if not hit:
            hit.append(key)
            if interrupt == "Ctrl-C":
                ctrl_c()
            else:
                raise SystemExit(143)
        return real(self, key)

    monkeypatch.setattr(TieredStore, "delete", delete)
    with pytest.raises(KeyboardInterrupt if interrupt == "Ctrl-C" else SystemExit):
        opt.close()
    assert hit and opt.closed
    assert os.listdir(tmp_path) == []
    assert opt.store._closed
    assert not [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    opt.close()  # and again: nothing to do


def test_a_sigterm_inside_close_writes_nothing_into_the_folder_it_removes(tmp_path, monkeypatch):
    # Stopped part-way through deleting the records (a SIGTERM handler's SystemExit), close() still closed the
    # store, which first wrote every dirty record left (up to host_budget bytes) into the folder removed right after;
    # on a full disk it logged that write's failure.
    model = mlp()
    opt = TieredOptimizer(model, tmp_path, **KW)
    train(model, opt, range(2))
    opt.store._state.settle()  # the step's own write-backs land first: only close() may write after this
    io, writes = opt.store._state.io, []
    assert any(opt.store.info(k).dirty for k in opt.store.keys())

    def full(*a, **k):
        writes.append(a[1])
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    def delete(self, key):
        monkeypatch.setattr(io, "pwrite", full)
        raise SystemExit(143)  # the deletes stop at the first record

    monkeypatch.setattr(TieredStore, "delete", delete)
    with pytest.raises(SystemExit):
        opt.close()
    assert writes == [] and opt.store._closed and os.listdir(tmp_path) == []


def test_a_ctrl_c_while_state_dict_reads_the_state_reaches_the_caller(tmp_path, monkeypatch):
    # A Ctrl-C landing in a read of a record was taken for the read's failure and the read tried again: the call
    # went on, and the user had to press again. It is raised from the call, the optimizer usable and exact after.
    ref, model = mlp(), mlp()
    with (
        TieredOptimizer(ref, tmp_path / "ref", **KW) as ref_opt,
        TieredOptimizer(model, tmp_path / "nvme", **KW) as opt,
    ):
        train(ref, ref_opt, range(3))
        train(model, opt, range(2))
        io = opt.store._state.io
        real, pressed = io.pread, []

        def pread(*a, **k):
            if not pressed and threading.current_thread() is threading.main_thread():
                pressed.append(1)
                ctrl_c()
            return real(*a, **k)

        monkeypatch.setattr(io, "pread", pread)
        with pytest.raises(KeyboardInterrupt):
            opt.state_dict()
        assert pressed
        monkeypatch.undo()
        train(model, opt, range(2, 3))
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
        got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
        assert all(torch.equal(got[i][k], want[i][k]) for i in want for k in want[i])


# --------------------------------------------------------------------------- preemption signals (SIGTERM, SIGUSR1, ...)
def whole_state(model, opt) -> dict:
    """The model's weights and the optimizer's state, copied (a save of both, as a preemption handler makes)."""
    sd = opt.state_dict()
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()},
    }


def assert_same_state(got: dict, want: dict) -> None:
    assert got["model"].keys() == want["model"].keys() and got["opt"].keys() == want["opt"].keys()
    for k in want["model"]:
        assert torch.equal(got["model"][k], want["model"][k]), k
    for i in want["opt"]:
        for k in want["opt"][i]:
            assert torch.equal(got["opt"][i][k], want["opt"][i][k]), (i, k)


@pytest.fixture
def handler_for():
    """``handler_for(sig, fn)`` installs ``fn`` for ``sig`` for the test; the one before comes back after it."""
    before = {}

    def install(sig, fn):
        before.setdefault(sig, signal.getsignal(sig))
        signal.signal(sig, fn)

    yield install
    for sig, old in before.items():
        signal.signal(sig, old)


PREEMPTIONS = [signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP]  # held as Ctrl-C is (interrupts.HELD)


@pytest.mark.parametrize("sig", PREEMPTIONS, ids=lambda s: s.name)
def test_a_handler_that_saves_during_a_step_saves_the_whole_step(tmp_path, monkeypatch, handler_for, sig):
    # The preemption pattern (k8s/SLURM SIGTERM, SLURM's --signal=USR1): the handler saves, the run goes on. It ran
    # between two chunks' updates, on the thread holding the step's re-entrant lock, and saved some parameters
    # at step 3 and others at step 2, the saved step counts disagreeing with the moments; no error anywhere.
    ref, model = mlp(), mlp()
    with (
        TieredOptimizer(ref, tmp_path / "ref", **KW) as ref_opt,
        TieredOptimizer(model, tmp_path / "nvme", **KW) as opt,
    ):
        train(ref, ref_opt, range(3))
        after = whole_state(ref, ref_opt)
        train(model, opt, range(2))
        saved, calls = [], []

        def save(signum, frame):
            saved.append((signum, len(calls), opt.global_step, whole_state(model, opt)))

        handler_for(sig, save)
        real = opt.chunked_state.updater.update

        def update_and_signal(*a, **k):
            calls.append(1)
            if len(calls) == 3:
                signal.pthread_kill(MAIN, sig)  # a real signal, between two chunks' updates
                signal.pthread_kill(MAIN, sig)  # and again: merged, as the kernel merges a blocked signal's
            return real(*a, **k)

        monkeypatch.setattr(opt.chunked_state.updater, "update", update_and_signal)
        backward(model, 2)
        opt.step()
        assert len(saved) == 1, "the handler ran once"
        signum, updated, global_step, state = saved[0]
        assert signum == sig and updated == len(opt.chunks) and global_step == 3, "after the step"
        assert_same_state(state, after)
        assert signal.getsignal(sig) is save
        monkeypatch.setattr(opt.chunked_state.updater, "update", real)
        opt.zero_grad()
        train(ref, ref_opt, range(3, 4))
        train(model, opt, range(3, 4))  # and the run goes on, as the uninterrupted one
        assert_same_state(whole_state(model, opt), whole_state(ref, ref_opt))


@pytest.mark.parametrize("load", ["load_state_dict", "load_checkpoint"])
def test_a_handler_that_saves_during_a_load_saves_the_whole_load(tmp_path, monkeypatch, handler_for, load):
    # A load streams the state in chunk by chunk under the same lock: a SIGUSR1 handler's save there held the
    # first chunks loaded and the rest as before.
    src, model = mlp(), mlp()
    with (
        TieredOptimizer(src, tmp_path / "src", **KW) as src_opt,
        TieredOptimizer(model, tmp_path / "nvme", **KW) as opt,
    ):
        train(src, src_opt, range(3))
        sd = src_opt.state_dict()
        src_opt.save_checkpoint(tmp_path / "ckpt")
        want = whole_state(model, src_opt)["opt"]  # the loaded state (the model's weights are not the load's)
        train(model, opt, range(7, 8))
        saved, calls = [], []
        handler_for(signal.SIGUSR1, lambda signum, frame: saved.append(whole_state(model, opt)["opt"]))
        real = TieredStore.put if load == "load_checkpoint" else TieredStore.mark_dirty

        def write_and_signal(self, *a, **k):
            calls.append(1)
            if len(calls) == 3:
                signal.pthread_kill(MAIN, signal.SIGUSR1)
            return real(self, *a, **k)

        monkeypatch.setattr(TieredStore, real.__name__, write_and_signal)
        opt.load_state_dict(sd) if load == "load_state_dict" else opt.load_checkpoint(tmp_path / "ckpt")
        assert len(calls) >= 3 and len(saved) == 1
        assert_same_state({"model": {}, "opt": saved[0]}, {"model": {}, "opt": want})


def test_held_handlers_run_in_the_order_their_signals_came(handler_for):
    ran = []
    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGUSR2):
        handler_for(sig, lambda signum, frame: ran.append(signum))
    with deferred_sigint():
        for sig in (signal.SIGUSR2, signal.SIGTERM, signal.SIGUSR2, signal.SIGUSR1):
            signal.pthread_kill(MAIN, sig)
        assert ran == []
    assert ran == [signal.SIGUSR2, signal.SIGTERM, signal.SIGUSR1]


def test_a_held_handler_runs_at_once_in_a_wait_that_has_committed_nothing(handler_for):
    # A preemption handler that saves and exits, the main thread waiting for I/O queue room on a stalled disk
    # (the store's read hand-over, deferred_sigint(lands=waiting_for_room)): held, it ran only when the disk
    # answered, never if it hung, and the process hung until SIGKILL. It runs at once there, each time.
    ran = []
    handler_for(signal.SIGTERM, lambda signum, frame: ran.append(signum))
    waiting = [True]
    with deferred_sigint(lands=lambda: waiting[0]):
        signal.pthread_kill(MAIN, signal.SIGTERM)
        signal.pthread_kill(MAIN, signal.SIGTERM)
        assert ran == [signal.SIGTERM, signal.SIGTERM]
        waiting[0] = False  # the hand-over goes on: held again
        signal.pthread_kill(MAIN, signal.SIGTERM)
        assert len(ran) == 2
    assert len(ran) == 3


def test_a_handler_installed_inside_a_block_stays_installed(handler_for):
    # A hook (a load_state_dict post-hook, a library set up inside a step) installs its own SIGTERM handler; the
    # block's end put back the one from before it, silently.
    handler_for(signal.SIGTERM, lambda signum, frame: None)
    handler_for(signal.SIGUSR1, lambda signum, frame: None)

    def armed(signum, frame):
        pass

    with deferred_sigint():
        signal.signal(signal.SIGTERM, armed)
    assert signal.getsignal(signal.SIGTERM) is armed
    assert not isinstance(getattr(signal.getsignal(signal.SIGUSR1), "__self__", None), Sigint)


def blocks_installed(sig) -> int:
    """How many blocks' handlers are chained on ``sig``, from the top down to the first handler of no block."""
    handler, depth = signal.getsignal(sig), 0
    while isinstance(block := getattr(handler, "__self__", None), Sigint):
        handler, depth = block._others[sig], depth + 1
    return depth


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))), ids=str)
def test_blocks_letting_signals_through_that_end_out_of_order_leave_no_handler_behind(handler_for, order):
    # A save's writer holds Ctrl-C around the whole save and its store pins open their blocks on top of it, ending
    # out of order (open 0, open 1, end 0): each save left one ended handler more on SIGINT and SIGTERM for good, and
    # after some hundreds of saves a Ctrl-C raised RecursionError, not KeyboardInterrupt.
    ran = []
    handler_for(signal.SIGTERM, term := lambda signum, frame: ran.append(signum))
    for _ in range(100):
        blocks = [deferred_sigint(lets_through=True) for _ in range(3)]
        for block in blocks:
            block.__enter__().through = True
        assert blocks_installed(signal.SIGINT) == blocks_installed(signal.SIGTERM) == 3
        blocks[order[0]].__exit__(None, None, None)
        assert blocks_installed(signal.SIGINT) == blocks_installed(signal.SIGTERM) == 2
        with pytest.raises(KeyboardInterrupt):  # let through by the blocks still open, once
            ctrl_c()
        signal.pthread_kill(MAIN, signal.SIGTERM)
        assert ran == [signal.SIGTERM]
        ran.clear()
        for i in order[1:]:
            blocks[i].__exit__(None, None, None)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is term
    assert_no_block_left(term)


def test_a_ctrl_c_under_a_thousand_blocks_letting_it_through_still_raises_keyboard_interrupt(handler_for):
    # A KV cache keeps a store pin open for each page it holds in host memory (512 for one 4K-token request on an 8B
    # Llama), each a block letting signals through: a press went down their handlers one call each, and past some
    # 450 of them raised RecursionError, not KeyboardInterrupt (which a serving loop's ``except Exception`` swallowed).
    ran = []
    handler_for(signal.SIGTERM, term := lambda signum, frame: ran.append(signum))
    blocks = [deferred_sigint(lets_through=True) for _ in range(1000)]
    sigints = []
    try:
        for block in blocks:
            sigints.append(block.__enter__())
            sigints[-1].through = True  # each installs its own handler on top of the last (a store pin's body)
        assert blocks_installed(signal.SIGINT) == blocks_installed(signal.SIGTERM) == 1000
        with pytest.raises(KeyboardInterrupt):
            ctrl_c()
        signal.pthread_kill(MAIN, signal.SIGTERM)
        assert ran == [signal.SIGTERM]
        ran.clear()
        sigints[0].through = False  # the first block holds: a press goes down the other 999 and is counted there
        ctrl_c()
        signal.pthread_kill(MAIN, signal.SIGTERM)
        assert sigints[0].pressed() == 1 and ran == []
        assert all(s.pressed() == 0 for s in sigints[1:])
    finally:
        for block in reversed(blocks[1 : len(sigints)]):
            block.__exit__(None, None, None)
    with pytest.raises(KeyboardInterrupt):  # the held press, as the block that held it ends
        blocks[0].__exit__(None, None, None)
    assert ran == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert_no_block_left(term)


def test_many_saves_in_a_row_leave_ctrl_c_and_sigterm_as_they_were(tmp_path, handler_for):
    handler_for(signal.SIGTERM, term := lambda signum, frame: None)
    model = mlp()
    with TieredOptimizer(model, str(tmp_path / "nvme"), **KW) as opt:
        train(model, opt, range(1))
        for i in range(40):  # a "latest" and a "best" a step, kept under the same names
            opt.save_checkpoint(str(tmp_path / "ck" / ("latest", "best")[i % 2]))
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, f"save {i} left a handler"
            assert signal.getsignal(signal.SIGTERM) is term, f"save {i} left a handler"
        assert_no_block_left(term)


def pressing_at_swap(monkeypatch, sig, when: str, send=None, putting_back: bool = True):
    """``interrupts._swap`` sending ``send`` (a real Ctrl-C by default) to the main thread once, ``when`` ("before",
    "after") the swap of ``sig``'s handler back to its own (``putting_back``) or to the block's (not)."""
    real = interrupts._swap

    def swap(signum, handler):
        ours = isinstance(getattr(handler, "__self__", None), Sigint)
        if signum != sig or ours == putting_back:
            return real(signum, handler)
        monkeypatch.setattr(interrupts, "_swap", real)
        if when == "before":
            signal.pthread_kill(MAIN, send or signal.SIGINT)  # Python runs its handler here, at once
        old = real(signum, handler)
        if when == "after":
            signal.pthread_kill(MAIN, send or signal.SIGINT)
        return old

    monkeypatch.setattr(interrupts, "_swap", swap)


def assert_no_block_left(term_handler) -> None:
    """The handlers from before the block are back, and the next block holds Ctrl-C (it is no nested one)."""
    assert signal.getsignal(signal.SIGTERM) is term_handler
    with pytest.raises(KeyboardInterrupt):  # at once, as if no block held it
        ctrl_c()
    with pytest.raises(KeyboardInterrupt):
        with deferred_sigint() as sigint:
            ctrl_c()
            assert sigint.pressed() == 1, "a block that is over counted the press"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) is term_handler


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_ctrl_c_as_a_block_puts_its_handlers_back_leaves_none_of_them_installed(monkeypatch, handler_for, sig, when):
    # A press between two of a block's swaps back (SIGINT's handler back first, SIGTERM's not yet) raised there: the
    # block's handler stayed SIGTERM's for good (a SIGTERM swallowed, its handler never run), and every later block
    # took itself for a nested one and installed nothing (a Ctrl-C no longer held).
    ran = []

    def term(signum, frame):
        ran.append(signum)

    handler_for(signal.SIGTERM, term)
    with pytest.raises(KeyboardInterrupt):
        with deferred_sigint():
            pressing_at_swap(monkeypatch, sig, when)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    signal.pthread_kill(MAIN, signal.SIGTERM)
    assert ran == [signal.SIGTERM]
    assert_no_block_left(term)


def exits(signum, frame):  # a preemption handler's end
    raise SystemExit(128 + signum)


def test_a_handler_that_raises_as_a_block_puts_it_back_leaves_ctrl_c_working(monkeypatch, handler_for):
    # A SIGTERM landing once its handler is back, before the block's other swaps back: that handler runs there (a
    # preemption handler's sys.exit) and stops them. Ctrl-C's handler must not stay the block's, counting every
    # later press for good.
    handler_for(signal.SIGTERM, exits)
    with pytest.raises(SystemExit):
        with deferred_sigint():
            pressing_at_swap(monkeypatch, signal.SIGTERM, "after", send=signal.SIGTERM)
    assert_no_block_left(exits)


def test_a_handler_that_raises_as_a_block_begins_leaves_ctrl_c_working(monkeypatch, handler_for):
    # A SIGTERM pending as a block swaps in its handlers runs the one from before (a preemption handler's
    # sys.exit) between two swaps: the block never began, and Ctrl-C's handler stayed the block's for good.
    handler_for(signal.SIGTERM, exits)
    pressing_at_swap(monkeypatch, signal.SIGTERM, "before", send=signal.SIGTERM, putting_back=False)
    with pytest.raises(SystemExit):
        with deferred_sigint():
            pytest.fail("the block ran")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert_no_block_left(exits)


def test_a_signal_held_by_a_step_that_fails_still_reaches_its_handler(tmp_path, monkeypatch, handler_for):
    # Never lost: the step's failure propagates, and the handler (which would exit) runs as it does.
    ran = []
    handler_for(signal.SIGTERM, lambda signum, frame: ran.append(signum))
    model = mlp()
    with TieredOptimizer(model, tmp_path, **KW) as opt:
        train(model, opt, range(1))

        def update_and_fail(*a, **k):
            signal.pthread_kill(MAIN, signal.SIGTERM)
            raise OSError("the disk went away")

        monkeypatch.setattr(opt.chunked_state.updater, "update", update_and_fail)
        backward(model, 1)
        with pytest.raises(OSError, match="went away"):
            opt.step()
        assert ran == [signal.SIGTERM]


def test_a_step_swaps_only_the_handlers_it_holds(tmp_path, monkeypatch, handler_for):
    # Each held signal costs two handler swaps a step (one in, one out), and only where a Python handler is
    # installed; SIGALRM (pytest-timeout, watchdogs) is never held: its handler runs inside the step.
    for sig in PREEMPTIONS:
        handler_for(sig, signal.SIG_DFL)
    alarms = []
    handler_for(signal.SIGALRM, lambda signum, frame: alarms.append(opt.global_step))
    model = mlp()
    with TieredOptimizer(model, tmp_path, **KW) as opt:
        train(model, opt, range(1))
        real_signal, swaps = interrupts._swap, []

        def counting(sig, handler):
            swaps.append(signal.Signals(sig).name)
            return real_signal(sig, handler)

        monkeypatch.setattr(interrupts, "_swap", counting)
        train(model, opt, range(1, 2))
        assert swaps == ["SIGINT", "SIGINT"]  # the store's hand-overs inside the step install nothing
        monkeypatch.setattr(interrupts, "_swap", real_signal)
        handler_for(signal.SIGTERM, lambda signum, frame: None)
        real = opt.chunked_state.updater.update

        def update_and_alarm(*a, **k):
            if not alarms:
                signal.pthread_kill(MAIN, signal.SIGALRM)
            return real(*a, **k)

        monkeypatch.setattr(opt.chunked_state.updater, "update", update_and_alarm)
        monkeypatch.setattr(interrupts, "_swap", counting)
        swaps.clear()
        train(model, opt, range(2, 3))
        assert sorted(swaps) == ["SIGINT", "SIGINT", "SIGTERM", "SIGTERM"]
        assert alarms == [2], "SIGALRM's handler ran inside the step"


PREEMPTED = """
import os, signal, sys, torch
from tiered import TieredOptimizer
root, out = {root!r}, {out!r}
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                            torch.nn.Linear(64, 8))
opt = TieredOptimizer(model, root, **{kw!r})

def preempted(signum, frame):  # the usual preemption handler: save everything, exit
    print("saving at global_step", opt.global_step, flush=True)
    torch.save({{"model": model.state_dict(), "opt": opt.state_dict()}}, os.path.join(out, "ck.pt"))
    opt.save_checkpoint(os.path.join(out, "ckpt"))
    sys.exit(0)

signal.signal(signal.SIGTERM, preempted)
real, calls = opt.chunked_state.updater.update, []
def update(*a, **k):
    calls.append(1)
    if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGTERM)  # as the cluster's, landing in the third chunk's update of step 3
    return real(*a, **k)
for s in range(6):
    if s == 3:
        opt.chunked_state.updater.update = update
    g = torch.Generator().manual_seed(s)  # test_optimizer_lifecycle.backward
    model(torch.randn(16, 32, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
print("not preempted", flush=True)
"""


def test_a_run_preempted_by_sigterm_in_a_step_resumes_bitwise(tmp_path):
    # The handler saves (a state dict and a checkpoint) and exits: both held a torn step 3, and a run resumed from
    # either matched the uninterrupted one neither from step 3 nor from step 4.
    proc = run_script(PREEMPTED.format(root=str(tmp_path / "nvme"), out=str(tmp_path), kw=KW), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["saving at global_step 4"], proc.stdout  # once, after the whole step
    assert os.listdir(tmp_path / "nvme") == []
    ref = mlp()
    with TieredOptimizer(ref, tmp_path / "ref", **KW) as ref_opt:
        train(ref, ref_opt, range(6))
        want = whole_state(ref, ref_opt)
    for how in ("state_dict", "checkpoint"):
        model = mlp()
        with TieredOptimizer(model, tmp_path / how, **KW) as opt:
            saved = torch.load(tmp_path / "ck.pt", weights_only=False)
            model.load_state_dict(saved["model"])
            if how == "state_dict":
                opt.load_state_dict(saved["opt"])
            else:
                opt.load_checkpoint(tmp_path / "ckpt")
                assert opt.global_step == 4
            train(model, opt, range(4, 6))
            assert_same_state(whole_state(model, opt), want)
