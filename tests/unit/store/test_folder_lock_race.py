"""The folder lock's startup against siblings reclaiming dead folders under one ``nvme_path`` root.

A ``.lock`` that appeared before it was locked let a sibling's ``reclaim_dead`` take the live folder for a
dead run's and delete it (seen as "the lock file ... has 0 hard links" in a loaded full run). The lock file
is now locked before it has its name; these tests hold a creator in what used to be the gap, and start
many processes together on one root.
"""

from __future__ import annotations

import errno
import fcntl
import os
import textwrap

import pytest
import torch
from helpers import run_script

from io_engine import IOConfig
from tiered.store import TieredStore
from tiered.store.lock import LOCK_NAME, FolderLock, StoreLockedError
from tiered.store.workdir import make_workdir, reclaim_dead, remove_workdir

CFG = IOConfig(threads=1, block_size="16KiB")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_a_sibling_reclaiming_while_the_lock_is_made_leaves_the_live_folder(tmp_path, monkeypatch):
    root = str(tmp_path)
    real_flock, seen = fcntl.flock, []

    def flock(fd, op):
        if not seen:  # the creator's first lock call: a sibling runs reclaim_dead right then
            seen.append(None)
            seen[0] = reclaim_dead(root)
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    folder, lock = make_workdir(root, "live")  # its lock is made right after the folder
    s = TieredStore(folder, host_budget="64KiB", io=CFG, folder_lock=lock)
    try:
        assert seen == [0] and os.path.isdir(folder), "the sibling took the live folder for a dead one"
        s.put("a", torch.ones(8))
        s.flush()
        assert reclaim_dead(root) == 0 and os.path.isdir(folder)
    finally:
        s.close()
    assert reclaim_dead(root) == 0 and os.path.isdir(folder)  # the store closed, the folder's owner holds it
    remove_workdir(folder, lock)
    assert os.listdir(root) == []


def test_a_dead_folder_a_sibling_reclaims_first_is_skipped(tmp_path, monkeypatch):
    """Two reclaimers of one dead folder: the second takes the lock the first just released, and finds the
    folder gone; that is no error (it made make_workdir say the root "cannot be written")."""
    import shutil

    from tiered.store import workdir

    root = str(tmp_path)
    make_workdir(root, "dead")[1].release()  # as its run's death does
    real = workdir._own_files

    def own_files(folder):
        shutil.rmtree(folder)  # the first reclaimer finished in between
        return real(folder)

    monkeypatch.setattr(workdir, "_own_files", own_files)
    assert reclaim_dead(root) == 0
    monkeypatch.undo()
    folder, lock = make_workdir(root, "next")
    assert os.listdir(root) == [os.path.basename(folder)]
    remove_workdir(folder, lock)


def test_removing_a_closed_folder_a_sibling_reclaims_meanwhile_is_no_error(tmp_path, monkeypatch):
    """Between a store's close (its lock released) and remove_workdir, a sibling's reclaim_dead may take the
    folder for a dead run's and empty it while remove_workdir lists it: the loaded CI's stampede saw
    FileNotFoundError on records/ from an optimizer's close. The folder is gone either way: no error."""
    import shutil

    from tiered.store import workdir

    root = str(tmp_path)
    folder, lock = make_workdir(root, "closing")
    lock.release()  # a store's own lock, as a plain TieredStore takes
    s = TieredStore(folder, host_budget="16KiB", io=CFG)
    s.put("a", torch.ones(4096))  # beyond the budget: a record file under records/
    s.flush()
    s.close()
    real_scandir = os.scandir

    def scandir(path):
        if isinstance(path, str) and os.path.basename(path) == "records":  # the sibling empties it as we list it
            shutil.rmtree(folder)
        return real_scandir(path)

    monkeypatch.setattr(workdir.os, "scandir", scandir)
    remove_workdir(folder)
    monkeypatch.undo()
    assert os.listdir(root) == []


@pytest.mark.parametrize("at", ["release", "lock_unlinked"])
def test_a_store_opened_as_a_reclaim_ends_keeps_its_lock_and_records(tmp_path, monkeypatch, at):
    """A reclaim released the folder's lock before it unlinked ``.lock`` and removed ``records/`` and the folder: a
    store opened in between (a user's empty closed store named ``tiered-<its pid>-<8 hex>``, reopened by its owner;
    any other process) got the lock, then lost its ``.lock`` (a second store on the folder opened too) and its
    ``records/`` (its flush failed). The shell is now removed under the lock: a store opened as the reclaim drops
    it, or once ``.lock`` is unlinked, makes the folder afresh and keeps it."""
    from tiered.store import workdir

    folder = os.path.join(tmp_path, f"tiered-{os.getpid()}-0badcafe")
    TieredStore(folder, host_budget="1MiB", io=CFG).close()  # the user's store, closed empty
    opened: list[TieredStore] = []

    def open_once() -> None:
        if not opened:
            opened.append(TieredStore(folder, host_budget="1MiB", io=CFG))

    class Lock(FolderLock):  # the reclaim's lock: the store opens right as it is dropped
        def release(self) -> None:
            super().release()
            if self.folder == folder:
                open_once()

    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):  # the store opens right after the reclaim unlinked .lock
        real_unlink(path, *args, **kwargs)
        if path == os.path.join(folder, LOCK_NAME):
            open_once()

    if at == "release":
        monkeypatch.setattr(workdir, "FolderLock", Lock)
    else:
        monkeypatch.setattr(workdir.os, "unlink", unlink)
    reclaim_dead(str(tmp_path))
    monkeypatch.undo()
    assert len(opened) == 1, "the store opened during the reclaim"
    s = opened[0]
    try:
        s.put("a", torch.ones(1 << 16))
        s.flush()  # first: a refused open makes a missing records/ before it tries the lock
        assert os.path.isfile(os.path.join(folder, LOCK_NAME)), "the open store's .lock was unlinked under it"
        with pytest.raises(StoreLockedError):
            TieredStore(folder, host_budget="1MiB", io=CFG).close()
    finally:
        s.close()
    with TieredStore(folder, io=CFG) as again:
        assert torch.equal(again.get("a"), torch.ones(1 << 16))


def test_a_lock_file_is_locked_from_the_moment_it_has_its_name(tmp_path):
    lock = FolderLock(tmp_path)
    try:
        assert sorted(os.listdir(tmp_path)) == [LOCK_NAME]  # the temporary name is gone
        st = os.lstat(tmp_path / LOCK_NAME)
        assert st.st_nlink == 1 and st.st_mode & 0o777 == 0o644
        fd = os.open(tmp_path / LOCK_NAME, os.O_RDONLY)
        try:  # another open file description is refused: it is locked
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                raise AssertionError("the lock file was not locked")
            except BlockingIOError:
                pass
            assert os.pread(fd, 32, 0).decode().strip() == str(os.getpid())
        finally:
            os.close(fd)
        try:
            FolderLock(tmp_path)
            raise AssertionError("a second lock was granted")
        except StoreLockedError as e:
            assert e.pid == os.getpid()
    finally:
        lock.release()
    FolderLock(tmp_path).release()  # an existing, free lock file is taken again


def test_a_lock_taken_keeping_the_pid_names_its_holder_to_whoever_it_refuses(tmp_path):
    """A reclaim takes a dead folder's lock with ``keep_pid`` (the pid its name holds must stay: workdir.py); the
    lock file then named only the previous owner, so a store refused meanwhile was told to close a store of its own
    process ("this process ..., through another TieredStore still open") or to end a dead run's pid, perhaps
    reused. The holder's pid now follows on a second line; the first keeps the name's, and a one-line lock file
    (an older tiered's, or one never taken with ``keep_pid``) still names its holder."""
    path = tmp_path / LOCK_NAME
    path.write_text("424242\n")  # a dead run's, of another pid
    fd = os.open(path, os.O_RDONLY)
    try:  # held as an older tiered holds it: its one line is the holder's pid
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(StoreLockedError) as e:
            FolderLock(tmp_path)
        assert e.value.pid == 424242
    finally:
        os.close(fd)
    for _ in range(2):  # taken again with keep_pid (a second reclaim, the first killed): still one holder line
        with FolderLock(tmp_path, keep_pid=True):
            assert path.read_text().splitlines()[0] == "424242"  # what workdir._made_by_make_workdir reads
            with pytest.raises(StoreLockedError) as e:
                FolderLock(tmp_path)
            assert e.value.pid == os.getpid(), f"names {e.value.pid}, the holder is {os.getpid()}"
        assert path.read_text() == f"424242\n{os.getpid()}\n"
    with FolderLock(tmp_path):  # an owner's lock: its pid alone
        assert path.read_text() == f"{os.getpid()}\n"


def test_a_store_handed_its_folders_lock_leaves_it_held_and_refuses_another(tmp_path):
    """The owner of a private folder keeps it locked across the stores it opens there in turn (an optimizer laying
    its state out again): a sibling's reclaim_dead finds it locked between them."""
    root = str(tmp_path)
    folder, lock = make_workdir(root, "owner")
    for _ in range(2):
        s = TieredStore(folder, host_budget="64KiB", io=CFG, folder_lock=lock)
        s.put("a", torch.ones(8))
        s.close()
        assert lock.held and reclaim_dead(root) == 0 and os.path.isdir(folder)
    other, other_lock = make_workdir(root, "other")
    with pytest.raises(ValueError, match="not of the store's folder"):
        TieredStore(folder, io=CFG, folder_lock=other_lock)
    remove_workdir(other, other_lock)
    remove_workdir(folder, lock)
    assert not lock.held and os.listdir(root) == []
    with pytest.raises(ValueError, match="was released"):
        TieredStore(folder, io=CFG, folder_lock=lock)
    assert os.listdir(root) == []  # refused before the folder is made


_STARTERS = 16
_ROUNDS = 3

# Forked from one parent that has imported everything, so the processes start together, not one import apart.
_STAMPEDE = textwrap.dedent(
    """
    import os, sys, traceback
    import torch
    from io_engine import IOConfig
    from tiered.store import TieredStore
    from tiered.store.workdir import make_workdir, reclaim_dead, remove_workdir

    root, n, rounds = ROOT, N, ROUNDS

    def child(i, gate):
        os.read(gate, 1)  # every child is released by one write
        for r in range(rounds):
            folder, lock = make_workdir(root, f"c{i}")
            s = TieredStore(folder, host_budget="64KiB", io=IOConfig(threads=1, block_size="16KiB"),
                            folder_lock=lock)
            s.put("a", torch.full((16,), float(i)))
            reclaim_dead(root)
            assert os.path.isdir(folder), f"{folder} was reclaimed while its store was open"
            s.flush()
            assert torch.equal(s.get("a"), torch.full((16,), float(i)))
            s.close()
            if (i + r) % 3:
                remove_workdir(folder, lock)
            else:
                lock.release()  # left behind, as by a killed run: a sibling reclaims it

    gate_r, gate_w = os.pipe()
    pids = []
    for i in range(n):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                child(i, gate_r)
            except BaseException:
                traceback.print_exc()
                code = 1
            os._exit(code)
        pids.append(pid)
    os.write(gate_w, b"x" * n)
    failed = [pid for pid in pids if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0]
    print(f"{len(failed)} of {n} failed")
    sys.exit(1 if failed else 0)
    """
)


def test_many_processes_starting_together_on_one_root_none_fails(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    for i in range(4):  # dead runs' folders for the starters to reclaim meanwhile
        folder, lock = make_workdir(str(root), f"dead{i}")
        TieredStore(folder, io=CFG, folder_lock=lock).close()
        lock.release()
    head = f"ROOT, N, ROUNDS = {str(root)!r}, {_STARTERS}, {_ROUNDS}\n"
    for attempt in range(3):
        rc = run_script(head + _STAMPEDE, timeout=300, cwd=REPO)
        assert rc.returncode == 0, f"attempt {attempt}: {rc.stdout}\n{rc.stderr[-4000:]}"
    reclaim_dead(str(root))  # what the last starters left behind: every one of them is dead now
    assert os.listdir(root) == [], os.listdir(root)


def test_lock_file_held_tells_a_held_lock_of_any_name_without_taking_it(tmp_path, monkeypatch):
    # A checkpoint save's hidden names are locked this way (FolderLock of another name, beside them), and a
    # sweep asks lock_file_held(): two askers at once must not take each other for the holder.
    from tiered.store.lock import lock_file_held

    path = str(tmp_path / ".ck.tmp-host-1-ab.lock")
    assert lock_file_held(path) is None
    lock = FolderLock(tmp_path, name=os.path.basename(path))
    assert lock_file_held(path) is True and sorted(os.listdir(tmp_path)) == [os.path.basename(path)]
    lock.release()
    other = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(other, fcntl.LOCK_SH)  # another asker, at this very moment
        assert lock_file_held(path) is False
    finally:
        os.close(other)

    def no_flock(*a):
        raise OSError(errno.ENOLCK, "No locks available")  # ENOLCK: a filesystem without flock cannot tell: held

    monkeypatch.setattr(fcntl, "flock", no_flock)
    assert lock_file_held(path) is True
