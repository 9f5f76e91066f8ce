"""Run a bench script with the engine's host buffers as they were before io_engine/hugepages.py: Python's default
shared anonymous mappings, in 4 KiB pages. The what-if that measures the change on the same machine in one call.

    python3 bench/shared_buffers.py bench/llama_step.py --steps 4 ...
"""

from __future__ import annotations

import mmap
import runpy
import sys

from io_engine import buffers, pool


def shared_mmap(nbytes: int) -> tuple[mmap.mmap, int]:
    return mmap.mmap(-1, max(nbytes, 1)), 0


if __name__ == "__main__":
    buffers.host_mmap = pool.host_mmap = shared_mmap  # type: ignore[assignment]
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
