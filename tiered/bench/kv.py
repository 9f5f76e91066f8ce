"""`tiered-bench kv`: greedy decoding through TieredCache, against DynamicCache and OffloadedCache, and the floor.

One run: a Llama of the given shape (random weights, bf16 on CUDA, fp32 on the CPU) prefills ``--context`` tokens
(in ``--prefill-chunk`` pieces, the same for every cache) and decodes ``--new-tokens`` greedily, once per cache in
``--caches``. For each: prefill seconds, decode tokens/s, peak GPU memory, and for TieredCache the bytes a decoded
token moved per tier: window loads (host -> GPU), write-backs (GPU -> host), NVMe reads and writes. The floor of a
token is the bytes that must cross PCIe divided by the PCIe bandwidth measured here (pinned, each way), and the
NVMe bytes divided by the disk bandwidth measured here (a fresh file written and read back through io_engine, in
``--dir``); ``floor_ratio`` is the decode time of a token over the larger floor. A cache that runs out of GPU
memory is reported as ``"oom"``. Tokens are compared with DynamicCache's where it ran, else with the first
cache's (``equal``, ``first_difference``).

``--memory-cap`` caps this process's GPU memory (``torch.cuda.set_per_process_memory_fraction``), so a 24 GB card
can be stood in for on a larger one. ``--json`` prints the result as JSON; ``--out PATH`` also writes it there,
after each cache, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from typing import Any

from .common import GB, UsageError, rounded

CACHES = ("tiered", "dynamic", "offloaded")
SHAPES = {  # hidden, layers, heads, kv heads, intermediate, vocab
    "tiny": (256, 4, 8, 2, 512, 1024),
    "8b": (4096, 32, 32, 8, 14336, 128256),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="model shape (tiny; 8b: Llama-3-8B's)")
    p.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    p.add_argument("--context", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens decoded (default 32)")
    p.add_argument("--prefill-chunk", type=int, default=4096, help="prompt tokens a forward (default 4096)")
    p.add_argument("--caches", default="tiered,dynamic,offloaded", help="which caches to run, in order")
    p.add_argument("--gpu-budget", default=None, help="TieredCache window bytes (default: no limit)")
    p.add_argument("--host-budget", default="1GiB", help="TieredCache pinned host bytes (default 1GiB)")
    p.add_argument("--page-tokens", type=int, default=256)
    p.add_argument("--dir", default=None, help="root of the NVMe tier and the disk measurement (default: temp)")
    p.add_argument("--device", default="auto", help="auto (cuda if present), cpu or cuda")
    p.add_argument("--memory-cap", default=None, help="cap this process's GPU memory, e.g. 24GB")
    p.add_argument("--disk-size", default="256MiB", help="file size of the disk measurement (0: skip it)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", default=None, help="also write the JSON here, after each cache")


def run(args: argparse.Namespace) -> int:
    from io_engine import parse_size

    try:
        import transformers  # noqa: F401 - the models and the baseline caches are transformers'
    except ImportError as e:
        raise UsageError("tiered-bench kv needs transformers (pip install 'transformers>=5'): " + str(e)) from e

    caches = [c.strip() for c in args.caches.split(",") if c.strip()]
    bad = [c for c in caches if c not in CACHES]
    if bad or not caches:
        raise UsageError(f"--caches: unknown {bad or caches}; choose from {','.join(CACHES)}")
    for name in ("context", "new_tokens", "prefill_chunk", "page_tokens"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    res = measure(args, caches, parse_size(args.disk_size, name="--disk-size"))
    if args.json:
        print(json.dumps(rounded(res), default=str))
    else:
        print(_table(res))
    return 0 if all(r.get("equal", True) for r in res["runs"].values() if isinstance(r, dict)) else 1


def measure(args: argparse.Namespace, caches: list[str], disk_size: int) -> dict[str, Any]:
    import torch

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))  # fmt: skip
    if device.type == "cuda" and args.memory_cap:
        from io_engine import parse_size

        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, parse_size(args.memory_cap, name="--memory-cap") / total))
    model = _model(args, device)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, model.config.vocab_size, (1, args.context), generator=g).to(device)
    res: dict[str, Any] = {"device": str(device), "shape": args.shape, "layers": model.config.num_hidden_layers,
                           "context": args.context, "new_tokens": args.new_tokens, "kv_bytes_per_token":
                           _kv_token_bytes(model), "runs": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="tiered-kv-", dir=args.dir) as root:
        res["bandwidth"] = _bandwidths(device, root, disk_size)
        tokens: dict[str, list[int]] = {}
        for name in caches:
            out = _one(name, model, prompt, args, root)
            if isinstance(out, dict) and "tokens" in out:
                tokens[name] = out.pop("tokens")
                _floor(out, res["bandwidth"])
            res["runs"][name] = out
            _compare(res["runs"], tokens)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(rounded(res), f, indent=1, default=str)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return res


def _compare(runs: dict[str, Any], tokens: dict[str, list[int]]) -> None:
    """Each run's tokens against DynamicCache's where it ran, else the first cache's: ``equal``, and where they
    part, ``first_difference`` (the index of the first new token that differs)."""
    if not tokens:
        return
    ref = tokens.get("dynamic", next(iter(tokens.values())))
    for name, toks in tokens.items():
        runs[name]["equal"] = toks == ref
        diff = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), None)
        if diff is None and len(toks) != len(ref):
            diff = min(len(toks), len(ref))
        runs[name].pop("first_difference", None)
        if diff is not None:
            runs[name]["first_difference"] = diff


def _model(args: argparse.Namespace, device: Any) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv, inter, vocab = SHAPES[args.shape]
    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=args.layers or layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                      max_position_embeddings=max(8192, args.context + args.new_tokens))  # fmt: skip
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype, in place: an 8B model never exists in fp32 or on the host
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def _kv_token_bytes(model: Any) -> int:
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    return 2 * c.num_key_value_heads * head_dim * model.dtype.itemsize * c.num_hidden_layers


def _make_cache(name: str, model: Any, args: argparse.Namespace, root: str) -> Any:
    from transformers import DynamicCache

    if name == "dynamic":
        return DynamicCache(config=model.config)
    if name == "offloaded":
        return DynamicCache(config=model.config, offloading=True)
    from tiered.kv import TieredCache

    return TieredCache(model.config, root, gpu_budget=args.gpu_budget, host_budget=args.host_budget,
                       page_tokens=args.page_tokens)  # fmt: skip


def _one(name: str, model: Any, prompt: Any, args: argparse.Namespace, root: str) -> dict[str, Any] | str:
    import torch

    from tiered.kv import cache_kwargs

    cuda = prompt.device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    if name == "offloaded" and not cuda:
        return "needs CUDA"  # OffloadedCache moves layers between a GPU and the host
    cache = None
    try:
        cache = _make_cache(name, model, args, root)
        with torch.no_grad():
            sync()
            t0 = time.perf_counter()
            for lo in range(0, prompt.shape[1], args.prefill_chunk):
                piece = prompt[:, lo : lo + args.prefill_chunk]
                out = model(input_ids=piece, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            sync()
            prefill = time.perf_counter() - t0
            before = _moved(cache)
            tokens = [int(tok)]
            t0 = time.perf_counter()
            for _ in range(args.new_tokens - 1):
                out = model(input_ids=tok, **cache_kwargs(model, cache), use_cache=True)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                tokens.append(int(tok))  # .item() syncs, as a server streaming tokens does
            sync()
            decode = time.perf_counter() - t0
        after = _moved(cache)
        resident = cache.stats()["resident"] if hasattr(cache, "stats") else None
    except torch.cuda.OutOfMemoryError:
        return "oom"
    finally:
        if cache is not None and hasattr(cache, "close"):
            cache.close()
    steps = max(1, args.new_tokens - 1)
    row: dict[str, Any] = {"prefill_s": prefill, "decode_tokens_per_s": steps / decode if decode else None,
                           "decode_s_per_token": decode / steps, "tokens": tokens}  # fmt: skip
    if cuda:
        row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    if after is not None and before is not None:
        row["bytes_per_token"] = {k: (after[k] - before[k]) / steps for k in after}
        row["resident_layers"] = resident
    return row


def _moved(cache: Any) -> dict[str, int] | None:
    if not hasattr(cache, "stats"):
        return None
    st = cache.stats()
    nvme = st["store"].get("nvme", {})
    return {"host_to_gpu": st["loaded_bytes"], "gpu_to_host": st["written_bytes"],
            "nvme_read": nvme.get("bytes_read", 0), "nvme_write": nvme.get("bytes_written", 0)}  # fmt: skip


def _bandwidths(device: Any, root: str, disk_size: int) -> dict[str, float | None]:
    """PCIe GB/s each way (pinned, one copy of 256 MiB, on CUDA) and the disk's read and write GB/s."""
    import torch

    out: dict[str, float | None] = {"h2d": None, "d2h": None, "disk_read": None, "disk_write": None}
    if device.type == "cuda":
        from .pcie import _one_way

        n = 256 << 20
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(n, dtype=torch.uint8, device=device)
        _one_way(dev, host)
        out["h2d"] = n / _one_way(dev, host) / GB
        out["d2h"] = n / _one_way(host, dev) / GB
        del host, dev
    if disk_size:
        from io_engine import IOConfig

        from .disk import measure_config
        from .io_types import IoOptions
        from .workspace import Workspace

        opts = IoOptions(dir=root, size=disk_size, warmup=0, loops=1, fio=False, progress=False)
        with Workspace(os.path.join(root, "disk")) as ws:
            row = measure_config(IOConfig.from_env(), ws, opts, disk_size, "kv")
        out["disk_read"], out["disk_write"] = row.read_gbps.median, row.write_gbps.median
    return out


def _floor(row: dict[str, Any], bw: dict[str, float | None]) -> None:
    """Seconds a token must take for the bytes it moves, per link, and the decode time over the larger."""
    moved = row.get("bytes_per_token")
    if not moved:
        return
    pcie = disk = 0.0
    if bw["h2d"] and bw["d2h"]:
        pcie = moved["host_to_gpu"] / (bw["h2d"] * GB) + moved["gpu_to_host"] / (bw["d2h"] * GB)
    if bw["disk_read"] and bw["disk_write"]:  # reads and writes take turns on such disks: the floor adds them
        disk = moved["nvme_read"] / (bw["disk_read"] * GB) + moved["nvme_write"] / (bw["disk_write"] * GB)
    row["floor_s_per_token"] = {"pcie": pcie, "disk": disk}
    worst = max(pcie, disk)
    row["floor_ratio"] = row["decode_s_per_token"] / worst if worst else None


def _table(res: dict[str, Any]) -> str:
    lines = [f"{res['shape']} Llama, {res['layers']} layers, context {res['context']}, {res['new_tokens']} new tokens, "
             f"{res['device']}; KV {res['kv_bytes_per_token']} bytes a token"]  # fmt: skip
    for name, r in res["runs"].items():
        if not isinstance(r, dict):
            lines.append(f"  {name:9s} {r}")
            continue
        line = f"  {name:9s} prefill {r['prefill_s']:.3f} s, decode {r['decode_tokens_per_s']:.2f} tokens/s"
        if "bytes_per_token" in r:
            b = r["bytes_per_token"]
            line += (f", per token: {b['host_to_gpu']:.0f} B up, {b['gpu_to_host']:.0f} B down, "
                     f"{b['nvme_read']:.0f} B NVMe read, {b['nvme_write']:.0f} B written")  # fmt: skip
        if r.get("floor_ratio"):
            line += f"; {r['floor_ratio']:.2f}x the floor"
        lines.append(line + ("" if r.get("equal", True) else f"  TOKENS DIFFER from token {r['first_difference']}"))
    return "\n".join(lines)


def command_spec() -> dict[str, Any]:
    return dict(
        name="kv",
        summary="greedy decoding through TieredCache vs DynamicCache / OffloadedCache: tokens/s, bytes, floor",
        description=__doc__.split("\n\n", 1)[1],
        examples="examples:\n  tiered-bench kv\n  tiered-bench kv --gpu-budget 0 --host-budget 64KiB --json\n"
        "  tiered-bench kv --shape 8b --context 65536 --memory-cap 24GB --gpu-budget 4GiB --out kv.json",
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


if __name__ == "__main__":
    raise SystemExit(main())
