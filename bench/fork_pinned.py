"""How long a fork takes in a process holding page-locked pool memory, and whether the child runs.

The engine's host buffers are private mappings wiped in a forked child (io_engine/hugepages.py), so a fork copies
no page tables' worth of shared memory and the child gets zeros of its own there. Run from the repo root on a GPU
machine (the pool page-locks only with CUDA): ``python3 bench/fork_pinned.py [GiB]`` (default 8).
"""

import os
import sys
import time

from io_engine import PinnedBufferPool


def main() -> None:
    gib = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    with PinnedBufferPool(gib << 30) as pool, pool.acquire(gib << 30) as b:
        b.tensor.fill_(1)
        t = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        took = time.perf_counter() - t
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        print(f"fork with {gib} GiB pinned: {took:.3f} s, child exit {code}, pinned {b.pinned}")


if __name__ == "__main__":
    main()
