"""The record formats' sizes for `tiered-bench plan`: tiered.layout.chunking's arithmetic without torch.

tiered/layout/chunking.py defines the formats on tensors (it imports torch); the planner must start instantly and
run where torch is not installed, so the byte counts are restated here, and tests/tools/test_plan.py checks every
one against ``chunking.Layout`` and ``RecordFormat.nbytes`` for each format and several chunk sizes.
"""

from __future__ import annotations

__all__ = [
    "BLOCK",
    "FORMATS",
    "GiB",
    "KiB",
    "MiB",
    "PAGE",
    "ROW_ALIGN",
    "chunk_numel",
    "record_bytes",
    "round_up",
    "pool",
]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PAGE = 4096  # io_engine's pool rounds every buffer up to whole pages (x86-64's size)
ROW_ALIGN = 1024  # tiered.layout.chunking.ROW_ALIGN: a chunk holds a multiple of this many elements

# Record formats (tiered.layout.chunking): the state bytes of a chunk of n parameters.
FORMATS = ("split", "packed", "full", "int8", "split-int8")
BLOCK = 256  # tiered.layout.moments_codec.BLOCK: elements an 8-bit moment's fp32 scale covers


def record_bytes(fmt: str, n: int) -> int:
    """Bytes of the store record of an n-element chunk: ``RecordFormat.nbytes`` of tiered.layout.chunking."""
    if fmt == "full":  # master, exp_avg, exp_avg_sq in fp32
        return 12 * n
    if fmt == "packed":  # fp32 master, bf16 exp_avg and exp_avg_sq
        return 8 * n
    if fmt == "split":  # fp32 moments, the masters' low halves (int16) and tie bits, padded to 4 KiB
        return round_up(10 * n + (n + 7) // 8, 4096)
    if fmt in ("int8", "split-int8"):  # master (or low halves and tie bits), 8-bit moments and their scales
        masters = [2 * n, (n + 7) // 8] if fmt == "split-int8" else [4 * n]
        at = 0
        for size in (*masters, n, n, 4 * -(-n // BLOCK), 4 * -(-n // BLOCK)):  # each section 64-byte aligned
            at = round_up(at + size, 64)
        return round_up(at, 4096)
    raise ValueError(f"unknown record format {fmt!r}: one of {', '.join(FORMATS)}")


def chunk_numel(fmt: str, chunk_bytes: int) -> int:
    """Elements of a full chunk: ``Layout(chunk_bytes, ...).numel`` of tiered.layout.chunking."""
    scales = 8 / BLOCK  # two fp32 scales a block of 8-bit moments
    per_elem = {"split": 10 + 1 / 8, "full": 12, "packed": 8, "int8": 6 + scales, "split-int8": 4 + 1 / 8 + scales}
    return max(ROW_ALIGN, int(chunk_bytes // per_elem[fmt]) // ROW_ALIGN * ROW_ALIGN)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pool(nbytes: int) -> int:
    """What a buffer takes of host_budget: io_engine's ``pool_bytes([nbytes])``."""
    return max(PAGE, round_up(nbytes, PAGE))
