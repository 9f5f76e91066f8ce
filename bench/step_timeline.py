"""Where one training step's time goes, on the GPU and on the host: a profiled step, summarized.

llama_ab.py --timeline runs one more step of each TieredOptimizer variant under torch.profiler, with the
update under backward's host work labelled (``UnderBackward`` methods wrapped in ``record_function``), and
records ``timeline(trace)``: for each labelled host range and each CUDA stream, the first start, the last end
(ms from the step's start) and the busy time, and how long the GPU was idle after backward's last kernel.
That says whether what follows backward waits for the link, the GPU or the host.

examples/big_model.py --trace PATH profiles one step of its own, labelled "step":

    python bench/step_timeline.py PATH --step step

prints the same summary as one JSON line, with how much of the step any kernel ran (``kernels_busy_ms``, the
union over streams: "the GPU stays busy" measured) and any copy did, and each stream's copies by kind
(``copies``: "Memcpy HtoD (Pinned -> Device)" and the like, their count, busy time and gigabytes), split at the
optimizer's start (``before_opt``: launched by forward and backward; ``after_opt``: anything running once the
host entered ``opt.step``), so a copy that holds up the compute stream shows where it runs.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
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


def union_ms(spans: list[tuple[float, float]]) -> float:
    """The time (ms) covered by any of ``spans`` (µs pairs)."""
    busy, cur = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > cur:
            busy += e - max(s, cur)
            cur = e
    return round(busy / 1000, 2)


def timeline(trace_path: str, step_label: str = "ab_step") -> dict[str, Any]:
    """Summary of a chrome trace holding one step labelled ``step_label``, its backward "backward" and its
    optimizer "opt.step". Without CUDA events (a CPU run), the host's labels only."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    step = next(e for e in events if e.get("name") == step_label and e.get("ph") == "X")
    t0, t1 = step["ts"], step["ts"] + step["dur"]
    ms = lambda t: round((t - t0) / 1000, 2)  # noqa: E731
    host: dict[str, list[float]] = defaultdict(list)
    streams: dict[str, list[tuple[float, float]]] = defaultdict(list)
    copies: list[tuple[str, str, float, float, float]] = []  # stream, kind, start, end, bytes
    for e in events:
        if e.get("ph") != "X" or not (t0 <= e.get("ts", -1) <= t1):
            continue
        cat = e.get("cat", "")
        if cat == "user_annotation" and e["name"] in (*LABELS, "backward", "opt.step"):
            host[e["name"]].append((e["ts"], e["ts"] + e["dur"]))
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kind = "copy" if cat != "kernel" else "kernel"
            stream = f"stream {e.get('args', {}).get('stream')}"
            streams[f"{stream} {kind}"].append((e["ts"], e["ts"] + e["dur"]))
            if kind == "copy":
                nbytes = float(e.get("args", {}).get("bytes", 0) or 0)
                copies.append((stream, e["name"], e["ts"], e["ts"] + e["dur"], nbytes))
    out: dict[str, Any] = {"step_ms": ms(t1)}
    for name, spans in sorted(host.items()):
        out[name] = {"first_ms": ms(min(s for s, _ in spans)), "last_end_ms": ms(max(e for _, e in spans)),
                     "n": len(spans), "busy_ms": round(sum(e - s for s, e in spans) / 1000, 2)}  # fmt: skip
    for name, spans in sorted(streams.items()):
        out[name] = {"first_ms": ms(min(s for s, _ in spans)), "last_end_ms": ms(max(e for _, e in spans)),
                     "n": len(spans), "busy_ms": round(sum(e - s for s, e in spans) / 1000, 2)}  # fmt: skip
    opt_start = min((s for s, _ in host.get("opt.step", [])), default=t1)
    out["copies"] = copies_by_kind(copies, opt_start)
    # The compute stream runs forward and backward: the one with the most kernel time.
    kernels = {k: v for k, v in streams.items() if k.endswith("kernel")}
    if not kernels:
        return out
    out["kernels_busy_ms"] = union_ms([x for v in kernels.values() for x in v])
    out["copies_busy_ms"] = union_ms([x for k, v in streams.items() if k.endswith("copy") for x in v])
    compute = max(kernels, key=lambda k: sum(e - s for s, e in kernels[k]))
    bwd_end = max(e for _, e in kernels[compute])
    # The union of every stream's work after backward's last kernel.
    busy = union_ms([(max(s, bwd_end), e) for spans in streams.values() for s, e in spans if e > bwd_end])
    out["compute_stream"] = compute
    out["backward_gpu_end_ms"] = ms(bwd_end)
    out["gpu_after_backward_ms"] = {"wall": ms(t1) - ms(bwd_end), "busy": busy}
    # Up to the optimizer's start (forward and backward): how much any kernel ran, and how much the compute
    # stream ran anything (a kernel or a copy queued on it, which a kernel then waits behind).
    clip = lambda spans: [(s, min(e, opt_start)) for s, e in spans if s < opt_start]  # noqa: E731
    own = compute.removesuffix(" kernel")
    on_compute = kernels[compute] + streams.get(f"{own} copy", [])
    out["until_opt_ms"] = {"wall": ms(opt_start), "kernels": union_ms(clip([x for v in kernels.values() for x in v])),
                           "compute_stream": union_ms(clip(on_compute))}  # fmt: skip
    return out


def copies_by_kind(copies: list[tuple[str, str, float, float, float]], split: float) -> dict[str, Any]:
    """Copies grouped as {"before_opt"|"after_opt": {stream: {kind: {n, busy_ms, gb}}}}, split by whether each
    started before ``split`` (µs)."""
    out: dict[str, Any] = {}
    for stream, kind, s, e, nbytes in copies:
        row = out.setdefault("before_opt" if s < split else "after_opt", {}).setdefault(stream, {})
        cell = row.setdefault(kind, {"n": 0, "busy_ms": 0.0, "gb": 0.0})
        cell["n"] += 1
        cell["busy_ms"] = round(cell["busy_ms"] + (e - s) / 1000, 2)
        cell["gb"] = round(cell["gb"] + nbytes / 1e9, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Summarize a profiled step's chrome trace (one JSON line).")
    p.add_argument("trace", help="a chrome trace (torch.profiler's export_chrome_trace)")
    p.add_argument("--step", default="ab_step", help="the step's label (big_model.py --trace: step)")
    a = p.parse_args(argv)
    try:
        print(json.dumps(timeline(a.trace, a.step)))
    except StopIteration:
        p.error(f"no event labelled {a.step!r} in {a.trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
