"""``host_budget="auto"`` and ``gpu_budget="auto"``: budgets read off this machine, at the public boundary.

- ``gpu_limit(device)``: the bytes this process may allocate on a CUDA device: the card's memory times the
  fraction ``torch.cuda.set_per_process_memory_fraction`` set (1 unless someone capped it).
- ``resolve_gpu_budget("auto", device)``: that limit, for deciding whether a model fits at all
  (``offload_model(enabled="auto")``); 0 without CUDA.
- ``auto_host_budget()``: the optimizer's ``host_budget="auto"``: RAM available now (at most the 90 % of
  RAM ``TierConfig`` allows a host budget), less 8 GiB for the process and the OS, less the host gradients
  an offloaded model will make in its first backward (as many bytes as its parameters).
- ``auto_gpu_budget()``: the optimizer's ``gpu_budget="auto"`` (HBM for state chunks): ``GPU_SHARE`` of the
  GPU limit less what this process holds there when the optimizer is built (its weights; for a model
  tiered.offload_model keeps on the host, next to nothing), whole GiB; the rest of the GPU is left to
  activations, the streamed layers and scratch. 0 without CUDA. The GPU memory a step leaves spare is known
  only after a forward and backward: examples/big_model.py measures it instead.
"""

from __future__ import annotations

import weakref
from typing import Any

import psutil
import torch

from io_engine import format_size, parse_size

from .shares import GPU_SHARE

__all__ = [
    "gpu_limit",
    "backward_room",
    "grad_room",
    "resolve_gpu_budget",
    "auto_host_budget",
    "auto_host_too_small",
    "auto_gpu_budget",
    "resolve_auto",
    "RAM_RESERVE",
]

RAM_RESERVE = 8 << 30  # bytes of RAM left to the process, its model copies and the OS beyond the pinned budget
MAX_PINNED_SHARE = 0.9  # of RAM: what TierConfig lets a host budget be (page-locked memory cannot be swapped)
# The models offload_model has put on the host in this process, while they live, and their parameters' bytes
# (their gradients, to come, take as many: auto_host_budget leaves them room).
_offloaded: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def note_offloaded(model: Any, param_bytes: int) -> None:
    _offloaded[model] = param_bytes


def offloaded_bytes() -> int:
    """The parameter bytes of the offloaded models alive in this process."""
    return sum(_offloaded.values())


def gpu_limit(device: torch.device | str | int | None = None) -> int:
    """Bytes the caching allocator may hand this process on ``device`` (0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
    if dev.type != "cuda":
        return 0
    index = torch.cuda.current_device() if dev.index is None else dev.index
    total = torch.cuda.get_device_properties(index).total_memory
    return int(total * torch.cuda.get_per_process_memory_fraction(index))


def grad_room(device: torch.device | None) -> int:
    """Bytes an optimizer step may take on ``device`` beyond what is allocated when it starts: the GPU limit less
    the allocated, less a margin (1 GiB and 1/16 of the limit) for the step's own scratch. 0 without CUDA. An
    offloaded model's clip keeps that many bytes of its gradients' copies there for the update to read."""
    if device is None or device.type != "cuda":
        return 0
    limit = gpu_limit(device)
    return max(0, limit - torch.cuda.memory_allocated(device) - _margin(limit))


def backward_room(device: torch.device, pass_peak: int, kept: int) -> int:
    """Bytes a backward may keep aside on ``device`` (an offloaded model's gradient sums for the clip) without
    running out of memory itself: the GPU limit less ``pass_peak`` (the most allocated by a pass that kept
    nothing, measured), less what it keeps already (``kept``) and grad_room's margin. Not the limit less what is
    allocated now: between two blocks backward has let go of the memory the next block takes again."""
    limit = gpu_limit(device)
    return max(0, limit - pass_peak - kept - _margin(limit))


def _margin(limit: int) -> int:
    return (1 << 30) + limit // 16


def resolve_gpu_budget(value: Any, device: torch.device | str | int | None = None) -> int:
    """For deciding whether a model fits the GPU at all: ``"auto"`` is the GPU limit of ``device``; anything
    else is parsed as a size (``ValueError`` names it)."""
    if value == "auto":
        return gpu_limit(device)
    return parse_size(value, name="gpu_budget")


def auto_host_budget(available: int | None = None, total: int | None = None, grads: int | None = None) -> int:
    """The pinned bytes ``host_budget="auto"`` takes with ``available`` of ``total`` bytes of RAM and ``grads``
    bytes of host gradients to come (default: this machine's now, and the offloaded models'), whole MiB."""
    vm = psutil.virtual_memory()
    available = vm.available if available is None else available
    total = vm.total if total is None else total
    grads = offloaded_bytes() if grads is None else grads
    room = min(int(MAX_PINNED_SHARE * total), available) - RAM_RESERVE - grads
    return max(0, room) >> 20 << 20


def auto_host_too_small(budget: int, need: int) -> ValueError:
    """The refusal where ``host_budget="auto"`` took ``budget`` bytes, less than the ``need`` of one state chunk
    and the staging beside it: what "auto" read off this machine, and a size to give instead. The optimizer's
    own refusal would name a budget the user never gave."""
    vm, grads = psutil.virtual_memory(), offloaded_bytes()
    cap = int(MAX_PINNED_SHARE * vm.total)
    read = f"{format_size(vm.available)} of RAM available"
    if cap < vm.available:
        read += f" (of which it takes at most 90 % of RAM, {format_size(cap)})"
    read += f", less {format_size(RAM_RESERVE)} kept for the process and the OS"
    if grads:
        read += f" and {format_size(grads)} for the gradients of the models offload_model keeps on the host"
    fix = f"give host_budget a size, at least {-(-need >> 20)}MiB (one state chunk and the staging beside it)"
    if budget:  # where auto left nothing, smaller chunks cannot help
        fix += ", or lower chunk_bytes"
    return ValueError(f"host_budget='auto' took {format_size(budget)}: {read}; {fix}")


def auto_gpu_budget(device: torch.device | str | int | None = None) -> int:
    """The optimizer's ``gpu_budget="auto"`` on ``device`` (see the module's docstring)."""
    limit = gpu_limit(device)
    if not limit:
        return 0
    held = torch.cuda.memory_reserved(torch.device(device or "cuda") if not isinstance(device, int) else device)
    return max(0, int(GPU_SHARE * limit) - held) >> 30 << 30


def resolve_auto(name: str, value: Any) -> Any:
    """``value``, or for ``"auto"`` the budget ``name`` (``host_budget`` or ``gpu_budget``) takes here; what
    ``TierConfig`` calls before it parses the sizes."""
    if value != "auto":
        return value
    if name == "host_budget":
        return auto_host_budget()
    if name == "gpu_budget":
        return auto_gpu_budget()
    raise ValueError(f"{name} takes no 'auto': give a size such as '64MiB'")
