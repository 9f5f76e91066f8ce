"""Compute alone: examples/big_model.py's forward and backward with the whole model on the GPU and nothing
moved, at layer counts that fit, extrapolated to the layers asked for. The yardstick of issue 29's "the GPU
stays busy" (a step at most 1.25x max(compute alone, the PCIe floor, the disk floor)).

    python3 bench/compute_alone.py --hidden 3200 --layers 34 --heads 32 --inter 8640 --seq 2048 --batch 4 \\
        --accumulate 8 --fit-layers 4,8 --steps 3 --json out.json

The model and tokens are big_model.py's (build_model, batches; gradient checkpointing as there). For each of
--fit-layers, --steps steps of --accumulate micro-batches (the first a warm-up, not counted), each step's
forward and backward timed to the GPU's end, no optimizer. A step's time is close to linear in the layers
(the embedding, the head and the loss are the intercept), so the line through the medians gives the model's
at --layers. One JSON line: each layer count's step times and median, the line, the estimate. A benchmark:
it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from big_model import add_model_args, batches, build_model  # noqa: E402


def forward_backward_s(args: argparse.Namespace, layers: int, device: torch.device) -> list[float]:
    """Step times (s) of ``args.steps`` steps at ``layers`` layers, after one untimed step."""
    a = argparse.Namespace(**{**vars(args), "layers": layers})
    model = build_model(a, device)
    batch = batches(a, device)
    times = []
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        for i in range(args.accumulate):
            x = batch(i)
            (model(input_ids=x, labels=x).loss / args.accumulate).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return times[1:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--fit-layers", default="4,8", help="layer counts to time, comma-separated (at least two)")
    p.add_argument("--json", metavar="PATH", help="also write the JSON line to PATH")
    args = p.parse_args(argv)
    counts = sorted({int(x) for x in args.fit_layers.split(",") if x})
    if len(counts) < 2 or counts[0] < 1:
        p.error("--fit-layers needs two or more distinct positive layer counts")
    if args.steps < 1:
        p.error("--steps must be at least 1")
    device = torch.device(args.device)
    runs = {}
    for n in counts:
        times = forward_backward_s(args, n, device)
        runs[n] = dict(step_s=[round(t, 4) for t in times], median_s=round(statistics.median(times), 4))
        print(f"{n:3d} layers: forward and backward {runs[n]['median_s']:.3f} s a step ({args.accumulate} "
              f"micro-batches of {args.batch} x {args.seq})", flush=True)  # fmt: skip
    slope, intercept = statistics.linear_regression(counts, [runs[n]["median_s"] for n in counts])
    at = intercept + slope * args.layers
    tokens = args.batch * args.seq * args.accumulate
    print(f"{args.layers} layers, extrapolated: forward and backward {at:.3f} s a step "
          f"({intercept:.3f} s + {slope:.4f} s a layer), {tokens / at:,.0f} tokens/s", flush=True)  # fmt: skip
    doc = dict(name="compute_alone", argv=sys.argv[1:] if argv is None else argv, device=str(device),
               gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None, torch=torch.__version__,
               layers=args.layers, tokens_a_step=tokens, runs={str(n): r for n, r in runs.items()},
               intercept_s=round(intercept, 4), per_layer_s=round(slope, 5), estimate_s=round(at, 4),
               tokens_per_s=round(tokens / at, 1))  # fmt: skip
    line = json.dumps(doc)
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
