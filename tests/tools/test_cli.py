"""tiered-bench: every subcommand at toy size in a subprocess, the JSON schema, errors and cleanup.

No timing is asserted anywhere: these prove the CLI works and its output is stable, not how fast a
disk is. fio, aiofiles and matplotlib are optional: each test checks the row or the message that
stands in for a missing one, so the file passes with or without them.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import TIMEOUT
from hypothesis import given, settings
from hypothesis import strategies as st

from io_engine import IOConfig, IOEngine, PinnedBufferPool
from tiered import cli
from tiered.bench import baselines, disk, ring, workspace
from tiered.bench.common import Stat, UsageError, figure, parse_count, rounded
from tiered.bench.disk import run_io
from tiered.bench.io_types import IoOptions
from tiered.bench.optim import OptimOptions, run_optim
from tiered.bench.workspace import Workspace

ROOT = Path(__file__).resolve().parents[2]  # the repository
# Each CLI run is a fresh interpreter that imports torch before it does any work.
CLI_TIMEOUT = 4 * TIMEOUT
# A sweep that takes a second or two at 8 MiB.
TINY = ["--size", "8MiB", "--block-sizes", "1MiB", "--threads", "2", "--warmup", "0", "--loops", "1", "-q"]

TINY_OPTS = IoOptions(size=8 << 20, block_sizes=(1 << 20,), threads=(2,), warmup=0, loops=1, fio=False, progress=False)

# The JSON schema, pinned: renaming or dropping a key breaks users' scripts, so it must break a test.
ENVELOPE = {"schema", "command", "host"}
STAT = {"median", "min", "max", "samples"}
IO_KEYS = ENVELOPE | {
    "dir", "filesystem", "size_bytes", "request_bytes", "direct", "direct_effective", "warmup", "loops",
    "sweep", "best_read", "best_write", "best", "config", "fio", "aiofiles", "notes", "budget_s", "seconds", "complete",
}  # fmt: skip
SWEEP_ROW = {"block_size", "threads", "queue_depth", "read_gbps", "write_gbps", "validated", "fsync_s"}
PICK = {"block_size", "threads", "queue_depth", "read_gbps", "write_gbps"}
CONFIG = {"block_size", "threads", "queue_depth", "direct", "alignment", "submit"}
FIO = {
    "version", "ioengine", "iodepth", "read_block_size", "read_gbps", "write_block_size", "write_gbps",
    "ours_over_fio_read", "ours_over_fio_write",
}  # fmt: skip
AIOFILES = {"block_size", "read_gbps", "write_gbps", "aiofiles_over_ours_read", "aiofiles_over_ours_write"}
PCIE_KEYS = ENVELOPE | {"available", "reason", "device", "size_bytes", "warmup", "loops", "rows"}
OPTIM_RESULT = {
    "params", "dtype", "device", "host_budget", "gpu_budget", "state_bytes", "chunk_bytes", "chunks", "warmup", "steps",
    "step_s", "phases_s", "nvme_read_bytes", "nvme_write_bytes", "host_hit_bytes", "read_gbps", "write_gbps",
    "io_config", "floor_s", "step_over_floor", "store", "io", "notes", "tier_bytes", "ranks", "summary",
}  # fmt: skip
PHASES = {"clip_s", "read_wait_s", "grad_d2h_s", "update_s", "h2d_s", "write_wait_s", "drain_s", "settle_s"}
TUNE_KEYS = ENVELOPE | {"out", "config", "io"}
TOUR_KEYS = ENVELOPE | {"io", "pcie", "optim", "notes"}

HAVE_OPTIMIZER = importlib.util.find_spec("tiered.optimizer") is not None


def bench(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `python -m tiered.cli ARGS` as a user would, from the repo root on the import path."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "tiered.cli", *args],
        cwd=cwd or ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
    )


def bench_json(*args: str, **kw) -> dict:
    p = bench(*args, "--json", **kw)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def check_io_doc(doc: dict) -> None:
    assert set(doc["sweep"][0]) == SWEEP_ROW
    assert set(doc["sweep"][0]["read_gbps"]) == STAT
    for key in ("best_read", "best_write", "best"):
        assert set(doc[key]) == PICK
    assert set(doc["config"]) == CONFIG
    IOConfig.from_dict(doc["config"])  # the best config is a valid IOConfig
    assert doc["sweep"][0]["read_gbps"]["median"] > 0 and doc["sweep"][0]["write_gbps"]["median"] > 0


# --------------------------------------------------------------------------------------------- help
def test_help_lists_every_command_with_examples():
    p = bench("--help")
    assert p.returncode == 0
    for name in ("tour", "io", "pcie", "optim", "tune"):
        assert name in p.stdout
    assert "examples:" in p.stdout
    p = bench("io", "--help")
    assert p.returncode == 0 and "tiered-bench io --dir" in p.stdout
    # The description says what the defaults sweep, as the grids are (a user picks the mode from it).
    from tiered.bench.io_types import FULL_SWEEP, QUICK_BUDGET_S, QUICK_SWEEP

    text = " ".join(p.stdout.split())
    q, f = QUICK_SWEEP, FULL_SWEEP
    assert f"By default {len(q.block_sizes)} block sizes x {len(q.threads)} thread counts" in text
    assert f"on a {q.size >> 30} GiB file, within a {QUICK_BUDGET_S:.0f}-second budget" in text
    assert f"--full sweeps {len(f.block_sizes)} x {len(f.threads)} with no budget" in text and f.size == q.size


# ----------------------------------------------------------------------------------------------- io
def test_io_json_keys_are_stable_and_the_folder_is_removed(tmp_path):
    data = tmp_path / "made-by-the-run" / "data"
    doc = bench_json("io", "--dir", str(data), *TINY, "--validate", "--no-fio")
    assert set(doc) == IO_KEYS
    assert doc["command"] == "io" and doc["schema"] == 1
    check_io_doc(doc)
    assert doc["sweep"][0]["validated"] is True
    assert doc["fio"] is None and doc["aiofiles"] is None
    assert not (tmp_path / "made-by-the-run").exists()  # every folder it made is gone


def test_io_table_names_the_best_configuration(tmp_path):
    p = bench("io", "--dir", str(tmp_path), *TINY, "--no-fio", "--threads", "1,2")
    assert p.returncode == 0, p.stderr
    assert "best read" in p.stdout and "best config" in p.stdout
    assert tmp_path.exists() and list(tmp_path.iterdir()) == []  # a folder the user had stays, empty


def test_io_baseline_rows_or_the_reason_they_are_missing(tmp_path):
    """fio's and aiofiles' rows when installed; otherwise a note that says how to get them."""
    doc = bench_json("io", "--dir", str(tmp_path), *TINY, "--aiofiles")
    notes = " ".join(doc["notes"])
    if doc["direct_effective"] and _which("fio"):
        assert set(doc["fio"]) == FIO and set(doc["fio"]["read_gbps"]) == STAT
        assert doc["fio"]["ours_over_fio_read"] > 0
    else:
        assert doc["fio"] is None and "fio" in notes
    if importlib.util.find_spec("aiofiles"):
        assert set(doc["aiofiles"]) == AIOFILES and doc["aiofiles"]["aiofiles_over_ours_read"] > 0
    else:
        assert doc["aiofiles"] is None and "aiofiles" in notes


def test_io_on_tmpfs_says_it_measured_memory():
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    data = shm / f"tiered-bench-test-{os.getpid()}"
    doc = bench_json("io", "--dir", str(data), *TINY, "--no-fio")
    if doc["filesystem"] != "tmpfs":
        pytest.skip(f"/dev/shm is {doc['filesystem']} here")
    assert any("memory figures" in n for n in doc["notes"])
    assert not data.exists()


def test_io_falls_back_to_buffered_where_o_direct_is_refused(tmp_path, monkeypatch):
    # Since Linux 6.6 tmpfs accepts O_DIRECT, so the refusal is simulated at the probe.
    monkeypatch.setattr(disk, "direct_supported", lambda folder: False)
    with Workspace(tmp_path) as ws:
        res = run_io(TINY_OPTS, ws)
        assert res.direct_effective is False and any("O_DIRECT is not supported" in n for n in res.notes)
        with pytest.raises(UsageError, match="refuses O_DIRECT"):
            run_io(dataclasses.replace(TINY_OPTS, direct="on"), ws)


def test_plot_is_written_or_matplotlib_is_named(tmp_path):
    png = tmp_path / "io.png"
    p = bench("io", "--dir", str(tmp_path / "d"), *TINY, "--no-fio", "--plot", str(png))
    if importlib.util.find_spec("matplotlib"):
        assert p.returncode == 0, p.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert p.returncode == 2 and "matplotlib" in p.stderr
        assert not (tmp_path / "d").exists()


# --------------------------------------------------------------------------------------------- tune
def test_tune_file_round_trips_into_ioconfig(tmp_path):
    out = tmp_path / "tiered-io.json"
    doc = bench_json("tune", "--dir", str(tmp_path / "d"), "--out", str(out), *TINY, "--no-fio")
    assert set(doc) == TUNE_KEYS
    assert set(doc["io"]) == IO_KEYS - ENVELOPE
    want = IOConfig.from_dict(doc["config"])
    assert IOConfig.from_file(out) == want
    assert json.loads(out.read_text())["_measured"]["read_gbps"] > 0
    env = {**os.environ, "TIERED_IO_CONFIG": str(out)}
    loaded = subprocess.run(
        [sys.executable, "-c", "from io_engine import IOConfig; print(IOConfig.from_env().to_dict())"],
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
    )
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == str(want.to_dict())


# --------------------------------------------------------------------------------------------- pcie
def test_pcie_json_keys_and_no_cuda_exits_zero():
    doc = bench_json("pcie", "--size", "8MiB", "--loops", "1", "-q")
    assert set(doc) == PCIE_KEYS
    if torch.cuda.is_available():
        assert doc["available"] and len(doc["rows"]) == 6
        assert set(doc["rows"][0]) == {"memory", "direction", "gbps"}
    else:
        assert doc["available"] is False and "CUDA" in doc["reason"] and doc["rows"] == []
        p = bench("pcie", "--size", "8MiB")
        assert p.returncode == 0 and "CUDA is not available" in p.stdout


# -------------------------------------------------------------------------------------------- optim
class FakeOptimizer:
    """Honours TieredOptimizer's bench-facing contract (docs/internals.md): constructor, step, stats, close.

    The state beyond the host budget goes to and from "NVMe" once a step, as a scan-resident policy
    does; the phase times are fixed so that the floor arithmetic can be checked exactly.
    """

    instances: list[FakeOptimizer] = []

    def __init__(self, params, nvme_path, *, host_budget, gpu_budget, io, chunk_bytes=64 << 20):
        self.params = list(params)
        self.kwargs = dict(nvme_path=nvme_path, host_budget=host_budget, gpu_budget=gpu_budget, io=io)
        self.state_bytes = 12 * sum(p.numel() for p in self.params)
        self.chunk_bytes = chunk_bytes
        self.steps = 0
        self.closed = False
        FakeOptimizer.instances.append(self)

    def step(self):
        self.steps += 1

    def stats(self):
        spill = max(0, self.state_bytes - self.kwargs["host_budget"])
        last = dict(
            step_s=0.5, clip_s=0.0, read_wait_s=0.2, grad_d2h_s=0.0, update_s=0.1, h2d_s=0.0, write_wait_s=0.1,
            settle_s=0.0, drain_s=0.0, under_backward_bytes=0, nvme_read_bytes=spill, nvme_write_bytes=spill,
            host_hit_bytes=self.state_bytes - spill,
        )  # fmt: skip
        return {
            "steps": self.steps,
            "chunks": -(-self.state_bytes // self.chunk_bytes),
            "chunk_bytes": self.chunk_bytes,
            "state_bytes": self.state_bytes,
            "last_step": last,
            "total": {k: v * self.steps for k, v in last.items()},
            "store": {"nvme": {"bytes_read": spill * self.steps, "in_use": 7}},
        }

    def close(self):
        self.closed = True


def test_optim_floor_and_ratio_from_the_same_runs_io_sweep(tmp_path):
    opts = OptimOptions(
        params=1_000_000, host_budget=4 << 20, steps=2, warmup=1, device="cpu", progress=False,
        io=TINY_OPTS,
    )  # fmt: skip
    FakeOptimizer.instances.clear()
    with Workspace(tmp_path / "d") as ws:
        res = run_optim(opts, ws, optimizer_cls=FakeOptimizer)
    fake = FakeOptimizer.instances[-1]
    assert fake.steps == 3 and fake.closed
    assert fake.kwargs["io"] == IOConfig.from_dict(res.io.config)  # the optimizer ran with the sweep's best
    spill = 12_000_000 - (4 << 20)
    assert res.nvme_read_bytes == res.nvme_write_bytes == spill
    floor = spill / (res.io.best.read_gbps * 1e9) + spill / (res.io.best.write_gbps * 1e9)
    assert res.floor_s == pytest.approx(floor, abs=1e-4)
    assert res.step_over_floor == pytest.approx(0.5 / floor, rel=1e-2)
    assert set(res.phases_s) == PHASES and res.step_s == Stat.of([0.5, 0.5])
    assert res.tier_bytes == {"nvme": {"bytes_read": spill}}  # one step's counter difference, no gauges
    assert not (tmp_path / "d").exists()


@pytest.mark.skipif(not HAVE_OPTIMIZER, reason="tiered/optimizer.py has not landed yet")
def test_optim_subprocess_json_keys(tmp_path):
    doc = bench_json(
        "optim", "--dir", str(tmp_path / "d"), "--params", "1M", "--host-budget", "4MiB", "--chunk-bytes", "1MiB",
        "--steps", "1", "--warmup-steps", "1", "--device", "cpu", *TINY,
    )  # fmt: skip
    assert set(doc) == ENVELOPE | OPTIM_RESULT
    assert set(doc["phases_s"]) == PHASES and set(doc["step_s"]) == STAT
    assert set(doc["io"]) == IO_KEYS - ENVELOPE
    assert doc["state_bytes"] >= 12_000_000
    assert doc["nvme_read_bytes"] > 0 and doc["floor_s"] > 0 and doc["step_over_floor"] > 0
    # The optimizer's own view, less its ratio to a floor of its own rate: the report's one is step_over_floor.
    assert doc["summary"].startswith("step 2:") and "-bound" in doc["summary"]
    assert "x the disk floor" not in doc["summary"]
    assert not (tmp_path / "d").exists()


@pytest.mark.skipif(not HAVE_OPTIMIZER, reason="tiered/optimizer.py has not landed yet")
def test_optim_nproc_runs_ranks_on_one_disk_and_adds_their_bytes(tmp_path):
    doc = bench_json(
        "optim", "--dir", str(tmp_path / "d"), "--params", "2M", "--nproc", "2", "--host-budget", "4MiB",
        "--chunk-bytes", "1MiB", "--steps", "2", "--warmup-steps", "1", "--device", "cpu", *TINY,
    )  # fmt: skip
    ranks = doc["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    # Each rank holds half of the parameters' state, and moved its own bytes; the step's figures are the sum.
    assert all(abs(r["state_bytes"] - 12_000_000) < 200_000 for r in ranks)
    assert doc["state_bytes"] == sum(r["state_bytes"] for r in ranks)
    assert all(r["nvme_read_bytes"] > 0 for r in ranks)
    assert doc["nvme_read_bytes"] == sum(r["nvme_read_bytes"] for r in ranks)
    assert doc["step_s"]["median"] >= max(r["step_s"]["median"] for r in ranks) * 0.999  # the slowest rank's
    assert doc["floor_s"] > 0
    assert not (tmp_path / "d").exists()
    text = bench("optim", "--dir", str(tmp_path / "d"), "--params", "1M", "--nproc", "2", "--host-budget", "4MiB",
                 "--chunk-bytes", "1MiB", "--steps", "1", "--warmup-steps", "0", "--device", "cpu", *TINY)  # fmt: skip
    assert text.returncode == 0, text.stderr
    assert "2 on one disk" in text.stdout and "rank 1" in text.stdout


@pytest.mark.skipif(not HAVE_OPTIMIZER, reason="tiered/optimizer.py has not landed yet")
def test_optim_nproc_removes_the_ranks_files_when_interrupted(tmp_path):
    """Ctrl-C while the ranks step: exit 130, and neither --dir nor the ranks' results folder in the system temp
    folder stays behind (it did: only a run that finished removed it)."""
    tmp, data = tmp_path / "tmp", tmp_path / "d"
    tmp.mkdir()
    # A million steps: the run never ends on its own before the signal comes, however slow the machine.
    args = ["optim", "--dir", str(data), "--params", "2M", "--nproc", "2", "--host-budget", "4MiB", "--chunk-bytes",
            "1MiB", "--steps", "1000000", "--device", "cpu", *TINY]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "tiered.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)})  # fmt: skip
    try:
        deadline = time.monotonic() + CLI_TIMEOUT  # only reached when the ranks never start
        while len(list(data.glob("tiered-bench-*/optim-state/tiered-rank*"))) < 2:  # both ranks built theirs
            assert proc.poll() is None and time.monotonic() < deadline, "the ranks never started stepping"
            time.sleep(0.05)
        assert list(tmp.glob("tiered-bench-ranks-*")), "the ranks' results folder is not where the test looks"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=CLI_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "temporary files removed" in err
    assert not data.exists() and not list(tmp.glob("tiered-bench-ranks-*"))


# The CLI, with its first signal to a rank (the cleanup after a Ctrl-C) made to say so and wait for the test's
# second Ctrl-C: a press that lands inside the cleanup, every time, with no timing to guess.
PRESSED_DURING_CLEANUP = """
import os, sys, time
marker, pressed = sys.argv[1], sys.argv[2]
real_kill = os.kill
def kill(pid, sig):
    real_kill(pid, sig)
    if sig != 0 and not os.path.exists(marker):
        open(marker, "w").close()
        deadline = time.monotonic() + 120  # only reached when the test never presses
        while not os.path.exists(pressed) and time.monotonic() < deadline:
            time.sleep(0.01)
os.kill = kill
from tiered.cli import main
sys.exit(main(sys.argv[3:]))
"""


def spawned_children(pid: int) -> list[int]:
    """The processes `pid` started by multiprocessing's spawn (the ranks; not its resource tracker)."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid and b"spawn_main" in (entry / "cmdline").read_bytes():
                out.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue  # not a process, or gone meanwhile
    return out


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not HAVE_OPTIMIZER, reason="tiered/optimizer.py has not landed yet")
def test_optim_nproc_cleans_up_through_a_second_ctrl_c(tmp_path):
    """A second Ctrl-C while the ranks are being stopped (a user pressing twice) waits for the cleanup: every rank
    ends and --dir and the ranks' results folder go. It cut the cleanup short: the ranks after the first were left
    stepping into --dir, and both folders stayed, while the CLI said the files were removed."""
    from helpers import run_bounded

    tmp, data, marker, pressed = tmp_path / "tmp", tmp_path / "d", tmp_path / "cleaning", tmp_path / "pressed"
    tmp.mkdir()
    args = ["optim", "--dir", str(data), "--params", "2M", "--nproc", "2", "--host-budget", "4MiB", "--chunk-bytes",
            "1MiB", "--steps", "1000000", "--device", "cpu", *TINY]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", PRESSED_DURING_CLEANUP, str(marker), str(pressed), *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)})  # fmt: skip
    ranks: list[int] = []

    def press_twice() -> str:
        while len(list(data.glob("tiered-bench-*/optim-state/tiered-rank*"))) < 2:  # both ranks built theirs
            assert proc.poll() is None, "the run ended before its ranks stepped"
            time.sleep(0.05)
        ranks.extend(spawned_children(proc.pid))
        proc.send_signal(signal.SIGINT)
        while not marker.exists():  # the cleanup has signalled one rank
            assert proc.poll() is None, "the run ended before its cleanup signalled a rank"
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        pressed.touch()
        return proc.communicate()[1]

    try:
        err = run_bounded(press_twice, CLI_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in ranks:  # left behind by a failed cleanup: stepping for ever otherwise
            if running(pid):
                os.kill(pid, signal.SIGKILL)
    assert len(ranks) == 2, ranks
    assert proc.returncode == 130, err
    assert "temporary files removed" in err
    assert not [pid for pid in ranks if running(pid)]
    assert not data.exists() and not list(tmp.glob("tiered-bench-ranks-*"))


def test_stopping_the_ranks_kills_one_that_ignores_sigterm(monkeypatch):
    """A rank that ignores SIGTERM is killed after a bounded wait; the others end on SIGTERM."""
    import multiprocessing

    from helpers import run_bounded

    from tiered.bench import ranks

    monkeypatch.setattr(ranks, "TERM_WAIT_S", 0.5)
    ctx = multiprocessing.get_context("fork")
    ready = [ctx.Event(), ctx.Event()]
    procs = [ctx.Process(target=_ignoring_sigterm, args=(ready[0],)), ctx.Process(target=_sleeping, args=(ready[1],))]
    for p in procs:
        p.start()
    try:
        assert all(e.wait(CLI_TIMEOUT) for e in ready)
        run_bounded(lambda: ranks.stop(procs), ranks.TERM_WAIT_S + ranks.KILL_WAIT_S + TIMEOUT)
        assert [p.exitcode for p in procs] == [-signal.SIGKILL, -signal.SIGTERM]
    finally:
        for p in procs:
            p.kill()
            p.join()


def _ignoring_sigterm(ready) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    while True:
        time.sleep(1)


def _sleeping(ready) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    ready.set()
    while True:
        time.sleep(1)


class PressAtCall:
    """A ``sys.setprofile`` hook: once ``armed``, a real Ctrl-C as the ``k``-th Python function from there begins
    (Python raises it there, or a block that holds it counts it). ``left`` stays above 0 where the run ended first."""

    def __init__(self, k: int) -> None:
        self.left, self.armed, self.fired = k, False, False

    def __call__(self, frame, event, arg) -> None:
        if not self.armed or self.fired or event != "call":
            return
        if self.left:
            self.left -= 1
            return
        sys.setprofile(None)
        self.fired = True
        signal.raise_signal(signal.SIGINT)


def test_a_second_ctrl_c_as_the_ranks_cleanup_begins_still_cleans_up(tmp_path, monkeypatch):
    """run_ranks opened its Ctrl-C hold inside its ``finally``: a second press pending as the ``finally`` began (two
    Ctrl-Cs in a row) raised ``KeyboardInterrupt`` before the hold was in place, so the ranks were never stopped
    and their results folder stayed. Swept over every call from the first press to the cleanup's end."""
    import tempfile

    import torch.multiprocessing as mp

    from tiered.bench import ranks

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where run_ranks makes its results folder
    stopped: list[object] = []
    monkeypatch.setattr(ranks, "stop", lambda processes: stopped.append(processes))
    hook = PressAtCall(0)

    class Ranks:  # torch's context of spawned ranks, stepping until the first Ctrl-C lands in the wait for them
        processes: list[object] = []
        error_files: list[str] = []

        def join(self, timeout: float | None = None) -> bool:
            hook.armed = True
            raise KeyboardInterrupt

    monkeypatch.setattr(mp, "start_processes", lambda *a, **k: Ranks())
    opts = OptimOptions(params=1000, nproc=2, device="cpu", progress=False)

    def run() -> None:
        try:
            ranks.run_ranks(opts, tmp_path / "state", None)
        finally:
            hook.armed = False  # an assignment, no call: the test's own calls from here on

    for k in range(200):
        hook, stopped[:] = PressAtCall(k), []
        try:
            sys.setprofile(hook)
            with pytest.raises(KeyboardInterrupt):
                run()
        finally:
            sys.setprofile(None)
        assert stopped == [[]], f"the ranks were not stopped (pressed at call {k})"
        assert not list(tmp_path.glob("tiered-bench-ranks-*")), f"the results folder stayed (pressed at call {k})"
        if not hook.fired:
            break
    assert k > 2 and not hook.fired, "the sweep never ran past the cleanup"


def test_optim_nproc_removes_the_ranks_files_when_a_rank_fails(tmp_path, monkeypatch):
    import tempfile

    from helpers import run_bounded

    from tiered.bench.common import BenchFailure
    from tiered.bench.ranks import run_ranks

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where run_ranks makes its results folder
    opts = OptimOptions(params=1000, nproc=2, device="cpu", progress=False)
    opts.dtype = "fp12"  # past the check, as a rank's own failure: it ends in a KeyError there
    with pytest.raises(BenchFailure, match="a rank failed"):
        run_bounded(lambda: run_ranks(opts, tmp_path / "state", None), CLI_TIMEOUT)
    assert not list(tmp_path.glob("tiered-bench-ranks-*"))
    # torch.multiprocessing's file of each failed rank's traceback, in the same temp folder: it stayed behind.
    assert not list(tmp_path.glob("pytorch-errorfile-*"))


def test_optim_refuses_more_ranks_than_parameters_before_the_sweep(tmp_path, capsys):
    """--nproc 3 over --params 2 left a rank no parameter: the sweep ran, then the ranks, and the run ended with
    exit 1 and a rank's traceback. Now it is a usage error, one line, before anything is made."""
    data = tmp_path / "d"
    with pytest.raises(SystemExit) as exc:
        sys.exit(cli.main(["optim", "--dir", str(data), "--params", "2", "--nproc", "3", "--device", "cpu", *TINY]))
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert err == "tiered-bench: error: --nproc 3 is more than --params 2: each rank needs a parameter at least\n"
    assert not data.exists()
    OptimOptions(params=3, nproc=3, device="cpu").check()  # one each is enough


def test_a_ranks_usage_error_comes_back_as_one(tmp_path, monkeypatch):
    """A rank's UsageError (a bad argument only a rank could see) reaches the CLI as a UsageError with its own
    message (exit 2, one line), not as a failed measurement carrying the rank's traceback."""
    import tempfile

    from helpers import run_bounded

    from tiered.bench.ranks import run_ranks

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where run_ranks makes its results folder
    opts = OptimOptions(params=1, nproc=2, device="cpu", progress=False)  # past the check: rank 1 gets nothing
    with pytest.raises(UsageError) as exc:
        run_bounded(lambda: run_ranks(opts, tmp_path / "state", None), CLI_TIMEOUT)
    assert str(exc.value) == "the optimizer got an empty parameter list"
    assert not list(tmp_path.glob("tiered-bench-ranks-*")) and not list(tmp_path.glob("pytorch-errorfile-*"))


# Put first on the ranks' import path: each rank (a process multiprocessing spawned; not its resource tracker)
# notes how SIGINT stands as its interpreter starts, and where Python code installs a SIGINT handler later on.
SIGINT_PROBE = """
import os, signal, sys
def note(line):
    with open(os.path.join(os.environ["SIGINT_PROBE_DIR"], str(os.getpid())), "a") as f:
        f.write(line + "\\n")
def probed(signum, handler):
    if signum == signal.SIGINT:
        note("installed " + getattr(handler, "__name__", str(handler)) + " in " + sys._getframe(1).f_code.co_name)
    return real(signum, handler)
with open("/proc/self/cmdline", "rb") as f:
    rank = b"spawn_main" in f.read()
if rank:
    note("start " + ("ignored" if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else "handled"))
    real, signal.signal = signal.signal, probed
"""


def test_ranks_ignore_ctrl_c_until_they_run_their_own_code(tmp_path, monkeypatch):
    """A terminal's Ctrl-C (to the whole process group) while the ranks started, importing torch for seconds,
    raised KeyboardInterrupt in multiprocessing's bootstrap, outside any handler, and a rank printed its
    traceback under the CLI's "interrupted". The ranks now start with SIGINT ignored (the parent stops them on
    its own Ctrl-C) and take Ctrl-C again once in _rank_main, where torch's wrapper catches it quietly; the
    parent's handler is back as soon as they are spawned."""
    import tempfile

    from tiered.bench import ranks
    from tiered.bench.common import BenchFailure

    probe, notes = tmp_path / "probe", tmp_path / "notes"
    probe.mkdir()
    notes.mkdir()
    (probe / "sitecustomize.py").write_text(SIGINT_PROBE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(probe), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("SIGINT_PROBE_DIR", str(notes))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(ranks, "TIMEOUT_S", CLI_TIMEOUT)  # bounds the run: the ranks fail at once
    before = signal.getsignal(signal.SIGINT)
    opts = OptimOptions(params=1000, nproc=2, device="cpu", progress=False)
    opts.dtype = "fp12"  # a rank's own failure, once in _rank_main: the run ends there
    # On the main thread, as in the CLI: only there can a process change its signal handlers.
    with pytest.raises(BenchFailure, match="a rank failed"):
        ranks.run_ranks(opts, tmp_path / "state", None)
    assert signal.getsignal(signal.SIGINT) is before
    logs = [f.read_text().splitlines() for f in notes.iterdir()]
    assert len(logs) == 2, logs  # the two ranks
    for log in logs:
        assert log[0] == "start ignored", log
        assert "installed default_int_handler in _rank_main" in log, log


def test_a_rank_whose_parent_died_while_it_started_does_nothing(tmp_path, monkeypatch):
    """torch ends a rank on its parent's death with SIGINT (pdeathsig), which a starting rank ignores: one whose
    parent died meanwhile (SIGKILL, while the ranks imported torch) went on stepping for ever. Now it returns."""
    import multiprocessing

    import torch.distributed as dist

    from tiered.bench import ranks

    class Dead:
        def is_alive(self) -> bool:
            return False

    def init_process_group(*a, **kw):
        raise AssertionError("a rank with no parent went on to run")

    monkeypatch.setattr(multiprocessing, "parent_process", Dead)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    opts = OptimOptions(params=1000, nproc=1, device="cpu", progress=False)
    ranks._rank_main(0, 1, 0, opts, str(tmp_path / "state"), None, str(tmp_path), False)
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(not HAVE_OPTIMIZER, reason="tiered/optimizer.py has not landed yet")
@pytest.mark.parametrize("split, update_on", [(True, "device"), (None, "auto"), (False, "host")])
def test_optim_passes_the_layout_and_update_knobs(tmp_path, split, update_on):
    from tiered import TieredOptimizer

    class Recording(TieredOptimizer):
        made: list = []

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            Recording.made.append(self)

    opts = OptimOptions(
        params=300_000, host_budget=4 << 20, steps=1, warmup=0, device="cpu", dtype="bf16", progress=False,
        io=TINY_OPTS, split_masters=split, update_on=update_on, chunk_bytes=1 << 20,
    )  # fmt: skip
    with Workspace(tmp_path / "d") as ws:
        run_optim(opts, ws, optimizer_cls=Recording)
    opt = Recording.made[-1]
    # On a CPU model "auto" is the host, where split masters default to off.
    assert opt.update_on == ("host" if update_on == "auto" else update_on)
    assert opt.split_masters is bool(split) and (opt.stats()["split_chunks"] > 0) is bool(split)


# --------------------------------------------------------------------------------------------- tour
def test_tour_is_the_default_and_its_keys_are_stable(tmp_path):
    doc = bench_json("--dir", str(tmp_path / "d"), "--size", "8MiB", "--no-fio", "-q")
    assert set(doc) == TOUR_KEYS and doc["command"] == "tour"
    assert set(doc["io"]) == IO_KEYS - ENVELOPE
    assert set(doc["pcie"]) == PCIE_KEYS - ENVELOPE
    assert set(doc["optim"]) == OPTIM_RESULT and doc["optim"]["io"] is None  # the tour's io is at the top
    assert not (tmp_path / "d").exists()


def test_tour_refuses_a_size_below_its_largest_block_naming_its_own_flag(tmp_path, capsys):
    """`tour --size 4MiB` was refused over `--block-sizes`, a flag tour does not have: tour measures 8 MiB blocks,
    so its --size says its minimum, in the error and in --help."""
    data = tmp_path / "d"
    with pytest.raises(SystemExit) as exc:
        sys.exit(cli.main(["tour", "--dir", str(data), "--size", "4MiB", "--no-fio", "-q"]))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--block-sizes" not in err and not data.exists()
    assert "tour: --size must be at least 8 MiB" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit):
        cli.main(["tour", "--help"])
    assert "at least 8MiB" in " ".join(capsys.readouterr().out.split())


# ------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "args, words",
    [
        (["io", "--size", "lots"], "cannot parse size"),
        (["io", "--threads", "0"], "--threads"),
        (["io", "--threads", ","], "argument --threads: expected integers >= 1"),
        (["io", "--block-sizes", ","], "argument --block-sizes: expected a comma-separated list of sizes"),
        (["io", "--block-sizes", " "], "argument --block-sizes: expected a comma-separated list of sizes"),
        (["optim", "--steps", "-1"], "argument --steps: expected an integer >= 1, got '-1'"),
        (["optim", "--steps", "0"], "argument --steps: expected an integer >= 1, got '0'"),
        (["optim", "--warmup-steps", "-1"], "argument --warmup-steps: expected an integer >= 0, got '-1'"),
        (["io", "--loops", "0"], "--loops"),
        (["io", "--block-sizes", "1000"], "block_size"),
        (["io", "--direct", "maybe"], "--direct"),
        (["optim", "--params", "many"], "--params"),
        (["io", "--size", "1KiB"], "at least 1 MiB"),
        (["io", "--size", "8MiB", "--block-sizes", "16MiB"], "at most the test file's 8.00 MiB (--size)"),
        (["nosuch"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(tmp_path, capsys, args, words):
    data = tmp_path / "d"
    with pytest.raises(SystemExit) as exc:
        sys.exit(cli.main([*args, "--dir", str(data)] if args[0] != "nosuch" else args))
    assert exc.value.code == 2
    assert words in capsys.readouterr().err
    assert not data.exists()


@pytest.mark.parametrize(
    "args",
    [
        ["io", *TINY],
        ["tune", "--out", "OUT", *TINY],
        ["optim", "--params", "1M", "--steps", "1", *TINY],
        ["tour", "--size", "8MiB", "-q"],
        ["kv", "--layers", "1", "--context", "16", "--new-tokens", "2", "--caches", "dynamic,tiered"],
    ],
    ids=lambda args: args[0],
)
def test_a_bad_huge_pages_setting_is_one_line_before_anything_is_measured(tmp_path, args):
    """$TIERED_HUGE_PAGES is read by every host buffer the commands make: a value neither on nor off was a
    traceback from the first one (mid-measurement); now one line naming it, exit 1, as a bad $TIERED_IO_CONFIG."""
    out, data = tmp_path / "io.json", tmp_path / "d"
    p = bench(*(str(out) if a == "OUT" else a for a in args), "--dir", str(data), env={"TIERED_HUGE_PAGES": "bogus"})
    assert p.returncode == 1, p.stderr
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("tiered-bench: ") and "$TIERED_HUGE_PAGES='bogus'" in p.stderr, p.stderr
    assert not out.exists() and not data.exists()


def test_tune_refuses_a_block_larger_than_the_file_before_it_writes_one(tmp_path, capsys):
    """A typo (1TiB for 1MiB) measured what any block past the request measures, and tune wrote block_size 1 TiB
    into the file every optimizer loading it then asked buffers for."""
    out, data = tmp_path / "io.json", tmp_path / "d"
    args = ["tune", "--dir", str(data), "--out", str(out), "--size", "16MiB", "--block-sizes", "1MiB,1TiB", "-q"]
    with pytest.raises(SystemExit) as exc:
        sys.exit(cli.main([*args, "--threads", "2", "--loops", "1", "--no-fio"]))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--block-sizes: 1.00 TiB is larger than the test file" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists() and not data.exists()


@pytest.mark.parametrize("flag", ["--disk", "--ram", "--gpu"])
def test_a_size_past_floats_range_is_a_usage_error(capsys, flag):
    # A 310-digit size was an OverflowError traceback, exit 1, from deep in the plan's arithmetic.
    args = {"--gpu": "24GB", "--ram": "64GiB", "--disk": "1TB", flag: "1" + "0" * 310 + "TB"}
    with pytest.raises(SystemExit) as exc:
        sys.exit(cli.main(["plan", "--params", "1B", *(x for kv in args.items() for x in kv)]))
    assert exc.value.code == 2 and "beyond any machine" in capsys.readouterr().err


def test_bad_argument_in_a_subprocess_exits_2(tmp_path):
    p = bench("io", "--dir", str(tmp_path / "d"), "--size", "4 potatoes")
    assert p.returncode == 2 and "cannot parse size" in p.stderr and "Traceback" not in p.stderr


def test_unwritable_folder_exits_2_and_leaves_nothing(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    p = bench("io", "--dir", str(blocker / "sub" / "dir"), *TINY)
    assert p.returncode == 2, p.stderr
    assert "cannot write" in p.stderr and str(blocker) in p.stderr and "Traceback" not in p.stderr
    assert blocker.read_text() == "not a folder" and sorted(tmp_path.iterdir()) == [blocker]
    p = bench("tune", "--dir", str(tmp_path / "d"), "--out", str(blocker / "x.json"), *TINY)
    assert p.returncode == 2 and "--out" in p.stderr
    assert sorted(tmp_path.iterdir()) == [blocker]


def test_not_enough_free_space_states_the_need(tmp_path):
    p = bench("io", "--dir", str(tmp_path / "d"), "--size", "1000TiB", "--no-fio", "-q")
    assert p.returncode == 2, p.stderr
    assert "free" in p.stderr and "needs" in p.stderr
    assert not (tmp_path / "d").exists()


def room_for(monkeypatch, nbytes: int) -> None:
    """The disk under every folder has room for `nbytes` of benchmark files, and its margin, no more."""
    free = nbytes + workspace.FREE_MARGIN
    monkeypatch.setattr(workspace.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2 * free, free, free))


def test_without_fio_the_io_sweep_asks_room_for_one_file_at_a_time(tmp_path, monkeypatch):
    # With fio missing no comparison runs and its second file is never written, yet the default (fio on) asked
    # room for two: a --size that fit (and ran with --no-fio, measuring the same) was refused.
    monkeypatch.setattr(baselines.shutil, "which", lambda name: None)  # fio is not installed
    opts = dataclasses.replace(TINY_OPTS, fio=True)
    room_for(monkeypatch, opts.size)
    with Workspace(tmp_path / "d") as ws:
        res = run_io(opts, ws)
    assert res.fio is None and any("fio not found" in n for n in res.notes)
    assert not (tmp_path / "d").exists()


def test_room_refused_for_the_fio_comparisons_file_names_no_fio(tmp_path, monkeypatch):
    monkeypatch.setattr(baselines.shutil, "which", lambda name: "/usr/bin/fio")  # fio is there...
    monkeypatch.setattr(disk, "direct_supported", lambda folder: True)  # ...and will run: O_DIRECT works
    opts = dataclasses.replace(TINY_OPTS, fio=True)
    room_for(monkeypatch, opts.size)  # one file fits, two do not
    with pytest.raises(UsageError, match=r"two test files .* for the fio comparison.* or --no-fio \(then one file"):
        with Workspace(tmp_path / "d") as ws:
            run_io(opts, ws)
    assert not (tmp_path / "d").exists()


def test_ctrl_c_removes_the_temporary_files(tmp_path):
    data = tmp_path / "d"
    args = ["io", "--dir", str(data), "--size", "64MiB", "--block-sizes", "1MiB", "--threads", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tiered.cli", *args, "--loops", "1000", "--warmup", "0", "--no-fio", "-q"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not list(data.glob("tiered-bench-*/*.bin")):  # wait until it is writing its files
            assert proc.poll() is None and time.monotonic() < deadline, "the benchmark never started writing"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert not data.exists()


# ---------------------------------------------------------------------------------------- the parts
CTRL_C_AT_IMPORT_TORCH = """
import os, signal, sys

class CtrlC:  # a Ctrl-C that arrives while torch is being imported (the parser's first seconds)
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlC())
from tiered.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("args", [["--help"], ["io", "--size", "nonsense"]], ids=["help", "argument-error"])
def test_ctrl_c_while_the_commands_load_says_interrupted(args):
    # `--help` and argument errors wait for `import torch` (the checkpoint commands' package imports it): a
    # Ctrl-C then was a KeyboardInterrupt traceback from the import of tiered.cli.
    p = subprocess.run([sys.executable, "-c", CTRL_C_AT_IMPORT_TORCH, *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=CLI_TIMEOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert p.returncode == 130 and p.stderr.strip() == "tiered-bench: interrupted" and not p.stdout, p.stderr


def test_parse_count_reads_decimal_suffixes():
    assert parse_count("50M") == 50_000_000
    assert parse_count("1.5B") == 1_500_000_000
    assert parse_count("7e6") == 7_000_000 and parse_count(123) == 123
    for bad in ("", "x", "0", "1.5"):
        with pytest.raises(ValueError):
            parse_count(bad)
    for huge in ("1e400", "1e100", "2000T"):  # 1e400 is inf: int() of it raised OverflowError, a traceback
        with pytest.raises(ValueError, match="beyond any model"):
            parse_count(huge)


@pytest.mark.parametrize("text, n", [("8.03B", 8_030_000_000), ("4.1B", 4_100_000_000), ("1.07B", 1_070_000_000),
                                     ("0.3M", 300_000), ("2.5e3", 2500), ("16.4k", 16_400)])  # fmt: skip
def test_parse_count_reads_decimals_exactly(text, n):
    # 8.03 * 1e9 is 8029999999.999999 in floats: Llama 3 8B's count, which `plan --config` prints, was refused.
    assert parse_count(text) == n


def test_a_count_whose_exponent_is_past_any_number_is_a_usage_error():
    # Decimal raised InvalidOperation (not a ValueError) past its exponent range: a traceback, exit 1.
    with pytest.raises(ValueError, match="beyond any model"):
        parse_count("1e99999999999999999999")
    p = bench("plan", "--params", "1e99999999999999999999")
    assert p.returncode == 2 and "beyond any model" in p.stderr and "Traceback" not in p.stderr, p.stderr


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=10**5), st.integers(min_value=0, max_value=99), st.sampled_from([1, 2]),
       st.sampled_from(["", "k", "M", "B"]))  # fmt: skip
def test_parse_count_decimals_property(whole, frac, places, unit):
    frac %= 10**places
    text = f"{whole}.{frac:0{places}d}{unit}"
    scaled = (whole * 10**places + frac) * {"": 1, "k": 10**3, "M": 10**6, "B": 10**9}[unit]
    if scaled % 10**places == 0 and scaled >= 10**places:
        assert parse_count(text) == scaled // 10**places, text
    else:
        with pytest.raises(ValueError, match="whole number >= 1"):
            parse_count(text)


def test_a_reader_that_goes_away_ends_the_output_silently():
    # `tiered-bench plan ... | head` where head has exited: "BrokenPipeError", exit 1, as for a failed measurement.
    cmd = [sys.executable, "-m", "tiered.cli", "plan", "--gpu", "24GB", "--ram", "64GiB", "--disk", "1TB",
           "--params", "10B", "--json"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # no reader: the first write fails
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=TIMEOUT) == 141 and err == ""


def test_figures_keep_four_places_and_never_round_a_measured_value_to_zero():
    # A fast disk's floor for a toy KV cache is ~3e-5 s a token: four decimal places alone made it 0.0, and
    # `tiered-bench kv` reported no disk floor at all (a CI run on a faster disk failed this way).
    assert figure(3.2123456e-5) == 3.212e-5 and figure(0.00004) == 0.00004 and figure(-1.23456e-7) == -1.235e-7
    assert figure(6.178123) == 6.1781 and figure(1464.123456) == 1464.1235 and figure(0.0) == 0.0
    assert figure(float("inf")) == float("inf")
    assert rounded({"floor": [3.2123456e-5, {"s": 2.0000001}], "n": 3}) == {"floor": [3.212e-5, {"s": 2.0}], "n": 3}
    assert Stat.of([2e-5, 1e-5, 3e-5]).median == 2e-5 > 0


def test_workspace_keeps_a_folder_it_did_not_make(tmp_path):
    keep = tmp_path / "mine.txt"
    keep.write_text("x")
    with Workspace(tmp_path) as ws:
        ws.path("f.bin").write_bytes(b"1")
    assert sorted(tmp_path.iterdir()) == [keep]
    with pytest.raises(UsageError, match="needs"):
        with Workspace(tmp_path / "a" / "b") as ws:
            ws.require_free(1 << 60, "a test")
    assert sorted(tmp_path.iterdir()) == [keep]


def test_a_folder_another_run_makes_meanwhile_is_used_and_left_to_it(tmp_path, monkeypatch):
    """Two runs starting together on the same new --dir: the one whose mkdir came second was refused ("File
    exists"). It now uses the folder, and leaves it to the run that made it."""
    root, theirs = tmp_path / "a" / "b", tmp_path / "a"
    real = os.mkdir

    def the_other_run_first(path, *args, **kw):
        if Path(path) == theirs:
            real(path)  # between this run's exists() and its mkdir
        return real(path, *args, **kw)

    monkeypatch.setattr(workspace.os, "mkdir", the_other_run_first)
    with Workspace(root) as ws:
        ws.path("f.bin").write_bytes(b"1")
    assert theirs.is_dir() and not root.exists()


@pytest.mark.parametrize("command", ["io", "kv"])
def test_a_new_folder_another_run_still_uses_is_left_as_the_help_says(tmp_path, capsys, command):
    """Two runs in one new --dir: the one that made it ends first and leaves it (and the other's files) alone; the
    other did not make it, so it stays, empty. The help said the folder a run made is removed afterwards."""
    root = tmp_path / "new"
    with Workspace(root) as first:
        second = Workspace(root).__enter__()
        first.path("f.bin").write_bytes(b"1")
    try:
        assert second.dir is not None and second.dir.is_dir()
    finally:
        second.close()
    assert root.is_dir() and os.listdir(root) == []
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "(and the folder, if this run created it and no other run still uses it then) is removed" in help_text


def test_run_io_in_process_matches_the_sweep_asked_for(tmp_path):
    opts = IoOptions(
        size=8 << 20, block_sizes=(1 << 20, 2 << 20), threads=(1, 2), warmup=0, loops=2, fio=False, progress=False
    )
    with Workspace(tmp_path) as ws:
        res = run_io(opts, ws)
    assert [(r.block_size, r.threads) for r in res.sweep] == [(1 << 20, 1), (1 << 20, 2), (2 << 20, 1), (2 << 20, 2)]
    assert all(len(r.read_gbps.samples) == 2 for r in res.sweep)
    best = max(res.sweep, key=lambda r: r.read_gbps.median)
    assert (res.best_read.block_size, res.best_read.threads) == (best.block_size, best.threads)


def test_validate_catches_a_corrupted_page(tmp_path):
    cfg = IOConfig(block_size=1 << 20, threads=2)
    path = tmp_path / "f.bin"
    with (
        PinnedBufferPool(3 << 20) as pool,
        ring.Ring(pool, 2, 1 << 20, pattern=True) as slots,
        pool.acquire(1 << 20) as scratch,
        IOEngine(cfg) as engine,
    ):
        ring.stream(engine, slots, path, 2 << 20, write=True)
        ring.validate(engine, slots, scratch, path, 2 << 20)  # intact: passes
        with open(path, "r+b") as f:
            f.seek((1 << 20) + 5 * 4096 + 100)
            f.write(b"\xff\x00")
        with pytest.raises(ring.ValidationError, match=f"offset {(1 << 20) + 5 * 4096}"):
            ring.validate(engine, slots, scratch, path, 2 << 20)


def test_measure_config_refuses_a_file_size_of_no_whole_pages(tmp_path):
    """Its ring's buffers are charged in whole pages: a file of 5000 bytes sized the pool short of them, and the
    second ring waited for a buffer for ever (`tiered-bench kv --disk-size 5000`). Callers round (run_io, kv)."""
    from helpers import run_bounded

    cfg = IOConfig(block_size=1 << 20, threads=2)
    with Workspace(tmp_path / "d") as ws:
        for size in (5000, 0, (1 << 20) + 8):
            with pytest.raises(ValueError, match="whole number of 4096-byte pages"):
                run_bounded(lambda size=size: disk.measure_config(cfg, ws, TINY_OPTS, size, "x"))


def test_optim_reports_a_disk_too_small_for_the_state_as_a_usage_error(tmp_path):
    """The optimizer checks the room its state needs (only it knows its layout): ENOSPC becomes exit code 2."""

    class Full(FakeOptimizer):
        def __init__(self, *a, **kw):
            raise OSError(errno.ENOSPC, "nvme_path has 1 MiB free, the optimizer state needs 12 MiB on disk")

    opts = OptimOptions(params=1_000_000, steps=1, warmup=0, device="cpu", progress=False, io=TINY_OPTS)
    with Workspace(tmp_path / "d") as ws, pytest.raises(UsageError, match="needs 12 MiB"):
        run_optim(opts, ws, optimizer_cls=Full)
    assert not (tmp_path / "d").exists()


def _which(name: str) -> bool:
    import shutil

    return shutil.which(name) is not None


# ----------------------------------------------------------------------- what a new user meets first
@pytest.mark.skipif(not HAVE_OPTIMIZER, reason="needs tiered.optimizer")
@pytest.mark.parametrize(
    "args, words",
    [
        (["--host-budget", "1MiB", "--chunk-bytes", "64MiB"], "cannot hold one state chunk"),
        # the smallest chunks (1024 parameters, 12 KiB): lowering chunk_bytes cannot help, so it is not offered
        (["--host-budget", "4KiB", "--chunk-bytes", "4KiB"], "raise host_budget to at least 12KiB (chunk_bytes"),
        (["--chunk-bytes", "0"], "chunk_bytes"),
    ],
)
def test_optim_refuses_knobs_the_optimizer_refuses_before_the_sweep(tmp_path, monkeypatch, capsys, args, words):
    """A host budget that cannot hold one chunk (the optimizer's own check) is refused before the io sweep
    spends a minute on the disk: exit 2, the optimizer's message, the sweep never started."""
    import tiered.bench.optim as optim_mod

    def no_sweep(*a, **kw):
        raise AssertionError("the io sweep ran before the arguments were checked")

    monkeypatch.setattr(optim_mod, "run_io", no_sweep)
    code = cli.main(["optim", "--params", "20M", *args, "--device", "cpu", "--dir", str(tmp_path / "d"), *TINY])
    assert code == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


@pytest.mark.skipif(not HAVE_OPTIMIZER, reason="needs tiered.optimizer")
@pytest.mark.parametrize(
    "args, room, words",
    [  # room: (host memory available, disk free) as this test's machine reports them
        (["--params", "1T"], (64 << 30, 1 << 50), ["--params 1,000,000,000,000 needs 7.28 TiB of host memory",
                                                    "64.00 GiB is available"]),
        (["--params", "2B", "--dtype", "bf16"], (4 << 30, 1 << 50), ["needs 7.45 GiB of host memory for"]),
        (["--params", "20M", "--host-budget", "16MiB", "--chunk-bytes", "4MiB"], (64 << 30, 1 << 20),
         ["has 1.00 MiB free, the optimizer state needs", "on disk", "raise host_budget"]),
        (["--params", "20M", "--host-budget", "16MiB", "--chunk-bytes", "4MiB", "--nproc", "2"],
         (64 << 30, 1 << 20), ["the optimizer state of 2 ranks needs"]),
        # The state the optimizer keeps in memory, up to the host budget, beside the parameters: 153 MiB of these
        # fit 256 MiB, not with 229 MiB of state (it passed, and the OOM killer ended the run).
        (["--params", "20M", "--host-budget", "1GiB", "--chunk-bytes", "4MiB"], (256 << 20, 1 << 50),
         ["needs 381.", "parameters and their gradients (152.59 MiB) and the optimizer state kept in memory up to "
          "the --host-budget (228.", "256.00 MiB is available here: use a smaller --params or --host-budget"]),
        (["--params", "20M", "--host-budget", "1GiB", "--chunk-bytes", "4MiB", "--nproc", "2"],
         (256 << 20, 1 << 50), ["up to the --host-budget of each of 2 ranks (2"]),
    ],
)  # fmt: skip
def test_optim_refuses_a_run_the_machine_cannot_hold_before_the_sweep(tmp_path, monkeypatch, capsys, args, room, words):
    """Parameters whose synthetic values and gradients, with the state kept in memory up to the host budget,
    exceed the host memory available (they used to be made one tensor at a time until the OOM killer ended the
    run, or another process), or whose state beyond the host budget exceeds the free disk, are refused before
    the io sweep: one line, exit 2, nothing left."""
    import shutil

    import tiered.bench.optim as optim_mod
    import tiered.checkpoint.convert as convert

    def no_sweep(*a, **kw):
        raise AssertionError("the io sweep ran before the room was checked")

    monkeypatch.setattr(optim_mod, "run_io", no_sweep)
    monkeypatch.setattr(convert, "available_memory", lambda: room[0])
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 50, 0, room[1]))
    code = cli.main([*["optim", *args], "--device", "cpu", "--dir", str(tmp_path / "d"), *TINY])
    err = capsys.readouterr().err
    assert code == 2, err
    assert all(w in err for w in words), err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "d").exists()


def test_io_by_default_sweeps_the_quick_grid_and_full_the_whole_one():
    from tiered.bench.io_types import FULL_SWEEP, QUICK_SWEEP

    parser = cli.build_parser()
    quick = commands_io_options(parser, ["io"])
    full = commands_io_options(parser, ["io", "--full"])
    tune = commands_io_options(parser, ["tune"])
    assert (quick.size, quick.block_sizes, quick.threads) == (QUICK_SWEEP.size, QUICK_SWEEP.block_sizes,
                                                               QUICK_SWEEP.threads)  # fmt: skip
    assert len(quick.configs()) == 6 and len(full.configs()) == len(tune.configs()) == 12
    assert 32 in quick.threads and 1 << 20 in quick.block_sizes  # the engine's default configuration is measured
    assert full.size == tune.size == FULL_SWEEP.size
    mine = commands_io_options(parser, ["io", "--full", "--size", "64MiB", "--threads", "2"])
    assert mine.size == 64 << 20 and mine.threads == (2,) and mine.block_sizes == FULL_SWEEP.block_sizes
    optim = commands_io_options(parser, ["optim"])
    assert optim.size == 1 << 30 and len(optim.configs()) == 6


def test_io_measures_the_grid_winners_first_and_a_users_lists_in_their_order():
    """A budget cuts the sweep's tail: the GPU machine's winners (64 and 32 threads x 1 MiB, 8 x 8 MiB) come
    first, so that what a short budget leaves out lost there."""
    from tiered.bench.io_types import QUICK_SWEEP

    parser = cli.build_parser()
    pairs = [(c.block_size, c.threads) for c in commands_io_options(parser, ["io"]).configs()]
    assert pairs[:3] == list(QUICK_SWEEP.first) == [(1 << 20, 64), (1 << 20, 32), (8 << 20, 8)]
    assert sorted(pairs) == sorted((b, t) for b in QUICK_SWEEP.block_sizes for t in QUICK_SWEEP.threads)
    mine = commands_io_options(parser, ["io", "--threads", "8,64", "--block-sizes", "1MiB"]).configs()
    assert [c.threads for c in mine] == [8, 64]


def commands_io_options(parser, argv):
    from tiered.bench.commands import _io_options

    return _io_options(parser.parse_args(argv))


def test_io_progress_names_each_configuration_and_the_time_left(tmp_path):
    """Without -q a line on stderr says which configuration runs and, once a pass is done, the time left."""
    args = ["io", "--dir", str(tmp_path / "d"), "--size", "8MiB", "--block-sizes", "1MiB,2MiB", "--threads", "2"]
    p = bench(*args, "--warmup", "0", "--loops", "1", "--no-fio")
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("io sweep:")]
    assert any("configuration 1 of 2, block 1.00 MiB, 2 threads" in ln for ln in lines), p.stderr
    assert any("configuration 2 of 2, block 2.00 MiB, 2 threads" in ln and "s left" in ln for ln in lines), p.stderr
    quiet = bench(*args, "--warmup", "0", "--loops", "1", "--no-fio", "-q")
    assert quiet.returncode == 0 and "io sweep:" not in quiet.stderr


def test_io_is_bounded_in_time_and_says_what_it_left_out(tmp_path, monkeypatch):
    """A budget the first timed pass already spends: the first configuration keeps that pass, the others and the
    baselines are left out, and a note says so and how to get them."""
    monkeypatch.setattr(disk.baselines, "passes", lambda **kw: 2)  # as if fio were installed
    opts = dataclasses.replace(TINY_OPTS, threads=(1, 2, 4), loops=3, fio=True, budget_s=1e-3)
    with Workspace(str(tmp_path / "d")) as ws:
        res = run_io(opts, ws)
    assert len(res.sweep) == 1 and len(res.sweep[0].read_gbps.samples) == 1 and res.fio is None
    assert not res.complete and res.budget_s == 1e-3 and res.seconds >= 0
    (note,) = [n for n in res.notes if "time budget" in n]
    assert "2 of 3 configurations" in note and "2 of 3 timed loops" in note and "fio" in note and "--full" in note
    with Workspace(str(tmp_path / "d")) as ws:
        whole = run_io(dataclasses.replace(TINY_OPTS, threads=(1, 2)), ws)  # no budget: everything
    assert whole.complete and len(whole.sweep) == 2 and not [n for n in whole.notes if "budget" in n]


def test_io_progress_counts_the_pass_a_budget_never_skips(tmp_path, monkeypatch, capsys):
    """The first configuration's warm-up and first timed pass run whatever the budget: where the warm-up had spent
    it, the line said "about 0 s left" with a whole pass to come. The time left now counts that pass."""
    from tiered.bench.common import SweepProgress

    monkeypatch.setattr(SweepProgress, "elapsed", lambda self: 10.0 * self.done)  # each pass takes 10 s
    opts = dataclasses.replace(TINY_OPTS, warmup=1, loops=3, budget_s=1.0, progress=True)
    with Workspace(str(tmp_path / "d")) as ws:
        res = run_io(opts, ws)
    lines = capsys.readouterr().err.splitlines()
    assert "io sweep: first pass done; 10 s so far, about 10 s left (--budget)" in lines, lines
    assert len(res.sweep[0].read_gbps.samples) == 1 and not res.complete  # that pass, then the budget ended it


def test_io_budget_flag(tmp_path):
    """--budget defaults to QUICK_BUDGET_S for io, none with --full; 0 is none; a negative one is refused."""
    from tiered.bench import commands
    from tiered.bench.io_types import QUICK_BUDGET_S

    parser = cli.build_parser()
    for argv, want in ((["io"], QUICK_BUDGET_S), (["io", "--full"], None), (["io", "--budget", "0"], None),
                       (["io", "--budget", "7.5"], 7.5), (["tune"], None)):  # fmt: skip
        assert commands._io_options(parser.parse_args(argv)).budget_s == want, argv
    p = bench("io", "--dir", str(tmp_path), "--budget", "-1")
    assert p.returncode == 2 and "--budget" in p.stderr


@pytest.mark.skipif(not HAVE_OPTIMIZER, reason="needs tiered.optimizer")
def test_optim_report_gives_one_floor_ratio_and_names_each_counter_once(tmp_path):
    """The optimizer's own ratio, against a rate cached by another run under another load, is not shown beside
    the report's, which uses this run's sweep; and the per-step bytes not read from NVMe and the store's pins
    that found a record in memory (read-ahead included) are not both called hits."""
    import platform

    cache = tmp_path / "cache"
    cache.mkdir()
    dev = os.stat(tmp_path).st_dev
    stale = {"read_gbps": 0.05, "write_gbps": 0.05, "date": "2020-01-01", "host": platform.node()}
    (cache / "disk_rates.json").write_text(json.dumps({f"dev-{dev}": stale, f"{platform.node()}:dev-{dev}": stale}))
    args = ["optim", "--params", "2M", "--host-budget", "8MiB", "--chunk-bytes", "1MiB", "--steps", "2",
            "--device", "cpu", "--dir", str(tmp_path / "d"), *TINY]  # fmt: skip
    p = bench(*args, env={"TIERED_CACHE_DIR": str(cache), "TIERED_IO_CONFIG": ""})
    assert p.returncode == 0, p.stderr
    ratios = [ln for ln in p.stdout.splitlines() if re.search(r"step / floor\s+[\d.]|[\d.]+x the disk floor", ln)]
    assert len(ratios) == 1 and "this run's io sweep" in ratios[0], p.stdout
    assert "optimizer     step" in p.stdout  # the optimizer's own line is still there, without its ratio
    assert "hit" not in p.stdout and "not read from NVMe" in p.stdout, p.stdout


@pytest.mark.parametrize("command", [["io"], ["kv"]])
def test_an_empty_dir_is_refused_by_name_not_taken_for_the_current_folder(tmp_path, command):
    """`--dir "$SCRATCH"` with the variable unset passes "": the run would write in the current folder."""
    p = bench(*command, "--dir", "", cwd=tmp_path)
    assert p.returncode == 2 and '--dir is empty ("")' in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert list(tmp_path.iterdir()) == []
