"""Turn the buffers users hand us (torch tensors, numpy arrays, memoryviews) into raw byte views.

Checks happen here, once, at the public boundary; the worker threads only see ``HostBuffer``.
"""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np

from .hugepages import host_mmap

try:  # torch is a dependency of the project, but io_engine works on numpy buffers without it
    import torch
except ImportError:  # pragma: no cover
    torch = None  # type: ignore[assignment]


@dataclass(frozen=True)
class HostBuffer:
    """A contiguous host byte range: ``view`` is a writable-or-not memoryview of ``nbytes`` bytes at ``address``."""

    view: memoryview
    address: int
    nbytes: int
    owner: Any  # keeps the user's object alive while requests run


def _from_address(address: int, nbytes: int, owner: Any) -> HostBuffer:
    if nbytes == 0:
        return HostBuffer(memoryview(bytearray(0)), address, 0, owner)
    raw = (ctypes.c_char * nbytes).from_address(address)
    return HostBuffer(memoryview(raw).cast("B"), address, nbytes, owner)


def as_host_buffer(buf: Any, *, writable: bool) -> HostBuffer:
    """Validate ``buf`` and return its bytes. ``writable`` is required for reads into it."""
    if torch is not None and isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise TypeError(
                f"buffer is a {buf.device.type} tensor; io_engine reads and writes host memory: "
                "use a CPU (ideally pinned) tensor and copy it to the device afterwards"
            )
        if not buf.is_contiguous():
            raise TypeError("buffer tensor is not contiguous: pass tensor.contiguous() (or a contiguous view)")
        if buf.is_sparse or buf.is_quantized:
            raise TypeError("buffer tensor must be a dense tensor")
        return _from_address(buf.data_ptr(), buf.numel() * buf.element_size(), buf)
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise TypeError("buffer array is not C-contiguous: pass np.ascontiguousarray(array)")
        if writable and not buf.flags.writeable:
            raise TypeError("buffer array is read-only; reads need a writable array")
        return _from_address(buf.ctypes.data, buf.nbytes, buf)
    if isinstance(buf, (bytes, bytearray, memoryview, mmap.mmap)) or hasattr(buf, "__buffer__"):
        try:
            mv = memoryview(buf)
        except TypeError as e:
            raise TypeError(f"unsupported buffer type {type(buf).__name__}") from e
        if not mv.c_contiguous:
            raise TypeError("buffer memoryview is not contiguous")
        if writable and mv.readonly:
            raise TypeError(
                f"buffer of type {type(buf).__name__} is read-only; reads need a writable buffer "
                "(bytearray, numpy array, tensor)"
            )
        mv = mv.cast("B") if mv.nbytes else mv
        address = np.frombuffer(mv, dtype=np.uint8).ctypes.data if mv.nbytes else 0
        return HostBuffer(mv, address, mv.nbytes, buf)
    raise TypeError(
        f"unsupported buffer type {type(buf).__name__}: pass a contiguous CPU torch tensor, a numpy array, "
        "a bytearray or a memoryview"
    )


def aligned_empty(nbytes: int, alignment: int = 4096) -> tuple[memoryview, Any]:
    """A page-aligned, zero-filled host buffer of ``nbytes`` (anonymous mmap, in huge pages where given:
    hugepages.py) and its owner."""
    if alignment > mmap.PAGESIZE:
        raise ValueError(f"alignment {alignment} exceeds the page size {mmap.PAGESIZE}")
    m, offset = host_mmap(nbytes)
    return memoryview(m)[offset : offset + nbytes], m
