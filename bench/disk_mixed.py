"""Do the disk's reads and writes overlap? Read alone, write alone, then both at once, per engine config.

    python3 bench/disk_mixed.py --dir /root/mixed [--size 4GiB] [--configs 16x8MiB,32x1MiB] [--budget 120]

An optimizer step reads one file set while it writes another. If the disk serves reads and writes in
parallel, a step's floor is max(read s, write s); if they take turns, it is read s + write s. Per config,
on one engine (io_engine.IOEngine, O_DIRECT), tiered.bench.mixed times:

  write   overwrite file A (already written once, as an optimizer's state files are), fsync counted
  read    read file A back
  mixed   read file A while overwriting file B, both streams submitted at once to the same engine

and reports mixed_s against read_s + write_s (take turns) and max(read_s, write_s) (full overlap):
    overlap = (read_s + write_s - mixed_s) / (read_s + write_s - max(read_s, write_s))
0 means the two directions take turns, 1 means they overlap fully. The write-then-read order matches
DeepSpeed's `ds_aio_bw.py` anchor, so its rows compare with these. One JSON line goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from io_engine import IOConfig, parse_size
from tiered.bench.files import direct_supported
from tiered.bench.mixed import parse_configs, sweep_mixed, whole_mib
from tiered.bench.workspace import Workspace


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="a folder on the disk to measure (files are removed after)")
    p.add_argument("--size", default="4GiB", help="bytes per file (two files are made)")
    p.add_argument("--configs", default="16x8MiB,16x1MiB,32x1MiB,64x1MiB,32x512KiB,128x1MiB,32x4MiB,64x2MiB")
    p.add_argument("--budget", type=float, default=120.0, help="seconds; configs that would pass it are skipped")
    args = p.parse_args(argv)
    size = whole_mib(parse_size(args.size))
    pairs = parse_configs(args.configs)  # (threads, block bytes), checked before any file is made
    start = time.perf_counter()
    with Workspace(args.dir) as ws:
        ws.require_free(2 * size, "the two test files")
        direct = "on" if direct_supported(ws.dir) else "off"
        configs = [IOConfig(threads=t, block_size=b, direct=direct) for t, b in pairs]
        rows = sweep_mixed(ws, configs, size, args.budget)
    print(
        json.dumps(
            dict(
                name="disk_mixed",
                size=size,
                direct=direct,
                rows=rows,
                best_read=max(r["read_GBps"] for r in rows),
                best_write=max(r["write_GBps"] for r in rows),
                seconds=time.perf_counter() - start,
            )
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
