"""Train a model whose AdamW state fits neither in GPU memory nor in host RAM: a 13B Llama on one H200.

    tiered-bench plan --params 13B --gpu 141GB --ram 125GiB --disk 64GB   # will it fit? (docs/capacity.md)
    python examples/big_model.py --nvme-path /mnt/nvme/tiered              # Llama-2-13B's shape, bf16, CUDA
    python examples/big_model.py --hidden 4096 --layers 32 --heads 32 --inter 11008 --nvme-path ...   # 6.7B
    python examples/big_model.py --hidden 6656 --layers 56 --heads 52 --inter 17920 --batch 2 --accumulate 16 \
        --moments-dtype int8 --host-budget 100GiB --nvme-path ...      # 30.4B: trained on the H200 (bench/RESULTS.md)
    python examples/big_model.py --device cpu --hidden 64 --layers 2 --heads 4 --inter 128 --vocab 256 \\
        --seq 32 --steps 3                                                  # a toy, to see it run anywhere
    python examples/big_model.py --hidden 4096 --layers 48 --heads 32 --inter 11008 --batch 4 --accumulate 8 \\
        --steps 3 --gpu-memory-cap 24GB --nvme-path ...    # 10.0B on a 24 GB GPU: parameters off it (docs/offload.md)

The parts to copy:
- `--offload auto` (default): where the bf16 weights and gradients take more than 60 % of the GPU, the model
  is made in host memory instead and `tiered.offload_model` streams it to the GPU a decoder layer at a time
  (FSDP2's CPU offload); micro-batches' gradients are summed on the host off backward's thread, and the
  update runs on the GPU, with split masters (docs/offload.md);
- the model is made on its device, in bf16 (a `torch.device` context and bf16 as the default dtype), so no
  fp32 copy and no host copy of the weights ever exists: 26 GB of bf16 weights for 13B, nothing more;
- gradient checkpointing keeps one layer's activations at a time (`--no-checkpointing` to turn it off);
- `TieredOptimizer` keeps the fp32 masters' low halves and both moments (10.1 bytes a parameter, exact)
  in `--host-budget` of pinned RAM, and the rest on NVMe under `--nvme-path`; `auto` takes the budget that
  `tiered-bench plan` gives for this machine's RAM: the whole state where it fits under 90 % of RAM less
  8 GiB for the process, else that much; on a GPU, as much again where that fits, for the spare buffers of
  the update under backward (pinned only once it turns on: with one long backward a step, e.g.
  `--batch 32 --accumulate 1`, it hides most of the optimizer's time);
- `--gpu-budget auto` (default) runs one micro-batch's forward and backward before the optimizer exists,
  and keeps the state that the GPU memory it leaves spare holds in HBM (less scratch and a reserve); those
  chunks update where they lie, off PCIe and off the disk. With the parameters offloaded most of the GPU is
  spare (a 24 GB card streaming a 10B Llama peaks near 7 GiB), so a 10B's state keeps some 12 GiB there
  instead of on the disk. The host budget is then planned for the rest;
- `--accumulate` micro-batches of `--batch` x `--seq` tokens a step, the loss scaled to their mean, and
  `opt.summary()` after every step: its time against the disk floor, and the NVMe bytes it moved.

The data: random windows of `--data FILE`'s bytes (one token a byte; needs `--vocab` >= 256), else a fixed
set of random-token batches, one per micro-batch, that the model memorizes: the loss falls if training
works. Replace `batches()` with your data loader.

`--gpu-memory-cap 80GB` lets the process allocate no more of the GPU than that, as on a smaller one.
`--trace PATH` runs one step more under torch.profiler (slower than the others: not counted in the figures) and
writes its chrome trace there, the step labelled "step", each backward "backward" and the optimizer "opt.step";
`python bench/step_timeline.py PATH --step step` says how busy each CUDA stream was.
`--json PATH` writes the run's figures as one JSON line; bench/ds_big.py writes DeepSpeed ZeRO-3's for the
same model and data.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import torch

from io_engine import PAGE, format_size, parse_size, round_up
from tiered import TieredOptimizer
from tiered.bench import example_args as checks
from tiered.bench.arg_types import size
from tiered.bench.common import rounded
from tiered.bench.pcie import link_floor_s
from tiered.bench.plan import Assumptions, recommend_gpu_budget, recommend_host_budget, state_split
from tiered.bench.training_run import Steps, cap_gpu_memory, measure_link, profiled
from tiered.offload import GPU_SHARE, offload_model

# With the parameters off the GPU, RAM left to the process beyond pinned memory: the model as built (unpinned,
# freed a layer at a time as it is sharded), FSDP2's host copies in flight, the CUDA context and the libraries.
OFFLOAD_RAM_RESERVE = 16 << 30
# The optimizer's phases printed after each step (TieredOptimizer.stats()["last_step"]): the time its clip took
# (max_grad_norm), it waited for disk reads and for room that write-backs free, ran the math, and queued copies.
WHERE = ("clip_s", "read_wait_s", "write_wait_s", "update_s", "h2d_s", "grad_d2h_s")


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """LlamaForCausalLM from the flags, made directly on ``device`` in bf16 (random init, seed ``--seed``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.inter,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads if args.kv_heads is None else args.kv_heads,
        max_position_embeddings=args.seq,
        use_cache=False,  # training: no KV cache (gradient checkpointing would turn it off anyway)
    )
    torch.manual_seed(args.seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # parameters are made, and initialized, in bf16 ...
    on_host = device.type == "cpu"
    try:  # ... on the device: the model never exists on the host, unless it is made there to be offloaded
        with torch.device(device), skipped_init() if on_host else contextlib.nullcontext():
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    if on_host:
        init_on_all_cores(model, cfg.initializer_range, args.seed)
    if args.checkpointing:  # transformers 5 renamed gradient_checkpointing_enable
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model.train()


def skipped_init() -> contextlib.AbstractContextManager:
    """Construction without the random init. On the CPU torch draws normal samples on one core (~170 M a
    second): a 10B model's two init passes (torch's, then transformers') took minutes on a 16-core host."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # an older transformers: its own init, slower
        return contextlib.nullcontext()
    return no_init_weights()


def init_on_all_cores(model: torch.nn.Module, std: float, seed: int) -> None:
    """transformers' Llama init (normal(0, std) for the linear and embedding weights; the norms' ones and the
    rotary tables are made at construction) drawn on every core: each piece of at most 16M weights from its own
    generator, seeded by its position, so the weights do not depend on the number of threads."""
    pieces = [w.detach().view(-1)[i : i + PIECE] for w in model.parameters() if w.dim() >= 2
              for i in range(0, w.numel(), PIECE)]  # fmt: skip

    def draw(k: int) -> None:
        pieces[k].normal_(0.0, std, generator=torch.Generator().manual_seed(seed * 1_000_003 + k))

    with torch.no_grad(), ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # normal_ releases the GIL
        list(pool.map(draw, range(len(pieces))))


PIECE = 1 << 24


def choose_offload(args: argparse.Namespace, device: torch.device, cap: int | None) -> tuple[bool, int]:
    """Whether the parameters and gradients go off the GPU (``--offload``; ``auto``: where the bf16 weights and
    gradients, 4 B a parameter, take more than tiered.offload.GPU_SHARE of the GPU), and the parameter count
    (counted on the meta device, which allocates nothing). Refuses, before anything is built, a model that fits
    nowhere: a CUDA OOM during construction, or the kernel's OOM killer, would say less."""
    shapes = [p.numel() for p in build_model(args, torch.device("meta")).parameters()]
    params = sum(shapes)
    # Weights and gradients page-locked in slabs of their size, in whole pages (tiered/offload/pinning.py).
    args.pinned_bytes = 2 * sum(round_up(2 * n, PAGE) for n in shapes)
    ram = psutil.virtual_memory().total
    if device.type == "cuda":
        where, have = "GPU memory", cap or torch.cuda.get_device_properties(device).total_memory
    else:
        where, have = "available RAM", psutil.virtual_memory().available
    offload = args.offload == "on" or (
        args.offload == "auto" and device.type == "cuda" and 4 * params > GPU_SHARE * have
    )
    if offload and args.pinned_bytes + OFFLOAD_RAM_RESERVE > ram:
        raise SystemExit(f"this {params / 1e9:.2f}B-parameter Llama's pinned bf16 weights and gradients "
                         f"({format_size(args.pinned_bytes)}) do not fit the {format_size(ram)} of RAM either: make it "
                         "smaller (--layers, --hidden)")  # fmt: skip
    if not offload and 4 * params > have:
        hint = " (--offload on puts them in host memory)" if device.type == "cuda" else ""
        raise SystemExit(
            f"this {params / 1e9:.2f}B-parameter Llama needs {format_size(4 * params)} for its bf16 weights and "
            f"gradients alone, more than the {format_size(have)} of {where}{hint}: make it smaller (--layers, "
            f"--hidden), or ask `tiered-bench plan --params {params / 1e9:.1f}B` what fits"
        )
    if offload:
        print(f"offload: the bf16 weights and gradients ({format_size(4 * params)}; "
              f"{format_size(args.pinned_bytes)} in pinned slabs) live in host memory, "
              f"streamed to {device.type} a decoder layer at a time (tiered.offload_model, FSDP2's CPU offload); "
              + ("the update runs on the GPU, the state going up and the new weights down" if device.type == "cuda"
                 else "the update runs on the CPU, beside the state"))  # fmt: skip
    return offload, params


def batches(args: argparse.Namespace, device: torch.device) -> Callable[[int], torch.Tensor]:
    """``batch(i)``: the token ids of micro-batch i, shape (batch, seq), on ``device``."""
    shape = (args.batch, args.seq)
    if args.data:
        data = torch.frombuffer(bytearray(Path(args.data).read_bytes()), dtype=torch.uint8).long()
        if len(data) <= args.seq or args.vocab < 256:
            raise SystemExit("--data needs more than --seq bytes and --vocab >= 256 (a token is a byte)")
        g = torch.Generator().manual_seed(args.seed)

        def window(i: int) -> torch.Tensor:
            starts = torch.randint(0, len(data) - args.seq, (args.batch, 1), generator=g)
            return data[starts + torch.arange(args.seq)].to(device)

        return window
    g = torch.Generator().manual_seed(args.seed)
    fixed = [torch.randint(0, args.vocab, shape, generator=g).to(device) for _ in range(args.accumulate)]
    return lambda i: fixed[i]


def record_format(args: argparse.Namespace, device: torch.device) -> str:
    """The record format the optimizer will use: split masters where bf16 weights update on the GPU, and with
    the parameters offloaded (main() asks for them there: RAM, not the CPU, is what runs short)."""
    formats = {"fp32": ("full", "split"), "bf16": ("packed", "packed"), "int8": ("int8", "split-int8")}  # bf16: never
    return formats[args.moments_dtype][device.type == "cuda" or args.offload_on]


def gpu_budget(args: argparse.Namespace, model: torch.nn.Module, batch: Callable[[int], torch.Tensor], params: int,
               device: torch.device, cap: int | None) -> int:  # fmt: skip
    """``--gpu-budget``, or for ``auto`` the HBM that training leaves spare, measured: one micro-batch's
    forward and backward before the optimizer exists (its peak: weights, gradients, activations), less the
    optimizer's scratch and a reserve (tiered.bench.plan.recommend_gpu_budget). Chunks kept there update in
    place: they never cross PCIe or touch the disk."""
    if device.type != "cuda":  # the optimizer keeps no state in HBM for a model on the CPU: plan none there
        return 0
    if args.gpu_budget != "auto":
        return args.gpu_budget
    # Offloaded too: the GPU then holds a layer or two of weights and the activations, most of it idle, and the
    # update runs there, so the state it keeps never crosses PCIe nor touches the disk.
    torch.cuda.reset_peak_memory_stats(device)
    x = batch(0)
    model(input_ids=x, labels=x).loss.backward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device)  # reserved, not allocated: the allocator's slack counts too
    model.zero_grad(set_to_none=True)
    allowed = cap or torch.cuda.get_device_properties(device).total_memory
    a = Assumptions(chunk_bytes=parse_size(args.chunk_bytes))
    budget = recommend_gpu_budget(peak, allowed, params, record_format(args, device), a)
    print(f"gpu_budget auto: {format_size(budget)} of state in HBM (a micro-batch's forward and backward took "
          f"{format_size(peak)} of {format_size(allowed)})")  # fmt: skip
    return budget


def host_budget(args: argparse.Namespace, params: int, device: torch.device, in_hbm: int) -> str | int:
    """``--host-budget``, or for ``auto`` what tiered-bench plan recommends for this machine's RAM, for the
    state that ``in_hbm`` (the gpu_budget) leaves."""
    if args.host_budget != "auto":
        return args.host_budget
    fmt = record_format(args, device)
    a = Assumptions(chunk_bytes=parse_size(args.chunk_bytes))
    # On a GPU, room for the update under backward's second copy too, where RAM allows (pinned only if it turns on).
    ram = psutil.virtual_memory().total
    if args.offload_on:  # the pinned bf16 weights and gradients come first; no update under backward on the host
        a = Assumptions(chunk_bytes=a.chunk_bytes, ram_reserve=OFFLOAD_RAM_RESERVE)
        budget = recommend_host_budget(params, fmt, ram - args.pinned_bytes, a, gpu_budget=in_hbm)
    else:
        budget = recommend_host_budget(params, fmt, ram, a, spare=device.type == "cuda", gpu_budget=in_hbm)
    split = state_split(params, fmt, budget + in_hbm, a)
    state, nvme = (split.state_bytes, split.nvme_bytes) if split else (0, 0)
    print(f"host_budget auto: {budget} ({format_size(budget)}) for {format_size(state)} of state, ", end="")
    print(f"{format_size(nvme)} on NVMe")
    return budget


def add_model_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The model's and the training's flags, which bench/ds_big.py shares; returns the training group."""
    m = p.add_argument_group("model (default: Llama-2-13B's shape)")
    m.add_argument("--hidden", type=int, default=5120)
    m.add_argument("--layers", type=int, default=40)
    m.add_argument("--heads", type=int, default=40)
    m.add_argument("--kv-heads", type=int, default=None, help="default: --heads (no grouped-query attention)")
    m.add_argument("--inter", type=int, default=13824, help="the MLP width")
    m.add_argument("--vocab", type=int, default=32000)
    m.add_argument("--no-checkpointing", dest="checkpointing", action="store_false", help="keep all activations")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=10)
    t.add_argument("--batch", type=int, default=1, help="sequences a micro-batch")
    t.add_argument("--seq", type=int, default=2048, help="tokens a sequence")
    t.add_argument("--accumulate", type=int, default=1, help="micro-batches a step")
    t.add_argument("--lr", type=float, default=1e-4)
    t.add_argument("--max-grad-norm", type=float, default=1.0, help="global-norm clipping; 0 turns it off")
    t.add_argument("--data", metavar="FILE", help="train on random windows of this file's bytes")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument(
        "--gpu-memory-cap", metavar="SIZE",
        help="let this process allocate at most SIZE of the GPU (e.g. 24GB), as on a smaller one",
    )  # fmt: skip
    return t


def link_moved(model: torch.nn.Module) -> tuple[int, int]:
    """Bytes an offloaded model's passes have moved so far: up (its weights, copied ahead or in line, and the held
    gradient sums copied up to be added) and down (its reduced gradients)."""
    weights, sums = model.tiered_prefetch.stats(), model.tiered_accumulation.stats()
    return weights["bytes"] + weights["bytes_inline"] + sums["bytes_held_up"], sums["bytes_reduced"]


def main(argv: list[str] | None = None) -> None:
    start = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", type=checks.output_file, help="the run's figures, one JSON line, to PATH")
    add_model_args(p).add_argument("--device", type=checks.device, default="cuda", help="cuda (default); cpu for a toy")
    o = p.add_argument_group("optimizer state")
    o.add_argument("--nvme-path", default="./tiered-state", type=checks.user_path,
                   help="a folder on the NVMe (default: %(default)s)")  # fmt: skip
    o.add_argument("--host-budget", type=checks.size_or_auto, default="auto",
                   help="pinned RAM for state, e.g. 100GiB (default: auto)")  # fmt: skip
    o.add_argument(
        "--gpu-budget", type=checks.size_or_auto, default="auto",
        help="HBM for state, e.g. 40GiB; auto (default): what a micro-batch's forward and backward leave spare",
    )  # fmt: skip
    o.add_argument("--chunk-bytes", type=size, default="64MiB", help="state bytes a chunk (default: %(default)s)")
    o.add_argument(
        "--offload", choices=("auto", "on", "off"), default="auto",
        help="parameters and gradients in host memory, streamed a layer at a time; auto (default): when their "
        "bf16 bytes take more than 60%% of the GPU; on with --device cpu runs the CPU stand-in",
    )  # fmt: skip
    o.add_argument(
        "--keep-for-backward", type=checks.keep_arg, default="auto", metavar="{auto,on,off,room,N}",
        help="offloaded: a micro-batch's weights stay on the GPU from forward to backward, crossing PCIe once, not "
        "twice; auto (default): when their bf16 bytes take at most 45%% of the GPU; N: the last N blocks' only; "
        "room: as many of the last blocks' as the GPU has room for, measured on the first backwards",
    )  # fmt: skip
    o.add_argument(
        "--moments-dtype", choices=("fp32", "bf16", "int8"), default="fp32",
        help="bf16: 8 bytes a parameter instead of 10.1; int8: 4.16 (8-bit blockwise); less disk traffic, not exact",
    )  # fmt: skip
    p.add_argument("--trace", metavar="PATH", type=checks.output_file, help="one step more, profiled; its trace here")
    args = p.parse_args(argv)
    checks.check_model_args(p, args)  # before anything is built: a typo should not cost a model's construction
    given = dict(chunk_bytes=args.chunk_bytes, moments_dtype=args.moments_dtype,  # the optimizer takes these names
                 max_grad_norm=args.max_grad_norm or None)  # fmt: skip
    if problem := checks.optimizer_problem(host_budget=args.host_budget, **given):  # a chunk_bytes of 0 ...
        p.error(problem)
    logging.basicConfig(format="%(message)s")  # where stderr is a log, not a terminal, setup's progress goes
    logging.getLogger("tiered").setLevel(logging.INFO)  # there every 30 s (tiered/progress.py)
    device = args.device
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: pass --device cpu, with a toy size (see --help)")
    if device.type != "cuda" and (args.gpu_memory_cap or args.gpu_budget not in ("auto", 0)):  # the optimizer
        flag = "--gpu-memory-cap" if args.gpu_memory_cap else "--gpu-budget"  # would ignore a gpu_budget
        p.error(f"{flag} sizes a CUDA device's memory; --device {device} has none")
    if problem := checks.folder_problem("--nvme-path", args.nvme_path):
        p.error(problem)
    cap = cap_gpu_memory(args.gpu_memory_cap, device) if args.gpu_memory_cap else None

    args.offload_on, params = choose_offload(args, device, cap)
    # An offloaded model's passes move its weights and gradients over the link: each step's forward and backward
    # is reported against the least time those bytes take on it.
    link = measure_link(device) if args.offload_on and device.type == "cuda" else None
    moved: dict[str, list[float]] = {k: [] for k in ("up_bytes", "down_bytes", "floor_s", "optimizer_up_bytes",
                                                     "optimizer_down_bytes", "step_floor_s")}  # fmt: skip
    t0 = time.perf_counter()
    model = build_model(args, torch.device("cpu") if args.offload_on else device)
    made_s = time.perf_counter() - t0
    if args.offload_on:  # built on the host, never whole on the GPU
        keep = {"on": True, "off": False}.get(args.keep_for_backward, args.keep_for_backward)
        offload_model(model, device=device, keep_for_backward=keep)
    model_s = time.perf_counter() - t0
    kept = args.offload_on and model.tiered_offload.kept_for_backward
    print(f"LlamaForCausalLM: {params:,} params, bf16, {'streamed to' if args.offload_on else 'on'} {device}"
          f"{' (kept from forward to backward)' if kept else ''}; "
          f"state under {args.nvme_path}; built in {model_s:.1f} s"
          + (f" (made in {made_s:.1f} s, sharded and pinned by FSDP2 in {model_s - made_s:.1f} s)"
             if args.offload_on else ""))  # fmt: skip
    batch = batches(args, device)
    in_hbm = gpu_budget(args, model, batch, params, device, cap)
    knobs = dict(gpu_budget=in_hbm, host_budget=host_budget(args, params, device, in_hbm), **given)
    if args.offload_on and args.moments_dtype != "bf16":
        knobs["split_masters"] = True  # 10.1 B a parameter instead of 12: what lets a 10B's state fit DDR + disk

    # `with` closes the optimizer at the end, errors included: pinned memory, I/O threads, the state files.
    t0 = time.perf_counter()
    with TieredOptimizer(model, nvme_path=args.nvme_path, lr=args.lr, **knobs) as opt:
        optimizer_s = time.perf_counter() - t0
        host = opt.store.stats()["host"]
        print(
            f"optimizer built in {optimizer_s:.1f} s (initial state written; "
            f"{host['made_bytes'] / 2**30:.1f} GiB of host memory mapped and pinned in {host['made_s']:.1f} s)"
        )
        steps = Steps(args.batch * args.seq * args.accumulate, start)
        phases: list[dict[str, float]] = []
        grads_on_gpu: dict[str, int] | None = None  # the last step's clip's copies (an offloaded model's)
        for n in range(args.steps + bool(args.trace)):  # --trace: one more step, profiled, not counted
            with profiled(args.trace if n == args.steps else None, device):
                before = link_moved(model) if args.offload_on else (0, 0)
                t0 = time.perf_counter()
                loss_sum = 0.0
                for i in range(args.accumulate):
                    x = batch(i)
                    loss = model(input_ids=x, labels=x).loss / args.accumulate
                    with torch.profiler.record_function("backward"):
                        loss.backward()
                    loss_sum += loss.item()  # waits for the GPU: the compute time below is the compute's
                t1 = time.perf_counter()
                with torch.profiler.record_function("opt.step"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)  # the update's kernels: the optimizer's time
            if n == args.steps:
                print(f"profiled step: loss {loss_sum:.4f}, {time.perf_counter() - t0:.2f} s (not counted)", flush=True)
                continue
            steps.add(loss_sum, t0, t1, time.perf_counter())
            print(f"  {opt.summary()}", flush=True)
            stats = opt.stats()
            last = stats["last_step"]  # where the optimizer's time went: waits for the disk, the math, copies
            if link is not None:
                up, down = (now - was for now, was in zip(link_moved(model), before))
                floor = link_floor_s(up, down, link)
                over = f"; took {(t1 - t0) / floor:.2f}x that" if floor > 0 else ""
                print(f"  link, forward and backward: {up / 1e9:.1f} GB up, {down / 1e9:.1f} GB down, at least "
                      f"{floor:.2f} s on it{over}", flush=True)  # fmt: skip
                # The optimizer's own copies (state records, gradients, new weights: tiered/optim/link.py) too:
                # the least time the whole step's bytes take on the link, beside its compute and disk floors.
                opt_up, opt_down = int(last["link_up_bytes"]), int(last["link_down_bytes"])
                whole = link_floor_s(up + opt_up, down + opt_down, link)
                over = f"; the step took {steps.step_s[-1] / whole:.2f}x that" if whole > 0 else ""
                print(f"  link, whole step: optimizer {opt_up / 1e9:.1f} GB up, {opt_down / 1e9:.1f} GB down; all at "
                      f"least {whole:.2f} s on it{over}", flush=True)  # fmt: skip
                for k, v in (("up_bytes", up), ("down_bytes", down), ("floor_s", floor), ("optimizer_up_bytes", opt_up),
                             ("optimizer_down_bytes", opt_down), ("step_floor_s", whole)):  # fmt: skip
                    moved[k].append(v)
            phases.append({k: last[k] for k in WHERE})
            print("  optimizer: " + ", ".join(f"{k[:-2].replace('_', ' ')} {last[k]:.2f} s" for k in WHERE), flush=True)
            if args.offload_on:  # micro-batches' gradients summed on the host, off backward's thread
                print(f"  gradient sums (all steps): {rounded(model.tiered_accumulation.stats(), 2)}", flush=True)
                some = model.tiered_kept_weights  # keep_for_backward N or room: the last blocks' weights
                if some is not None:
                    print(f"  weights kept from forward to backward: the last {some.count} of {len(some.units)} "
                          f"blocks, {format_size(some.kept_bytes)}", flush=True)  # fmt: skip
                # The clip's gradient copies on the GPU; of those, sums backward left there.
                grads_on_gpu = {k: stats[k] for k in ("grads_kept_bytes", "grads_found_bytes")}
                print(f"  gradients on the GPU for the update: kept {format_size(stats['grads_kept_bytes'])}, found "
                      f"{format_size(stats['grads_found_bytes'])}", flush=True)  # fmt: skip
            peaks = steps.peaks(device)  # every step: a run cut short still says how much memory it took
        budget = opt.host_budget
        st = opt.store.stats()  # where the state lies: HBM in use, the pinned host tier, the NVMe traffic
        state = dict(hbm_bytes=st["gpu"]["in_use"], host_peak_bytes=st["host"]["peak"], nvme=st["nvme"],
                     records=st["records"], split_masters=bool(knobs.get("split_masters")))  # fmt: skip
        t0 = time.perf_counter()
    close_s = time.perf_counter() - t0
    print(f"closed in {close_s:.1f} s (pinned memory released, the state files removed)")
    if args.json:
        figures = dict(engine="tiered", params=params, host_budget=budget, gpu_budget=in_hbm,
                       moments_dtype=args.moments_dtype,
                       batch=args.batch, seq=args.seq, accumulate=args.accumulate, model_s=model_s,
                       optimizer_s=optimizer_s, **steps.figures(), **peaks, close_s=close_s,
                       gpu_memory_cap=cap, offload=args.offload_on, state=state,
                       gradient_sums=model.tiered_accumulation.stats() if args.offload_on else None,
                       grads_on_gpu=grads_on_gpu,
                       link=dict(rates_GBps=link, **moved) if link is not None else None,
                       optimizer_phases=phases)  # fmt: skip
        Path(args.json).write_text(json.dumps({**rounded(figures, 3), "losses": steps.losses}) + "\n")


if __name__ == "__main__":
    checks.exit_on_sigterm("big_model.py")
    try:
        main()
    except (ValueError, TypeError, OSError) as e:  # a bad flag or path: one line, not a traceback
        raise SystemExit(f"big_model.py: error: {e}") from None
