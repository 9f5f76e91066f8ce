"""Running a test body on N ranks (processes), bounded in time, with each rank's result handed back.

``run_ranks(fn, world, *args)`` spawns ``world`` processes; each calls ``fn(rank, world, *args)`` inside an
initialized process group (gloo on CPU; ``backend="cuda:nccl,cpu:gloo"`` puts rank r on GPU r) and returns a
picklable result; ``run_ranks`` returns the results in rank order, fails with every failed rank's traceback
(the likely first cause first: not a lost peer), names a rank that died without a result, and fails a test
whose ranks hang. ``fn`` must be a module-level function (the rank processes import it by name).

CPU ranks (gloo) start from a fork server that has imported torch and its distributed packages once (each fresh
interpreter importing torch took 3-5 s of a 2-core CI machine's time, a rank, a test); each rank is forked from it
clean (no torch op has run there, no CUDA, no thread pool), takes the test process's environment and working folder
as a spawned rank would, and runs the interpreter's exit handlers when it ends as one would. Ranks on CUDA (nccl)
are spawned.
"""

from __future__ import annotations

import atexit
import datetime
import os
import pickle
import socket
import tempfile
import time
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import TIMEOUT

# All ranks together: each is a spawned interpreter that imports torch and joins a process group before the body
# runs; only reached when something hangs.
RANKS_TIMEOUT = 8 * TIMEOUT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the fork server imports before it forks any rank: nothing that runs a torch op (a thread pool started
# before a fork is not the child's) or touches CUDA.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint"]


def _context(backend: str):
    if "nccl" in backend:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _entry(rank: int, world: int, port: int, out: str, backend: str, fn, args, env: dict, cwd: str, forked: bool
           ) -> None:  # fmt: skip
    # A forked rank has the fork server's environment and folder: the test process's, as a spawned rank has.
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))  # fmt: skip
    result: dict = {}
    try:
        if "nccl" in backend:
            import torch

            torch.cuda.set_device(rank)
        # A bounded wait: a rank that dies (a test's SIGKILL) makes the others' collectives fail, not hang. The
        # ranks meet through a file, not a TCP port: two test runs at once (CI on a loaded machine) once picked the
        # same free port between its probe and its bind (EADDRINUSE). MASTER_* stay set for the frameworks that
        # read them.
        store = dist.FileStore(os.path.join(out, "rendezvous"), world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))  # fmt: skip
        try:
            result["value"] = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - handed back to the test process
        result["error"] = f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"
    try:
        data = pickle.dumps(result)
    except Exception as e:  # noqa: BLE001 - a value that does not pickle is the test's error, said as one
        data = pickle.dumps({"error": f"rank {rank}: its result does not pickle: {type(e).__name__}: {e}"})
    # Written whole or not at all (a rank killed as it wrote left an empty file, read as "Ran out of input").
    path = os.path.join(out, f"rank{rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)
    if forked:  # a forked process ends in os._exit: run what a spawned rank's interpreter runs at its exit
        atexit._run_exitfuncs()


def run_ranks(fn, world: int, *args, timeout: float = RANKS_TIMEOUT, backend: str = "gloo", allow_missing: bool = False
              ) -> list:  # fmt: skip
    """``allow_missing``: a rank that left no result (it was killed, as a test may do on purpose) gives None
    instead of failing the run."""
    out = tempfile.mkdtemp(prefix="ranks-")
    port = _free_port()
    ctx = _context(backend)
    env, cwd, forked = dict(os.environ), os.getcwd(), ctx.get_start_method() != "spawn"
    procs = [ctx.Process(target=_entry, args=(rank, world, port, out, backend, fn, args, env, cwd, forked))
             for rank in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        if hung:
            raise AssertionError(f"ranks {hung} of {world} did not finish within {timeout:.0f} s")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    results, errors = [], []
    for rank, p in enumerate(procs):
        path = os.path.join(out, f"rank{rank}.pkl")
        if not os.path.exists(path):
            if not allow_missing:
                errors.append(f"rank {rank}: left no result (exit code {p.exitcode}: killed or crashed)")
            results.append(None)
            continue
        with open(path, "rb") as f:
            r = pickle.load(f)
        if "error" in r:
            errors.append(r["error"])
        results.append(r.get("value"))
    if errors:
        # The rank that failed first is the one to read: the others then lose their peer ("Connection closed
        # by peer") or time out waiting for it, so those errors go last.
        errors.sort(key=lambda e: any(k in e for k in _CONSEQUENCES))
        raise AssertionError("\n\n".join(errors))
    return results


_CONSEQUENCES = ("Connection closed by peer", "Connection reset by peer", "remote worker", "Timed out", "timed out")
