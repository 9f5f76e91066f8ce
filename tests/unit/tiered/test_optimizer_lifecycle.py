"""Reliability of TieredOptimizer as a user meets it: exit without close(), failed and interrupted steps,
saves beside steps, dead runs' leftovers, and parameters that are not what the state was built for.

Each hang-prone case runs in a subprocess or a bounded thread: a hang fails the test instead of stalling CI.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import TESTS_ROOT, run_bounded, run_script, small_tmpfs
from torch import nn

from tiered import TieredOptimizer
from tiered.optimizer import OptimizerBrokenError
from tiered.store import TieredStore, workdir
from tiered.store.index import record_path
from tiered.store.workdir import WORKDIR_MARK, make_workdir, reclaim_dead

KW = dict(lr=1e-2, host_budget="60KiB", chunk_bytes="12KiB", prefetch_depth=2)  # 7 chunks, most on disk


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))


def backward(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(16, 32, generator=g)).pow(2).mean().backward()


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for s in steps:
        backward(model, s)
        opt.step()
        opt.zero_grad()


def assert_same(a: nn.Module, b: nn.Module) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)


# ------------------------------------------------------------------------------- exit without close()
EXIT_SCRIPT = """
import sys, torch
from tiered import TieredOptimizer
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
opt = TieredOptimizer(model, sys.argv[1] if len(sys.argv) > 1 else {root!r}, host_budget="512KiB",
                      chunk_bytes="64KiB")
for _ in range(2):
    model(torch.randn(8, 64)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
print("trained", flush=True)
{ending}
"""


@pytest.mark.parametrize(
    "ending,code,runs", [("", 0, 5), ("raise SystemExit(3)", 3, 2), ("raise RuntimeError('boom')", 1, 2)]
)
def test_exit_without_close_is_prompt_clean_and_keeps_the_exit_code(tmp_path, ending, code, runs):
    # Before: 14 of 20 runs hung (read-ahead futures on frozen daemon threads) or aborted ("terminate called
    # without an active exception"), and every one left the whole state on disk.
    # Two runs at a time (the child is mostly one core's torch import), each on its own root.
    roots = [tmp_path / f"nvme{j}" for j in range(runs)]
    with ThreadPoolExecutor(2) as ex:
        outs = list(ex.map(lambda root: run_script(EXIT_SCRIPT.format(root=str(root), ending=ending), timeout=60),
                           roots))  # fmt: skip
    for root, out in zip(roots, outs, strict=True):
        assert out.returncode == code, out.stderr
        assert "trained" in out.stdout
        assert "terminate called" not in out.stderr
        assert os.listdir(root) == [], "the state files and the private folder are removed at exit"


OUTLIVES_SCRIPT = """
import signal, sys, threading, torch
sys.path.insert(0, {tests!r})
from helpers import main_thread_joins, wait_until
from tiered import TieredOptimizer
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
opt = TieredOptimizer(model, {root!r}, host_budget="512KiB", chunk_bytes="64KiB")
ended = threading.Event()
def train():  # steps once the main thread has ended and the exit has begun
    ended.wait()
    assert wait_until(lambda: opt.closed or main_thread_joins())
    for _ in range(3):
        model(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    print("trained", opt.state_dict()["state"][0]["step"].item(), flush=True)
threading.Thread(target=train).start()  # non-daemon: Python waits for it, as it would with torch's AdamW
ended.set()
{ending}
"""


@pytest.mark.parametrize("ending", ["", "signal.raise_signal(signal.SIGINT)"])
def test_a_training_thread_that_outlives_the_main_thread_trains_to_its_end(tmp_path, ending):
    # Before: the close at exit ran as soon as the main thread ended (fell off the script, or took a Ctrl-C), and
    # the training thread's next step raised "this TieredOptimizer is closed".
    root = tmp_path / "nvme"
    out = run_script(OUTLIVES_SCRIPT.format(tests=TESTS_ROOT, root=str(root), ending=ending), timeout=120)
    assert "trained 3.0" in out.stdout, out.stdout + out.stderr
    assert out.returncode == (-signal.SIGINT if ending else 0), out.stderr
    assert os.listdir(root) == [], "closed once the training thread ended: its folder removed"


LATE_SCRIPT = """
import sys, threading, torch
sys.path.insert(0, {tests!r})
from helpers import main_thread_joins, wait_until
from tiered import TieredOptimizer
class Optimizer(TieredOptimizer):  # as a user's subclass that saves something in close()
    def close(self):
        print("close() ran", flush=True)
        super().close()
def train():  # builds its optimizer once the main thread has ended and its exit hooks have run
    global opt  # left open, not dropped
    assert wait_until(main_thread_joins)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    opt = Optimizer(model, {root!r}, host_budget="512KiB", chunk_bytes="64KiB")
    for _ in range(3):
        model(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    print("trained", opt.state_dict()["state"][0]["step"].item(), flush=True)
threading.Thread(target=train).start()  # non-daemon: Python waits for it
"""


def test_an_optimizer_a_thread_builds_after_the_main_thread_ended_is_closed_at_exit(tmp_path):
    # Before: with nothing of tiered's open as the main thread ended, the close at exit had run (with nothing to
    # close) when the thread built its optimizer, whose close() then never ran: only its finalizer released it,
    # at finalization, as if it had been dropped.
    root = tmp_path / "nvme"
    out = run_script(LATE_SCRIPT.format(tests=TESTS_ROOT, root=str(root)), timeout=120)
    assert out.stdout.splitlines() == ["trained 3.0", "close() ran"], out.stdout + out.stderr
    assert out.returncode == 0, out.stderr
    assert os.listdir(root) == [], "closed once the training thread ended: its folder removed"


def test_a_framework_wrapper_being_collected_closes_nothing(tmp_path):
    # Lightning's LightningOptimizer subclasses the optimizer's class and shares its __dict__; when the
    # wrapper was collected, the inherited __del__ closed the real optimizer's store ("no record 'g0.c0'").
    model = mlp()
    with TieredOptimizer(model, tmp_path, **KW) as opt:

        class Wrapper:
            def __init__(self, inner):
                self.__dict__ = dict(inner.__dict__)
                self.__class__ = type("LightningTiered", (Wrapper, inner.__class__), {})

        w = Wrapper(opt)
        del w
        import gc

        gc.collect()
        train(model, opt, range(2))
        assert opt.global_step == 2


def test_dropped_optimizer_is_closed_by_the_collector(tmp_path):
    opt = TieredOptimizer(mlp(), tmp_path, **KW)
    folder = opt.workdir
    del opt
    import gc

    gc.collect()
    assert not os.path.exists(folder)


# ------------------------------------------------------------------------------------------- a fork
FORK_SETUP = """
import os, sys, torch
from tiered import TieredOptimizer
KW = {kw!r}
def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 8))
def backward(model, s):
    g = torch.Generator().manual_seed(s)
    model(torch.randn(16, 32, generator=g)).pow(2).mean().backward()
def train(model, opt, steps):
    for s in steps:
        backward(model, s)
        opt.step()
        opt.zero_grad()
"""
FORK_SCRIPT = (
    FORK_SETUP
    + """
from tiered.store.lock import FolderLock, StoreLockedError
def files(folder):
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)
ref_model, model = mlp(), mlp()
with TieredOptimizer(ref_model, os.path.join({root!r}, "ref"), **KW) as ref:
    train(ref_model, ref, range(5))
opt = TieredOptimizer(model, os.path.join({root!r}, "run"), **KW)
train(model, opt, range(2))
before = files(opt.workdir)
pid = os.fork()
if pid == 0:  # a helper forked from the training process (an uploader, a daemon) that ends the usual way
    {child}
    sys.exit(0)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status), flush=True)
print("folder kept", set(before) <= set(files(opt.workdir)), flush=True)  # the parent's writes may add more
try:
    FolderLock(opt.workdir).release()
    print("lock taken by a probe", flush=True)
except StoreLockedError:
    print("lock held", flush=True)
except FileNotFoundError:
    print("lock gone with the folder", flush=True)
train(model, opt, range(2, 5))
print("same weights", all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters())), flush=True)
opt.close()
print("removed at close", os.listdir(os.path.join({root!r}, "run")) == [], flush=True)
"""
)


@pytest.mark.parametrize("child", ["pass", "opt.close(); assert opt.closed", "del opt; import gc; gc.collect()"])
def test_a_forked_child_that_exits_normally_leaves_the_parents_optimizer_alone(tmp_path, child):
    # A child of os.fork() that ended with sys.exit ran the finalizer it had copied: it deleted the parent's live
    # folder (the parent's next step raised IntegrityError, the optimizer broken) and dropped its folder lock.
    # The child's close(), or its copy being collected, did the same.
    proc = run_script(FORK_SCRIPT.format(kw=KW, root=str(tmp_path), child=child), timeout=600)  # a hang, loaded
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in ("child exit 0", "folder kept True", "lock held", "same weights True", "removed at close True"):
        assert line in proc.stdout, proc.stdout + proc.stderr
    assert "TieredOptimizer.close" not in proc.stderr, proc.stderr  # the child released nothing, so none failed


CHILD_CALLS_SCRIPT = (
    FORK_SETUP
    + """
import signal, threading
from tiered.optim.reports import Reports
root = {root!r}
ref_model, model = mlp(), mlp()
with TieredOptimizer(ref_model, os.path.join(root, "ref"), max_grad_norm=0.01, **KW) as ref:
    train(ref_model, ref, range(4))
opt = TieredOptimizer(model, os.path.join(root, "run"), max_grad_norm=0.01, **KW)  # a step would clip the grads
train(model, opt, range(2))
ckpt = opt.save_checkpoint(os.path.join(root, "ckpt"))
backward(model, 2)  # the gradients of a step to come
grads = [p.grad.clone() for p in model.parameters()]
held, go = threading.Event(), threading.Event()
def hold():  # a training thread inside a step or save at the fork
    with opt._lock:
        held.set()
        go.wait()
holder = threading.Thread(target=hold)
if {held}:
    holder.start()
    held.wait()
p0 = next(model.parameters())
calls = {{"step": opt.step, "zero_grad": opt.zero_grad, "state_dict": opt.state_dict,
         "load_state_dict": lambda: opt.load_state_dict(torch.optim.AdamW(mlp().parameters()).state_dict()),
         "save_checkpoint": lambda: opt.save_checkpoint(os.path.join(root, "child-ckpt")),
         "load_checkpoint": lambda: opt.load_checkpoint(ckpt), "stats": opt.stats,
         "add_param_group": lambda: opt.add_param_group({{"params": [torch.nn.Parameter(torch.zeros(4))]}}),
         "state[p]": lambda: opt.state[p0], "state[p] = ...": lambda: opt.state.__setitem__(p0, {{}}),
         "state.clear": opt.state.clear}}
public = {{n for c in (TieredOptimizer, Reports) for n, v in vars(c).items() if callable(v) and n[0] != "_"}}
print("untested:", sorted(public - set(calls) - {{"close", "summary"}}) or "none", flush=True)
pid = os.fork()
if pid == 0:
    signal.alarm(60)  # a call that waits for ever is killed by SIGALRM
    for name, call in calls.items():
        try:
            call()
            print("child:", name, "returned", flush=True)
        except RuntimeError as e:
            print("child:", name, "raised", "TieredOptimizer" in str(e) and "before a fork" in str(e), flush=True)
        except Exception as e:
            print("child:", name, "raised", type(e).__name__, e, flush=True)
    print("child reads closed", opt.closed, flush=True)
    kept = all(p.grad is not None and torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    print("child grads kept", kept, flush=True)
    opt.close()
    os._exit(0)
go.set()
if {held}:
    holder.join()
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status), flush=True)
opt.step()
opt.zero_grad()
train(model, opt, range(3, 4))
print("same weights", all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters())), flush=True)
opt.close()
print("removed at close", os.listdir(os.path.join(root, "run")) == [], flush=True)
"""
)


@pytest.mark.parametrize("held", [True, False], ids=["lock-held-at-fork", "idle-at-fork"])
def test_every_call_of_a_forked_childs_optimizer_refuses_at_once(tmp_path, held):
    # In a child forked while a training thread held the optimizer's lock (a step or save under way), step(),
    # state_dict(), save_checkpoint() and the rest waited for ever: the lock's holder does not exist there. Forked
    # when idle, step() ran part of a step (clipped the gradients) before the store refused, leaving the copy
    # broken (OptimizerBrokenError) rather than closed. Every call now refuses first, and the copy reads closed.
    proc = run_script(CHILD_CALLS_SCRIPT.format(kw=KW, root=str(tmp_path), held=held), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in ("untested: none", "child reads closed True", "child grads kept True", "child exit 0",
                 "same weights True", "removed at close True"):  # fmt: skip
        assert line in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.count("raised True") == 11 and "returned" not in proc.stdout, proc.stdout


# ------------------------------------------------------------------------------------ all-or-nothing
def _corrupt_a_streamed_record(opt: TieredOptimizer) -> str:
    key = next(c.key for c in reversed(opt.chunks) if not opt.store.is_resident(c.key))
    opt.store.evict(key).result()
    path = record_path(opt.workdir, key)
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 8)
    return key


def test_a_step_that_fails_part_way_breaks_the_optimizer_until_a_load(tmp_path):
    ref, model = mlp(), mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with TieredOptimizer(model, tmp_path / "nvme", **KW) as opt:
        train(ref, ref_opt, range(2))
        train(model, opt, range(2))
        opt.save_checkpoint(tmp_path / "ckpt")
        good = copy.deepcopy(model.state_dict())
        _corrupt_a_streamed_record(opt)
        backward(model, 2)
        with pytest.raises(OSError, match="corrupted"):
            opt.step()
        # Some chunks were updated, the corrupt one not: every way on from here refuses, by name.
        for call in (opt.step, opt.state_dict, lambda: opt.save_checkpoint(tmp_path / "torn")):
            with pytest.raises(OptimizerBrokenError, match="load_checkpoint"):
                call()
        assert not (tmp_path / "torn").exists()
        model.load_state_dict(good)
        opt.load_checkpoint(tmp_path / "ckpt")
        opt.zero_grad()
        train(ref, ref_opt, range(2, 4))
        train(model, opt, range(2, 4))
        torch.testing.assert_close(list(model.parameters()), list(ref.parameters()), rtol=1e-6, atol=1e-7)
    assert os.listdir(tmp_path / "nvme") == []  # close() after a failed step: nothing stays pinned


@pytest.mark.parametrize("at_chunk", [0, 3, 6])
def test_ctrl_c_during_a_step_is_delivered_after_the_step(tmp_path, monkeypatch, at_chunk):
    ref, model = mlp(), mlp()
    with TieredOptimizer(ref, tmp_path / "ref", **KW) as ref_opt:
        train(ref, ref_opt, range(3))
    with TieredOptimizer(model, tmp_path / "nvme", **KW) as opt:
        train(model, opt, range(2))
        calls = []
        real = opt.chunked_state.updater.update

        def update_and_interrupt(*a, **k):
            calls.append(1)
            if len(calls) == at_chunk + 1:
                os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, in the middle of the step
            return real(*a, **k)

        monkeypatch.setattr(opt.chunked_state.updater, "update", update_and_interrupt)
        backward(model, 2)
        with pytest.raises(KeyboardInterrupt):
            opt.step()
        assert len(calls) == len(opt.chunks), "the step ran to its end before the interrupt"
        assert opt.global_step == 3
        assert_same(ref, model)
        monkeypatch.setattr(opt.chunked_state.updater, "update", real)
        opt.zero_grad()
        train(model, opt, range(3, 4))  # and it goes on


def test_a_second_ctrl_c_stops_the_step_and_breaks_the_optimizer(tmp_path, monkeypatch):
    model = mlp()
    with TieredOptimizer(model, tmp_path, **KW) as opt:
        train(model, opt, range(1))
        real = opt.chunked_state.updater.update
        calls = []

        def update_and_interrupt(*a, **k):
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)
            return real(*a, **k)

        monkeypatch.setattr(opt.chunked_state.updater, "update", update_and_interrupt)
        backward(model, 1)
        with pytest.raises(KeyboardInterrupt):
            opt.step()
        assert len(calls) < len(opt.chunks)
        with pytest.raises(OptimizerBrokenError):
            opt.step()


def test_a_failure_before_any_chunk_after_a_restore_leaves_the_optimizer_usable(tmp_path, monkeypatch):
    # A torn step breaks the optimizer until a whole state is loaded; after that load, a step that fails before it
    # touches any chunk (here in the clip) changes nothing, so it must raise and leave the optimizer usable.
    model = mlp()
    with TieredOptimizer(model, tmp_path, max_grad_norm=1.0, **KW) as opt:
        train(model, opt, range(1))
        whole = opt.state_dict()
        real = opt.chunked_state.updater.update
        calls = []

        def update_then_fail(*a, **k):
            calls.append(1)
            if len(calls) == 2:
                raise OSError("the disk went away")
            return real(*a, **k)

        monkeypatch.setattr(opt.chunked_state.updater, "update", update_then_fail)
        backward(model, 1)
        with pytest.raises(OSError):
            opt.step()
        with pytest.raises(OptimizerBrokenError):
            opt.step()
        monkeypatch.setattr(opt.chunked_state.updater, "update", real)
        opt.load_state_dict(whole)

        shards = opt.chunked_state.shards

        def clip_fails(*a, **k):
            raise RuntimeError("the norm could not be taken")

        monkeypatch.setattr(shards, "clip_grad_norm_", clip_fails)
        with pytest.raises(RuntimeError, match="norm could not"):
            opt.step()
        monkeypatch.undo()
        assert opt.state_dict()["state"].keys() == whole["state"].keys()  # not broken
        opt.zero_grad()
        train(model, opt, range(2, 3))  # and it goes on


def test_an_ignored_sigint_stays_without_effect(tmp_path, monkeypatch):
    # Under nohup or as a shell's background job SIGINT is ignored: Ctrl-Cs during a step must neither
    # interrupt it nor break the optimizer, and SIGINT must stay ignored afterwards.
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ref, model = mlp(), mlp()
        with TieredOptimizer(ref, tmp_path / "ref", **KW) as ref_opt:
            train(ref, ref_opt, range(2))
        with TieredOptimizer(model, tmp_path / "nvme", **KW) as opt:
            real = opt.chunked_state.updater.update

            def update_and_interrupt(*a, **k):
                os.kill(os.getpid(), signal.SIGINT)
                return real(*a, **k)

            monkeypatch.setattr(opt.chunked_state.updater, "update", update_and_interrupt)
            train(model, opt, range(2))
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            assert opt.global_step == 2
            assert_same(ref, model)
    finally:
        signal.signal(signal.SIGINT, before)


def test_sigint_handler_is_restored_and_steps_off_the_main_thread_are_unaffected(tmp_path):
    model = mlp()
    before = signal.getsignal(signal.SIGINT)
    with TieredOptimizer(model, tmp_path, **KW) as opt:
        train(model, opt, range(1))
        assert signal.getsignal(signal.SIGINT) is before
        backward(model, 1)
        run_bounded(opt.step)
        assert opt.global_step == 2


def test_a_save_beside_a_step_waits_for_it(tmp_path, monkeypatch):
    # Before: a save in another thread mixed moments from before and after the step, and verify passed it.
    model = mlp()
    with TieredOptimizer(model, tmp_path / "nvme", **KW) as opt:
        train(model, opt, range(1))
        real, started = opt.chunked_state.updater.update, threading.Event()

        def slow_update(*a, **k):
            started.set()
            time.sleep(0.02)
            return real(*a, **k)

        monkeypatch.setattr(opt.chunked_state.updater, "update", slow_update)
        backward(model, 1)
        saver = threading.Thread(target=lambda: started.wait(10) and opt.save_checkpoint(tmp_path / "ckpt"))
        saver.start()
        opt.step()
        saver.join(60)
        assert not saver.is_alive()
        after = opt.state_dict()["state"]
        other = mlp()
        with TieredOptimizer(other, tmp_path / "nvme", **KW) as back:
            back.load_checkpoint(tmp_path / "ckpt")
            loaded = back.state_dict()["state"]
            assert back.global_step == 2
        for i in after:
            for k in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(loaded[i][k], after[i][k], rtol=0, atol=0)


# ------------------------------------------------------------------------------- dead runs' leftovers
def test_a_killed_runs_folder_is_reclaimed_on_a_tight_disk():
    # Before: the dead run's record files stayed, and a restart on a tight disk was refused for space.
    script = (
        "import sys, time, torch; from tiered import TieredOptimizer\n"
        "m = torch.nn.Linear(256, 256)\n"
        "o = TieredOptimizer(m, sys.argv[1], host_budget='256KiB', chunk_bytes='64KiB')\n"
        "print(o.workdir, flush=True); time.sleep(60)\n"
    )
    with small_tmpfs("1200k") as mnt:
        root = os.path.join(mnt, "state")
        proc = subprocess.Popen([sys.executable, "-c", script, root], stdout=subprocess.PIPE, text=True)
        try:
            folder = proc.stdout.readline().strip()
            assert folder.startswith(root)
        finally:
            proc.kill()
            proc.wait(30)
        assert os.path.isdir(folder) and os.listdir(os.path.join(folder, "records"))
        m = torch.nn.Linear(256, 256)
        with TieredOptimizer(m, root, host_budget="256KiB", chunk_bytes="64KiB") as opt:
            assert not os.path.exists(folder), "the dead run's folder was reclaimed"
            m(torch.randn(2, 256)).sum().backward()
            opt.step()


def test_a_folder_that_is_not_a_dead_run_is_left_alone(tmp_path):
    foreign = tmp_path / "tiered-1234-abc"
    foreign.mkdir()
    (foreign / ".lock").write_text("1234\n")
    (foreign / "notes.txt").write_text("mine")
    with TieredOptimizer(mlp(), tmp_path, **KW):
        assert (foreign / "notes.txt").read_text() == "mine"


# The second and third: a run's name's shape; the third also has the name's pid in its lock file (this process, the
# last to open it, wrote it there): exactly the shape of a dead run's folder from before the marker.
@pytest.mark.parametrize("name", ["tiered-embeddings", "tiered-2024-snapshot", f"tiered-{os.getpid()}-0badcafe"])
def test_a_users_closed_store_named_like_a_runs_folder_is_left_alone(tmp_path, name):
    # Before: a TieredStore of the user's under the root, named tiered-*, closed (its lock free) and holding only a
    # store's files, was taken for a dead run's folder and deleted, records and all, by the next optimizer there;
    # then still one named tiered-<its pid>-<8 characters> (a name made per run, as f"tiered-{os.getpid()}-
    # {secrets.token_hex(4)}"), whose lock holds that pid.
    with TieredStore(tmp_path / name, host_budget="1MiB") as s:
        s.put("table", torch.arange(1000.0))
    with TieredOptimizer(mlp(), tmp_path, **KW):
        pass
    with TieredStore(tmp_path / name) as s:
        assert torch.equal(s.get("table"), torch.arange(1000.0))


def test_a_users_store_filled_while_a_reclaim_looks_at_it_is_left_alone(tmp_path, monkeypatch):
    # A user's store with a dead run's shape (tiered-<pid>-<8 characters>, that pid in its lock), empty when the
    # reclaim first looks at it, then opened, filled and closed by its owner before the reclaim takes its lock: the
    # reclaim looks again under the lock, and leaves it.
    folder = tmp_path / f"tiered-{os.getpid()}-0badcafe"
    TieredStore(folder, host_budget="1MiB").close()
    real_lock = workdir.FolderLock

    def fill_then_lock(path, **kwargs):
        with TieredStore(folder, host_budget="1MiB") as s:
            s.put("table", torch.arange(1000.0))
        return real_lock(path, **kwargs)

    monkeypatch.setattr(workdir, "FolderLock", fill_then_lock)
    assert reclaim_dead(str(tmp_path)) == 0
    with TieredStore(folder) as s:
        assert torch.equal(s.get("table"), torch.arange(1000.0))


@pytest.mark.parametrize("tag", [f"{os.getpid()}", f"rank3-{os.getpid()}"])
@pytest.mark.parametrize("index", [False, True], ids=["no_index", "empty_index"])
def test_a_dead_runs_folder_from_before_the_marker_is_still_reclaimed(tmp_path, tag, index):
    # A folder an older tiered made and its run left (killed): no marker file, but the name make_workdir gave it
    # (tiered-[rank<r>-]<pid>-<8 random>) and that pid in its lock file. It holds a whole state, in record files its
    # index (if any) does not list: a run's store is never flushed; one laid out again (param_set.py) was emptied,
    # then closed, writing an empty index. Reclaimed.
    folder, lock = make_workdir(str(tmp_path), tag)
    if index:
        with TieredStore(folder, folder_lock=lock) as s:
            s.put("g0.c0", torch.ones(1000), tier="nvme")
            s.delete("g0.c0")
        assert os.path.isfile(os.path.join(folder, "index.json"))
    s = TieredStore(folder, folder_lock=lock)
    s.put("g0.c0", torch.ones(1000), tier="nvme")
    s.close(discard=True)  # killed: nothing flushed
    lock.release()  # as the run's death does
    os.unlink(os.path.join(folder, WORKDIR_MARK))
    assert reclaim_dead(str(tmp_path)) > 0 and os.listdir(tmp_path) == []


_KILLED_RECLAIM = r"""
import os, sys, time
from tiered.store.workdir import reclaim_dead
stop_at, unlink = sys.argv[2], os.unlink
def unlink_then_stop(path, *args, **kwargs):  # stops the reclaim right after it removed (or tried) that name
    try:
        return unlink(path, *args, **kwargs)
    finally:
        if stop_at in (os.path.basename(path), os.path.basename(os.path.dirname(path))):
            print("stopped", flush=True)
            time.sleep(600)  # SIGKILLed here
os.unlink = unlink_then_stop
reclaim_dead(sys.argv[1])
print("ended", flush=True)
"""


def _dead_runs_folder(root: str, *, marked: bool) -> str:
    """A killed run's folder: its store's records on disk, none listed in an index (a run's store is never flushed:
    its records are deleted, or the store closed with discard), its lock free; without the marker, an older
    tiered's."""
    folder, lock = make_workdir(root, str(os.getpid()))
    store = TieredStore(folder, folder_lock=lock, host_budget="1MiB")
    for i in range(3):
        store.put(f"g0.c{i}", torch.ones(1000), tier="nvme")
    store.close(discard=True)
    lock.release()  # as the run's death does
    if not marked:
        os.unlink(os.path.join(folder, WORKDIR_MARK))
    assert len(os.listdir(os.path.join(folder, "records"))) == 3
    return folder


@pytest.mark.parametrize("marked", [False, True], ids=["before_the_marker", "marked"])
@pytest.mark.parametrize("stop_at", ["records", WORKDIR_MARK], ids=["deleting_records", "after_its_marker"])
def test_a_reclaim_killed_part_way_leaves_a_folder_the_next_start_reclaims(tmp_path, marked, stop_at):
    # Before: the reclaim's lock wrote the reclaimer's pid into the dead folder's .lock; SIGKILLed part-way (a restart
    # loop killed again) it left a folder without the marker (an older tiered's, or its marker already removed) whose
    # lock no longer held its name's pid, so no later start recognised it: stranded on the disk for good.
    root = str(tmp_path)
    folder = _dead_runs_folder(root, marked=marked)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_RECLAIM, root, stop_at], stdout=subprocess.PIPE, text=True)
    try:
        assert run_bounded(proc.stdout.readline, timeout=120).strip() == "stopped"
    finally:
        proc.kill()
        proc.wait(30)
        proc.stdout.close()
    assert os.path.isdir(folder)  # killed part-way through deleting it
    reclaim_dead(root)
    assert os.listdir(root) == [], "the next start reclaimed what the killed reclaim left"


# ----------------------------------------------------------------------------- parameters at the boundary
def test_sparse_gradients_are_refused_by_name_before_anything_changes(tmp_path):
    emb = nn.Embedding(10, 4, sparse=True)
    with TieredOptimizer(emb, tmp_path) as opt:
        emb(torch.tensor([1, 2])).sum().backward()
        with pytest.raises(TypeError, match="'weight' has a sparse gradient"):
            opt.step()
        assert opt.global_step == 0
        emb.weight.grad = emb.weight.grad.to_dense()
        opt.step()  # not broken: nothing had changed


def test_only_zero_size_parameters_train_as_torch_does(tmp_path):
    p, q = nn.Parameter(torch.zeros(0)), nn.Parameter(torch.zeros(0))
    ref = torch.optim.AdamW([q])
    with TieredOptimizer([p], tmp_path) as opt:
        for o, t in ((opt, p), (ref, q)):
            t.grad = torch.zeros(0)
            o.step()
        assert opt.global_step == 1 and opt.step_counts == [1]


def test_a_parameter_changed_after_build_is_named_before_any_update(tmp_path):
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 3))
    with TieredOptimizer(conv, tmp_path) as opt:
        conv(torch.randn(1, 3, 8, 8)).sum().backward()
        before = [p.detach().clone() for p in conv.parameters()]
        conv[1].to(memory_format=torch.channels_last)
        with pytest.raises(ValueError, match=r"'1\.weight' changed after the optimizer was built"):
            opt.step()
        for p, b in zip(conv.parameters(), before):
            assert torch.equal(p, b)
        conv[1].weight.data = conv[1].weight.data.contiguous()
        opt.step()
        conv[0].weight.data = conv[0].weight.data.reshape(4, -1)
        with pytest.raises(ValueError, match=r"'0\.weight' changed.*shape \(4, 27\)"):
            opt.step()


def test_float64_parameters_are_refused_not_narrowed(tmp_path):
    with pytest.raises(TypeError, match="float64"):
        TieredOptimizer(nn.Linear(2, 2).double(), tmp_path)
    assert os.listdir(tmp_path) == []
