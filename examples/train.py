"""Train with the optimizer state on disk: `TieredOptimizer` where you would write `torch.optim.AdamW`.

    python examples/train.py                    # a tiny byte-level transformer on the CPU, ~20 s
    python examples/train.py --save ckpt        # ... then an NVMe-tier checkpoint in ./ckpt
    python examples/train.py --llama            # Llama-0.94B (bf16, batch 8 x seq 1024) on CUDA
    python examples/train.py --llama --layers 2 --hidden 256 --seq 128 --batch 2   # a small Llama

The optimizer keeps fp32 master weights, m and v under --nvme-path and at most --host-budget of them in
host memory; with a budget smaller than the state, part of it streams from the disk every step.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm

from tiered import TieredOptimizer
from tiered.bench import example_args as checks
from tiered.bench.workload import Workload, build_llama, build_tiny, width_problem

CORPUS = Path(__file__)  # the tiny model's training text: this very file, as bytes (nothing to download)


def build(args: argparse.Namespace, device: torch.device) -> Workload:
    """The model, and the loss of one batch: the tiny model on random windows of CORPUS, or the 0.94B Llama
    reference workload (transformers), shrunk by the flags."""
    if args.llama:
        return build_llama(device, layers=args.layers, hidden=args.hidden, seq=args.seq, batch=args.batch)
    corpus = CORPUS.read_bytes()
    return build_tiny(device, dim=args.dim, layers=args.layers, seq=args.seq, batch=args.batch, corpus=corpus)


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> torch.device:
    """The training's device, once the flags that torch, transformers or the end of the run would refuse
    have been checked; a bad one is argparse's one-line error, before anything is built."""
    flag, width = ("--hidden", args.hidden) if args.llama else ("--dim", args.dim)
    problem = width_problem(width, llama=args.llama)
    if problem:
        p.error(f"{flag} {problem}")
    size = CORPUS.stat().st_size
    if not args.llama and args.seq + 2 > size:  # a window is --seq tokens and the next one, a token a byte
        p.error(f"--seq {args.seq} is longer than the training text allows ({CORPUS.name}: {size} bytes, "
                f"windows of at most {size - 2})")  # fmt: skip
    device = args.device or torch.device("cuda" if args.llama else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        what = f"--device {device}" if args.device else "--llama (on cuda unless --device says)"
        small = " with a small model (--layers 2 --hidden 256 --seq 128)" if args.llama else ""
        p.error(f"{what}: no CUDA device here; pass --device cpu{small}")
    for problem in (checks.folder_problem("--nvme-path", args.nvme_path),
                    args.save and checks.save_problem(args.save, args.nvme_path),
                    checks.optimizer_problem(**knobs(args))):  # fmt: skip
        if problem:
            p.error(problem)  # the save, at the end, is also checked now: a bad path would lose the whole run
    return device


def knobs(args: argparse.Namespace) -> dict[str, str]:
    """The optimizer's knobs the flags set (--chunk-bytes unset with --llama: the optimizer's default)."""
    unset = args.chunk_bytes is None
    return {"host_budget": args.host_budget, **({} if unset else {"chunk_bytes": args.chunk_bytes})}


DEFAULTS = {  # per mode: the tiny CPU model, or --llama (the reference workload of bench/RESULTS.md)
    False: dict(steps=150, host_budget="4MiB", chunk_bytes="256KiB", lr=3e-3, layers=4, seq=64, batch=16),
    True: dict(steps=10, host_budget="2GiB", chunk_bytes=None, lr=1e-4, layers=16, seq=1024, batch=8),
}


def positive(text: str) -> int:
    """An argparse type: an integer >= 1 (0 steps or a log every 0 steps is a typo, not a request)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return n


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=positive, default=None, help="default: 150 (tiny), 10 (--llama)")
    p.add_argument("--nvme-path", default="./tiered-state", type=checks.user_path,
                   help="folder for the optimizer's disk tier")  # fmt: skip
    p.add_argument("--host-budget", default=None, help="host memory for state: 4MiB (tiny), 2GiB (--llama)")
    p.add_argument("--chunk-bytes", default=None, help="default 256KiB (tiny), the optimizer's (--llama)")
    p.add_argument("--lr", type=float, default=None, help="default 3e-3 (tiny), 1e-4 (--llama)")
    p.add_argument("--save", metavar="DIR", type=checks.user_path, help="save an NVMe-tier checkpoint here at the end")
    p.add_argument("--log-every", type=positive, default=10)
    p.add_argument("--llama", action="store_true", help="train a transformers LlamaForCausalLM on CUDA")
    p.add_argument("--layers", type=positive, default=None, help="default 4 (tiny), 16 (--llama)")
    p.add_argument("--hidden", type=positive, default=2048, help="--llama width")
    p.add_argument("--dim", type=positive, default=128, help="tiny model width")
    p.add_argument("--seq", type=positive, default=None, help="default 64 (tiny), 1024 (--llama)")
    p.add_argument("--batch", type=positive, default=None, help="default 16 (tiny), 8 (--llama)")
    p.add_argument("--device", type=checks.device, help="default: cuda for --llama, else cpu")
    args = p.parse_args(argv)
    for name, value in DEFAULTS[args.llama].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    device = check(p, args)

    work = build(args, device)  # seeds torch with 0 first
    model = work.model
    room = args.save and checks.save_room_problem(args.save, work.params)  # known once the model is
    if room:
        p.error(room)
    save = Path(args.save) if args.save else None
    print(f"{type(model).__name__}: {work.params / 1e6:.2f} M params on {device}; state in {args.nvme_path}")
    # The optimizer refuses a bad knob or an unusable folder by name: say that, not a traceback.
    try:
        opt = TieredOptimizer(model, nvme_path=args.nvme_path, lr=args.lr, **knobs(args))
    except (ValueError, TypeError) as e:
        p.error(str(e))
    except OSError as e:
        p.error(f"--nvme-path {args.nvme_path}: {e}")
    # `with` closes the optimizer at the end (pinned memory, I/O threads, the folder's lock), errors too.
    with opt:
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps, eta_min=args.lr / 10)
        t0 = time.perf_counter()
        bar = tqdm(range(args.steps), desc="train", unit="step")
        for step in bar:
            loss = work.loss()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            value = loss.item()
            bar.set_postfix(loss=f"{value:.3f}")
            if step % args.log_every == 0 or step == args.steps - 1:
                tqdm.write(f"step {step:4d}  loss {value:.4f}")
        bar.close()
        elapsed = time.perf_counter() - t0
        s = opt.stats()
        last, mib = s["last_step"], 2**20
        print(f"{args.steps} steps in {elapsed:.1f} s; state {s['state_bytes'] / mib:.1f} MiB")
        print(
            f"last step: read {last['nvme_read_bytes'] / mib:.2f} MiB from disk, wrote "
            f"{last['nvme_write_bytes'] / mib:.2f} MiB; {last['host_hit_bytes'] / mib:.2f} MiB of the state "
            "stayed in host memory"
        )
        if save is not None:
            try:
                opt.save_checkpoint(save)
            except OSError as e:  # a full disk, no permission, a path taken since the check above
                raise SystemExit(f"train.py: the checkpoint was not saved: {e}") from None
            print(f"checkpoint saved to {save}")


if __name__ == "__main__":
    checks.exit_on_sigterm("train.py")
    main()
