"""A save over an existing checkpoint that fails at its commit: after the rename or exchange that commits it (the
folder's fsync, pruning), or between the fallback's two renames (a Ctrl-C, any exception).

Before the commit point the previous checkpoint stays at the path; after it the new one is there, whole, and the
error (CheckpointCommittedError, an OSError) names the path and says so. Either way no hidden folder is left.
Kill -9 at each point is in test_checkpoint_crash.py. Also a save aborted before its commit: by a Ctrl-C, twice, or a
file that cannot be reserved.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import threading

import pytest
import torch
from helpers import TIMEOUT, wait_until
from torch import nn

from io_engine import IOConfig
from tiered import TieredOptimizer
from tiered.checkpoint import errors, fsops, hidden, inspect_checkpoint, latest_checkpoint, verify_checkpoint, writer


def _train(model: nn.Module, opt, s: int) -> None:
    g = torch.Generator().manual_seed(s)
    model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.fixture
def saved(tmp_path):
    """An optimizer at step 2 whose step-1 checkpoint is at ck/latest."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 40))
    with TieredOptimizer(model, tmp_path / "nvme", lr=1e-2, chunk_bytes="12KiB", host_budget="40KiB") as opt:
        _train(model, opt, 0)
        latest = opt.save_checkpoint(tmp_path / "ck" / "latest")
        _train(model, opt, 1)
        yield model, opt, latest


def _hidden(folder: str) -> list[str]:
    return [e for e in os.listdir(folder) if e.startswith(".")]


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "no-exchange"])
def test_a_failed_folder_fsync_after_the_commit_says_the_new_checkpoint_is_in_place(saved, monkeypatch, exchange):
    # The save raised a bare EIO naming no path; with an exchange its abort then deleted the previous checkpoint
    # (swapped to the temp folder's name) though the new one was in place; without one (NFS, Lustre, FUSE) the
    # previous one stayed under a hidden name that no later save of the process removed.
    _, opt, latest = saved
    folder = os.path.dirname(latest)
    if not exchange:
        monkeypatch.setattr(fsops, "exchange", lambda a, b: False)
    real = fsops.fsync_dir

    def failing(path):
        if path == folder:
            raise OSError(errno.EIO, "Input/output error")
        return real(path)

    monkeypatch.setattr(fsops, "fsync_dir", failing)
    said = f"{re.escape(latest)} was saved and is in place, but the fsync"
    with pytest.raises(errors.CheckpointCommittedError, match=said):
        opt.save_checkpoint(latest)
    monkeypatch.setattr(fsops, "fsync_dir", real)
    assert inspect_checkpoint(latest)["step"] == 2 and verify_checkpoint(latest)["ok"]
    assert _hidden(folder) == []  # the replaced checkpoint deleted, as by a save that succeeds
    opt.save_checkpoint(latest)
    assert os.listdir(folder) == ["latest"]


def test_a_committed_error_is_an_oserror_with_the_causes_errno(saved, monkeypatch):
    _, opt, latest = saved
    monkeypatch.setattr(fsops, "fsync_dir", lambda path: (_ for _ in ()).throw(OSError(errno.EIO, "EIO")))
    with pytest.raises(OSError) as e:
        opt.save_checkpoint(latest)
    assert e.value.errno == errno.EIO and e.value.filename == latest and isinstance(e.value.__cause__, OSError)


def test_a_failed_prune_after_the_commit_says_the_new_checkpoint_is_in_place(saved, monkeypatch):
    # keep_last: an older checkpoint that could not be deleted made a save that had committed raise a bare error.
    model, opt, latest = saved
    folder = os.path.dirname(latest)
    step1, step2 = os.path.join(folder, "step-1"), os.path.join(folder, "step-2")
    opt.save_checkpoint(step1)  # at step 2
    _train(model, opt, 2)
    rename = os.rename

    def refuse_deleting(src, dst, *args, **kw):
        if ".deleting-" in os.path.basename(dst):
            raise PermissionError(errno.EACCES, "Permission denied", src)
        return rename(src, dst, *args, **kw)

    monkeypatch.setattr(os, "rename", refuse_deleting)
    said = rf"{re.escape(step2)} was saved and is in place, but deleting step-1, an older"
    with pytest.raises(errors.CheckpointCommittedError, match=said) as e:
        opt.save_checkpoint(step2, keep_last=1)
    assert e.value.errno == errno.EACCES
    monkeypatch.setattr(os, "rename", rename)
    assert inspect_checkpoint(step2)["step"] == 3 and inspect_checkpoint(step1)["step"] == 2
    assert sorted(os.listdir(folder)) == ["latest", "step-1", "step-2"]
    opt.save_checkpoint(step2, keep_last=1)  # a later save prunes it
    assert sorted(os.listdir(folder)) == ["latest", "step-2"]


def test_an_exception_between_the_fallbacks_renames_puts_the_previous_checkpoint_back(saved, monkeypatch):
    # A KeyboardInterrupt (or any exception not an OSError) raised by the rename in: the new checkpoint was deleted
    # and the previous one stayed under its hidden name, which this process took for a save under way: for the rest
    # of the process latest_checkpoint found nothing, a load of "latest" raised CheckpointNotFoundError, and the
    # next save left the hidden copy on disk.
    _, opt, latest = saved
    folder = os.path.dirname(latest)
    monkeypatch.setattr(fsops, "exchange", lambda a, b: False)
    rename = os.rename

    def interrupted(src, dst, *args, **kw):
        if dst == latest and ".tmp-" in os.path.basename(src):
            raise KeyboardInterrupt
        return rename(src, dst, *args, **kw)

    monkeypatch.setattr(os, "rename", interrupted)
    with pytest.raises(KeyboardInterrupt):
        opt.save_checkpoint(latest)
    monkeypatch.setattr(os, "rename", rename)
    assert os.listdir(folder) == ["latest"] and inspect_checkpoint(latest)["step"] == 1
    assert latest_checkpoint(folder) == latest
    assert opt.load_checkpoint(latest)["step"] == 1
    opt.save_checkpoint(latest)
    assert os.listdir(folder) == ["latest"]


def test_a_ctrl_c_between_the_fallbacks_renames_lands_once_the_save_has_committed(saved, monkeypatch):
    # A real SIGINT arriving once the previous checkpoint is aside: held until the new one is in and the old one
    # deleted, then raised.
    _, opt, latest = saved
    folder = os.path.dirname(latest)
    monkeypatch.setattr(fsops, "exchange", lambda a, b: False)
    rename = os.rename

    def pressed(src, dst, *args, **kw):
        out = rename(src, dst, *args, **kw)
        if src == latest:
            os.kill(os.getpid(), signal.SIGINT)  # Python runs its handler before the next bytecode here
        return out

    monkeypatch.setattr(os, "rename", pressed)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, whoever started pytest
    try:
        with pytest.raises(KeyboardInterrupt):
            opt.save_checkpoint(latest)
    finally:
        signal.signal(signal.SIGINT, before)
    monkeypatch.setattr(os, "rename", rename)
    assert os.listdir(folder) == ["latest"] and inspect_checkpoint(latest)["step"] == 2
    assert verify_checkpoint(latest)["ok"]


def test_a_ctrl_c_during_the_commit_lands_once_keep_last_has_pruned(saved, monkeypatch):
    # A real SIGINT during a keep_last save's commit was raised as the commit ended, before the pruning: one
    # checkpoint more than keep_last stayed, for good where the run ended there.
    model, opt, latest = saved
    folder = os.path.dirname(latest)
    step = lambda s: os.path.join(folder, f"step-{s}")  # noqa: E731
    opt.save_checkpoint(step(1), keep_last=2)
    _train(model, opt, 2)
    opt.save_checkpoint(step(2), keep_last=2)
    _train(model, opt, 3)
    real = fsops.fsync_dir

    def pressed(path):
        if path == folder:  # the fsync that makes the rename in durable: the commit point is passed
            os.kill(os.getpid(), signal.SIGINT)
        return real(path)

    monkeypatch.setattr(fsops, "fsync_dir", pressed)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            opt.save_checkpoint(step(3), keep_last=2)
    finally:
        signal.signal(signal.SIGINT, before)
    monkeypatch.setattr(fsops, "fsync_dir", real)
    assert sorted(os.listdir(folder)) == ["latest", "step-2", "step-3"]
    assert inspect_checkpoint(step(3))["step"] == 4 and verify_checkpoint(step(3))["ok"]


def test_a_second_ctrl_c_as_an_aborted_save_cleans_up_leaves_nothing_behind(saved, monkeypatch):
    # The first press aborted the save; a second, landing as the abort removed the temporary folder, stopped it
    # there: the folder and its lock stayed, marked as under way in this process, so no later save here swept them.
    model, opt, latest = saved
    folder = os.path.dirname(latest)
    write, rmtree = writer.CheckpointWriter.write, writer.shutil.rmtree
    calls = []

    def pressed_write(self, *args, **kw):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # the first press, mid-save
        return write(self, *args, **kw)

    def pressed_rmtree(path, *args, **kw):
        os.kill(os.getpid(), signal.SIGINT)  # the second, as the abort removes the temporary folder
        return rmtree(path, *args, **kw)

    monkeypatch.setattr(writer.CheckpointWriter, "write", pressed_write)
    monkeypatch.setattr(writer.shutil, "rmtree", pressed_rmtree)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            opt.save_checkpoint(os.path.join(folder, "next"))
    finally:
        signal.signal(signal.SIGINT, before)
    monkeypatch.setattr(writer.CheckpointWriter, "write", write)
    monkeypatch.setattr(writer.shutil, "rmtree", rmtree)
    assert len(calls) >= 2 and os.listdir(folder) == ["latest"]
    opt.save_checkpoint(os.path.join(folder, "next"))
    assert sorted(os.listdir(folder)) == ["latest", "next"] and verify_checkpoint(os.path.join(folder, "next"))["ok"]


@pytest.mark.parametrize(
    "first, second",
    [("write", "close"), ("write", "abort"), ("reserve", "abort")],
    ids=["mid-write,engine-close", "mid-write,abort-begins", "reserving,abort-begins"],
)
def test_a_second_ctrl_c_before_an_aborted_saves_cleanup_leaves_nothing_behind(saved, monkeypatch, first, second):
    # The first press aborted the save (mid-write, or while its files were reserved); a second, landing while the
    # abort waited for the writes in flight (IOEngine.close), or as the abort began, left before any cleanup ran: the
    # temporary folder (its row files at full size) and its lock stayed, marked as under way in this process, so no
    # later save here swept them.
    _, opt, latest = saved
    folder = os.path.dirname(latest)
    write, reserve, abort = writer.CheckpointWriter.write, writer.reserve, writer.CheckpointWriter._abort
    firsts, seconds, under_way = [], [], set(hidden._UNDER_WAY)

    def press_first(fn):
        def pressed(*args, **kw):
            firsts.append(1)
            if len(firsts) == 2:
                os.kill(os.getpid(), signal.SIGINT)  # the first press
            return fn(*args, **kw)

        return pressed

    class PressedEngine(writer.IOEngine):
        def close(self):
            if not seconds:
                seconds.append(1)
                self.flush()  # the writes in flight done, so that none races with the abort's removal
                try:
                    os.kill(os.getpid(), signal.SIGINT)  # the second, as the abort waits for the writes in flight
                finally:
                    super().close()
            super().close()

    def pressed_abort(self):
        if not seconds:
            seconds.append(1)
            os.kill(os.getpid(), signal.SIGINT)  # the second, as the abort begins
        abort(self)

    if first == "write":
        monkeypatch.setattr(writer.CheckpointWriter, "write", press_first(write))
    else:
        monkeypatch.setattr(writer, "reserve", press_first(reserve))
    if second == "close":
        monkeypatch.setattr(writer, "IOEngine", PressedEngine)
    else:
        monkeypatch.setattr(writer.CheckpointWriter, "_abort", pressed_abort)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            opt.save_checkpoint(os.path.join(folder, "next"))
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # nothing of the save's hold left
    finally:
        signal.signal(signal.SIGINT, before)
    monkeypatch.undo()
    assert len(firsts) >= 2 and seconds == [1]
    assert os.listdir(folder) == ["latest"] and hidden._UNDER_WAY == under_way
    opt.save_checkpoint(os.path.join(folder, "next"))
    assert sorted(os.listdir(folder)) == ["latest", "next"] and verify_checkpoint(os.path.join(folder, "next"))["ok"]


def test_a_ctrl_c_while_the_writes_in_flight_are_waited_for_leaves_no_write_after_the_cleanup(tmp_path, monkeypatch):
    # A press while an aborted save waited for its writes in flight (IOEngine.close) dropped the writer's engine: the
    # abort removed the temporary folder and released its lock while a write was still running, which then landed
    # after the cleanup, and the engine's threads were left running. Now the abort closes the engine again (the
    # retry waits for the writes and joins the threads), then removes the folder; the interrupt still reaches the
    # caller.
    path = str(tmp_path / "ck" / "next")
    under_way = set(hidden._UNDER_WAY)
    started, release, landed, closes, engines = threading.Event(), threading.Event(), [], [], []
    main = threading.get_ident()

    def press():  # once the first close() waits for the write held below
        if wait_until(lambda: engines[0]._closed):
            signal.pthread_kill(main, signal.SIGINT)

    class HeldEngine(writer.IOEngine):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            engines.append(self)

        def _run(self, t):
            if t.req.write:
                started.set()
                release.wait(TIMEOUT)  # held until the close after the interrupted one (or the test's end)
                landed.append(os.path.isdir(os.path.dirname(t.req.path)))  # its folder still there
            super()._run(t)

        def close(self):
            closes.append(1)
            if len(closes) == 1:
                threading.Thread(target=press, daemon=True).start()
            else:
                release.set()  # a close after the interrupted one: the write may now end
            super().close()

    monkeypatch.setattr(writer, "IOEngine", HeldEngine)
    w = writer.CheckpointWriter(path, numel=1024, objects=b"x", io=IOConfig(threads=1, direct="off"))
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    try:
        with pytest.raises(KeyboardInterrupt):
            with w:
                w.write(0, 0, torch.ones(1024))
                assert started.wait(TIMEOUT)
                raise KeyboardInterrupt  # the first press, mid-save; the second stops the wait for the write
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # nothing of the save's hold left
        alive = [t.is_alive() for t in engines[0]._workers]
    finally:
        signal.signal(signal.SIGINT, before)
        release.set()
        engines[0].close()  # joins the worker, wherever the save left it
    assert landed == [True], landed  # the write ended before its folder was removed
    assert alive == [False]  # the engine's thread was joined by the save
    assert os.listdir(os.path.dirname(path)) == [] and hidden._UNDER_WAY == under_way


def test_a_file_that_cannot_be_reserved_is_named_with_its_checkpoint(saved, monkeypatch):
    # fallocate's EFBIG (a `ulimit -f`), EIO or EPERM came out as a bare OSError naming no file: design.md's
    # I/O errors carry the path. A full disk stays an InsufficientSpaceError.
    _, opt, latest = saved
    folder = os.path.dirname(latest)
    target = os.path.join(folder, "next")

    def refuse(code):
        def reserve(fd, nbytes):
            raise OSError(code, os.strerror(code))

        return reserve

    monkeypatch.setattr(writer, "reserve", refuse(errno.EFBIG))
    with pytest.raises(OSError) as info:
        opt.save_checkpoint(target)
    e = info.value
    assert e.errno == errno.EFBIG and e.filename and os.path.dirname(e.filename).startswith(folder), e
    assert target in str(e) and "reserving" in str(e), e
    assert os.listdir(folder) == ["latest"]
    monkeypatch.setattr(writer, "reserve", refuse(errno.ENOSPC))
    with pytest.raises(errors.InsufficientSpaceError) as full:
        opt.save_checkpoint(target)
    assert "(the disk filled while writing: [Errno 28] No space left on device)" in str(full.value), full.value
    assert os.listdir(folder) == ["latest"]
