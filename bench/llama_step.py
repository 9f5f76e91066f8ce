"""The reference workload (Llama-0.94B, bench/RESULTS.md) trained with TieredOptimizer, against the disk's floor.

    python3 bench/llama_step.py --nvme /root/tiered_nvme [--host-budget 2GiB] [--steps 5]
    python3 bench/llama_step.py --plain    # torch.optim.AdamW(fused=True), all on the GPU: the loss reference
    python3 bench/llama_step.py --plain --masters    # the same over fp32 master copies: TieredOptimizer's math

--plain updates the bf16 weights in bf16, as ds_anchor.py's gpu mode does; TieredOptimizer keeps fp32 masters,
so the two loss curves agree to bf16 rounding, not bit for bit. --plain --masters keeps fp32 masters on the GPU
as TieredOptimizer does on disk (fp32 gradients, fused AdamW, weights cast back): its losses are what ours
should reproduce.

The model is tiered.bench.workload.build_llama(), the one DeepSpeed's anchor (`ds_anchor.py`, stage `ds` of
bench/device_run.sh) trains: LlamaForCausalLM from a config (random init, seed 0, bf16), one fixed batch of random
tokens. Each step is timed between torch.cuda.synchronize() calls, the median over steps 1..N-1, as the anchor does.

Before training it measures the disk the state lives on, in this process, with tiered.bench.mixed.measure_floor
(bench/disk_mixed.py's method: O_DIRECT, overwrites of two files of --floor-size, 4 GiB: the optimizer overwrites
its state files every step): the optimizer's IOConfig first, then the configs of FLOOR_SWEEP while --floor-budget
seconds allow. The floor of a step is then
    floor_s = nvme_read_bytes / best read B/s + nvme_write_bytes / best write B/s
with the bytes that step moved (opt.stats()["last_step"]), and ratio = median step / median floor;
floor_own_s and ratio_own are the same at the optimizer's own I/O configuration.

Progress goes to stderr; one JSON line to stdout, also written to $OUT/<name>.json after every step (so a
run cut short still leaves its figures; "complete" tells). Nothing CUDA- or transformers-bound is imported
before main() runs.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sys
import time
import uuid

import torch

from tiered.bench.common import emit_json, stderr_log
from tiered.bench.mixed import measure_floor
from tiered.bench.workload import add_llama_arguments, build_llama, llama_kwargs

T0 = time.perf_counter()
log = stderr_log("llama_step")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--nvme",
        default="/root/tiered_nvme",
        help="folder for the state (a run subfolder is made in it, removed at the end)",
    )
    p.add_argument("--plain", action="store_true", help="torch.optim.AdamW(fused=True) on the device instead")
    p.add_argument("--masters", action="store_true", help="with --plain: over fp32 master copies of the weights")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument(
        "--deadline",
        type=float,
        default=300.0,
        help="seconds from start after which no further step starts (at least 2 steps run)",
    )
    add_llama_arguments(p)  # --layers --hidden --inter --vocab --seq --batch: the 0.94B model by default
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--device", default="cuda", help="cuda; cpu only for smoke tests at toy sizes")
    g = p.add_argument_group("TieredOptimizer knobs (docs/internals.md); unset ones keep its defaults")
    g.add_argument("--host-budget", default="2GiB")
    g.add_argument("--moments-dtype", choices=("fp32", "bf16", "int8"), default=None)
    g.add_argument("--split-masters", choices=("on", "off"), default=None, help="default: the optimizer's")
    g.add_argument("--update-on", choices=("host", "device"), default=None, help="default: the optimizer's (auto)")
    g.add_argument("--gpu-budget", default=None)
    g.add_argument("--chunk-bytes", default=None)
    g.add_argument("--prefetch-depth", type=int, default=None)
    g.add_argument(
        "--io-config", default=None, help="IOConfig JSON file (default: $TIERED_IO_CONFIG, else the defaults)"
    )
    g.add_argument(
        "--io-from-sweep", action="store_true", help="give the optimizer the best IOConfig of the floor's sweep instead"
    )
    f = p.add_argument_group("the floor")
    f.add_argument("--floor-size", default="4GiB", help="size of the fresh file the disk is measured with")
    f.add_argument("--floor-budget", type=float, default=60.0, help="seconds for the disk sweep; 0 skips the floor")
    p.add_argument("--name", default=None, help="JSON file name under $OUT (default from the mode and knobs)")
    p.add_argument("--keep-state", action="store_true", help="leave the run's state folder on disk")
    p.add_argument(
        "--no-close",
        action="store_true",
        help="end without opt.close() and keep the folder, as training frameworks do: the JSON's leaving_at "
        "(time.time()) lets the caller time the exit and count the files left",
    )
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error("--steps must be >= 1")
    llama_kwargs(a)  # fills in --inter, so that the JSON's args name the model in full
    if a.name is None:
        moments = f"_{a.moments_dtype}m" if a.moments_dtype else ""
        plain = "llama_plain_masters" if a.masters else "llama_plain"
        a.name = plain if a.plain else f"llama_hb{a.host_budget}{moments}"
    a.name = re.sub(r"[^A-Za-z0-9._-]", "_", a.name)
    return a


# ------------------------------------------------------------------------------------------------ training
class MasterAdamW:
    """torch.optim.AdamW(fused=True) over fp32 copies of low-precision weights, all on their device: the
    arithmetic TieredOptimizer does with its state on disk (fp32 gradients, fp32 update, weights cast back)."""

    def __init__(self, params, lr: float):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [p.detach().float() for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=lr, fused=True)

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def disk_seconds(phase: dict, disk: dict, own: bool = False) -> tuple[float, float]:
    """(read s, write s) the disk needs for the bytes one step moved, at its measured best, or (``own``) at
    the I/O configuration the optimizer ran with."""
    r, w = ("optimizer_read_GBps", "optimizer_write_GBps") if own else ("read_GBps", "write_GBps")
    return phase["nvme_read_bytes"] / (disk[r] * 1e9), phase["nvme_write_bytes"] / (disk[w] * 1e9)


def steady(values: list[float]) -> float:
    """ds_anchor.py's figure: the (upper) median of steps 1..N-1, or step 0 when it is the only one."""
    rest = sorted(values[1:])
    return rest[len(rest) // 2] if rest else values[0]


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` kills: still run the finally blocks
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        log("no CUDA device here; --device cpu runs toy sizes")
        return 2
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    res: dict = dict(
        name=a.name,
        mode=("plain_masters" if a.masters else "plain") if a.plain else "tiered",
        complete=False,
        args=vars(a).copy(),
        torch=torch.__version__,
        gpu=torch.cuda.get_device_name() if cuda else None,
    )

    def emit(final: bool = False) -> None:
        emit_json(res, a.name, final)

    io_cfg, run_dir, opt = None, None, None
    try:
        if not a.plain:
            from io_engine import IOConfig, format_size, parse_size

            io_cfg = IOConfig.from_file(a.io_config) if a.io_config else IOConfig.from_env()
            if a.floor_budget > 0:
                disk = res["disk"] = measure_floor(
                    a.nvme, io_cfg, parse_size(a.floor_size), a.floor_budget, log=lambda m: log(f"disk: {m}")
                )
                if a.io_from_sweep:
                    io_cfg = io_cfg.replace(**disk["best_cfg"])
            res["io_config"] = io_cfg.to_dict()
            emit()

        import transformers

        res["transformers"] = transformers.__version__
        t = time.perf_counter()
        work = build_llama(device, **llama_kwargs(a))
        model = work.model
        sync()
        res.update(params=work.params, model_init_s=time.perf_counter() - t)
        log(f"model: {res['params'] / 1e6:.1f} M params, built in {res['model_init_s']:.1f} s")
        t = time.perf_counter()
        if a.plain and a.masters:
            opt = MasterAdamW(model.parameters(), lr=a.lr)
        elif a.plain:
            opt = torch.optim.AdamW(model.parameters(), lr=a.lr, fused=True)
        else:
            from tiered import TieredOptimizer

            knobs = dict(host_budget=a.host_budget, io=io_cfg)
            if a.moments_dtype:
                knobs["moments_dtype"] = a.moments_dtype  # the optimizer takes these names
            if a.split_masters:
                knobs["split_masters"] = a.split_masters == "on"
            for k in ("update_on", "gpu_budget", "chunk_bytes", "prefetch_depth"):
                if getattr(a, k) is not None:
                    knobs[k] = getattr(a, k)
            run_dir = os.path.join(a.nvme, f"run-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            opt = TieredOptimizer(model, nvme_path=run_dir, lr=a.lr, **knobs)
        sync()
        res["opt_init_s"] = time.perf_counter() - t
        log(f"optimizer: {type(opt).__name__} ready in {res['opt_init_s']:.1f} s")

        times, losses, phases, floors, overlaps, own_floors = [], [], [], [], [], []
        res.update(step_s=times, losses=losses)
        if not a.plain:
            res.update(phases=phases, floor_step_s=floors)
        for i in range(a.steps):
            sync()
            t = time.perf_counter()
            loss = work.loss()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            times.append(time.perf_counter() - t)
            losses.append(loss.item())
            msg = f"step {i} {times[-1]:.2f}s loss {losses[-1]:.4f}"
            if not a.plain:
                ph = opt.stats()["last_step"]
                phases.append(ph)
                if "disk" in res:
                    read_s, write_s = disk_seconds(ph, res["disk"])
                    floors.append(read_s + write_s)
                    overlaps.append(max(read_s, write_s))
                    if "optimizer_read_GBps" in res["disk"]:
                        own_floors.append(sum(disk_seconds(ph, res["disk"], own=True)))
                    msg += f" floor {floors[-1]:.2f}s"
                msg += f" (disk: read {format_size(int(ph['nvme_read_bytes']))},"
                msg += f" wrote {format_size(int(ph['nvme_write_bytes']))})"
            log(msg)
            med = steady(times)
            res.update(median_steady_s=med, tokens_per_s=a.batch * a.seq / med)
            if floors:
                # floor_overlap_s: the floor if reads and writes overlapped perfectly (max instead of sum)
                floor = steady(floors)
                res.update(floor_s=floor, floor_overlap_s=steady(overlaps), ratio=med / floor if floor > 0 else None)
            if own_floors:  # the same at the I/O configuration the optimizer ran with
                own = steady(own_floors)
                res.update(floor_own_s=own, ratio_own=med / own if own > 0 else None)
            emit()
            elapsed = time.perf_counter() - T0
            if i >= 1 and i + 1 < a.steps and elapsed + max(times[1:]) > a.deadline:
                log(f"deadline: {elapsed:.0f} s spent of {a.deadline:.0f} s, stopping after {i + 1} steps")
                res["deadline_hit"] = True
                break
        if cuda:
            res["peak_gpu_GiB"] = torch.cuda.max_memory_allocated() / 2**30
        if not a.plain:  # totals over all steps and the store's bytes per tier
            res["stats"] = {k: v for k, v in opt.stats().items() if k != "last_step"}
        res["complete"] = True
    except BaseException as e:
        res["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        if opt is not None and hasattr(opt, "close") and not a.no_close:
            opt.close()
        if run_dir and not (a.keep_state or a.no_close):
            shutil.rmtree(run_dir, ignore_errors=True)
        res["total_s"] = time.perf_counter() - T0
        res["leaving_at"] = time.time()
        emit(final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
