"""bf16 moments against fp32 moments: the loss of one small model over --steps steps, and the bytes moved.

    python bench/moments_bf16.py --steps 300

Trains the tiny byte-level transformer of examples/train.py (tiered.bench.workload.build_tiny, on windows of
that module's source) twice from the same seed on the same batches: once with exact AdamW state (fp32
exp_avg/exp_avg_sq), once with `moments_dtype=torch.bfloat16`. Reports both loss curves' tails, their largest
gap, the state's bytes as each optimizer counts them, and the NVMe bytes per step with the same host
budget. A benchmark: it prints figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile

import torch

from tiered import TieredOptimizer
from tiered.bench.workload import build_tiny


def run(moments: torch.dtype, a: argparse.Namespace, folder: str) -> dict:
    work = build_tiny("cpu", dim=a.dim, layers=a.layers, seq=a.seq, batch=a.batch, seed=0)
    model = work.model
    losses = []
    with TieredOptimizer(model, folder, lr=a.lr, host_budget=a.host_budget, chunk_bytes=a.chunk_bytes,
                         moments_dtype=moments) as opt:  # fmt: skip
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, a.steps)
        torch.manual_seed(1)  # the same batches for both runs
        for _ in range(a.steps):
            loss = work.loss()
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            losses.append(float(loss.detach()))
        last = opt.stats()["last_step"]
        return dict(
            losses=losses,
            state_bytes=opt.state_bytes,
            nvme_read_bytes=last["nvme_read_bytes"],
            nvme_write_bytes=last["nvme_write_bytes"],
        )


def moved(run: dict) -> float:
    """NVMe bytes read and written in a run's last step."""
    return run["nvme_read_bytes"] + run["nvme_write_bytes"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--host-budget", default="4MiB")
    ap.add_argument("--chunk-bytes", default="256KiB")
    a = ap.parse_args(argv)
    out: dict = {"args": vars(a)}
    with tempfile.TemporaryDirectory(dir=".") as d:
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            out[name] = run(dtype, a, f"{d}/{name}")
            print(
                f"[moments_bf16] {name}: final loss {statistics.mean(out[name]['losses'][-20:]):.4f}", file=sys.stderr
            )
    f, b = out["fp32"]["losses"], out["bf16"]["losses"]
    out["summary"] = dict(
        steps=a.steps,
        fp32_last20_mean=round(statistics.mean(f[-20:]), 4),
        bf16_last20_mean=round(statistics.mean(b[-20:]), 4),
        last20_rel_diff=round(statistics.mean(b[-20:]) / statistics.mean(f[-20:]) - 1, 5),
        max_abs_gap=round(max(abs(x - y) for x, y in zip(f, b)), 4),
        state_bytes_ratio=round(out["bf16"]["state_bytes"] / out["fp32"]["state_bytes"], 4),
        nvme_bytes_ratio=round(moved(out["bf16"]) / moved(out["fp32"]), 4) if moved(out["fp32"]) else None,
    )
    print(json.dumps(out["summary"]), file=sys.stderr)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
