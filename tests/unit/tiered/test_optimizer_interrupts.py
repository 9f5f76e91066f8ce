"""Ctrl-C at the edges of TieredOptimizer's calls: a step that a Ctrl-C let finish, and what it leaves of the dicts
``opt.state[p]`` handed out before it; ``close()``, which runs once, so must not stop part-way; and reads of the
state on NVMe (``state_dict()``), whose waits must not swallow the interrupt.

Real SIGINTs sent from inside the call, as in test_optimizer_lifecycle.py's step tests and test_optimizer_loads.py;
the loads' own case is there.
"""

from __future__ import annotations

import errno
import os
import signal
import threading

import pytest
import torch
from test_optimizer_lifecycle import KW, backward, mlp, train  # the same small model and loop

from tiered import TieredOptimizer, TieredStore
from tiered.interrupts import deferred_sigint
from tiered.optimizer import OptimizerBrokenError


def ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C: Python raises it in the main thread unless it is held


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


def test_a_second_ctrl_c_during_a_reads_hand_over_still_stops_the_step(tmp_path, monkeypatch):
    # README: a second Ctrl-C in the same step stops it at the next chunk boundary, the optimizer broken. Both
    # presses landing while a record's read was handed to the I/O threads (a wait for queue room) counted as one.
    model = mlp()
    with TieredOptimizer(model, tmp_path, **KW) as opt:
        train(model, opt, range(1))
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
