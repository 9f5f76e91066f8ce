"""`tiered-bench kv`: greedy decoding through TieredCache, against DynamicCache and OffloadedCache, and the floor.

One run: a Llama of the given shape (random weights, bf16 on CUDA, fp32 on the CPU) prefills ``--context`` tokens
(in ``--prefill-chunk`` pieces, the same for every cache) and decodes ``--new-tokens`` greedily, once per cache in
``--caches`` (``dynamic``: DynamicCache, all in HBM, the reference; ``dynamic_again``: the same again, to see that
the reference repeats itself; ``offloaded``: transformers' OffloadedCache; ``tiered``: TieredCache with
``--prefetch`` layers loaded ahead; ``serial``: TieredCache's serial twin, ``prefetch=0``). Every cache after the
reference is fed the reference's tokens, and its logits are compared with the reference's at every step, bit for
bit (kv_decode.py). For each: prefill seconds, decode tokens/s, peak GPU memory, and for TieredCache the bytes a
decoded token moved per tier (window loads host -> GPU, writes GPU -> host, NVMe reads and writes), its copy calls
and host synchronizations. The floor of a token is the bytes that must cross PCIe divided by the PCIe bandwidth
measured here (pinned, each way), and the NVMe bytes divided by the disk bandwidth measured here (a file written and
read back through io_engine in ``--dir``); ``floor_ratio`` is the decode time of a token over the larger floor. A
cache that runs out of GPU memory is reported as ``oom`` with the prompt tokens it reached.

``--suite targets`` runs the issue's whole target set in one process, each step side by side, within
``--time-limit`` seconds (a step that no longer fits is skipped and says so): ``compare`` (the caches above at
``--context``), ``long`` (``--long-context`` tokens: DynamicCache, expected to run out of memory, then TieredCache
with the KV in pinned DDR), ``nvme`` (TieredCache at ``--context`` with ``--nvme-host-budget`` of host memory, the
rest on NVMe, against the reference of ``compare``) and ``preempt`` (kv_serve.py: ``--preempt-requests`` requests,
``--preempt-running`` at once, by swapping and by recomputing, every output against the request run alone).
``--preempt`` runs that last step alone. ``--suite exact`` runs the same less ``long`` (and less OffloadedCache),
with ``--deterministic``.

Exactness (kv_exact.py): on a GPU DynamicCache need not repeat itself, so ``dynamic_again``'s difference from
``dynamic`` is the reference's own spread (``reference_spread``), every later cache is compared with both runs,
and each gets a ``verdict``: ``bitwise``, ``within spread`` or ``outside spread``; TieredCache outside the spread
fails the run. ``--deterministic`` asks for kernels that repeat themselves (``--sdpa``: the attention backend,
default math, whose prefill chunk is capped so its scores fit), so that a run can show bitwise equality.
``offloaded`` is transformers' OffloadedCache with its prefetch stream made to wait for the compute stream (a
race in transformers up to at least 5.17); ``offloaded_stock`` is the same as shipped.

``--memory-cap`` caps this process's GPU memory (``torch.cuda.set_per_process_memory_fraction``), so a 24 GB card
can be stood in for on a larger one. ``--json`` prints the result as JSON; ``--out PATH`` also writes it there,
after each cache, so a run cut short keeps what it measured. Exit status 1 when a compared cache's tokens differ
from the reference's, or a step failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from typing import Any

from .arg_types import positive, positive_seconds
from .common import BenchFailure, UsageError, check_device, check_env, rounded
from .io_types import file_size
from .kv_decode import SHAPES, Reference, bandwidths, build_model, floor, kv_token_bytes, prompt_ids, run_cache
from .kv_exact import SDPA, deterministic, environment, judge, math_chunk, nondeterministic_ops, offloaded_cache, sdpa
from .kv_exact import spread as reference_spread
from .kv_table import table

CACHES = ("dynamic", "dynamic_again", "offloaded", "offloaded_stock", "tiered", "serial")
OURS = ("tiered", "serial")  # the caches whose exactness decides the exit status


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="model shape (tiny; 8b: Llama-3-8B's)")
    p.add_argument("--layers", type=positive, default=None, help="override the shape's layer count")
    p.add_argument("--context", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens decoded (default 32)")
    p.add_argument("--prefill-chunk", type=int, default=4096, help="prompt tokens a forward (default 4096)")
    p.add_argument("--caches", default="dynamic,offloaded,tiered", help=f"which caches, from {','.join(CACHES)}")
    p.add_argument("--gpu-budget", default="0", help="TieredCache window bytes (default 0: every layer streams)")
    p.add_argument("--host-budget", default="auto", help="TieredCache pinned host bytes (auto: the whole KV fits)")
    p.add_argument("--page-tokens", type=int, default=256)
    p.add_argument("--prefetch", type=int, default=2, help="TieredCache layers loaded ahead (default 2)")
    p.add_argument(
        "--dir",
        default=None,
        help="root of the NVMe tier and the disk measurement; created if missing, and every file (and the "
        "folder, if this run created it and no other run still uses it then) is removed afterwards (default: temp)",
    )
    p.add_argument("--device", default="auto",
                   help="auto (cuda if present), cpu, cuda, or cuda:N (GPU N of a machine with several)")  # fmt: skip
    p.add_argument("--memory-cap", default=None, help="cap this process's GPU memory, e.g. 24GB")
    p.add_argument("--disk-size", default="256MiB", help="file size of the disk measurement (0: skip it)")
    p.add_argument(
        "--suite",
        choices=["targets", "exact"],
        default=None,
        help="targets: the issue's target set; exact: the same less the long step, --deterministic",
    )
    p.add_argument(
        "--deterministic", action="store_true", help="deterministic kernels (kv_exact.py), to compare bit for bit"
    )
    p.add_argument(
        "--sdpa",
        choices=SDPA,
        default=None,
        help="attention backend (default: math with --deterministic, else torch's choice)",
    )
    p.add_argument("--time-limit", type=positive_seconds, default=230.0,
                   help="seconds for the whole suite (default 230)")  # fmt: skip
    p.add_argument("--long-context", type=int, default=131072, help="suite: the long context (default 131072)")
    p.add_argument("--long-new-tokens", type=int, default=8, help="suite: tokens decoded at it (default 8)")
    p.add_argument(
        "--long-prefetch",
        type=int,
        default=1,
        help="suite: TieredCache's --prefetch at it (default 1: PCIe-bound, and the ring is a layer less)",
    )
    p.add_argument("--nvme-host-budget", default="2GiB", help="suite: host bytes of the NVMe step (default 2GiB)")
    p.add_argument("--nvme-new-tokens", type=int, default=6, help="suite: tokens decoded there (default 6)")
    p.add_argument("--preempt", action="store_true", help="run the preemption workload only")
    p.add_argument("--preempt-requests", type=int, default=8)
    p.add_argument("--preempt-running", type=int, default=2, help="requests the window holds at once")
    p.add_argument("--preempt-quantum", type=int, default=2, help="tokens a turn before a preemption")
    p.add_argument("--preempt-prompt", type=int, default=8192, help="prompt tokens of each request")
    p.add_argument("--preempt-new-tokens", type=int, default=8)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", default=None, help="also write the JSON here, after each step")


def run(args: argparse.Namespace) -> int:
    try:
        import transformers  # noqa: F401 - the models and the baseline caches are transformers'
    except ImportError as e:
        raise UsageError("tiered-bench kv needs transformers (pip install 'transformers>=5'): " + str(e)) from e
    from io_engine import parse_size

    caches = [c.strip() for c in args.caches.split(",") if c.strip()]
    bad = [c for c in caches if c not in CACHES]
    if bad or not caches:
        raise UsageError(f"--caches: unknown {bad or caches}; choose from {','.join(CACHES)}")
    for name in ("context", "new_tokens", "prefill_chunk", "page_tokens", "long_context", "long_new_tokens",
                 "nvme_new_tokens", "preempt_requests", "preempt_running", "preempt_quantum", "preempt_prompt",
                 "preempt_new_tokens"):  # fmt: skip
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.prefetch < 0 or args.long_prefetch < 0:
        raise UsageError(f"--prefetch and --long-prefetch must be >= 0, got {args.prefetch}, {args.long_prefetch}")
    check_device(args.device)
    try:  # every size now, before the model is built: parse_size's message names the flag and its form
        disk = parse_size(args.disk_size, name="--disk-size")
        for name in ("gpu_budget", "nvme_host_budget", "host_budget", "memory_cap"):
            value = getattr(args, name)
            if not (name == "host_budget" and value == "auto" or name == "memory_cap" and value is None):
                parse_size(value, name="--" + name.replace("_", "-"))
    except ValueError as e:
        raise UsageError(str(e)) from None
    if disk:  # 0 skips the measurement; else the file io measures: at least 1 MiB, whole pages
        disk = file_size(disk, "--disk-size")
    check_env(io_config=True)  # the disk measurement and TieredCache read them: said once, now, before the model
    if args.out is not None:  # refused before the model is built and the disk measured, as tune's --out
        from .tune import check_out

        args.out = str(check_out(args.out))  # written where it was checked: with ~ expanded
    if args.suite == "exact":
        args.deterministic = True
    if args.sdpa is None:
        args.sdpa = "math" if args.deterministic else "auto"
    res = measure(args, caches, disk)
    print(json.dumps(rounded(res), default=str) if args.json else table(res))
    return 0 if res.get("ok", True) else 1


def measure(args: argparse.Namespace, caches: list[str], disk_size: int) -> dict[str, Any]:
    from .workspace import Workspace  # io_engine: only once the command runs, not for --help

    # --dir as every tiered-bench command's: made if missing (a folder it cannot make is a UsageError naming
    # --dir), and what this run made is removed after it; before the model is built, so that a bad --dir fails fast
    with Workspace(tempfile.gettempdir() if args.dir is None else args.dir) as ws:
        if disk_size:  # as io and tour refuse a file the disk has no room for: before the model is built
            ws.require_free(disk_size, "the disk measurement's test file", size_flag="--disk-size (0: none)")
        with deterministic(args.deterministic) as settings:  # before the first cuBLAS call
            return _measure(args, str(ws.dir), caches, disk_size, settings)


def _measure(args: argparse.Namespace, root: str, caches: list[str], disk_size: int,
             settings: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    import torch

    start = time.monotonic()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))  # fmt: skip
    if device.type == "cuda" and args.memory_cap:
        from io_engine import parse_size

        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, parse_size(args.memory_cap, name="--memory-cap") / total))
    longest = max(args.context + args.new_tokens, args.long_context + args.long_new_tokens if args.suite else 0,
                  args.preempt_prompt + args.preempt_new_tokens)  # fmt: skip
    model = build_model(args.shape, args.layers, longest + 1, device)
    res: dict[str, Any] = {"device": str(device), "shape": args.shape, "layers": model.config.num_hidden_layers,
                           "kv_bytes_per_token": kv_token_bytes(model), "page_tokens": args.page_tokens,
                           "prefill_chunk": args.prefill_chunk, "prefetch": args.prefetch,
                           "build_s": time.monotonic() - start, "ok": True}  # fmt: skip
    if device.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name(device)
        res["memory_cap"] = args.memory_cap
    res["exactness"] = {"deterministic": settings or False, "sdpa": args.sdpa, "environment": environment(),
                        "nondeterministic_ops": []}  # fmt: skip

    def save() -> None:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rounded(res), f, indent=1, default=str)

    found = res["exactness"]["nondeterministic_ops"]
    with sdpa(args.sdpa), nondeterministic_ops(found):
        res["bandwidth"] = bandwidths(device, root, disk_size)
        save()
        if args.preempt:
            _step(res, "preempt", lambda: _preempt(model, args, root, res), start, args, save)
        elif args.suite:
            _suite(model, args, root, res, start, save)
        else:
            res["runs"] = _compare(model, args, root, caches, args.context, args.new_tokens, save, res)
    res["total_s"] = time.monotonic() - start
    save()
    return res


def _step(res: dict[str, Any], name: str, fn: Any, start: float, args: argparse.Namespace, save: Any,
          need_s: float = 0.0) -> Any:  # fmt: skip
    """Run one step of the suite: skipped when fewer than ``need_s`` seconds are left; an error is recorded."""
    left = args.time_limit - (time.monotonic() - start)
    if left < need_s:
        res.setdefault("suite", {})[name] = f"skipped: {left:.0f} s left of --time-limit, the step needs ~{need_s:.0f}"
        res["ok"] = False
        save()
        return None
    t0 = time.monotonic()
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - recorded, and the next step still runs
        traceback.print_exc()
        out = {"error": f"{type(e).__name__}: {e}"[:500]}
        res["ok"] = False
    if isinstance(out, dict):
        out["step_s"] = time.monotonic() - t0
    res.setdefault("suite", {})[name] = out
    save()
    return out


def _suite(model: Any, args: argparse.Namespace, root: str, res: dict[str, Any], start: float, save: Any) -> None:
    refs = (Reference(), Reference())  # DynamicCache, and DynamicCache again: the reference and its spread
    names = ["dynamic", "dynamic_again", "offloaded", "tiered", "serial"]
    if args.suite == "exact":  # OffloadedCache's prefill in the math backend's small chunks would take minutes
        names.remove("offloaded")
    compare = _step(res, "compare", lambda: _compare(model, args, root, names, args.context, args.new_tokens, save,
                                                      res, refs=refs), start, args, save)  # fmt: skip
    if args.suite == "targets":
        long_args = argparse.Namespace(**{**vars(args), "prefetch": args.long_prefetch})
        _step(res, "long", lambda: _compare(model, long_args, root, ["dynamic", "tiered"], args.long_context,
                                            args.long_new_tokens, save, res), start, args, save, need_s=40)  # fmt: skip
    compute = _compute(compare) if isinstance(compare, dict) else None
    spread = compare.get("reference_spread") if isinstance(compare, dict) else None

    def nvme() -> dict[str, Any]:
        row = _tiered(model, args, root, args.context, args.nvme_new_tokens, args.nvme_host_budget, refs, res,
                      compute)  # fmt: skip
        _verdict("tiered", row, spread, res)
        return {"context": args.context, "new_tokens": args.nvme_new_tokens, "reference_spread": spread,
                "tiered": row}  # fmt: skip

    _step(res, "nvme", nvme, start, args, save, need_s=20)
    _step(res, "preempt", lambda: _preempt(model, args, root, res), start, args, save, need_s=25)


def _chunk(model: Any, args: argparse.Namespace, context: int) -> int:
    """The prefill chunk: ``--prefill-chunk``, smaller under the math backend on a GPU (its scores are held)."""
    if args.sdpa != "math" or model.device.type != "cuda":
        return int(args.prefill_chunk)
    return math_chunk(args.prefill_chunk, model.config.num_attention_heads, context)


def _compute(runs: dict[str, Any]) -> float | None:
    """DynamicCache's decode time a token, all in HBM: the faster of its runs (the first pays for warming up)."""
    times = [r["decode_s_per_token"] for n in ("dynamic", "dynamic_again") if isinstance(r := runs.get(n), dict)
             and r.get("decode_s_per_token")]  # fmt: skip
    return min(times) if times else None


def _compare(model: Any, args: argparse.Namespace, root: str, caches: list[str], context: int, new_tokens: int,
             save: Any, res: dict[str, Any],
             refs: tuple[Reference, Reference] | None = None) -> dict[str, Any]:  # fmt: skip
    """The caches at one context, DynamicCache first (the reference) when it is among them; ``dynamic_again``
    measures the reference's spread, and every later cache is compared with both of its runs."""
    prompt = prompt_ids(model, context)
    ref, again = refs if refs is not None else (Reference(), Reference())
    chunk = _chunk(model, args, context)
    runs: dict[str, Any] = {"context": context, "new_tokens": new_tokens, "prefill_chunk": chunk}
    order = sorted(caches, key=lambda c: c != "dynamic")
    have_ref = False
    for name in order:
        if name.startswith("offloaded") and prompt.device.type != "cuda":
            runs[name] = "needs CUDA"  # OffloadedCache moves layers between a GPU and the host
            continue
        if name in OURS:
            runs[name] = _tiered(model, args, root, context, new_tokens, args.host_budget,
                                 (ref, again) if have_ref else None, res, _compute(runs),
                                 prefetch=0 if name == "serial" else args.prefetch)  # fmt: skip
        else:

            def make(n: str = name) -> Any:
                if n.startswith("offloaded"):
                    return offloaded_cache(model.config, fix=n == "offloaded")
                from transformers import DynamicCache

                return DynamicCache(config=model.config)

            keep = ref if name == "dynamic" else again if name == "dynamic_again" else None
            runs[name] = run_cache(model, prompt, make, new_tokens=new_tokens, chunk=chunk,
                                   ref=ref if have_ref else None, keep=keep,
                                   again=again if have_ref and name != "dynamic_again" else None)  # fmt: skip
            if name == "dynamic" and not runs[name].get("oom"):
                have_ref = True
        if name == "dynamic_again":
            runs["reference_spread"] = reference_spread(runs)
        elif name != "dynamic" and isinstance(runs[name], dict):
            _verdict(name, runs[name], runs.get("reference_spread"), res)
        save()
    dyn, tie, off = (runs.get(n) for n in ("dynamic", "tiered", "offloaded"))
    if isinstance(tie, dict) and isinstance(off, dict) and tie.get("decode_tokens_per_s") and \
            off.get("decode_tokens_per_s"):  # fmt: skip
        runs["tiered_over_offloaded"] = tie["decode_tokens_per_s"] / off["decode_tokens_per_s"]
    if isinstance(dyn, dict):
        runs["dynamic_oom"] = bool(dyn.get("oom"))
    return runs


def _tiered(model: Any, args: argparse.Namespace, root: str, context: int, new_tokens: int, host_budget: str,
            refs: tuple[Reference, Reference] | None, res: dict[str, Any], compute_s: float | None,
            prefetch: int | None = None) -> Any:  # fmt: skip
    from io_engine import parse_size
    from tiered.kv import TieredCache
    from tiered.kv.layout import check_page_room, layout_from_config

    if host_budget == "auto":  # the scan policy keeps 3/4 of the budget resident: the whole KV and a margin
        kv = (context + new_tokens + args.page_tokens) * res["kv_bytes_per_token"]
        host_budget = str(int(kv / 0.75) + (64 << 20))
    pf = args.prefetch if prefetch is None else prefetch

    try:  # a budget that holds no page of this model's, in its dtype: the flags' fault, said before generating
        layout = layout_from_config(model.config, args.page_tokens)
        check_page_room(layout, parse_size(host_budget), next(model.parameters()).element_size())
    except ValueError as e:
        raise UsageError(f"--host-budget {host_budget}, --page-tokens {args.page_tokens}: {e}") from None

    def make() -> Any:
        return TieredCache(model.config, root, gpu_budget=args.gpu_budget, host_budget=host_budget,
                           page_tokens=args.page_tokens, prefetch=pf)  # fmt: skip

    ref, again = refs if refs is not None and refs[0].logits else (None, None)
    row = run_cache(model, prompt_ids(model, context), make, new_tokens=new_tokens,
                    chunk=_chunk(model, args, context), ref=ref, again=again)  # fmt: skip
    row.update({"host_budget": host_budget, "prefetch": pf})
    floor(row, res["bandwidth"], compute_s)
    return row


def _preempt(model: Any, args: argparse.Namespace, root: str, res: dict[str, Any]) -> dict[str, Any]:
    from .kv_serve import measure_preempt

    host = args.host_budget
    if host == "auto":
        kv = args.preempt_requests * (args.preempt_prompt + args.preempt_new_tokens + 2 * args.page_tokens)
        host = str(int(kv * kv_token_bytes(model) / 0.75) + (64 << 20))
    out = measure_preempt(model, root, requests=args.preempt_requests, running=args.preempt_running,
                          quantum=args.preempt_quantum, prompt=args.preempt_prompt,
                          new_tokens=args.preempt_new_tokens, page_tokens=args.page_tokens, host_budget=host,
                          chunk=_chunk(model, args, args.preempt_prompt + args.preempt_new_tokens),
                          prefetch=args.prefetch)  # fmt: skip
    if out["swap"]["verdict"] == "outside spread":  # recompute is not bitwise by construction (kv_serve.py)
        res["ok"] = False
    return out


def _verdict(name: str, row: dict[str, Any], spread: dict[str, Any] | None, res: dict[str, Any]) -> None:
    """Judge a cache against the reference's spread; ours outside it (or, with a bitwise-repeating reference,
    not bitwise) fail the run. The baselines are judged and reported, and never fail it."""
    if "logits_equal" not in row:
        return
    row["verdict"] = judge(row, spread)
    if name in OURS and row["verdict"] not in ("bitwise", "within spread"):
        res["ok"] = False


def command_spec() -> dict[str, Any]:
    return dict(
        name="kv",
        summary="greedy decoding through TieredCache vs DynamicCache / OffloadedCache: tokens/s, bytes, floor",
        description=__doc__.split("\n\n", 1)[1],
        examples="examples:\n  tiered-bench kv\n"
        "  tiered-bench kv --host-budget 256KiB --caches dynamic,tiered,serial --json\n"
        "  tiered-bench kv --shape 8b --suite targets --memory-cap 24GB --prefill-chunk 2048 --page-tokens 1024 "
        "--out kv.json",
        add_arguments=add_arguments,
        run=run,
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m tiered.bench.kv ...``: the same as ``tiered-bench kv ...``."""
    p = argparse.ArgumentParser(prog="python -m tiered.bench.kv", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_arguments(p)
    try:
        return run(p.parse_args(argv))
    except UsageError as e:
        p.error(str(e))
    except BenchFailure as e:  # as tiered-bench says it (cli.py): one line, exit 1
        print(f"{p.prog}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
