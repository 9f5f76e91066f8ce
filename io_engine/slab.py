"""PinnedSlab: one page-locked host allocation of exactly the pages asked for, carved into tensors.

torch's pinned-memory allocator rounds every block up to a power of two: an 86 MiB tensor pinned by
``tensor.pin_memory()`` takes 128 MiB of page-locked RAM. A slab is an anonymous mmap, page-locked once with
cudaHostRegister (as the buffer pool's blocks are), so it takes the pages it holds and no more.

Fork: a slab is Python's default *shared* anonymous mapping, not the pool's private one wiped on fork
(hugepages.py): a forked child reads (and writes) the parent's bytes there, so a state dict taken in the parent, of
an offloaded model whose weights and gradients live in slabs (tiered/offload/pinning.py), is whole when a forked
child saves it (a fork-based background checkpoint). A slab's bytes move only between host and GPU, never straight
to disk, so the private huge pages that speed the engine's direct I/O would buy it nothing.

``carve(offset, nbytes)`` hands out a uint8 tensor over a byte range of the slab with a storage of its own: code
that tells tensors apart by their storage (tied-weight detection in ``save_pretrained``, safetensors' shared-
memory check) sees separate tensors, as it would for separately allocated ones.

Lifetime: the slab must outlive its carved tensors to keep them page-locked. ``close()`` (or the slab being
collected) unregisters the pages first; tensors still alive then stay valid, in pageable memory, and the mapping
goes with the last of them. A registered range is never left behind an unmapped one (CUDA then refuses, or
misreports, a later mapping at that address).
"""

from __future__ import annotations

import torch

from .align import PAGE, round_up
from .pool import _Block

__all__ = ["PinnedSlab"]


class PinnedSlab:
    """``nbytes`` (rounded up to whole pages) of host memory, page-locked where ``pin`` (default: where CUDA is
    available); ``carve`` it into tensors."""

    def __init__(self, nbytes: int, *, pin: bool | None = None) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        pin = torch.cuda.is_available() if pin is None else bool(pin)
        if pin and not torch.cuda.is_available():
            raise ValueError("pin=True needs CUDA; pass pin=None to pin only where CUDA is available")
        self.nbytes = max(PAGE, round_up(nbytes, PAGE))
        self._block: _Block | None = _Block(self.nbytes, pin, shared=True)  # a child reads it: the docstring

    @property
    def pinned(self) -> bool:
        return self._block is not None and self._block.registered

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s bytes lie in this slab (open)."""
        if self._block is None:
            return False
        base, start = self._block.tensor.data_ptr(), tensor.data_ptr()
        return base <= start and start + tensor.numel() * tensor.element_size() <= base + self.nbytes

    def carve(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over bytes ``[offset, offset + nbytes)`` of the slab, with its own storage."""
        if self._block is None:
            raise ValueError("the slab is closed: carve its tensors before close()")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) are outside the slab's {self.nbytes}")
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        start = self._block.offset + offset
        return torch.frombuffer(memoryview(self._block.mm)[start : start + nbytes], dtype=torch.uint8)

    def close(self) -> None:
        """Unregister the pages (idempotent); carved tensors stay valid, pageable."""
        block, self._block = self._block, None
        if block is not None:
            block.free()

    def __del__(self) -> None:
        if getattr(self, "_block", None) is not None:
            try:
                self.close()
            except Exception:
                pass
