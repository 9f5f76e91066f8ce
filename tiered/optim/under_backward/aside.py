"""The device strategy's update, aside: the update under backward (overlap.py) runs it into a spare buffer,
the parameters untouched, and fingerprints what it read so that ``step()`` can tell whether that is still so.

``AsideUpdate(strategy)`` works over a ``DeviceUpdate`` (device_update.py) through its public pieces, on the
same streams and records as the step's own updates, in the same order: the record goes up
(``upload``); on the work stream, after it, the gradients are gathered into ``grad_row`` and the parameters
copied into a row of ``rows16`` (``param_row``), both fingerprinted (``grad_fingerprint``) from the very
rows the update then reads (``adamw``); the new record comes down into another pinned buffer
(``download``). A split chunk's new bf16 weights wait in a row on the device (``weights_row``) until
``push_rows``, or come down to a pinned buffer. ``same_fingerprints`` tells, at ``step()``, whether the
gradients and parameters are still those. On a CPU model the "device" is the host: the same code runs, and
is tested, without a GPU.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from ...layout import split_kernels
from ...layout.chunking import Chunk, Piece
from ..device_update import DeviceUpdate
from ..link import LinkBytes

__all__ = ["AsideUpdate", "grad_fingerprint"]

_ROW_MARGIN = 20  # weights_row leaves free at least 1/20 of the memory the process may use on the device

_WEIGHTS = split_kernels.WEIGHTS  # position weights of the fingerprint's second sum (cycled)


class AsideUpdate:
    """Updates of ``strategy``'s chunks into other buffers, their inputs fingerprinted; see the module doc."""

    def __init__(self, strategy: DeviceUpdate):
        self.strategy = strategy
        # Chunks that are not split read their parameters as fp32 into the whole bf16 scratch (exact, and one to
        # one, whatever their dtypes); a split chunk reads its bf16 bits into its first half, as its step does.
        self._values = strategy.rows16.view(torch.float32)
        self._positions: torch.Tensor | None = None  # grad_fingerprint's weights, made on first use

    def update(self, chunk: Chunk, js: list[int], state: torch.Tensor, out: torch.Tensor, weights: torch.Tensor | None,
               group: dict[str, Any], ready: Any = None) -> tuple[Any, torch.Tensor]:  # fmt: skip
        """Chunk's record up and updated as the strategy's ``update`` does, but the new record comes down into
        ``out`` (a pinned buffer shaped like ``state``, which is left as it was) and the parameters are not
        touched: a split chunk's new bf16 weights go into ``weights`` (a device row from ``weights_row``, or
        pinned), the others' are ``out``'s master row. ``push_rows`` or the strategy's ``push_params`` put them
        into the parameters later. ``group``: the hyperparameters it reads, taken by the caller (the user may
        set the chunk's group meanwhile). ``ready``: a CUDA event the gradients are ready after. Returns the event
        after which ``out`` and ``weights`` hold the result, and the fingerprints (``grad_fingerprint``, int64
        [4]) of the gradients and of the parameters it used, each taken from the very row the update read
        (``fingerprints``)."""
        dev = self.strategy
        if ready is not None:  # an event: on CUDA, where the work stream is made
            cast(torch.cuda.Stream, dev.work_stream).wait_event(ready)
        record = dev.upload(state)
        with dev.on_stream():
            # A copy of the gradients and of the parameters, whose bits the fingerprints then tell exactly: whatever
            # the update read of a write (through .data, which no version counter sees), even one racing it,
            # step() compares those bits.
            grads = dev.gather_grads(chunk, dev.grad_row, js)
            values = self.param_row(chunk)
            printed = self._fingerprints(chunk, values)
            direct = weights is not None and weights.device == dev.device  # weights_row's (CPU: any)
            new = dev.adamw(chunk, js, record, grads, values, weights if direct else None, group)
            if weights is not None and not direct:
                weights.copy_(new, non_blocking=True)
                dev.link.add(new, weights)
            event = dev.download(record, out)
        return event, printed

    def param_row(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's parameters in row layout, on the work stream: a split chunk's bf16 bits, the others'
        values as fp32 (exact, and one to one, whatever their dtypes)."""
        row = (self.strategy.rows16 if chunk.split else self._values)[: chunk.numel]
        _copy_pieces(row, [(pc, self.strategy.params[pc.param].detach()) for pc in chunk.pieces], self.strategy.link)
        return row

    def fingerprints(self, chunk: Chunk, js: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """``update``'s fingerprints of the chunk's gradients (pieces ``js``) and parameters as they are now,
        into ``out`` (int64 [4], zeros) if given. On the work stream: call it inside ``on_stream()``."""
        params = self.strategy.params
        grads = [(pc, cast(torch.Tensor, params[pc.param].grad)) for pc in (chunk.pieces[j] for j in js)]
        _copy_pieces(self.strategy.grad_row, grads, self.strategy.link)  # as gather_grads
        return self._fingerprints(chunk, self.param_row(chunk), out)

    def same_fingerprints(self, early: list[tuple[Chunk, list[int], torch.Tensor]]) -> list[tuple[bool, bool]]:
        """For each (chunk, pieces, fingerprints from ``update``): whether its gradients, and its parameters,
        have those fingerprints now. All on the work stream, where the fingerprints were made, into one tensor;
        one sync for all."""
        with self.strategy.on_stream():
            now = torch.zeros(len(early), 4, dtype=torch.int64, device=self.strategy.device)
            for i, (chunk, js, _) in enumerate(early):
                self.fingerprints(chunk, js, now[i])
            then = torch.stack([printed for _, _, printed in early])
            same = (now == then).view(len(early), 2, 2).all(dim=2).tolist()
        return [(grads, params) for grads, params in same]

    def _fingerprints(self, chunk: Chunk, params: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """int64 [4]: ``grad_fingerprint`` of the gathered gradient row, then of ``params`` (``param_row``'s),
        into ``out`` (zeros) if given. The chunk's pieces lie end to end in both."""
        row = self.strategy.grad_row
        grads = row[: chunk.numel]
        if split_kernels.available(grads):  # the same sums, both rows in one kernel
            return split_kernels.fingerprint(grads, params, out)
        if self._positions is None:
            self._positions = torch.arange(row.numel(), dtype=torch.int32, device=row.device) % _WEIGHTS + 1
        printed = torch.cat([grad_fingerprint(grads, self._positions), grad_fingerprint(params, self._positions)])
        return printed if out is None else out.copy_(printed)

    def weights_row(self, n: int) -> torch.Tensor | None:
        """A bf16 row of ``n`` elements on the device, for ``update``'s new weights to wait in until
        ``push_rows``; None without CUDA, or where taking it would leave less than 1/20 of the memory the
        process may use free. It is allocated on the work stream, which alone then uses it: the caching
        allocator gives a stream only blocks freed on that stream, whereas a block backward just freed on the
        compute stream may still be written by kernels queued there before the free."""
        dev = self.strategy
        if not dev.cuda:
            return None
        room, total = torch.cuda.mem_get_info(dev.device)
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(dev.device)
        allowed = int(fraction * total)
        if fraction < 1:  # set_per_process_memory_fraction caps the caching allocator below the device
            room = min(room, allowed - torch.cuda.memory_reserved(dev.device))  # (memory_stats: slow)
        if room - 2 * n < allowed // _ROW_MARGIN:
            return None
        with dev.on_stream():
            return torch.empty(n, dtype=torch.bfloat16, device=dev.device)

    def push_rows(self, rows: list[tuple[Chunk, torch.Tensor, list[int]]]) -> None:
        """The strategy's ``push_params`` for rows already on the device (``weights_row``'s), all at once on
        the work stream."""
        with self.strategy.on_stream():
            self.strategy.scatter_rows(rows)


def _copy_pieces(row: torch.Tensor, pieces: list[tuple[Piece, torch.Tensor]], link: LinkBytes) -> None:
    """Each (piece, tensor): the piece's elements of ``tensor`` into its place in ``row``, cast to the row's dtype
    (exact: a wider float, or the same), counted on ``link``. One multi-tensor copy: a chunk of many small pieces
    (norms, biases) launches a kernel or two, not one a piece (``gather_params`` and ``gather_grads`` copy the
    same bits)."""
    dst, src = [row[pc.in_chunk] for pc, _ in pieces], [t.reshape(-1)[pc.in_param] for pc, t in pieces]
    torch._foreach_copy_(dst, src)
    if dst:  # one chunk's parameters (or gradients) share a device
        link.add(src[0], dst[0], sum(t.nbytes for t in dst))


def grad_fingerprint(row: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Two int64 sums over the bits of an fp32 gradient row (or of a bf16 or fp16 row, their 16 bits as signed
    integers): of the bits, and of the bits times ``positions`` (int32 products, wrapping). Integer sums are
    exact in any order, so the same gradients give the same fingerprint on any stream. Scaling gradients by a
    factor below 1 (clipping, unscaling) lowers the bits of every element it changes, so it always changes the
    first sum; so does any change of a single element; the second catches values moved around."""
    bits = row.view(torch.int32 if row.element_size() == 4 else torch.int16)
    return torch.stack([bits.sum(), (bits * positions[: bits.numel()]).sum()])
