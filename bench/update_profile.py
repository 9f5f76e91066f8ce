"""Where the offloaded update's time goes: ``TieredOptimizer.step()`` alone, state in pinned DDR, updated on the GPU.

Issue 29: with 8-bit moments the 4.42B's optimizer took 1.17-1.26 s, 2.1x the link's floor for its bytes (274
records at 4.6 ms each), while fp32 moments ran near theirs (667 records at 2.2 ms). This measures the update
with no model around it: bf16 parameters on the GPU (split masters), random gradients, ``update_on="device"``,
the state in DDR (``host_budget`` over it), no update under backward. For each moments dtype: the step's time
(median of --steps after two warm-ups), the link's bytes and floor (``link_floor_s`` at the pinned rates measured
now), and one profiled step: each stream's kernel and copy busy time and the kernels that took the most.

    python3 bench/update_profile.py --params 1.0B --json out.json

``--variants`` adds what-ifs, monkeypatched for this process only, each checked bitwise against the plain step
on the same gradients: ``workdown`` (the record's copy down on the work stream, as before the fortieth session, so
the next chunk's update queues behind it), ``torchcodec`` (the 8-bit codes in torch ops, as before the Triton
kernels of codec_kernels.py), ``in3`` (three chunks in flight, device records and pipeline window, not two).
A benchmark: it reports the variants' parity, and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tiered import TieredOptimizer  # noqa: E402
from tiered.bench.common import parse_count  # noqa: E402
from tiered.bench.pcie import link_floor_s  # noqa: E402
from tiered.bench.training_run import measure_link  # noqa: E402


def make_params(n: int, device: torch.device, seed: int = 0) -> list[torch.nn.Parameter]:
    """Llama-like bf16 matrices of 4096 x 11008 (45M), the last one short, ``n`` elements in all."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out, left = [], n
    while left > 0:
        k = min(left, 4096 * 11008)
        w = (torch.randn(k, generator=g) * 0.02).to(torch.bfloat16)
        out.append(torch.nn.Parameter(w.to(device)))
        left -= k
    return out


def set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    g = torch.Generator(device=params[0].device).manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, device=p.device, dtype=torch.bfloat16) * 1e-3


def kernels_summary(prof: Any, top: int) -> dict[str, Any]:
    """Per stream: kernel and copy busy ms (sum of durations) and counts; the top kernels by total time."""
    events = prof.events()
    by_stream: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        dur = e.time_range.elapsed_us() / 1000
        name = e.name
        kind = "copy" if name.startswith("Memcpy") or name.startswith("Memset") else "kernel"
        s = by_stream[f"stream {getattr(e, 'device_resource_id', '?')}"]
        s[f"{kind}_ms"] += dur
        s[f"{kind}_n"] += 1
        by_name[name[:90]].append(dur)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"streams": {k: {a: round(b, 2) for a, b in v.items()} for k, v in by_stream.items()},
            "top": [{"name": k, "n": len(v), "ms": round(sum(v), 2)} for k, v in ranked]}  # fmt: skip


def work_down_variant() -> Any:
    """Patch DeviceUpdate.download back to the record's copy down on the work stream (before the fortieth
    session), so that the next chunk's update queues behind it. Returns an undo."""
    from tiered.optim.device_update import DeviceUpdate

    orig = DeviceUpdate.download

    def download(self: Any, record: torch.Tensor, out: torch.Tensor) -> Any:
        if not self.cuda:
            return orig(self, record, out)
        with self.on_stream():
            out.copy_(record, non_blocking=True)
            self.link.add(record, out)
            event = self._free[self._last] = torch.cuda.Event()
            event.record(self.work_stream)
        return event

    DeviceUpdate.download = download

    def undo() -> None:
        DeviceUpdate.download = orig

    return undo


def three_in_flight_variant() -> Any:
    """Three device records and three chunks open in the pipeline (shares.CHUNKS_IN_FLIGHT), not two."""
    from tiered import shares

    saved = shares.CHUNKS_IN_FLIGHT
    shares.CHUNKS_IN_FLIGHT = 3

    def undo() -> None:
        shares.CHUNKS_IN_FLIGHT = saved

    return undo


def torch_codec_variant() -> Any:
    """Patch the 8-bit codes to the torch ops (the kernels' reference, the update as before codec_kernels.py)."""
    from tiered.layout import codec_kernels

    saved = codec_kernels.available
    codec_kernels.available = lambda *ts: False

    def undo() -> None:
        codec_kernels.available = saved

    return undo


VARIANTS = {"workdown": work_down_variant, "torchcodec": torch_codec_variant, "in3": three_in_flight_variant}


def run_one(n: int, moments: str, rates: dict[str, float], args: argparse.Namespace, root: str,
            variant: str | None) -> dict[str, Any]:  # fmt: skip
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    params = make_params(n, dev)
    undo = VARIANTS[variant]() if variant else None
    try:
        opt = TieredOptimizer(params, nvme_path=root, host_budget=args.host_budget, moments_dtype=moments,
                              update_on="device", update_in_backward=False, lr=1e-3)  # fmt: skip
        times = []
        for s in range(2 + args.steps):
            set_grads(params, s)
            sync()
            t0 = time.perf_counter()
            opt.step()
            sync()
            if s >= 2:
                times.append(time.perf_counter() - t0)
        last = opt.stats()["last_step"]
        up, down = int(last["link_up_bytes"]), int(last["link_down_bytes"])
        set_grads(params, 99)
        acts = [torch.profiler.ProfilerActivity.CPU]
        if dev.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            t0 = time.perf_counter()
            opt.step()
            sync()
            prof_s = time.perf_counter() - t0
        digest = [float(p.detach().float().sum()) for p in params[:3]]
        weights = torch.cat([p.detach().reshape(-1)[: 1 << 20].float().cpu() for p in params])
        opt.close()
    finally:
        if undo:
            undo()
    try:
        summary = kernels_summary(prof, args.top)
    except Exception as e:  # a profiler API of another torch: the timings stand without it
        summary = {"summary_error": repr(e)}
    floor = link_floor_s(up, down, rates) if rates else float("nan")
    med = statistics.median(times)
    return {"moments": moments, "variant": variant or "plain", "params": n, "step_s": [round(t, 4) for t in times],
            "median_s": round(med, 4), "link_up_gb": round(up / 1e9, 3), "link_down_gb": round(down / 1e9, 3),
            "link_floor_s": round(floor, 4), "over_floor": round(med / floor, 3), "profiled_step_s": round(prof_s, 4),
            "digest": digest, "_weights": weights, **summary}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", default="1.0B", help="parameters in all (bf16, on the GPU)")
    p.add_argument("--moments", default="float32,int8", help="comma-separated moments dtypes")
    p.add_argument("--variants", default="", help="comma-separated what-ifs to add: " + ", ".join(VARIANTS))
    p.add_argument("--host-budget", default="40GiB")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (no link, no kernels)")
    p.add_argument("--dir", default=None, help="the optimizer's folder (default: a temp folder)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA"}))
        return 0
    n = parse_count(args.params, name="--params")
    rates = measure_link(torch.device("cuda")) if args.device == "cuda" else {}
    rows = []
    for moments in args.moments.split(","):
        base = None
        for variant in [None, *[v for v in args.variants.split(",") if v]]:
            with tempfile.TemporaryDirectory(dir=args.dir) as root:
                row = run_one(n, moments, rates, args, root, variant)
            w = row.pop("_weights")
            if variant is None:
                base = w
            else:
                row["bitwise_as_plain"] = bool(torch.equal(w.view(torch.int32), base.view(torch.int32)))
            print(json.dumps({k: row[k] for k in row if k not in ("streams", "top")}), flush=True)
            rows.append(row)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    out = {"rates": rates, "rows": rows, "device": name}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
