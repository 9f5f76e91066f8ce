"""Does Python that holds the GIL slow the engine? `tiered-bench io`'s pass at each shape, with nothing else
running and with one pure-Python thread spinning beside it, in mirrored rounds.

    python3 bench/gil_busy.py --dir /root/gil [--size 2GiB] [--shapes 32x1MiB,aio:32x1MiB,8x8MiB] [--rounds 2]

Why: a step's reads run ahead under the next forward and backward, whose Python (module code, autograd hooks,
FSDP2's) holds the GIL between kernels. An engine thread whose pread returns must take the GIL back before it
queues its next request; a thread that runs Python keeps it up to the interpreter's switch interval (5 ms), so
with one 1 MiB request a thread, each thread may wait that long for every MiB. Kernel AIO (``aio:``) takes the
GIL once for a batch of completions. Each pass is tiered.bench.disk.measure_config's (a file laid out, then
overwritten, evicted and read back at the shape, O_DIRECT where the disk allows), run idle, beside a thread
that takes a core but not the GIL ("native", the control), and beside one that takes a core and the GIL
("python"). One JSON document to stdout (and --out): per shape and load, the passes' read and write GB/s,
their medians, and each load's over idle.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from io_engine import IOConfig, parse_size
from tiered.bench.disk import measure_config
from tiered.bench.io_types import IoOptions
from tiered.bench.mixed import parse_shape, whole_mib
from tiered.bench.workspace import Workspace

LOADS = ("idle", "native", "python")


@contextmanager
def load(kind: str) -> Iterator[None]:
    """While inside: nothing ("idle"); a thread computing CRC32s of 1 MiB, which releases the GIL ("native": a
    core taken, the GIL free); a thread adding integers in a Python loop ("python": a core taken and the GIL
    held but for the interpreter's forced switches)."""
    stop = threading.Event()
    block = bytes(1 << 20)

    def native() -> None:
        while not stop.is_set():
            zlib.crc32(block)

    def python() -> None:
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i

    th = None if kind == "idle" else threading.Thread(target=native if kind == "native" else python, daemon=True)
    if th is not None:
        th.start()
    try:
        yield
    finally:
        stop.set()
        if th is not None:
            th.join()


def record(into: dict[str, float], read: float, write: float) -> None:
    into.update(read=read, write=write)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="a folder on the disk to measure (its files are removed after)")
    p.add_argument("--size", default="2GiB", help="bytes of the file each pass writes and reads")
    p.add_argument("--shapes", default="32x1MiB,aio:32x1MiB,8x8MiB", help="[aio:]threads x block, comma-separated")
    p.add_argument("--rounds", type=int, default=2, help="each round: every shape idle then busy, then mirrored")
    p.add_argument("--out", help="also write the JSON document here")
    p.add_argument("--switch-interval", type=float, default=None, metavar="S",
                   help="sys.setswitchinterval(S) for the run: how long a thread running Python keeps the GIL "
                   "from one that waits (default: the interpreter's, 0.005)")  # fmt: skip
    args = p.parse_args(argv)
    if args.switch_interval is not None:
        if not 0 < args.switch_interval <= 1:
            p.error("--switch-interval must be in (0, 1] seconds")
        sys.setswitchinterval(args.switch_interval)
    size = whole_mib(parse_size(args.size))
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    cfgs = {}
    for s in shapes:  # every shape checked before any file is made
        submit, threads, block = parse_shape(s)
        cfgs[s] = IOConfig(threads=threads, block_size=block, submit=submit)
    if args.rounds < 1 or size < 1 << 20:
        p.error("--rounds must be >= 1 and --size at least 1 MiB")
    order = [(s, kind) for s in shapes for kind in LOADS]
    passes: dict[str, dict[str, list[dict[str, float]]]] = {s: {k: [] for k in LOADS} for s in shapes}
    opts = IoOptions(dir=args.dir, size=size, warmup=0, loops=1, fio=False, progress=False)
    with Workspace(args.dir) as ws:
        for r in range(args.rounds):
            for s, kind in order if r % 2 == 0 else order[::-1]:
                got: dict[str, float] = {}
                with load(kind):
                    measure_config(cfgs[s], ws, opts, size, tag="gil", on_pass=partial(record, got))
                passes[s][kind].append(got)
                print(f"round {r} {s:>12} {kind:>6}: read {got['read']:.2f}, write {got['write']:.2f} GB/s",
                      file=sys.stderr, flush=True)  # fmt: skip
    out: dict[str, Any] = {"size": size, "rounds": args.rounds, "switch_interval_s": sys.getswitchinterval()}
    out["shapes"] = {}
    for s in shapes:
        row: dict[str, Any] = {"passes": passes[s]}
        for kind in LOADS:
            for d in ("read", "write"):
                row[f"{kind}_{d}_gbps"] = round(statistics.median(x[d] for x in passes[s][kind]), 3)
        for kind in LOADS[1:]:
            for d in ("read", "write"):
                row[f"{kind}_over_idle_{d}"] = round(row[f"{kind}_{d}_gbps"] / row[f"idle_{d}_gbps"], 3)
        out["shapes"][s] = row
    text = json.dumps(out)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
