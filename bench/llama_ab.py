"""A/B of TieredOptimizer settings on the reference workload: one model, several optimizers in turn.

    python3 bench/llama_ab.py --nvme /root/ab --variants 'default;verify=0;io=32x1MiB;prefetch_depth=8'

Builds the reference model once (tiered.bench.workload.build_llama, as llama_step.py does: the slow part),
then for each round and each variant: a fresh TieredOptimizer with that variant's knobs over the same model,
--steps steps (the first is a warm-up), closed and its folder removed before the next. Rounds interleave
the variants so that the disk's drift over the run falls on all of them alike. A variant is `;`-separated
from the next and holds `,`-separated knobs:

    default              the optimizer's defaults (host_budget --host-budget)
    host_budget=state+10%   the state's own pinned size (as the optimizer plans it for this variant's knobs)
                         and 10 % more: what users give it
    verify=0             no checksum check on reads
    io=32x1MiB           IOConfig(threads=32, block_size=1 MiB); io=aio:32x1MiB the same with submit="aio" (kernel
                         AIO from one thread, 32 requests in flight)
    prefetch_depth=8     chunk_bytes=96MiB     host_budget=2GiB     threads=8 (torch.set_num_threads)
    update_on=device     split_masters=1
    early=1              update_in_backward=True (0: False; auto: "auto", the default on a GPU)
    max_grad_norm=1.0    the optimizer's own clip
    clip=1.0             the user's clip between backward and step: torch.nn.utils.clip_grad_norm_ on the
                         model, as HF Trainer, accelerate and Lightning do
    plain=1              torch.optim.AdamW(fused=True) over the parameters on the GPU: no offload, the bar
    switch=0.0005        sys.setswitchinterval(0.0005) for the variant: how long a thread running Python (forward
                         and backward) keeps the GIL from the engine's threads that wait for it (default 0.005)

Each run records its peak GPU memory (allocated and reserved), the global gradient norm of each step where a
clip measures one (the optimizer's ``max_grad_norm``: ``stats()["grad_norm"]``; the harness's ``clip``: what
``clip_grad_norm_`` returns), and, for TieredOptimizer, ``stats()["under_backward"]``. With ``--timeline``, one
more step of each TieredOptimizer variant runs under torch.profiler, and the run records where its time went
after backward (step_timeline.py).

Timing. ``--sync device`` (the default) brackets each step with torch.cuda.synchronize(), as ds_anchor.py does.
That also waits for work a step leaves running on side streams for the next forward to hide (TieredOptimizer's
downloads of the state it updated in HBM), and starts the next step only after it: ``--sync stream`` times the
steps back to back instead, each ending when the compute stream is done, with no untimed gap between them. The
loop then calls ``loss.item()``, as training loops do, inside the next step's time; ``item_s`` records what each
waited: a copy down, it also waits for any copies down that hold the copy engine (a step's downloads, were they
queued back to back). The summary gives each variant's median against its bar:
``plain=1`` (with ``clip=X`` where the variant clips by ``max_grad_norm=X`` or ``clip=X``), and with
``--same-start`` (every variant from the model's initial weights) whether an ``early=0`` variant's losses equal
those of the same variant without it, bit for bit. Bitwise needs deterministic backward kernels:
``--deterministic`` (torch.use_deterministic_algorithms, warn only; SDPA's math backend; cuBLAS's fixed
workspace), for a small model, as its kernels are slower.

The weights keep training across variants: the step's I/O and arithmetic do not depend on the values.
Progress on stderr; one JSON line on stdout, also written to $OUT/<--name>.json after every variant.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import time

import torch

from io_engine import IOConfig
from tiered.bench.common import emit_json, rounded, stderr_log
from tiered.bench.mixed import parse_shape
from tiered.bench.workload import add_llama_arguments, build_llama, llama_kwargs

log = stderr_log("llama_ab")


def parse_variant(text: str, host_budget: str) -> tuple[dict, int | None]:
    """'io=32x1MiB,verify=0' -> (TieredOptimizer kwargs, torch threads or None). The harness's own knobs
    (``clip``, ``plain``, ``switch``) come back in the kwargs under their names, for main() to take out."""
    knobs: dict = dict(host_budget=host_budget)
    threads = None
    on = lambda value: value not in ("0", "false", "False")  # noqa: E731
    for item in filter(None, (s.strip() for s in text.split(","))):
        if item == "default":
            continue
        key, _, value = item.partition("=")
        if key == "io":
            submit, threads, block = parse_shape(value)
            knobs["io"] = IOConfig(threads=threads, block_size=block, submit=submit)
        elif key == "verify":
            knobs["verify"] = value not in ("0", "false", "False")
        elif key == "prefetch_depth":
            knobs["prefetch_depth"] = int(value)
        elif key == "host_budget" and value.startswith("state"):
            extra = value.removeprefix("state").removeprefix("+").removesuffix("%")
            knobs[key] = ("state", float(extra or 0) / 100)  # resolved against the model in main()
        elif key in ("chunk_bytes", "host_budget", "update_on"):
            knobs[key] = value
        elif key == "split_masters":
            knobs[key] = on(value)
        elif key == "early":
            knobs["update_in_backward"] = "auto" if value == "auto" else on(value)
        elif key in ("max_grad_norm", "clip"):
            knobs[key] = float(value)
        elif key == "switch":
            knobs[key] = float(value)
            if not 0 < knobs[key] <= 1:
                raise SystemExit(f"switch must be in (0, 1] seconds, got {value!r} in variant {text!r}")
        elif key == "plain":
            knobs[key] = on(value)
        elif key == "threads":
            threads = int(value)
        else:
            raise SystemExit(f"unknown knob {key!r} in variant {text!r}")
    return knobs, threads


def state_bytes(model: torch.nn.Module, knobs: dict) -> int:
    """The pinned bytes TieredOptimizer's state over ``model`` takes with these knobs, planned as the optimizer
    plans its chunks (nothing is allocated)."""
    from io_engine import pool_bytes
    from tiered.arguments import param_groups
    from tiered.config import TierConfig
    from tiered.optim import param_set
    from tiered.optim.assembly import plan_layout
    from tiered.optim.shards import Shards

    groups, names = param_groups(model)
    layout = {k: knobs[k] for k in ("chunk_bytes", "moments_dtype", "split_masters", "update_on") if k in knobs}
    planned = plan_layout(names, Shards(param_set.flat(groups)), groups, TierConfig(**layout))
    return pool_bytes([c.nbytes for c in planned.chunks])


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
    p.add_argument("--sync", choices=("device", "stream"), default="device", help="how steps are timed (above)")
    p.add_argument("--same-start", action="store_true", help="every variant starts from the initial weights")
    p.add_argument("--deterministic", action="store_true", help="deterministic kernels, for bitwise losses")
    a = p.parse_args(argv)
    shape = llama_kwargs(a)  # before vars(a) is recorded: the JSON's args name the model in full
    if a.deterministic:  # before CUDA starts: cuBLAS reads it once
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    from tiered import TieredOptimizer

    t_start = time.perf_counter()
    work = build_llama(torch.device(a.device), **shape)
    model = work.model
    cuda = a.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step_sync = (lambda: torch.cuda.current_stream().synchronize()) if cuda and a.sync == "stream" else sync
    kernels = contextlib.nullcontext
    if a.deterministic:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kernels = lambda: sdpa_kernel([SDPBackend.MATH])  # noqa: E731
    initial = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()} if a.same_start else None
    default_threads = torch.get_num_threads()
    default_switch = sys.getswitchinterval()
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
            times, phases, losses, norms, early, profiled = [], [], [], [], None, None
            item_s: list[float] = []  # what each loss.item() waited (counted in the next step's time)
            clip, plain = knobs.pop("clip", None), knobs.pop("plain", False)
            sys.setswitchinterval(knobs.pop("switch", default_switch))
            if isinstance(knobs.get("host_budget"), tuple):
                state = state_bytes(model, knobs)
                knobs["host_budget"] = int(state * (1 + knobs["host_budget"][1]))
                log(f"{v!r}: state {state / 2**30:.3f} GiB, host_budget {knobs['host_budget'] / 2**30:.3f} GiB")
            if initial is not None:
                model.load_state_dict(initial)
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            if plain:
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
            else:
                opt = TieredOptimizer(model, nvme_path=folder, lr=1e-4, **knobs)
            try:
                sync()
                t = time.perf_counter()
                for _ in range(a.steps):
                    with kernels():
                        loss = work.loss()
                        loss.backward()
                    if clip is not None:
                        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    step_sync()
                    now = time.perf_counter()  # the next step's time starts here: no untimed gap
                    times.append(now - t)
                    t = now
                    losses.append(loss.item())
                    item_s.append(time.perf_counter() - now)
                    if not plain:
                        st = opt.stats()
                        phases.append(st["last_step"])
                        early = st["under_backward"]
                        if st.get("grad_norm") is not None:
                            norms.append(st["grad_norm"])
                sync()
                if a.timeline and not plain and cuda:
                    profiled = profile_step(work, opt, model, clip, os.path.join(a.nvme, "trace.json"))
            finally:
                if not plain:
                    opt.close()
                del opt
                shutil.rmtree(folder, ignore_errors=True)
            steady = times[a.warmup :] or times
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
            reserved = torch.cuda.max_memory_reserved() / 2**30 if cuda else None
            norms = [float(n) for n in norms]
            res["runs"].append(dict(variant=v, round=rnd, step_s=times, median_s=statistics.median(steady),
                                    phases=phases[-1] if phases else None, under_backward=early,
                                    peak_gpu_GiB=peak, peak_reserved_GiB=reserved, losses=losses, grad_norms=norms,
                                    item_s=item_s,
                                    clip_active=all(n > (clip or knobs.get("max_grad_norm") or 0) for n in norms)
                                    if norms else None, timeline=profiled))  # fmt: skip
            log(
                f"round {rnd} {v!r}: steps {[round(t, 3) for t in times]} item {[round(t, 4) for t in item_s]} "
                f"peak {peak} norms "
                f"{[round(n, 3) for n in norms]} early {early} phases {rounded(phases[-1], 3) if phases else None}"
            )
            emit()
    res["summary"] = summarize(res["runs"], variants)
    res["total_s"] = time.perf_counter() - t_start
    torch.set_num_threads(default_threads)
    sys.setswitchinterval(default_switch)
    emit(final=True)
    return 0


def summarize(runs: list[dict], variants: list[str]) -> dict:
    """Per variant: the median of its rounds' medians; against its bar (``plain=1``, with ``clip=X`` for a variant
    that clips by X); and, for an ``early=0`` variant, whether its twin without that knob had the same losses."""
    out: dict = {}
    for v in variants:
        meds = [r["median_s"] for r in runs if r["variant"] == v]
        if meds:
            out[v] = dict(median_s=statistics.median(meds), rounds=meds)
    for v, row in out.items():
        items = [i.strip() for i in v.split(",")]
        if "plain=1" in items:
            continue
        clip = [i.split("=", 1)[1] for i in items if i.startswith(("max_grad_norm=", "clip="))]
        bar = f"plain=1,clip={clip[0]}" if clip else "plain=1"
        if bar in out:
            row.update(bar=bar, over_bar=row["median_s"] / out[bar]["median_s"])
        if "early=0" in items:
            twin = ",".join(i for i in items if i != "early=0") or "default"
            mine = [r["losses"] for r in runs if r["variant"] == v]
            theirs = [r["losses"] for r in runs if r["variant"] == twin]
            if twin in out and mine and theirs:
                row.update(twin=twin, same_losses=mine[0] == theirs[0])
    return out


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
