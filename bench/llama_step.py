"""The reference workload (perf.md, "Llama-0.94B") trained with TieredOptimizer, against the disk's floor.

    python3 bench/llama_step.py --nvme /root/tiered_nvme [--host-budget 2GiB] [--steps 5]
    python3 bench/llama_step.py --plain    # torch.optim.AdamW(fused=True), all on the GPU: the loss reference
    python3 bench/llama_step.py --plain --masters    # the same over fp32 master copies: TieredOptimizer's math

--plain updates the bf16 weights in bf16, as ds_anchor.py's gpu mode does; TieredOptimizer keeps fp32 masters,
so the two loss curves agree to bf16 rounding, not bit for bit. --plain --masters keeps fp32 masters on the GPU
as TieredOptimizer does on disk (fp32 gradients, fused AdamW, weights cast back): its losses are what ours
should reproduce.

Mirrors ../shared/anchors/ds_anchor.py: LlamaForCausalLM from a config (random init, seed 0, bf16), one fixed
batch of random tokens, each step timed between torch.cuda.synchronize() calls, the median over steps 1..N-1.

Before training it measures the disk the state lives on, in this process, with io_engine as bench/disk_mixed.py
does (O_DIRECT, overwrites of two files of --floor-size, 4 GiB: the optimizer overwrites its state files every
step): the optimizer's IOConfig first, then the configs of SWEEP while --floor-budget seconds allow. The
floor of a step is then
    floor_s = nvme_read_bytes / best read B/s + nvme_write_bytes / best write B/s
with the bytes that step moved (opt.stats()["last_step"]), and ratio = median step / median floor;
floor_own_s and ratio_own are the same at the optimizer's own I/O configuration.

Progress goes to stderr; one JSON line to stdout, also written to $OUT/<name>.json after every step (so a
run cut short still leaves its figures; "complete" tells). Nothing CUDA- or transformers-bound is imported
before main() runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import time
import uuid

import torch

T0 = time.perf_counter()
# (threads, block MiB): the best rows of bench/disk_mixed.py on the H200 (bench/RESULTS.md).
SWEEP = ((32, 1), (16, 1), (64, 2), (16, 8))


def log(msg: str) -> None:
    print(f"[llama_step {time.perf_counter() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


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
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=None, help="default 5504 * hidden / 2048")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--device", default="cuda", help="cuda; cpu only for smoke tests at toy sizes")
    g = p.add_argument_group("TieredOptimizer knobs (docs/internals.md); unset ones keep its defaults")
    g.add_argument("--host-budget", default="2GiB")
    g.add_argument("--moments-dtype", choices=("fp32", "bf16"), default=None)
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
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error("--steps must be >= 1")
    if a.inter is None:
        a.inter = 5504 * a.hidden // 2048
    if a.name is None:
        moments = f"_{a.moments_dtype}m" if a.moments_dtype else ""
        plain = "llama_plain_masters" if a.masters else "llama_plain"
        a.name = plain if a.plain else f"llama_hb{a.host_budget}{moments}"
    a.name = re.sub(r"[^A-Za-z0-9._-]", "_", a.name)
    return a


# ------------------------------------------------------------------------------------------------ the disk
def measure_disk(directory: str, base_cfg, size: int, budget_s: float) -> dict:
    """Read and write GB/s of the disk under `directory`: the optimizer's IOConfig, then the sweep.

    Each config is measured as bench/disk_mixed.py does: two files written once untimed, then an
    overwrite of one (fsync counted, as the optimizer overwrites its state files every step), a read of
    it, and a read of it while the other is overwritten. O_DIRECT unless the filesystem refuses it. The
    sweep stops once `budget_s` would be passed.
    """
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling, also when imported by path
    from disk_mixed import measure, write_once

    from tiered.bench.disk import direct_supported
    from tiered.bench.workspace import Workspace

    size = size // (1 << 20) * (1 << 20)
    sweep = [base_cfg.replace(threads=t, block_size=b << 20) for t, b in SWEEP]
    configs = list(dict.fromkeys([base_cfg, *sweep]))  # the optimizer's first, each config once
    rows: list[dict] = []
    start = time.perf_counter()
    with Workspace(directory, flag="--nvme") as ws:
        ws.require_free(2 * size, "the floor's two test files")
        direct = direct_supported(ws.dir)
        if not direct:
            log(f"{directory} refuses O_DIRECT: buffered I/O measured (the page cache may flatter it)")
        configs = [c.replace(direct="on" if direct else "off") for c in configs]
        a, b = ws.path("floor-a.bin"), ws.path("floor-b.bin")
        write_once(configs[0], (a, b), size)
        for cfg in configs:
            spent = time.perf_counter() - start
            if rows and spent + spent / len(rows) > budget_s:
                log(f"disk: sweep stopped after {len(rows)} of {len(configs)} configs ({spent:.0f} s)")
                break
            rows.append(measure(cfg, a, b, size))
            r = rows[-1]
            log(
                f"disk: {cfg.threads:3d} threads x {cfg.block_size >> 20:2d} MiB blocks: read {r['read_GBps']:.2f},"
                f" write {r['write_GBps']:.2f} GB/s; both at once {r['mixed_GBps']:.2f} GB/s"
            )
    best = min(rows, key=lambda r: 1 / r["read_GBps"] + 1 / r["write_GBps"])
    return dict(
        size=size,
        direct=direct,
        rows=rows,
        seconds=time.perf_counter() - start,
        read_GBps=max(r["read_GBps"] for r in rows),
        write_GBps=max(r["write_GBps"] for r in rows),
        mixed_GBps=max(r["mixed_GBps"] for r in rows),
        optimizer_read_GBps=rows[0]["read_GBps"],
        optimizer_write_GBps=rows[0]["write_GBps"],
        best_cfg=dict(threads=best["threads"], block_size=int(best["block_MiB"] * 2**20)),
    )


# ------------------------------------------------------------------------------------------------ training
def build_model(a: argparse.Namespace, device: torch.device):
    """As ds_anchor.py: seed 0, the model built on the CPU (fp32, then bf16); the batch made on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = max(1, a.hidden // 128)
    cfg = LlamaConfig(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.inter,
        num_hidden_layers=a.layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=a.seq,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    x = torch.randint(0, a.vocab, (a.batch, a.seq), device=device)
    return model.to(device), x


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


def emit_json(res: dict, name: str, final: bool) -> None:
    """The result so far as one JSON line: to $OUT/<name>.json (rewritten each time, so a run cut short
    leaves its figures), and to stdout when ``final``."""
    line = json.dumps(rounded(res), default=str)
    if final:
        print(line, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"{name}.json"), "w") as fh:
            fh.write(line + "\n")


def rounded(obj, nd: int = 4):
    if isinstance(obj, float):
        return round(obj, nd)
    if isinstance(obj, dict):
        return {k: rounded(v, nd) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [rounded(v, nd) for v in obj]
    return obj


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
                disk = res["disk"] = measure_disk(a.nvme, io_cfg, parse_size(a.floor_size), a.floor_budget)
                if a.io_from_sweep:
                    io_cfg = io_cfg.replace(**disk["best_cfg"])
            res["io_config"] = io_cfg.to_dict()
            emit()

        import transformers

        res["transformers"] = transformers.__version__
        t = time.perf_counter()
        model, x = build_model(a, device)
        sync()
        res.update(params=sum(p.numel() for p in model.parameters()), model_init_s=time.perf_counter() - t)
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
                knobs["moments_dtype"] = torch.bfloat16 if a.moments_dtype == "bf16" else torch.float32
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
            loss = model(input_ids=x, labels=x).loss
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
                # floor_overlap_s: the floor if reads and writes overlapped perfectly (perf.md's 5.9 s case)
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
        if opt is not None and hasattr(opt, "close"):
            opt.close()
        if run_dir and not a.keep_state:
            shutil.rmtree(run_dir, ignore_errors=True)
        res["total_s"] = time.perf_counter() - T0
        emit(final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
