"""AdamW on one chunk record, in place: math only (no I/O, no streams, no store).

A record's layout (chunking.py) decides where a chunk's master, ``exp_avg`` and ``exp_avg_sq`` live:
three fp32 rows; an fp32 master row and bf16 moments packed in one row; or, for a split chunk, fp32
moments and the masters' low halves, joined with the bf16 parameters (master_split.py); with 8-bit
moments, their codes and block scales beside either kind of master (moments_codec.py), decoded into fp32
scratch rows for the update and encoded again after it. ``ChunkUpdater``
gives the views of any of them, keeps the masters in line with what was written to the parameters, and
runs torch's fused AdamW over the pieces that have gradients.

Call order per step: ``begin(steps, written)``; then ``update(...)`` or ``update_split(...)`` per chunk,
on whichever device the record is (host memory, a device copy, HBM).
"""

from __future__ import annotations

from typing import Any, cast

import torch

from ..layout.chunking import Chunk, Piece
from ..layout.master_split import join_params, split
from ..layout.moments_codec import SIGNED, UNSIGNED, decode_moments, encode_moments
from .adamw_kernel import adamw_update, hyperparameters

__all__ = ["ChunkUpdater"]


class ChunkUpdater:
    def __init__(self, params: list[torch.Tensor], moments_dtype: torch.dtype, chunk_numel: int, *,
                 any_split: bool, where: torch.device):  # fmt: skip
        """``params``: the optimizer's flat list (shared, so groups added later are seen); scratch rows of
        ``chunk_numel`` elements live on ``where``, the device streamed chunks update on."""
        self.params, self.moments_dtype = params, moments_dtype
        n = chunk_numel
        # Split chunks: their joined fp32 masters during an update, and an int32 scratch. Every scratch row is
        # made with its dtype, whatever torch's default (set_default_dtype): the records' bytes are viewed as them.
        self._split_scratch = (
            (torch.empty(n, dtype=torch.float32, device=where), torch.empty(n, dtype=torch.int32, device=where))
            if any_split
            else None
        )
        # fp32 working copies of bf16 or 8-bit moments during an update (two chunk rows).
        self._moment_scratch = (
            torch.empty(2, n, dtype=torch.float32, device=where) if moments_dtype != torch.float32 else None
        )
        if moments_dtype == torch.int8:  # the code tables on the device now, not in the first step's stream
            for code in (SIGNED, UNSIGNED):
                code.on(where)
        self._steps: list[int] = []
        self._step_tensors: dict[torch.device, torch.Tensor] = {}
        self.written: set[int] = set()

    @property
    def splits(self) -> bool:
        """Whether split chunks can be updated (the scratch for joined masters exists)."""
        return self._split_scratch is not None

    def begin(self, steps: list[int], written: set[int]) -> None:
        """A new step: per-parameter step counts (this step counted), and the parameters written since the
        optimizer last set them (``_forget_low_halves``)."""
        self._steps, self._step_tensors, self.written = steps, {}, written

    # ------------------------------------------------------------------------------------------ update
    def update_split(self, chunk: Chunk, js: list[int], state: torch.Tensor, grads: list[torch.Tensor],
                     group: dict[str, Any], bits: torch.Tensor, weights: torch.Tensor) -> None:  # fmt: skip
        """AdamW on a split chunk: join its masters (from the parameters' ``bits``), update, split them
        again; the new bf16 weights land in ``weights``. All tensors on one device."""
        master, scratch = (t[: chunk.numel] for t in self._split_scratch)  # type: ignore[union-attr]
        lo, ties = chunk.fmt.master_halves(state, chunk.numel)
        self.forget_low_halves(chunk, lo, self.written)
        join_params(bits, lo, ties, master, scratch)  # in line with the parameters: no sync_masters
        self.update(chunk, js, state, grads, group, master=master)
        split(master, weights, lo, ties)

    def update(self, chunk: Chunk, js: list[int], state: torch.Tensor, grads: list[torch.Tensor],
               group: dict[str, Any], master: torch.Tensor | None = None,
               values: torch.Tensor | None = None) -> None:  # fmt: skip
        """AdamW on the pieces ``js`` of one chunk record, in place. ``master``: a split chunk's joined
        master row (the record holds only its low halves). ``values``: the parameters' values as fp32 in row
        layout, on the record's device, read instead of the parameters (the update under backward's copy,
        whose bits it fingerprints). The caller marks the record dirty."""
        pieces = [chunk.pieces[j] for j in js]
        in_line = master is not None  # a split chunk's joined masters are in line already (join_params)
        rows = [chunk.views(state, p.chunk_start, p.numel, master) for p in pieces]
        masters, m, v = ([r[i] for r in rows] for i in range(3))
        if not in_line:
            self.sync_masters(masters, pieces, values)
        scratch = self._moment_scratch
        packed = scratch is not None
        quantized = chunk.fmt.quantized
        if scratch is not None:  # packed: bf16 or 8-bit moments: update fp32 working copies, then round or encode
            if state.device != scratch.device:  # an HBM-resident chunk
                scratch = torch.empty(2, chunk.numel, dtype=torch.float32, device=state.device)
            m_stored, v_stored = m, v
            if quantized:  # the whole chunk, as its blocks may span pieces (moments_codec.py)
                codes = chunk.fmt.moment_codes(state, chunk.numel)
                m_row, v_row = decode_moments(codes, scratch[0, : chunk.numel], scratch[1, : chunk.numel])
                m = [m_row[p.in_chunk] for p in pieces]
                v = [v_row[p.in_chunk] for p in pieces]
            else:
                m = [scratch[0, p.in_chunk].copy_(x) for p, x in zip(pieces, m_stored)]
                v = [scratch[1, p.in_chunk].copy_(x) for p, x in zip(pieces, v_stored)]
        # On the state's device: the fused kernel wants every tensor there, step counts included (HBM chunks).
        if state.device not in self._step_tensors:  # one host-to-device copy a step, not one per piece
            counts = torch.tensor(self._steps, dtype=torch.float32)
            if state.device.type == "cuda":  # from pinned memory: the host does not wait for the stream
                counts = counts.pin_memory().to(state.device, non_blocking=True)
            self._step_tensors[state.device] = counts
        steps = [self._step_tensors[state.device][p.param] for p in pieces]
        # Read as step() read them before it began (step.py: check_groups), so no value fails here part-way.
        lr, beta1, beta2, eps, weight_decay = hyperparameters(group, f"param_groups[{chunk.group}]")
        adamw_update(
            masters, grads, m, v, steps, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
            maximize=group.get("maximize", False),
        )  # fmt: skip
        if quantized:
            # A block without an updated element encodes back to its own codes; one beside an updated piece
            # may take a new scale, which moves its other elements within their rounding.
            encode_moments(m_row, v_row, codes, clobber=True)
        elif packed:
            torch._foreach_copy_(m_stored, m)
            torch._foreach_copy_(v_stored, v)

    # --------------------------------------------------------------------------- masters and parameters
    def forget_low_halves(self, chunk: Chunk, lo: torch.Tensor, written: set[int]) -> None:
        """A split chunk's masters are their parameters joined with stored low halves, so a write to the
        parameter changes the master's high half and leaves a stale low half, within half a bf16 step of
        the value written. Where torch saw the write (``written``: the parameter's version counter moved:
        in-place ops, ``load_state_dict``, inits; not writes through ``.data``), the low halves are dropped,
        so the master is exactly the parameter. The weights a load left, written again, are no write
        (``StateChunks.written_now``)."""
        for pc in chunk.pieces:
            if pc.param in written:
                lo[pc.in_chunk] = 0  # with a zero low half the tie bit is unused

    def sync_masters(self, masters: list[torch.Tensor], pieces: list[Piece] | tuple[Piece, ...],
                     values: torch.Tensor | None = None) -> None:  # fmt: skip
        """Make each master hold what was written to its parameter since the optimizer last set it, as
        torch's AdamW (which updates the parameter itself) would see it: a ``load_state_dict``, a re-init, an
        in-place change, a write through ``.data``. An fp32 master is its parameter. A lower-precision
        parameter's master is replaced wherever the parameter no longer equals the master rounded to the
        parameter's dtype (untouched elements keep their extra precision). ``values``: the parameters as
        fp32 in row layout (``update``), the same bits as ``param.float()``, so the same masters."""
        for mv, pc in zip(masters, pieces):
            dtype = self.params[pc.param].dtype
            if values is not None:
                wide = values[pc.in_chunk]
                src = wide if dtype == torch.float32 else wide.to(dtype)  # exact: the values are of that dtype
            else:
                src = self.params[pc.param].detach().reshape(-1)[pc.in_param]
                if src.device != mv.device:  # update_on="host" with CUDA parameters: a blocking copy down
                    src = src.to(mv.device)
                wide = src if dtype == torch.float32 else src.float()
            if dtype == torch.float32:
                mv.copy_(src)
            else:
                mv.copy_(torch.where(mv.to(dtype) == src, mv, wide))

    # ------------------------------------------------------------------------------------ checkpoints
    def state_rows(self, chunk: Chunk, record: torch.Tensor, bits: torch.Tensor | None,
                   written: set[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """(master, exp_avg, exp_avg_sq) of a chunk record, each fp32 [chunk.numel], the masters in line with
        the parameters (``written`` as for ``forget_low_halves``). The master is a new tensor (a split
        chunk's joined from ``bits``, its parameters' bf16 values in row layout); fp32 moments stay views of
        the record."""
        n = chunk.numel
        if chunk.split:
            lo, ties = chunk.fmt.master_halves(record, n)
            lo = lo.clone()
            self.forget_low_halves(chunk, lo, written)
            bits = cast(torch.Tensor, bits)  # given for a split chunk (the docstring)
            master = join_params(bits, lo, ties, torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.int32))
            _, m, v = chunk.views(record, 0, n, master)  # the moments as stored
        else:
            master, m, v = chunk.views(record, 0, n)
            master, m, v = master.clone(), m.float(), v.float()
            self.sync_masters([master[pc.in_chunk] for pc in chunk.pieces], chunk.pieces)
        if chunk.fmt.quantized:  # 8-bit moments: their fp32 values
            m, v = decode_moments(chunk.fmt.moment_codes(record, n))
        return master, m, v
