"""Where one training step's time goes, on the GPU and on the host: a profiled step, summarized.

llama_ab.py --timeline runs one more step of each TieredOptimizer variant under torch.profiler, with the
update under backward's host work labelled (``UnderBackward`` methods wrapped in ``record_function``), and
records ``timeline(trace)``: for each labelled host range and each CUDA stream, the first start, the last end
(ms from the step's start) and the busy time, and how long the GPU was idle after backward's last kernel.
That says whether what follows backward waits for the link, the GPU or the host.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections import defaultdict
from typing import Any

import torch

LABELS = ("drain", "_judge", "_commit", "_start", "settle")  # UnderBackward's methods, labelled by their names


@contextlib.contextmanager
def labelled():
    """UnderBackward's methods in LABELS run inside ``record_function(name)`` for as long as this lasts."""
    from tiered.optim.under_backward.overlap import UnderBackward

    saved = {name: getattr(UnderBackward, name) for name in LABELS}

    def wrap(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def inner(*args: Any, **kw: Any) -> Any:
            with torch.profiler.record_function(name):
                return fn(*args, **kw)

        return inner

    for name, fn in saved.items():
        setattr(UnderBackward, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(UnderBackward, name, fn)


def timeline(trace_path: str) -> dict[str, Any]:
    """Summary of a chrome trace holding one step labelled "ab_step", "backward" and "opt.step"."""
    events = json.load(open(trace_path))["traceEvents"]
    step = next(e for e in events if e.get("name") == "ab_step" and e.get("ph") == "X")
    t0, t1 = step["ts"], step["ts"] + step["dur"]
    ms = lambda t: round((t - t0) / 1000, 2)  # noqa: E731
    host: dict[str, list[float]] = defaultdict(list)
    streams: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or not (t0 <= e.get("ts", -1) <= t1):
            continue
        cat = e.get("cat", "")
        if cat == "user_annotation" and e["name"] in (*LABELS, "backward", "opt.step"):
            host[e["name"]].append((e["ts"], e["ts"] + e["dur"]))
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kind = "copy" if cat != "kernel" else "kernel"
            streams[f"stream {e.get('args', {}).get('stream')} {kind}"].append((e["ts"], e["ts"] + e["dur"]))
    out: dict[str, Any] = {"step_ms": ms(t1)}
    for name, spans in sorted(host.items()):
        out[name] = {"first_ms": ms(min(s for s, _ in spans)), "last_end_ms": ms(max(e for _, e in spans)),
                     "n": len(spans), "busy_ms": round(sum(e - s for s, e in spans) / 1000, 2)}  # fmt: skip
    for name, spans in sorted(streams.items()):
        out[name] = {"first_ms": ms(min(s for s, _ in spans)), "last_end_ms": ms(max(e for _, e in spans)),
                     "n": len(spans), "busy_ms": round(sum(e - s for s, e in spans) / 1000, 2)}  # fmt: skip
    # The compute stream runs forward and backward: the one with the most kernel time.
    kernels = {k: v for k, v in streams.items() if k.endswith("kernel")}
    compute = max(kernels, key=lambda k: sum(e - s for s, e in kernels[k]))
    bwd_end = max(e for _, e in kernels[compute])
    after = sorted((s, e) for spans in streams.values() for s, e in spans if e > bwd_end)
    busy, cur = 0.0, bwd_end
    for s, e in after:  # the union of every stream's work after backward's last kernel
        if e > cur:
            busy += e - max(s, cur)
            cur = e
    out["compute_stream"] = compute
    out["backward_gpu_end_ms"] = ms(bwd_end)
    out["gpu_after_backward_ms"] = {"wall": ms(t1) - ms(bwd_end), "busy": round(busy / 1000, 2)}
    return out
