"""How parameters map onto state chunks, and how a chunk's state is laid out in its store record.

Each param group's parameters are laid end to end in one flat space and cut into chunks of at most
``chunk_numel`` elements. A chunk never spans two groups (so it has one set of hyperparameters), and a
parameter larger than a chunk is split across several, cut only at multiples of ``CUT_ALIGN`` elements from
its own start (so a chunk may end up to ``CUT_ALIGN - 1`` elements short): the update runs torch's fused
kernel on each piece, and the kernel rounds a tensor's last few elements differently from the rest, so only
cuts where the kernel's own work units begin leave every element rounded as in AdamW over the whole
parameter. Each chunk is one store record, in one of five formats (``RecordFormat``; the only place that
knows them):

- ``FULL``: three fp32 rows: master weights, exp_avg, exp_avg_sq (12 bytes a parameter).
- ``PACKED`` (bf16 moments): the fp32 master row, and one row whose bytes are exp_avg then exp_avg_sq in
  bf16 (8 bytes a parameter).
- ``SPLIT`` (bf16 parameters, split masters: master_split.py): flat bytes, exp_avg and exp_avg_sq (fp32)
  first, then the masters' low halves (int16) and their tie bits, padded to 4 KiB (10 bytes and a bit).
  The masters' high halves are the parameters themselves.
- ``INT8`` (8-bit moments, moments_codec.py): one fp32 row, the master in its first n elements, then the
  bytes of exp_avg's int8 codes, exp_avg_sq's uint8 codes and the two rows of fp32 block scales, padded to
  4 KiB (6 bytes and a bit).
- ``SPLIT_INT8`` (8-bit moments and split masters): flat int8 bytes, the masters' low halves and tie bits,
  then the moments as in ``INT8``, padded to 4 KiB (4.16 bytes).

Inside an 8-bit record every section starts on a 64-byte boundary; the 4 KiB padding keeps a whole record's
I/O O_DIRECT. A checkpoint holds fp32 rows whatever the format (``pack`` makes a record from them, the
optimizer's ``state_rows`` gives them back).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import sizes
from .master_split import split, tie_bytes
from .moments_codec import MomentCodes, encode_moments

STATE_ROWS = ("master", "exp_avg", "exp_avg_sq")

# Elements: where plan_chunks may cut a parameter, counted from the parameter's start. torch's fused CPU AdamW
# splits a tensor into work units of one 64-byte cache line (16 fp32, 32 bf16 elements) from its start, runs
# each thread's units through a SIMD loop (8 fp32 lanes on AVX2, 16 on AVX-512; bf16 twice that) and the
# elements left over at the tensor's end through a scalar loop, whose fused multiply-adds round otherwise. A
# piece whose length is a whole number of units and lanes has no scalar tail of its own, and the parameter's
# last piece ends in the parameter's tail: every element takes the path it takes in AdamW over the whole
# tensor. 64 is a multiple of every such width (the masters the kernel updates are fp32, so 16 would do
# today; 64 leaves room for wider vectors). On CUDA an element's math does not depend on where it lies, so
# there the cuts cost only the few elements a chunk ends short.
CUT_ALIGN = 64


class RecordFormat:
    """One layout of a chunk's state record. Stateless; ``FULL``, ``PACKED``, ``SPLIT``, ``INT8`` and
    ``SPLIT_INT8`` are the instances.

    ``views(record, n, start, numel, master)``: (master, exp_avg, exp_avg_sq) of elements [start, start +
    numel) of a record of an n-element chunk, the moments as stored (fp32, bf16, or 8-bit codes, whose block
    scales ``moment_codes`` gives); a split record's master comes from ``master`` (joined by the caller).
    ``pack(rows)``: the record holding fp32 ``rows`` (3, n): what ``store.put`` takes. Split formats also
    give ``master_halves(record, n)``: the masters' low halves and tie bits.
    """

    name = "full"
    split = False  # the masters' high halves are the bf16 parameters (master_split.py)
    quantized = False  # 8-bit moments (moments_codec.py)

    if TYPE_CHECKING:  # given by the formats that say so (split / quantized), absent from the others

        def master_halves(self, record: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]: ...
        def moment_codes(self, record: torch.Tensor, n: int) -> MomentCodes: ...

    def nbytes(self, numel: int) -> int:
        """Bytes of the record of a ``numel``-element chunk in this format (sizes.py counts every format)."""
        return sizes.record_bytes(self.name, numel)

    def views(self, record: torch.Tensor, n: int, start: int, numel: int,
              master: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        end = start + numel
        return record[0, start:end], record[1, start:end], record[2, start:end]

    def pack(self, rows: torch.Tensor) -> torch.Tensor:
        return rows


class PackedMoments(RecordFormat):
    name = "packed"

    def views(self, record, n, start, numel, master=None):  # type: ignore[no-untyped-def]
        packed, end = record[1].view(torch.bfloat16), start + numel  # exp_avg in [0, n), exp_avg_sq in [n, 2n)
        return record[0, start:end], packed[start:end], packed[n + start : n + end]

    def pack(self, rows: torch.Tensor) -> torch.Tensor:
        n = rows.shape[1]
        out = torch.empty(2, n, dtype=torch.float32)
        _, m, v = self.views(out, n, 0, n)
        out[0].copy_(rows[0])
        m.copy_(rows[1])  # rounded to nearest, as the update rounds them
        v.copy_(rows[2])
        return out


class SplitMasters(RecordFormat):
    name = "split"
    split = True

    def views(self, record, n, start, numel, master=None):  # type: ignore[no-untyped-def]
        m, v, _, _ = split_views(record, n)
        end = start + numel
        return master[start:end], m[start:end], v[start:end]  # type: ignore[index]

    def master_halves(self, record: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The masters' low halves (int16) and tie bits (uint8)."""
        return split_views(record, n)[2:]

    def pack(self, rows: torch.Tensor) -> torch.Tensor:
        """The record for fp32 masters ``rows[0]``: their low halves and tie bits against bf16(master), which
        the caller must then write into the parameters."""
        n = rows.shape[1]
        out = torch.zeros(self.nbytes(n), dtype=torch.uint8)
        m, v, lo, ties = split_views(out, n)
        m.copy_(rows[1])
        v.copy_(rows[2])
        split(rows[0].contiguous(), torch.empty(n, dtype=torch.bfloat16), lo, ties)
        return out


class Int8Moments(RecordFormat):
    """8-bit moments beside fp32 masters (``split=False``) or split masters (``split=True``)."""

    quantized = True

    def __init__(self, split: bool):
        self.split = split
        self.name = "split-int8" if split else "int8"

    def sections(self, n: int) -> tuple[dict[str, tuple[int, int]], int]:
        """{section: (byte offset, bytes)} of an n-element chunk's record, and the record's bytes."""
        return _int8_sections(self.split, n)

    def nbytes(self, numel: int) -> int:
        return self.sections(numel)[1]

    def _section(self, record: torch.Tensor, n: int, name: str, dtype: torch.dtype) -> torch.Tensor:
        (at, size), flat = self.sections(n)[0][name], record.view(-1).view(torch.uint8)
        return flat[at : at + size].view(dtype)

    def moment_codes(self, record: torch.Tensor, n: int) -> MomentCodes:
        """The chunk's 8-bit moments: codes and block scales, views of the record."""
        sec = lambda name, dtype: self._section(record, n, name, dtype)  # noqa: E731
        return MomentCodes(sec("m", torch.int8), sec("m_scales", torch.float32), sec("v", torch.uint8),
                           sec("v_scales", torch.float32))  # fmt: skip

    def master_halves(self, record: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A split record's low halves (int16) and tie bits (uint8)."""
        return self._section(record, n, "lo", torch.int16), self._section(record, n, "ties", torch.uint8)

    def views(self, record, n, start, numel, master=None):  # type: ignore[no-untyped-def]
        end = start + numel
        if not self.split:
            master = self._section(record, n, "master", torch.float32)
        m, v = self._section(record, n, "m", torch.int8), self._section(record, n, "v", torch.uint8)
        return master[start:end], m[start:end], v[start:end]  # type: ignore[index]

    def pack(self, rows: torch.Tensor) -> torch.Tensor:
        """The record for fp32 ``rows``, its moments quantized; with split masters, as ``SPLIT.pack``."""
        n = rows.shape[1]
        out = torch.zeros(self.nbytes(n), dtype=torch.int8)
        if self.split:
            lo, ties = self.master_halves(out, n)
            split(rows[0].contiguous(), torch.empty(n, dtype=torch.bfloat16), lo, ties)
        else:
            out = out.view(torch.float32).view(1, -1)  # row 0 begins with the master, as FULL's does
            self._section(out, n, "master", torch.float32).copy_(rows[0])
        encode_moments(rows[1].contiguous(), rows[2].contiguous(), self.moment_codes(out, n))
        return out


_int8_sections = functools.lru_cache(maxsize=256)(sizes.int8_sections)  # looked up for every piece of every update


FULL, PACKED, SPLIT = RecordFormat(), PackedMoments(), SplitMasters()
INT8, SPLIT_INT8 = Int8Moments(split=False), Int8Moments(split=True)


@dataclass(frozen=True)
class Piece:
    """A contiguous span of one parameter inside one chunk."""

    param: int  # index into the optimizer's flat parameter list
    param_start: int  # first element within the flattened parameter
    chunk_start: int  # first element within the chunk row
    numel: int

    @property
    def in_chunk(self) -> slice:
        """Its span of the chunk's row: ``row[piece.in_chunk]``."""
        return slice(self.chunk_start, self.chunk_start + self.numel)

    @property
    def in_param(self) -> slice:
        """Its span of the flattened parameter: ``param.reshape(-1)[piece.in_param]``."""
        return slice(self.param_start, self.param_start + self.numel)


@dataclass(frozen=True)
class Chunk:
    key: str
    group: int
    numel: int
    pieces: tuple[Piece, ...]
    fmt: RecordFormat = FULL

    @property
    def nbytes(self) -> int:
        return self.fmt.nbytes(self.numel)

    @property
    def split(self) -> bool:
        """Masters split against bf16 parameters: the weights come and go as bf16 bits."""
        return self.fmt.split

    def views(self, record: torch.Tensor, start: int, numel: int,
              master: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """(master, exp_avg, exp_avg_sq) of elements [start, start + numel) of this chunk's record."""
        return self.fmt.views(record, self.numel, start, numel, master)


def plan_chunks(
    group_numels: list[list[tuple[int, int]]],
    chunk_numel: int,
    fmt_for: Callable[[list[int]], RecordFormat] = lambda params: FULL,
    *,
    align: int = CUT_ALIGN,
) -> list[Chunk]:
    """Cut groups into chunks.

    ``group_numels[g]`` lists ``(param_index, numel)`` for group ``g`` in order. Returns the chunks in
    scan order (group by group, front to back). ``fmt_for(param_indices)`` gives the record format of a
    chunk over those parameters. A parameter is cut only ``align`` elements apart from its start (the
    kernel's work units, ``CUT_ALIGN``): where the room left in a chunk is not a whole number of them, the
    chunk ends that much short and the parameter goes on in the next. Chunks narrower than ``align`` (a tiny
    ``chunk_bytes``, or a group added to an optimizer of tiny records) cut at their own width instead.
    """
    if chunk_numel < 1:
        raise ValueError(f"chunk_numel must be >= 1, got {chunk_numel}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    align = min(align, chunk_numel)
    chunks: list[Chunk] = []
    for g, params in enumerate(group_numels):
        pieces: list[Piece] = []
        fill = count = 0

        def close(g: int = g) -> None:
            nonlocal pieces, fill, count
            if pieces:
                chunks.append(Chunk(f"g{g}.c{count}", g, fill, tuple(pieces), fmt_for([pc.param for pc in pieces])))
                count += 1
            pieces, fill = [], 0

        for index, numel in params:
            start = 0
            while start < numel:
                room = chunk_numel - fill
                take = numel - start if numel - start <= room else room // align * align
                if take == 0:  # under one unit of room left: the parameter goes on in a new chunk
                    close()
                    continue
                pieces.append(Piece(index, start, fill, take))
                fill += take
                start += take
                if fill == chunk_numel or start < numel:  # full, or the parameter was cut
                    close()
        close()
    return chunks


class Layout:
    """How one optimizer's parameters are cut into chunks: ``chunk_bytes`` of state a chunk, in the record
    format each chunk's parameters call for. Deterministic, so a param group added later does not move the
    chunks of earlier ones (``plan`` is called again with every group)."""

    def __init__(self, chunk_bytes: int, moments_dtype: torch.dtype, split_masters: bool, all_bf16: bool):
        self.moments_dtype, self.split_masters = moments_dtype, split_masters
        self.numel = chunk_numel(chunk_bytes, moments_dtype, split_masters and all_bf16)

    def plan(self, groups: list[list[torch.Tensor]]) -> list[Chunk]:
        """The chunks of every group of parameters (flat indices run across groups, in order)."""
        bf16: list[bool] = []
        group_numels = []
        for params in groups:
            group_numels.append([(len(bf16) + i, p.numel()) for i, p in enumerate(params)])
            bf16.extend(p.dtype == torch.bfloat16 for p in params)
        unsplit, split_fmt = _FORMATS[self.moments_dtype]
        split = lambda ps: self.split_masters and all(bf16[i] for i in ps)  # noqa: E731
        fmt_for = lambda ps: split_fmt if split(ps) else unsplit  # noqa: E731
        return plan_chunks(group_numels, self.numel, fmt_for, align=CUT_ALIGN)  # read now, so tests may vary it


# moments_dtype: (the format of other chunks, of chunks whose masters are split). bf16 moments never split.
_FORMATS = {torch.float32: (FULL, SPLIT), torch.bfloat16: (PACKED, PACKED), torch.int8: (INT8, SPLIT_INT8)}


def chunk_numel(chunk_bytes: int, moments_dtype: torch.dtype, split: bool) -> int:
    """Elements of a full chunk of ``chunk_bytes`` of state (whole multiples of ``ROW_ALIGN``). Bytes a
    parameter: 12 (fp32 rows), 8 (bf16 moments), 10 and a bit (split masters); with 8-bit moments, 6 and a bit
    (fp32 masters) or 4 and a bit (split); sizes.py counts them."""
    fmts = _FORMATS[moments_dtype]
    return sizes.chunk_numel((fmts[1] if split else fmts[0]).name, chunk_bytes)


def split_views(record: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(exp_avg, exp_avg_sq, low halves, tie bits) of a ``SPLIT`` chunk's flat byte record (the module doc)."""
    flat = record.view(torch.uint8).view(-1)
    m = flat[: 4 * n].view(torch.float32)
    v = flat[4 * n : 8 * n].view(torch.float32)
    lo = flat[8 * n : 10 * n].view(torch.int16)
    ties = flat[10 * n : 10 * n + tie_bytes(n)]
    return m, v, lo, ties
