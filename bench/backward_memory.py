"""Run a training script with each backward's GPU memory printed: ``python3 bench/backward_memory.py SCRIPT ARGS``.

For each of the first ``LIMIT`` backwards (and any that raises): the bytes allocated before and after it, the
process's peak so far, the gradient sums an offloaded model keeps on the GPU (``tiered.optim.resident_grads``)
and the pass peak their room is measured above (``KeptSums.pass_peak``). What tells where a run under a
tight GPU cap ran out of memory: which micro-batch, and beside how many kept sums.
"""

from __future__ import annotations

import runpy
import sys
from typing import Any

import torch

LIMIT = 40
GiB = 2**30


def _kept_and_peak() -> str:
    from tiered.offload import accumulation
    from tiered.optim import resident_grads

    peaks = [a.kept.pass_peak for a in list(accumulation._live)]
    shown = ", ".join("none" if p is None else f"{p / GiB:.2f} GiB" for p in peaks) or "no offloaded model"
    return f"kept {resident_grads.held_bytes() / GiB:.2f} GiB, pass peak {shown}"


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    backward = torch.Tensor.backward
    count = [0]

    def logged(self: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        count[0] += 1
        n, before = count[0], torch.cuda.memory_allocated()
        try:
            backward(self, *args, **kwargs)
        except BaseException:
            print(f"backward {n} raised: {before / GiB:.2f} GiB allocated before, peak "
                  f"{torch.cuda.max_memory_allocated() / GiB:.2f} GiB, {_kept_and_peak()}", flush=True)  # fmt: skip
            raise
        if n <= LIMIT:
            after, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
            print(f"backward {n}: {before / GiB:.2f} -> {after / GiB:.2f} GiB allocated, "
                  f"peak {peak / GiB:.2f} GiB, {_kept_and_peak()}", flush=True)  # fmt: skip

    torch.Tensor.backward = logged  # type: ignore[method-assign]
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
