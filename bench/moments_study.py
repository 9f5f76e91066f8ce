"""What narrower moments cost in loss: a byte-level language model trained on real text, held-out loss.

    python bench/moments_study.py --steps 600 --seeds 0,1,2 --options fp32,bf16,int8 --png moments.png
    # on a GPU, a 25M-parameter model, the state held in pinned DDR:
    python bench/moments_study.py --device cuda --dim 512 --layers 8 --seq 256 --batch 32 --steps 2000 \
        --lr 1e-3 --host-budget 4GiB --options fp32,bf16,int8 --seeds 0,1,2

The text is the source of Python's own standard library (on every machine with Python, nothing
downloaded): its .py files, split by file into train and validation (one file in ten, chosen by a hash of its
path, is held out). The model is TinyGPT (tiered.bench.workload), a byte-level transformer. Each run trains it
from the seed's initialization on the seed's sequence of random train windows, with TieredOptimizer and one
``moments_dtype`` (fp32: exact AdamW; bf16: moments rounded to bf16 between steps; int8: 8-bit blockwise
moments, tiered/layout/moments_codec.py), a cosine learning rate,
and measures the loss on the same fixed validation windows every ``--eval-every`` steps. Options of one seed
see the same initialization and the same batches, so their difference is the optimizer's alone.
``--device cuda`` runs the model on the GPU (the update then runs there too, as ``update_on="auto"`` has it);
``--param-dtype bf16`` trains bf16 parameters over fp32 masters, split where the update runs on the GPU.

A benchmark: it prints a table (final validation loss per option: mean and spread over the seeds) and writes
every curve to $OUT/<--name>.json; with --png, a plot of the validation curves (needs matplotlib). It
asserts nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from tiered import TieredOptimizer
from tiered.bench.workload import TinyGPT

MOMENTS = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}
PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def corpus(limit: int) -> tuple[bytes, bytes]:
    """(train, validation) bytes of the standard library's .py files, split by file, each at most ``limit``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val = bytearray(), bytearray()
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        held_out = hashlib.sha256(str(path.relative_to(root)).encode()).digest()[0] % 10 == 0
        part = val if held_out else train
        if len(part) < limit:
            part += path.read_bytes()[: limit - len(part)]
        if len(train) >= limit and len(val) >= limit // 10:
            break
    return bytes(train), bytes(val[: limit // 10])


def windows(text: torch.Tensor, n: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    i = torch.randint(0, len(text) - seq - 1, (n, 1), generator=gen) + torch.arange(seq + 1)
    return text[i]


def warmup_cosine(step: int, warmup: int, steps: int) -> float:
    return min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps))


def loss_of(model: nn.Module, w: torch.Tensor) -> torch.Tensor:
    logits = model(w[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), w[:, 1:].flatten())


def run(option: str, seed: int, a: argparse.Namespace, train: torch.Tensor, val: list[torch.Tensor]) -> dict:
    torch.manual_seed(seed)
    model = TinyGPT(a.dim, a.layers, a.seq).to(a.device, PARAM_DTYPES[a.param_dtype])
    gen = torch.Generator().manual_seed(1000 + seed)  # the seed's batches, the same for every option
    curve = []
    t0 = time.perf_counter()
    with (
        tempfile.TemporaryDirectory() as folder,
        TieredOptimizer(
            model, folder, lr=a.lr, weight_decay=0.1, host_budget=a.host_budget, moments_dtype=MOMENTS[option]
        ) as opt,
    ):
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, a.warmup, a.steps))
        for step in range(1, a.steps + 1):
            loss_of(model, windows(train, a.batch, a.seq, gen).to(a.device)).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            if step % a.eval_every == 0 or step == a.steps:
                with torch.no_grad():
                    v = statistics.fmean(float(loss_of(model, w)) for w in val)
                curve.append((step, v))
                print(f"[moments_study] {option} seed {seed} step {step}: val {v:.4f}", file=sys.stderr, flush=True)
        state = opt.state_bytes
    params = sum(p.numel() for p in model.parameters())
    return dict(option=option, seed=seed, curve=curve, final_val=curve[-1][1], state_bytes=state, params=params,
                seconds=time.perf_counter() - t0)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--options", default="fp32,bf16", help=f"comma-separated, of {sorted(MOMENTS)}")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--val-batches", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--host-budget", default="256MiB", help="a state larger than this streams through the disk")
    p.add_argument("--device", default="cpu", help="where the model trains: cpu, cuda, cuda:1, ...")
    p.add_argument("--param-dtype", default="fp32", choices=sorted(PARAM_DTYPES))
    p.add_argument("--corpus-bytes", type=int, default=8 << 20)
    p.add_argument("--name", default="moments_study")
    p.add_argument("--png", default=None, help="plot the validation curves here (needs matplotlib)")
    a = p.parse_args(argv)
    options = [o.strip() for o in a.options.split(",") if o.strip()]
    if any(o not in MOMENTS for o in options):
        p.error(f"--options: each of {sorted(MOMENTS)}")
    seeds = [int(s) for s in a.seeds.split(",")]
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if torch.device(a.device).type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {a.device}: CUDA is not available here")

    train_b, val_b = corpus(a.corpus_bytes)
    train = torch.tensor(list(train_b), dtype=torch.long)
    val_text = torch.tensor(list(val_b), dtype=torch.long)
    vgen = torch.Generator().manual_seed(7)
    val = [windows(val_text, a.batch, a.seq, vgen).to(a.device) for _ in range(a.val_batches)]
    runs = []
    for s in seeds:
        for o in options:
            runs.append(run(o, s, a, train, val))
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "curve"}), flush=True)  # kept if cut short

    summary = {}
    for o in options:
        finals = [r["final_val"] for r in runs if r["option"] == o]
        state = next(r["state_bytes"] for r in runs if r["option"] == o)
        summary[o] = dict(final_val_mean=statistics.fmean(finals), final_val_spread=max(finals) - min(finals),
                          finals=finals, state_bytes=state)  # fmt: skip
    doc = dict(name=a.name, args=vars(a), train_bytes=len(train_b), val_bytes=len(val_b), runs=runs, summary=summary)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, f"{a.name}.json"), "w") as fh:
        json.dump(doc, fh)
    print(f"{'option':<6} {'final val loss (mean)':>22} {'spread':>8} {'state bytes':>12}  per seed")
    for o, s in summary.items():
        print(f"{o:<6} {s['final_val_mean']:>22.4f} {s['final_val_spread']:>8.4f} {s['state_bytes']:>12}  "
              + ", ".join(f"{x:.4f}" for x in s["finals"]))  # fmt: skip
    if a.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        colors = dict(zip(MOMENTS, ("black", "tab:orange", "tab:blue")))
        for r in runs:
            steps, vals = zip(*r["curve"])
            label = r["option"] if r["seed"] == seeds[0] else None
            ax.plot(steps, vals, color=colors[r["option"]], alpha=0.7, label=label)
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss (nats a byte)")
        ax.set_title(f"TinyGPT {runs[0]['params'] / 1e6:.1f}M on the stdlib's source, seeds {a.seeds}")
        ax.legend(title="moments")
        fig.tight_layout()
        fig.savefig(a.png, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
