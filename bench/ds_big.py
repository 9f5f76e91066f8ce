"""DeepSpeed's side of examples/big_model.py: the same model, data and steps under ZeRO-3, the optimizer
offloaded to host RAM (--offload cpu, ZeRO-Offload) or to NVMe (--offload nvme, ZeRO-Infinity), and with
--offload-param cpu|nvme the bf16 weights too, kept in host RAM (or on NVMe under --nvme-path) and brought to the
GPU as layers need them (ZeRO-3's offload_param: DeepSpeed's way to train a model whose weights do not fit the
GPU, the capacity comparison).

    bash .anchors/run_on_device.sh ../bench/ds_big.py --offload nvme --nvme-path /root/ds_nvme --json ds.json
    bash .anchors/run_on_device.sh ../bench/ds_big.py --offload cpu --hidden 4096 --layers 32 --heads 32 \\
        --inter 11008 --gpu-memory-cap 80GB                    # 6.7B, as on an 80 GB GPU

The model and training flags are big_model.py's, and so are build_model() and batches(): the same weights
and the same tokens. Where big_model.py would offload the parameters (its `--offload auto`: the bf16 weights and
gradients over tiered.offload.GPU_SHARE of the GPU under the cap), it draws them on the host, so the model is
made there the same way and then moved to the GPU; elsewhere it is made on the GPU, as big_model.py makes it.
DeepSpeed scales the loss by 1/--accumulate and steps at the last micro-batch itself; its AdamW takes
TieredOptimizer's defaults. A line a step, then one JSON line (also written to --json) with big_model --json's
keys where they apply.

A watchdog thread ends the run (exit 3) with an error line when the host's available RAM falls below
--min-free-ram: left to the kernel's OOM killer, the run would leave no record of how far it got, and the
killer may pick another process. An exception, or SIGTERM (a timeout), also leaves an error line (exit 1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # tiered and io_engine, for big_model, where PYTHONPATH lacks the repo

from big_model import add_model_args, batches, build_model  # noqa: E402

from io_engine import parse_size  # noqa: E402
from tiered.bench.common import rounded  # noqa: E402
from tiered.bench.example_args import check_model_args  # noqa: E402
from tiered.bench.training_run import Steps, cap_gpu_memory, peak_host_bytes  # noqa: E402
from tiered.offload import GPU_SHARE  # noqa: E402

GiB = 2**30


class Report:
    """The run's one JSON line, from whichever thread ends it first: the main thread or the watchdog."""

    def __init__(self, start: float, json_path: str | None, offload: str) -> None:
        self.start = start  # main()'s, as big_model.py counts its first step from
        self.json_path, self.offload = json_path, offload
        self.phase = "start"
        self.min_available = psutil.virtual_memory().available
        self._lock = threading.Lock()

    def finish(self, result: dict[str, Any]) -> None:
        """The success line. The lock stays held: a watchdog that fires during the exit stays quiet."""
        self._lock.acquire()
        self._emit(result)

    def _emit(self, record: dict[str, Any]) -> None:
        # Each of the two whatever became of the other: the disk may be full, and after a timeout's SIGTERM to
        # the whole process group the reader of stdout may be gone.
        line = json.dumps(record)
        if self.json_path:
            with contextlib.suppress(OSError):
                Path(self.json_path).write_text(line + "\n")
        with contextlib.suppress(OSError):
            print(line, flush=True)

    def fail(self, error: str, code: int) -> NoReturn:
        """Emit the error line and end the process now. os._exit: no waiting on DeepSpeed's threads, no
        atexit hooks that may need the memory that ran out. The second thread to fail waits here for it."""
        self._lock.acquire()
        try:
            rss = psutil.Process().memory_info().rss
            record = dict(
                engine="deepspeed",
                offload=self.offload,
                error=error,
                phase=self.phase,
                rss_GiB=rss / GiB,
                peak_host_GiB=peak_host_bytes() / GiB,
                min_available_GiB=self.min_available / GiB,
                elapsed_s=time.perf_counter() - self.start,
            )
            self._emit(rounded(record, 3))
        finally:
            os._exit(code)

    def watch(self, min_free: int, min_free_text: str) -> None:
        """The watchdog's loop: every 0.5 s, the host's available RAM against ``min_free``."""
        while True:
            available = psutil.virtual_memory().available
            self.min_available = min(self.min_available, available)
            if available < min_free:
                self.fail(f"host RAM exhausted (available {available / GiB:.1f} GiB < {min_free_text})", 3)
            time.sleep(0.5)


def describe(e: BaseException) -> str:
    """The exception's type and the last line of its message (DeepSpeed's can run to many lines)."""
    if isinstance(e, SystemExit) and isinstance(e.code, str):
        return e.code  # our own refusals (cap_gpu_memory, batches) say what is wrong already
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[-1]}" if lines else type(e).__name__


def ds_config(args: argparse.Namespace, largest: int = 0) -> dict[str, Any]:
    """The engine's configuration; ``largest``: the most elements of one parameter (ZeRO-3's NVMe buffers for the
    weights must hold it)."""
    offload: dict[str, Any] = {"device": args.offload, "pin_memory": True}
    if args.offload == "nvme":
        offload.update(nvme_path=args.nvme_path, buffer_count=4)
    zero: dict[str, Any] = {
        "stage": 3,
        "offload_optimizer": offload,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 100_000_000,
    }
    if args.offload_param != "none":
        zero["offload_param"] = {"device": args.offload_param, "pin_memory": True}
    if args.offload_param == "nvme":  # DeepSpeed's own example's buffers, large enough for the embedding
        size = max(100_000_000, largest)
        zero["offload_param"].update(nvme_path=args.nvme_path, buffer_count=5, buffer_size=size, max_in_cpu=10**9)
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": args.accumulate,
        "gradient_clipping": args.max_grad_norm,  # 0: off, as in big_model.py
        "bf16": {"enabled": True},
        # DeepSpeedCPUAdam's own weight_decay default is 0, torch's and TieredOptimizer's 1e-2: say it.
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 1e-2},
        },
        "zero_optimization": zero,
        # .anchors/ds_anchor.py's: 0.19.8 reads intra_op_parallelism (thread_count is ignored)
        "aio": {
            "block_size": 1 << 20,
            "queue_depth": 8,
            "intra_op_parallelism": 1,
            "single_submit": False,
            "overlap_events": True,
        },
        "steps_per_print": 10**9,
    }


def run(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: DeepSpeed's side runs on a GPU")
    device = torch.device("cuda")
    cap = cap_gpu_memory(args.gpu_memory_cap, device) if args.gpu_memory_cap else None

    report.phase = "build model"
    t0 = time.perf_counter()
    shapes = [p.numel() for p in build_model(args, torch.device("meta")).parameters()]
    params, largest = sum(shapes), max(shapes)
    if args.offload_param != "none":  # left on the host: DeepSpeed moves each weight's partition into pinned RAM
        model = build_model(args, torch.device("cpu"))
    elif 4 * params > GPU_SHARE * (cap or torch.cuda.get_device_properties(device).total_memory):
        model = build_model(args, torch.device("cpu")).to(device)  # big_model.py's initial weights, offloaded
    else:
        model = build_model(args, device)
    torch.cuda.synchronize(device)
    model_s = time.perf_counter() - t0
    print(f"LlamaForCausalLM: {params:,} params, bf16, on {model.device}; built in {model_s:.1f} s", flush=True)
    batch = batches(args, device)

    report.phase = "deepspeed.initialize"
    import deepspeed  # here, not above: --help works where it is not installed (.anchors installs it)

    if "nvme" in (args.offload, args.offload_param):
        os.makedirs(args.nvme_path, exist_ok=True)
    t0 = time.perf_counter()
    config = ds_config(args, largest)
    if args.offload_param != "none":
        # Partitioned off the host-built model parameter by parameter, as if made under zero.Init (DeepSpeed's way
        # for models larger than the GPU): initialize alone would move the whole model onto the GPU first, and a
        # model whose bf16 weights exceed the cap would run out of memory there before its first step.
        deepspeed.zero.Init(
            module=model, config_dict_or_path=config, remote_device=args.offload_param, pin_memory=True,
            dtype=torch.bfloat16,
        )  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    torch.cuda.synchronize(device)
    init_s = time.perf_counter() - t0
    where = f"optimizer offloaded to {args.offload}, weights to {args.offload_param}"
    print(f"deepspeed.initialize: {init_s:.1f} s (ZeRO-3, {where})", flush=True)

    steps = Steps(args.batch * args.seq * args.accumulate, report.start)
    for step in range(args.steps):
        report.phase = f"step {step}"
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss_sum = 0.0
        for i in range(args.accumulate):
            x = batch(i)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            loss_sum += loss.item()  # waits for the GPU
            t1 = time.perf_counter()  # the last micro-batch's engine.step() is the optimizer's step
            engine.step()
        torch.cuda.synchronize(device)
        steps.add(loss_sum / args.accumulate, t0, t1, time.perf_counter())

    report.phase = "done"
    figures = dict(engine="deepspeed", offload=args.offload, offload_param=args.offload_param, params=params,
                   batch=args.batch, seq=args.seq, accumulate=args.accumulate, model_s=model_s, init_s=init_s,
                   **steps.figures(), **steps.peaks(device), min_available_GiB=report.min_available / GiB,
                   gpu_memory_cap=cap)  # fmt: skip
    return {**rounded(figures, 3), "losses": steps.losses}


def main(argv: list[str] | None = None) -> None:
    start = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="write the result, or the error, to PATH as one JSON line")
    add_model_args(p)
    d = p.add_argument_group("DeepSpeed")
    d.add_argument(
        "--offload",
        choices=("cpu", "nvme"),
        default="nvme",
        help="ZeRO-3's offload_optimizer device (default: %(default)s)",
    )
    d.add_argument(
        "--offload-param",
        choices=("none", "cpu", "nvme"),
        default="none",
        help="ZeRO-3's offload_param device: the weights in host RAM, or on NVMe (default: %(default)s)",
    )
    d.add_argument("--nvme-path", default="./ds-nvme", help="the nvme offloads' swap folder (default: %(default)s)")
    d.add_argument(
        "--min-free-ram", metavar="SIZE", default="3GiB",
        help="end the run (exit 3) when less host RAM than this is available (default: %(default)s)",
    )  # fmt: skip
    args = p.parse_args(argv)
    check_model_args(p, args)
    try:
        min_free = parse_size(args.min_free_ram, name="--min-free-ram")
    except ValueError as e:
        p.error(str(e))

    report = Report(start, args.json, args.offload)

    def on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit("terminated by SIGTERM (a timeout?)")

    # Python runs the handler between bytecodes: a long call into DeepSpeed's C++ delays it, and `timeout -k`
    # then kills the process with no line.
    signal.signal(signal.SIGTERM, on_sigterm)
    threading.Thread(target=report.watch, args=(min_free, args.min_free_ram), name="ram-watchdog", daemon=True).start()
    try:
        result = run(args, report)
    except BaseException as e:
        with contextlib.suppress(OSError):  # stderr's reader may be gone (SIGTERM): the line still goes to --json
            traceback.print_exc()
        report.fail(describe(e), 1)
    report.finish(result)
    os._exit(0)  # the figures are out: no waiting on the teardown of DeepSpeed's process group and aio threads


if __name__ == "__main__":
    main()
