"""Running a test body on N ranks (processes), bounded in time, with each rank's result handed back.

``run_ranks(fn, world, *args)`` spawns ``world`` processes; each calls ``fn(rank, world, *args)`` inside an
initialized process group (gloo on CPU; ``backend="cuda:nccl,cpu:gloo"`` puts rank r on GPU r) and returns a
picklable result; ``run_ranks`` returns the results in rank order, re-raises the first rank's failure with its
traceback, and fails a test whose ranks hang. ``fn`` must be a module-level function (spawned processes import
it by name).
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = 240.0  # seconds for all ranks together: only reached when something hangs


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
        dist.init_process_group(backend, rank=rank, world_size=world)
        try:
            result["value"] = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - handed back to the test process
        result["error"] = f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"
    with open(os.path.join(out, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_ranks(fn, world: int, *args, timeout: float = TIMEOUT, backend: str = "gloo") -> list:
    out = tempfile.mkdtemp(prefix="ranks-")
    ctx = mp.start_processes(_entry, args=(world, _free_port(), out, backend, fn, args), nprocs=world, join=False,
                             start_method="spawn")  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise AssertionError(f"{world} ranks did not finish within {timeout:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = []
    for rank in range(world):
        with open(os.path.join(out, f"rank{rank}.pkl"), "rb") as f:
            r = pickle.load(f)
        if "error" in r:
            raise AssertionError(r["error"])
        results.append(r["value"])
    return results
