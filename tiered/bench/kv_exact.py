"""Exactness for `tiered-bench kv`: the reference's own spread, a deterministic mode, and a race-free OffloadedCache.

On a GPU the reference itself does not repeat itself: DynamicCache run twice on the same inputs gave logits that
differ from the third token on (an H200, torch 2.11; the likely cause: torch's SDPA prefers cuDNN attention on sm90
when cuDNN is newer than 9.15, and torch lists cuDNN attention as nondeterministic; ``environment`` records what
decides it). So a cache is judged against that spread (``judge``):
``bitwise`` when its logits equal one of the reference's runs bit for bit, ``within spread`` when its largest
logit difference is no larger than the reference's against itself, else ``outside spread`` (a defect).

``--deterministic`` (``deterministic``) asks for bitwise repeatability: ``CUBLAS_WORKSPACE_CONFIG`` (set before the
first cuBLAS call, so every stream's workspace is the same fixed size and cuBLAS picks the same kernels),
``torch.use_deterministic_algorithms(True, warn_only=True)`` (ops without a deterministic kernel warn; the warnings
are collected and reported, naming the op), cuDNN deterministic with autotuning off, and attention through one SDPA
backend (``--sdpa``, default ``math``: a plain matmul-softmax-matmul; with ``warn_only`` torch would still pick
cuDNN attention, so the backend is chosen here rather than left to torch). The math backend materializes the
scores (in fp32 for bf16 inputs), so its prefill chunk is capped (``math_chunk``).

transformers' OffloadedCache (``DynamicCache(offloading=True)``) up to at least 5.17 has a race: the side stream
that copies the next layer back to the GPU does not wait for the compute stream, whose non-blocking copy of that
layer to pinned host memory may not have run yet, so the GPU gets stale host bytes (later versions make the side
stream wait; 5.24 does). ``offloaded_cache`` adds that wait on versions that lack it; ``offloaded_stock`` is left
as shipped, to show the race.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

SDPA = ("auto", "math", "efficient", "flash", "cudnn", "no-cudnn")
WORKSPACE = ":4096:8"  # 8 workspaces of 4 MiB: the size cuBLAS documents for reproducible results across streams


@contextlib.contextmanager
def deterministic(on: bool = True) -> Iterator[dict[str, Any]]:
    """Deterministic kernels within (``on``), put back as they were at the end; yields what was set. Enter it
    before the process's first CUDA matmul: cuBLAS reads its workspace setting once."""
    import torch

    if not on:
        yield {}
        return
    before = (os.environ.get("CUBLAS_WORKSPACE_CONFIG"), torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark)  # fmt: skip
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", WORKSPACE)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield {"CUBLAS_WORKSPACE_CONFIG": os.environ["CUBLAS_WORKSPACE_CONFIG"], "deterministic_algorithms": True,
               "warn_only": True, "cudnn_deterministic": True}  # fmt: skip
    finally:
        env, algos, warn, cudnn_det, bench = before
        if env is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        torch.use_deterministic_algorithms(algos, warn_only=warn)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_det, bench


@contextlib.contextmanager
def sdpa(name: str) -> Iterator[None]:
    """Attention through the SDPA backends ``name`` names (``auto``: torch's own choice)."""
    if name == "auto":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"math": [SDPBackend.MATH], "efficient": [SDPBackend.EFFICIENT_ATTENTION],
              "flash": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],  # flash takes no mask
              "cudnn": [SDPBackend.CUDNN_ATTENTION],
              "no-cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                           SDPBackend.MATH]}[name]  # fmt: skip
    with sdpa_kernel(chosen):
        yield


def math_chunk(chunk: int, heads: int, context: int, limit: int = 1 << 29) -> int:
    """The largest power-of-two prefill chunk (at most ``chunk``) whose fp32 attention scores over ``context``
    keys fit ``limit`` bytes: the math backend holds them (and their softmax, and the keys and values repeated
    for every head in fp32), and a 24 GB card has ~2.5 GB beside an 8B model's weights and its KV at 32K tokens."""
    c = 1
    while c * 2 <= chunk and (c * 2) * heads * context * 4 <= limit:
        c *= 2
    return max(16, min(c, chunk))


@contextlib.contextmanager
def nondeterministic_ops(found: list[str]) -> Iterator[None]:
    """Collect (once each) the ops torch warned have no deterministic kernel, under ``warn_only``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            for w in caught:
                msg = str(w.message)
                if "deterministic" in msg and msg[:200] not in found:
                    found.append(msg[:200])


def environment() -> dict[str, Any]:
    """Versions and settings that decide which kernels ran: to read a later run's results against."""
    import torch
    import transformers

    env: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__,
                           "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                           "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}  # fmt: skip
    if torch.cuda.is_available():
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
        env["cudnn_sdp_enabled"] = torch.backends.cuda.cudnn_sdp_enabled()
        order = getattr(torch._C, "_get_sdp_priority_order", None)
        if order is not None:
            with contextlib.suppress(Exception):
                env["sdp_priority_order"] = [str(b) for b in order()]
    return env


def offloaded_cache(config: Any, fix: bool = True) -> Any:
    """transformers' OffloadedCache; with ``fix``, its prefetch stream first waits for the compute stream."""
    from transformers import DynamicCache

    if not fix:
        return DynamicCache(config=config, offloading=True)

    class _Offloaded(DynamicCache):  # type: ignore[misc]
        def prefetch(self, layer_idx: int, only_non_sliding: bool = True) -> None:
            import torch

            # The layer about to be copied back was copied out by the compute stream without a wait: wait for
            # it (and for the reads of the previously prefetched tensors) before the copy reads the host bytes.
            self.prefetch_stream.wait_stream(torch.cuda.current_stream())
            super().prefetch(layer_idx, only_non_sliding)

    return _Offloaded(config=config, offloading=True)


def spread(runs: dict[str, Any]) -> dict[str, Any] | None:
    """The reference against itself (``dynamic_again`` against ``dynamic``), or None when not run."""
    again = runs.get("dynamic_again")
    if not isinstance(again, dict) or "logits_equal" not in again:
        return None
    return {"logits_equal": again["logits_equal"], "first_logits_difference": again["first_logits_difference"],
            "max_abs_logit_diff": again["max_abs_logit_diff"], "tokens_equal": again["tokens_equal"]}  # fmt: skip


def judge(row: dict[str, Any], ref_spread: dict[str, Any] | None) -> str:
    """``bitwise``, ``within spread`` or ``outside spread`` (see the module's text); ``no reference`` without one,
    ``differs (no spread measured)`` when the reference was run once only."""
    if "logits_equal" not in row:
        return "no reference"
    if row["logits_equal"] or row.get("again", {}).get("logits_equal"):
        return "bitwise"
    if ref_spread is None:
        return "differs (no spread measured)"
    if row["max_abs_logit_diff"] <= ref_spread["max_abs_logit_diff"]:
        return "within spread"
    return "outside spread"
