"""One cache's prefill and greedy decode for `tiered-bench kv`, timed, its logits compared with a reference's.

``run_cache`` prefills a prompt in chunks (the same chunks for every cache: chunking changes the arithmetic) and
decodes ``new_tokens`` tokens. Given a reference run (``Reference``: DynamicCache's tokens and logits), it feeds
the reference's tokens (teacher forcing), so every step of every cache sees the same inputs and its logits can be
compared bit for bit at every step, not only up to the first token that differs: ``tokens_equal`` (each step's
argmax is the reference's, which is the same as greedy generation giving the same tokens), ``logits_equal``,
``first_logits_difference`` and ``max_abs_logit_diff``. Each step copies the logits to the host, which waits for the
GPU, as a server streaming tokens does. A CUDA out-of-memory error ends the run and is reported, with the prompt
tokens reached, rather than raised.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .common import GB

SHAPES = {  # hidden, layers, heads, kv heads, intermediate, vocab
    "tiny": (256, 4, 8, 2, 512, 1024),
    "8b": (4096, 32, 32, 8, 14336, 128256),
}


@dataclass
class Reference:
    tokens: list[int] = field(default_factory=list)
    logits: list[Any] = field(default_factory=list)  # host tensors, one a step


def build_model(shape: str, layers: int | None, positions: int, device: Any) -> Any:
    """A Llama of ``shape`` with random weights from a fixed seed, made in place on ``device`` in its dtype (bf16
    on CUDA, fp32 on the CPU): an 8B model never exists in fp32 or on the host."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, n_layers, heads, kv, inter, vocab = SHAPES[shape]
    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers or n_layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                      max_position_embeddings=max(8192, positions))  # fmt: skip
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def prompt_ids(model: Any, tokens: int, seed: int = 0) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, model.config.vocab_size, (1, tokens), generator=g).to(model.device)


def kv_token_bytes(model: Any) -> int:
    c = model.config
    return 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * model.dtype.itemsize * \
        c.num_hidden_layers  # fmt: skip


def run_cache(model: Any, prompt: Any, make: Callable[[], Any], *, new_tokens: int, chunk: int,
              ref: Reference | None = None, keep: Reference | None = None,
              again: Reference | None = None) -> dict[str, Any]:  # fmt: skip
    """Prefill ``prompt`` in ``chunk``-token pieces, decode ``new_tokens`` (fed the reference's tokens when given),
    and return the figures; ``keep`` collects this run's tokens and logits (to be the reference). ``again``: the
    reference's second run (fed the same tokens), compared with too (``row["again"]``)."""
    import torch

    from tiered.kv import cache_kwargs

    cuda = prompt.device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    cache, reached, row = None, 0, {}
    cmp, cmp2 = _Comparison(ref), _Comparison(again if again is not None and again.logits else None)
    try:
        cache = make()
        kw = cache_kwargs(model, cache)
        with torch.no_grad():
            sync()
            t0 = time.perf_counter()
            for lo in range(0, prompt.shape[1], chunk):
                out = model(input_ids=prompt[:, lo : lo + chunk], **kw, use_cache=True, logits_to_keep=1)
                reached = min(prompt.shape[1], lo + chunk)
            logits = out.logits[0, -1].cpu()
            del out
            prefill = time.perf_counter() - t0
            before = moved(cache)
            tokens = [int(logits.argmax())]
            cmp.add(0, logits, keep)
            cmp2.add(0, logits, None)
            t0 = time.perf_counter()
            for i in range(1, new_tokens):
                feed = ref.tokens[i - 1] if ref is not None else tokens[-1]
                ids = torch.tensor([[feed]], device=prompt.device)
                logits = model(input_ids=ids, **kw, use_cache=True).logits[0, -1].cpu()  # waits for the GPU
                tokens.append(int(logits.argmax()))
                cmp.add(i, logits, keep)
                cmp2.add(i, logits, None)
            decode = time.perf_counter() - t0
        after = moved(cache)
        st = cache.stats() if hasattr(cache, "stats") else None
    except torch.cuda.OutOfMemoryError as e:
        row = {"oom": True, "prompt_tokens_reached": reached, "error": str(e).split("\n")[0][:300]}
        return row
    finally:
        if cache is not None and hasattr(cache, "close"):
            cache.close()
        del cache
        gc.collect()
        if cuda:
            row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
            torch.cuda.empty_cache()
    steps = max(1, new_tokens - 1)
    row.update({"prefill_s": prefill, "decode_tokens_per_s": steps / decode if decode else None,
                "decode_s_per_token": decode / steps, "tokens": tokens})  # fmt: skip
    if keep is not None:
        keep.tokens = list(tokens)
    row.update(cmp.result())
    if cmp2.ref is not None:
        row["again"] = {k: v for k, v in cmp2.result().items() if "logit" in k}
    if after is not None and before is not None and st is not None:
        row["bytes_per_token"] = {k: (after[k] - before[k]) / steps for k in after}
        row["resident_layers"] = st["resident"]
        row["window_peak_bytes"] = st["window_peak"]
        row["loads"] = st["loads"]
    return row


class _Comparison:
    def __init__(self, ref: Reference | None) -> None:
        self.ref = ref
        self.tokens_equal = self.logits_equal = True
        self.first_token: int | None = None
        self.first_logits: int | None = None
        self.max_diff = 0.0

    def add(self, i: int, logits: Any, keep: Reference | None) -> None:
        if keep is not None:
            keep.logits.append(logits)
        if self.ref is None or i >= len(self.ref.logits):
            return
        want = self.ref.logits[i]
        if int(logits.argmax()) != int(want.argmax()) and self.tokens_equal:
            self.tokens_equal, self.first_token = False, i
        if not bool((logits == want).all()):
            if self.logits_equal:
                self.logits_equal, self.first_logits = False, i
            self.max_diff = max(self.max_diff, float((logits.float() - want.float()).abs().max()))

    def result(self) -> dict[str, Any]:
        if self.ref is None:
            return {}
        return {"tokens_equal": self.tokens_equal, "first_token_difference": self.first_token,
                "logits_equal": self.logits_equal, "first_logits_difference": self.first_logits,
                "max_abs_logit_diff": self.max_diff}  # fmt: skip


def moved(cache: Any) -> dict[str, int] | None:
    """A TieredCache's counters of bytes moved: host -> GPU (loads), GPU -> host (writes), NVMe read and written."""
    if not hasattr(cache, "stats"):
        return None
    st = cache.stats()
    nvme = st["store"].get("nvme", {})
    return {"host_to_gpu": st["loaded_bytes"], "gpu_to_host": st["written_bytes"],
            "nvme_read": nvme.get("bytes_read", 0), "nvme_write": nvme.get("bytes_written", 0),
            "page_copies": st["page_copies"], "host_syncs": st["host_syncs"]}  # fmt: skip


def bandwidths(device: Any, root: str, disk_size: int) -> dict[str, float | None]:
    """PCIe GB/s each way (pinned, one copy of 256 MiB, on CUDA) and the disk's read and write GB/s (a file
    written and read back through io_engine, O_DIRECT where the folder allows)."""
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
            r = measure_config(IOConfig.from_env(), ws, opts, disk_size, "kv")
        out["disk_read"], out["disk_write"] = r.read_gbps.median, r.write_gbps.median
    return out


def floor(row: dict[str, Any], bw: dict[str, float | None], compute_s: float | None = None) -> None:
    """Seconds a token must take for the bytes it moves, per link (PCIe both ways; the disk's reads and writes
    added, as such disks take turns), and the decode time over the larger (``floor_ratio``). With ``compute_s``
    (DynamicCache's decode time at this context, all in HBM) also over max(floor, compute)."""
    moved_ = row.get("bytes_per_token")
    if not moved_:
        return
    pcie = disk = 0.0
    if bw["h2d"] and bw["d2h"]:
        pcie = moved_["host_to_gpu"] / (bw["h2d"] * GB) + moved_["gpu_to_host"] / (bw["d2h"] * GB)
    if bw["disk_read"] and bw["disk_write"]:
        disk = moved_["nvme_read"] / (bw["disk_read"] * GB) + moved_["nvme_write"] / (bw["disk_write"] * GB)
    row["floor_s_per_token"] = {"pcie": pcie, "disk": disk}
    worst = max(pcie, disk)
    row["floor_ratio"] = row["decode_s_per_token"] / worst if worst else None
    row["floor_link"] = ("disk" if disk > pcie else "pcie") if worst else None
    if compute_s:
        row["compute_s_per_token"] = compute_s
        row["ratio_to_max_floor_compute"] = row["decode_s_per_token"] / max(worst, compute_s)
