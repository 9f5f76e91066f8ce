"""A/B of TieredOptimizer settings on the reference workload: one model, several optimizers in turn.

    python3 bench/llama_ab.py --nvme /root/ab --variants 'default;verify=0;io=32x1MiB;prefetch_depth=8'

Builds the reference model once (tiered.bench.workload.build_llama, as llama_step.py does: the slow part),
then for each round and each variant: a fresh TieredOptimizer with that variant's knobs over the same model,
--steps steps (the first is a warm-up), closed and its folder removed before the next. Rounds interleave
the variants so that the disk's drift over the run falls on all of them alike. A variant is `;`-separated
from the next and holds `,`-separated knobs:

    default              the optimizer's defaults (host_budget --host-budget)
    verify=0             no checksum check on reads
    io=32x1MiB           IOConfig(threads=32, block_size=1 MiB)
    prefetch_depth=8     chunk_bytes=96MiB     host_budget=2GiB     threads=8 (torch.set_num_threads)
    update_on=device     split_masters=1
    early=1              update_in_backward=True (0: False; auto: "auto", the default on a GPU)
    max_grad_norm=1.0    the optimizer's own clip
    clip=1.0             the user's clip between backward and step: torch.nn.utils.clip_grad_norm_ on the
                         model, as HF Trainer, accelerate and Lightning do
    plain=1              torch.optim.AdamW(fused=True) over the parameters on the GPU: no offload, the bar

Each run records its peak GPU memory and, for TieredOptimizer, ``stats()["under_backward"]``. With
``--timeline``, one more step of each TieredOptimizer variant runs under torch.profiler, and the run records
where its time went after backward (step_timeline.py).

The weights keep training across variants: the step's I/O and arithmetic do not depend on the values.
Progress on stderr; one JSON line on stdout, also written to $OUT/<--name>.json after every variant.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

import torch

from io_engine import IOConfig, parse_size
from tiered.bench.common import emit_json, rounded, stderr_log
from tiered.bench.workload import add_llama_arguments, build_llama, llama_kwargs

log = stderr_log("llama_ab")


def parse_variant(text: str, host_budget: str) -> tuple[dict, int | None]:
    """'io=32x1MiB,verify=0' -> (TieredOptimizer kwargs, torch threads or None). The harness's own knobs
    (``clip``, ``plain``) come back in the kwargs under their names, for main() to take out."""
    knobs: dict = dict(host_budget=host_budget)
    threads = None
    on = lambda value: value not in ("0", "false", "False")  # noqa: E731
    for item in filter(None, (s.strip() for s in text.split(","))):
        if item == "default":
            continue
        key, _, value = item.partition("=")
        if key == "io":
            t, _, b = value.partition("x")
            knobs["io"] = IOConfig(threads=int(t), block_size=parse_size(b))
        elif key == "verify":
            knobs["verify"] = value not in ("0", "false", "False")
        elif key == "prefetch_depth":
            knobs["prefetch_depth"] = int(value)
        elif key in ("chunk_bytes", "host_budget", "update_on"):
            knobs[key] = value
        elif key == "split_masters":
            knobs[key] = on(value)
        elif key == "early":
            knobs["update_in_backward"] = "auto" if value == "auto" else on(value)
        elif key in ("max_grad_norm", "clip"):
            knobs[key] = float(value)
        elif key == "plain":
            knobs[key] = on(value)
        elif key == "threads":
            threads = int(value)
        else:
            raise SystemExit(f"unknown knob {key!r} in variant {text!r}")
    return knobs, threads


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nvme", default="/root/ab")
    p.add_argument("--variants", default="default;verify=0")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="per variant and round")
    p.add_argument("--warmup", type=int, default=1, help="steps left out of each run's median (default: %(default)s; "
                   "3 leaves out the steps update_in_backward='auto' times before it decides)")  # fmt: skip
    p.add_argument("--host-budget", default="2GiB")
    p.add_argument("--deadline", type=float, default=1e9, help="seconds from start: no variant starts after")
    add_llama_arguments(p)  # --layers --hidden --inter --vocab --seq --batch: the 0.94B model by default
    p.add_argument("--name", default="llama_ab")
    p.add_argument("--timeline", action="store_true", help="profile one more step of each tiered variant")
    p.add_argument("--device", default="cuda", help="cpu only for smoke tests at toy sizes")
    a = p.parse_args(argv)
    shape = llama_kwargs(a)  # before vars(a) is recorded: the JSON's args name the model in full
    from tiered import TieredOptimizer

    t_start = time.perf_counter()
    work = build_llama(torch.device(a.device), **shape)
    model = work.model
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    default_threads = torch.get_num_threads()
    variants = [v.strip() for v in a.variants.split(";") if v.strip()]
    res: dict = dict(name=a.name, args=vars(a), runs=[])

    def emit(final: bool = False) -> None:
        emit_json(res, a.name, final)

    for rnd in range(a.rounds):
        for v in variants:
            if time.perf_counter() - t_start > a.deadline:
                log(f"deadline: {v!r} of round {rnd} not run")
                res["deadline_hit"] = True
                continue
            knobs, threads = parse_variant(v, a.host_budget)
            torch.set_num_threads(threads or default_threads)
            folder = os.path.join(a.nvme, f"v{len(res['runs'])}")
            times, phases, losses, early, profiled = [], [], [], None, None
            clip, plain = knobs.pop("clip", None), knobs.pop("plain", False)
            if a.device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            if plain:
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=a.device == "cuda")
            else:
                opt = TieredOptimizer(model, nvme_path=folder, lr=1e-4, **knobs)
            try:
                for _ in range(a.steps):
                    sync()
                    t = time.perf_counter()
                    loss = work.loss()
                    loss.backward()
                    if clip is not None:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    sync()
                    times.append(time.perf_counter() - t)
                    losses.append(loss.item())
                    if not plain:
                        phases.append(opt.stats()["last_step"])
                        early = opt.stats()["under_backward"]
                if a.timeline and not plain and a.device == "cuda":
                    profiled = profile_step(work, opt, model, clip, os.path.join(a.nvme, "trace.json"))
            finally:
                if not plain:
                    opt.close()
                del opt
                shutil.rmtree(folder, ignore_errors=True)
            steady = times[a.warmup :] or times
            peak = torch.cuda.max_memory_allocated() / 2**30 if a.device == "cuda" else None
            res["runs"].append(dict(variant=v, round=rnd, step_s=times, median_s=statistics.median(steady),
                                    phases=phases[-1] if phases else None, under_backward=early,
                                    peak_gpu_GiB=peak, losses=losses, timeline=profiled))  # fmt: skip
            log(
                f"round {rnd} {v!r}: steps {[round(t, 3) for t in times]} peak {peak} early {early} "
                f"phases {rounded(phases[-1], 3) if phases else None}"
            )
            emit()
    summary = {}
    for v in variants:
        meds = [r["median_s"] for r in res["runs"] if r["variant"] == v]
        if meds:
            summary[v] = dict(median_s=statistics.median(meds), rounds=meds)
    res["summary"] = summary
    res["total_s"] = time.perf_counter() - t_start
    torch.set_num_threads(default_threads)
    emit(final=True)
    return 0


def profile_step(work, opt, model, clip, trace_path: str) -> dict:
    """One more step under torch.profiler; where its time went (step_timeline.timeline)."""
    from step_timeline import labelled, timeline

    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with labelled(), torch.profiler.profile(activities=acts) as prof:
        with torch.profiler.record_function("ab_step"):
            loss = work.loss()
            with torch.profiler.record_function("backward"):
                loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with torch.profiler.record_function("opt.step"):
                opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)
    try:
        return timeline(trace_path)
    finally:
        os.remove(trace_path)


if __name__ == "__main__":
    sys.exit(main())
