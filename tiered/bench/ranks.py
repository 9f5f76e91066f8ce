"""`tiered-bench optim --nproc N`: N ranks, one process each, stepping at the same time on one disk.

Each rank holds ``params / N`` of the synthetic parameters (its shard, as under FSDP2 or ZeRO) in its own
TieredOptimizer, whose private folder sits under the same root: so the ranks share the disk as the ranks
of one machine do. Before every step the ranks meet at a barrier, as a training step's collectives make
them, so their reads and writes contend. Each rank hands back its own figures; the caller adds their
bytes (one disk moved them all) and takes the slowest rank's step time (the next step waits for it).

Process groups: gloo on CPU, NCCL on GPUs (rank r on GPU r modulo the GPUs there are).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch

from tiered.interrupts import deferred_sigint

from .common import BenchFailure, UsageError

TIMEOUT_S = 3600.0  # the whole run, all ranks: only reached when a rank hangs
TERM_WAIT_S = 5.0  # for all ranks to end on SIGTERM; one that has not (it ignores it) then gets SIGKILL
KILL_WAIT_S = 10.0  # for all killed ranks to be gone: SIGKILL ends one at once unless the kernel holds it in I/O


def run_ranks(opts: Any, state_root: Any, cfg: Any) -> list[tuple[dict[str, Any], list[dict[str, float]]]]:
    """Each rank's (last stats, timed steps' `last_step`), in rank order. On every way out (a rank failed,
    Ctrl-C, a hang) the ranks are stopped and the folder of their results is removed, with Ctrl-C held
    meanwhile: a second press (or a SIGTERM) then ends the run once the cleanup is done, not part-way through it."""
    import torch.multiprocessing as mp

    out: str | None = None
    ctx = None
    # Held from the ``finally``'s first line: a hold opened inside it came too late for a press pending as it began
    # (a second Ctrl-C right after the one that stopped the wait), which skipped the cleanup. So one block, opened
    # before the ``try``, lets signals through while the ranks run and holds them again with an assignment.
    with deferred_sigint(lets_through=True) as sigint:
        try:
            sigint.through = True
            out = tempfile.mkdtemp(prefix="tiered-bench-ranks-")
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            with sigint_ignored() as interruptible:
                args = (opts.nproc, port, opts, str(state_root), cfg, out, interruptible)
                ctx = mp.start_processes(_rank_main, args=args, nprocs=opts.nproc, join=False, start_method="spawn")
            deadline = time.monotonic() + TIMEOUT_S
            try:
                while not ctx.join(timeout=1.0):
                    if time.monotonic() > deadline:
                        raise BenchFailure(f"{opts.nproc} ranks did not finish within {TIMEOUT_S:.0f} s")
            except mp.ProcessRaisedException as e:  # a rank's exception, with its traceback as text
                # A bad argument: its one line and exit 2, as in a run of one process. Any rank's: the rank that
                # failed first may be one whose group the bad argument's rank left while it was still joining.
                usages = [os.path.join(out, f"rank{r}.usage") for r in (e.error_index, *range(opts.nproc))]
                usage = next((u for u in usages if os.path.exists(u)), None)
                if usage is not None:
                    with open(usage) as f:
                        raise UsageError(f.read()) from None
                raise BenchFailure(f"a rank failed: {e}") from None
            results = []
            for rank in range(opts.nproc):
                with open(os.path.join(out, f"rank{rank}.pkl"), "rb") as f:
                    results.append(pickle.load(f))
            return results
        finally:
            # Held: a press cutting this short left ranks stepping into --dir after the Workspace removed it, and
            # this folder behind, while the CLI said the files were removed.
            sigint.through = False
            stop(ctx.processes if ctx is not None else [])
            if out is not None:
                shutil.rmtree(out, ignore_errors=True)
            # torch's files of the failed ranks' tracebacks, in the temp folder too: it leaves them there. After
            # stop: no rank writes one any more.
            for name in ctx.error_files if ctx is not None else []:
                with contextlib.suppress(FileNotFoundError):  # only a rank that raised wrote one
                    os.unlink(name)


@contextlib.contextmanager
def sigint_ignored() -> Iterator[bool]:
    """SIGINT ignored in this process while it spawns the ranks, which keep it through exec: a Ctrl-C to the
    terminal's process group while a rank starts (seconds importing torch) raised KeyboardInterrupt in
    multiprocessing's bootstrap, outside any handler, and the rank printed its traceback. The ranks take Ctrl-C
    again in ``_rank_main``; meanwhile this process stops them on its own Ctrl-C, which it handles again as soon
    as they are spawned (a press within the spawn itself, milliseconds, is lost). Yields whether the ranks are
    to take Ctrl-C: not where it was ignored already (``nohup``, a shell's background job). Off the main thread
    (no signal handler can change there), or where a handler not set from Python is installed, nothing changes."""
    import threading

    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield previous is not signal.SIG_IGN
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield previous is not signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def stop(processes: list[Any]) -> None:
    """End every process still alive: SIGTERM to all, then SIGKILL to any not gone within ``TERM_WAIT_S``, then
    wait up to ``KILL_WAIT_S`` for those (dead before their folders go, so no result lands in a removed one).
    Each wait is over all of them at once, so the whole takes at most the two waits, however many ranks."""
    alive = [p for p in processes if p.is_alive()]
    for end, wait in (("terminate", TERM_WAIT_S), ("kill", KILL_WAIT_S)):
        for p in alive:
            getattr(p, end)()
        deadline = time.monotonic() + wait
        for p in alive:
            p.join(max(0.0, deadline - time.monotonic()))
        alive = [p for p in alive if p.is_alive()]


def _rank_main(
    rank: int, world: int, port: int, opts: Any, state_root: str, cfg: Any, out: str, interruptible: bool
) -> None:
    if interruptible:  # SIGINT came ignored (sigint_ignored); from here torch's wrapper ends a rank on it quietly
        signal.signal(signal.SIGINT, signal.default_int_handler)
    parent = multiprocessing.parent_process()
    if parent is not None and not parent.is_alive():  # its death's signal (torch's pdeathsig: SIGINT) was ignored
        return
    import torch.distributed as dist

    from tiered import TieredOptimizer

    from .steps import DTYPES, synthetic_params, time_steps

    cuda = opts.device == "cuda" or (opts.device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        share = opts.params // world + (rank < opts.params % world)
        params = synthetic_params(share, device, DTYPES[opts.dtype])
        quiet = type(opts)(**{**vars(opts), "progress": opts.progress and rank == 0})
        stats, lasts, _ = time_steps(quiet, TieredOptimizer, params, state_root, cfg, cuda, before_step=dist.barrier)
    except BaseException as e:
        # The usage error's file first: leaving the group ends the other ranks' connections, and a rank still
        # joining it then fails too, which the parent may hear of first (it looks for any rank's file).
        if isinstance(e, UsageError):  # for the parent to raise again (the error file holds only text)
            with open(os.path.join(out, f"rank{rank}.usage"), "w") as f:
                f.write(str(e))
        dist.destroy_process_group()
        raise RuntimeError(f"rank {rank}:\n{traceback.format_exc()}") from None
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump((stats, lasts), f)
