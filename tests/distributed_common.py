"""Running a test body on N ranks (processes), bounded in time, with each rank's result handed back.

``run_ranks(fn, world, *args)`` spawns ``world`` processes; each calls ``fn(rank, world, *args)`` inside an
initialized process group (gloo on CPU; ``backend="cuda:nccl,cpu:gloo"`` puts rank r on GPU r) and returns a
picklable result; ``run_ranks`` returns the results in rank order, fails with every failed rank's traceback
(the likely first cause first: not a lost peer), names a rank that died without a result, and fails a test
whose ranks hang. ``fn`` must be a module-level function (spawned processes import
it by name).
"""

from __future__ import annotations

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


def _entry(rank: int, world: int, port: int, out: str, backend: str, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))  # fmt: skip
    result: dict = {}
    try:
        if "nccl" in backend:
            import torch

            torch.cuda.set_device(rank)
        # A bounded wait: a rank that dies (a test's SIGKILL) makes the others' collectives fail, not hang.
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        try:
            result["value"] = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - handed back to the test process
        result["error"] = f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"
    with open(os.path.join(out, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_ranks(fn, world: int, *args, timeout: float = RANKS_TIMEOUT, backend: str = "gloo", allow_missing: bool = False
              ) -> list:  # fmt: skip
    """``allow_missing``: a rank that left no result (it was killed, as a test may do on purpose) gives None
    instead of failing the run."""
    out = tempfile.mkdtemp(prefix="ranks-")
    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(rank, world, port, out, backend, fn, args)) for rank in range(world)]
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
