"""What both update strategies share: copies between chunk rows and the parameters.

A chunk's row lays its pieces end to end (chunking.py). ``ParamCopies.gather_params`` copies the
parameters' values into such a row (any device; cast to the row's dtype), ``scatter`` copies a row on the
parameters' device back into them. The two places an update can run build on it:

- ``HostUpdate`` (host_update.py, ``update_on="host"``): gradients come down to pinned slots, torch's fused
  AdamW runs on the CPU over the pinned record, new weights go up.
- ``DeviceUpdate`` (device_update.py, ``update_on="device"``): the record goes up to the parameters'
  device, updates there and comes back; gradients and weights never cross PCIe.

Both implement ``UpdateStrategy`` (strategy.py), whose docstring numbers the calls a step makes; this module
only copies.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from ..layout.chunking import Chunk, Piece
from .groups import Groups
from .link import LinkBytes

__all__ = ["ParamCopies", "Work"]

Work = list[tuple[Chunk, list[int]]]  # chunks with gradients, and the indices of their pieces that have them


def _may_queue(host: torch.Tensor, device: torch.Tensor) -> bool:
    """Whether a copy between ``host`` and ``device`` may be queued rather than waited for: only from the host
    up to a GPU (the host's memory stays as it is, the GPU's stream orders whatever reads it), and, in
    ``scatter_rows``, down into offloaded parameters, which the device strategy waits for (``end_step``). A
    copy down into memory the host reads next is waited for."""
    return host.device.type == "cpu" and device.device.type == "cuda"


class ParamCopies:
    """The parameters, and copies between them and chunk rows. Base of ``UpdateStrategy`` (strategy.py)."""

    def __init__(self, params: list[torch.Tensor], groups: Groups, updater: Any):
        """``params``: the optimizer's flat list (shared: a group added later is seen); ``groups``: its
        ``param_groups`` of now (groups.py); ``updater``: the ChunkUpdater that does the math."""
        self.params, self.groups, self.updater = params, groups, updater
        self.cuda = any(p.is_cuda for p in params)
        # The clip's coefficient where ``max_grad_norm`` left the gradients unscaled (an offloaded model: see
        # Shards.clip_grad_norm_'s ``defer``), set for one step: every gradient read applies it, as torch's
        # clip would have in place (the same multiply in the gradient's dtype, so the same bits).
        self.grad_scale: torch.Tensor | None = None
        # That clip's copies of gradients left on the GPU, by parameter index, for one step (Shards.device_grads):
        # the device strategy reads those rather than copying the host gradients up again.
        self.device_grads: dict[int, torch.Tensor] = {}
        self.device = params[0].device if params else torch.device("cpu")  # where the strategy's streams are
        self.link = LinkBytes()  # what every copy below (and the strategies') moved between host and GPU

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's ``param_groups`` as they are now: the hyperparameters an update reads."""
        return self.groups.now

    def gather_params(self, chunk: Chunk, out: torch.Tensor) -> torch.Tensor:
        """Copy ``chunk``'s parameter values into ``out`` (its row layout, any device); returns ``out``."""
        for pc in chunk.pieces:
            src = self.params[pc.param].detach().reshape(-1)[pc.in_param]
            out[pc.in_chunk].copy_(src, non_blocking=_may_queue(src, out))
            self.link.add(src, out[pc.in_chunk])
        return out

    def gather_grads(self, chunk: Chunk, row: torch.Tensor, pieces: list[int],
                     sources: list[torch.Tensor] | None = None) -> list[torch.Tensor]:  # fmt: skip
        """Copy the gradients of ``chunk.pieces[j]`` for j in ``pieces`` into ``row`` (chunk layout, on the
        device, cast to its dtype); returns their views of ``row``. ``sources``: copies of those gradients on
        the device (one a piece, in their own dtype: DeviceUpdate's staging), read instead of ``param.grad``
        and scaled in place."""
        out = []
        for n, j in enumerate(pieces):
            pc = chunk.pieces[j]
            dst = row[pc.in_chunk]
            ours = sources is not None
            src = sources[n] if sources is not None else self.grad_of(pc)
            nb = _may_queue(src, dst)  # offloaded parameters: queued, from pinned memory
            crossed = dst  # a cast crosses in the row's dtype, made on the host (link.py)
            if self.grad_scale is None:
                dst.copy_(src, non_blocking=nb)
            elif src.dtype == dst.dtype:
                dst.copy_(src, non_blocking=nb).mul_(self._scale_on(dst.device))
            else:  # scaled in the gradient's own dtype first, where torch's clip would have scaled it
                scaled = crossed = src if ours else src.to(dst.device, non_blocking=nb, copy=True)
                dst.copy_(scaled.mul_(self._scale_on(dst.device)))
            self.link.add(src, crossed)
            out.append(dst)
        return out

    def grad_of(self, pc: Piece, grad: torch.Tensor | None = None) -> torch.Tensor:
        """The gradient of piece ``pc``, contiguous: a view of ``grad``, a whole gradient of its parameter (default:
        its ``.grad``; the pieces asked for have one), or a copy of the piece where that view is not contiguous."""
        grad = cast(torch.Tensor, self.params[pc.param].grad) if grad is None else grad
        piece = grad.reshape(-1)[pc.in_param]
        # A strided or expanded ``.grad`` (``flat[::2]``, ``g.expand(n)``) stays a view through ``reshape``, and
        # torch's fused kernel reads its memory as if it were dense: the piece's values are copied out for it.
        return piece if piece.is_contiguous() else piece.contiguous()

    def host_grads(self, chunk: Chunk, pieces: list[int]) -> list[torch.Tensor]:
        """fp32 gradients where they are (CPU parameters, or HBM chunks beside CUDA ones): views of ``param.grad``,
        a copy only for low-precision grads."""
        out = []
        for j in pieces:
            g = self.grad_of(chunk.pieces[j])
            if self.grad_scale is not None:
                g = g * self._scale_on(g.device)  # in g's dtype (a 0-dim factor does not promote it)
            out.append(g if g.dtype == torch.float32 else g.float())
        return out

    def _scale_on(self, device: torch.device) -> torch.Tensor:
        """``grad_scale`` on ``device`` (copied once a step where it is needed elsewhere)."""
        scale = cast(torch.Tensor, self.grad_scale)
        if scale.device != device:
            scale = self.grad_scale = scale.to(device)
        return scale

    def scatter(self, chunk: Chunk, row: torch.Tensor, pieces: list[int]) -> None:
        """``row`` (chunk layout, on the parameters' device) -> the parameters of ``pieces``, cast."""
        self.scatter_rows([(chunk, row, pieces)])

    def scatter_rows(self, rows: list[tuple[Chunk, torch.Tensor, list[int]]]) -> None:
        """``scatter`` for many (chunk, row, pieces) at once: one multi-tensor copy, so that a step keeping a
        hundred chunks' new weights launches a few kernels, not a few hundred."""
        dst, src = [], []
        for chunk, row, pieces in rows:
            for j in pieces:
                pc = chunk.pieces[j]
                dst.append(self.params[pc.param].detach().view(-1)[pc.in_param])
                src.append(row[pc.in_chunk])
        if dst:
            # Parameters in host memory updated on the GPU (FSDP2's CPU offload): queued into their pinned
            # storage, which the strategy's end_step waits for.
            torch._foreach_copy_(dst, src, non_blocking=_may_queue(dst[0], src[0]))
            self.link.add(src[0], dst[0], sum(t.nbytes for t in dst))  # the parameters share a device, the rows one
