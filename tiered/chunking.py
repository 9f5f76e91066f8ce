"""How parameters map onto state chunks: pure layout arithmetic, no tensors, no I/O.

Each param group's parameters are laid end to end in one flat fp32 space and cut into chunks of at
most ``chunk_numel`` elements. A chunk never spans two groups (so it has one set of hyperparameters),
and a parameter larger than a chunk is split across several. Each chunk is one store record holding
three fp32 rows: master weights, exp_avg, exp_avg_sq. With bf16 moments it holds two: the master
row, and one row whose bytes are exp_avg then exp_avg_sq in bf16 (8 bytes a parameter instead of 12).
A chunk of bf16 parameters may split its masters (``split=True``, see master_split.py): its record is
then flat bytes, exp_avg and exp_avg_sq (fp32) first, then the masters' low halves (int16) and their tie
bits, padded to 4 KiB (10 bytes a parameter and a bit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .master_split import tie_bytes

STATE_ROWS = ("master", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Piece:
    """A contiguous span of one parameter inside one chunk."""

    param: int  # index into the optimizer's flat parameter list
    param_start: int  # first element within the flattened parameter
    chunk_start: int  # first element within the chunk row
    numel: int


@dataclass(frozen=True)
class Chunk:
    key: str
    group: int
    numel: int
    pieces: tuple[Piece, ...]
    record_rows: int = len(STATE_ROWS)  # fp32 rows in the store record (2 when moments are packed bf16)
    split: bool = False  # masters split against bf16 parameters: a flat byte record (see the module doc)

    @property
    def nbytes(self) -> int:
        if self.split:
            return split_record_bytes(self.numel)
        return self.record_rows * self.numel * 4


def split_record_bytes(numel: int) -> int:
    """exp_avg + exp_avg_sq (fp32) + low halves (int16) + tie bits, rounded up to 4 KiB for O_DIRECT."""
    return -(-(10 * numel + tie_bytes(numel)) // 4096) * 4096


def plan_chunks(
    group_numels: list[list[tuple[int, int]]],
    chunk_numel: int,
    record_rows: int = 3,
    split_if: Callable[[list[int]], bool] | None = None,
) -> list[Chunk]:
    """Cut groups into chunks.

    ``group_numels[g]`` lists ``(param_index, numel)`` for group ``g`` in order. Returns the chunks in
    scan order (group by group, front to back). ``split_if(param_indices)`` says whether a chunk over
    those parameters splits its masters.
    """
    if chunk_numel < 1:
        raise ValueError(f"chunk_numel must be >= 1, got {chunk_numel}")
    chunks: list[Chunk] = []
    for g, params in enumerate(group_numels):
        pieces: list[Piece] = []
        fill = count = 0

        def close(g: int = g) -> None:
            nonlocal pieces, fill, count
            if pieces:
                split = bool(split_if and split_if([pc.param for pc in pieces]))
                chunks.append(Chunk(f"g{g}.c{count}", g, fill, tuple(pieces), record_rows, split))
                count += 1
            pieces, fill = [], 0

        for index, numel in params:
            start = 0
            while start < numel:
                take = min(numel - start, chunk_numel - fill)
                pieces.append(Piece(index, start, fill, take))
                fill += take
                start += take
                if fill == chunk_numel:
                    close()
        close()
    return chunks


def split_views(record: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(exp_avg, exp_avg_sq, low halves, tie bits) of a split chunk's flat byte record (the module doc)."""
    flat = record.view(torch.uint8).view(-1)
    m = flat[: 4 * n].view(torch.float32)
    v = flat[4 * n : 8 * n].view(torch.float32)
    lo = flat[8 * n : 10 * n].view(torch.int16)
    ties = flat[10 * n : 10 * n + tie_bytes(n)]
    return m, v, lo, ties


def plan_residency(sizes: list[int], budget: int, in_flight: int) -> tuple[int, int]:
    """How many of the first chunks (``sizes``, host bytes each, in scan order) stay in host memory, and the
    stream reserve that leaves them exactly that room: ``(resident, stream_reserve)``.

    The chunks that stream need room for ``in_flight`` of them at once (read-ahead, update, write-back),
    but never more than there are: with two streamed chunks, two chunks' room is enough, and with none the
    whole budget holds state. The most chunks that fit beside that room stay resident.
    """
    largest = max(sizes, default=0)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    for r in range(len(sizes), -1, -1):
        room = min(in_flight, len(sizes) - r) * largest
        if prefix[r] + room <= budget:
            return r, budget - prefix[r]
    return 0, budget
