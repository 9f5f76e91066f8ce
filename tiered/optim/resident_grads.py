"""Gradients an offloaded model's backward left on the GPU, found by the host tensor they equal.

An offloaded model's gradients live in host memory (tiered.offload_model), and the optimizer's clip copies
each one up to take the norm on the GPU, keeping as many copies as fit for the update (Shards.clip_grad_norm_,
``defer``): 8.8 GB up a step for a 4.4B model, on a link the update's own 50 GB up already fill
(bench/RESULTS.md, nineteenth session: the optimizer at the link's floor for its bytes). Yet the last
micro-batch's sums were on the GPU a moment before, in FSDP2's reduced gradients (offload/accumulation.py adds
the held gradients there before the copy down). ``offer`` keeps such a device tensor beside the host tensor it
equals; ``take`` hands it back only if the host tensor has not changed since (the same storage, shape, dtype
and version counter: a scaler's ``unscale_``, a user's own clip or a ``zero_grad(set_to_none=False)`` in between
bumps the counter, and the host's bits are then what count). The clip reads what ``take`` gives instead of
copying up, and keeps it for the update as it keeps its own copies.

On by default (``ENABLED``; False: the clip copies every gradient up as before). On the 4.42B under a 24 GB cap
it took the optimizer from 1.42 s to 1.32 s and peak GPU memory from 16.3 to 13.7 GiB (bench/RESULTS.md,
twentieth session), its CUDA test bitwise the run on the GPU. The copies hold GPU memory from backward to the
step, which gives back what its clip did not take (``release``); the owner drops the rest (``drop``) before the
next forward, and where the GPU has no room (``room``) nothing is kept.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["ENABLED", "offer", "take", "drop", "release", "held_bytes", "storage_bytes"]

ENABLED = True
ALIGN = 16  # bytes: torch's foreach norm takes its vectorised path only from addresses aligned so (copies are)

_lock = threading.Lock()
# By the host tensor's data pointer: (its owner, the host tensor, its version when offered, the device copy).
_held: dict[int, tuple[Any, torch.Tensor, int, torch.Tensor]] = {}


def _renew_lock() -> None:
    global _lock
    # A forked child: a parent's thread (a model's summing worker in ``offer``) may have held the lock at the fork,
    # and the child's own optimizer steps take it (``release``). The parent's copies stay, unused here.
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_lock)


def offer(owner: Any, host: torch.Tensor, device_copy: torch.Tensor) -> bool:
    """Keep ``device_copy`` (on the GPU; bitwise ``host`` as it is now, which its caller makes sure of) for
    ``take(host)``. Returns whether it was kept: not where ``ENABLED`` is off, the shapes or dtypes differ, or
    the copy's address would put torch's norm on another path than a fresh copy's (``ALIGN``)."""
    if not ENABLED or device_copy.data_ptr() == host.data_ptr() or host.shape != device_copy.shape:
        return False
    if host.dtype != device_copy.dtype or device_copy.data_ptr() % ALIGN or not device_copy.is_contiguous():
        return False
    with _lock:
        _held[host.data_ptr()] = (owner, host, host._version, device_copy)
    return True


def take(host: torch.Tensor) -> torch.Tensor | None:
    """The device copy offered for ``host``, if ``host`` is unchanged since (then forgotten here: the caller
    holds it now); None otherwise."""
    with _lock:
        entry = _held.pop(host.data_ptr(), None)
    if entry is None:
        return None
    _, offered, version, copy = entry
    same = offered.shape == host.shape and offered.dtype == host.dtype and host._version == version
    return copy if same and host.device == offered.device else None


def drop(owner: Any) -> None:
    """Forget ``owner``'s copies (their GPU memory goes back)."""
    with _lock:
        for key in [k for k, v in _held.items() if v[0] is owner]:
            del _held[key]


def release(hosts: list[torch.Tensor]) -> None:
    """Forget the copies offered for ``hosts`` (the optimizer's step, for what its clip did not take: no clip, or
    one over several ranks): their GPU memory goes back before the update rather than at the next forward."""
    keys = {h.data_ptr() for h in hosts}
    with _lock:
        for key in keys & _held.keys():
            del _held[key]


def held_bytes(owner: Any = None) -> int:
    """Bytes of GPU memory the device copies held (``owner``'s, or everyone's) keep: their storages'
    (``storage_bytes``)."""
    with _lock:
        return storage_bytes(c for o, _, _, c in _held.values() if owner is None or o is owner)


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages ``tensors`` view: the memory they keep from going back. A copy offered is
    a view of a block's reduced gradients (offload/accumulation.py), which one view alone keeps whole: counted
    by their own sizes, the views of a block's small parameters (its norms' weights) kept beside none of its large
    ones hid that block's 0.38 GiB, and a 12.4B Llama under a 12 GB cap ran out of memory (bench/RESULTS.md,
    twenty-third session)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
