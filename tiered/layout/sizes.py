"""The record formats' byte sizes: the one place that counts bytes a parameter, without torch.

``RecordFormat.nbytes`` (chunking.py), ``chunk_numel``, the 8-bit records' sections and ``tiered-bench plan``
(which must start instantly and run where torch is not installed) all read these functions, so the planner's
bytes a parameter are the optimizer's by construction. Formats by name: ``full`` (three fp32 rows), ``packed``
(fp32 master, bf16 moments), ``split`` (fp32 moments, the masters' low halves and tie bits), ``int8`` and
``split-int8`` (8-bit moments and their block scales, beside full or split masters).
"""

from __future__ import annotations

__all__ = ["BLOCK", "FORMATS", "PAGE", "ROW_ALIGN", "chunk_numel", "int8_sections", "num_blocks", "pool",
           "record_bytes", "round_up", "tie_bytes"]  # fmt: skip

FORMATS = ("split", "packed", "full", "int8", "split-int8")
ROW_ALIGN = 1024  # elements: whole multiples keep every row of a chunk 4 KiB-aligned, as O_DIRECT wants
BLOCK = 256  # elements an 8-bit moment's fp32 scale covers: bitsandbytes' block size for 8-bit blockwise states
PAGE = 4096  # io_engine's pool rounds every buffer up to whole pages (x86-64's size)
_RECORD_ALIGN = 4096  # a whole record's I/O stays O_DIRECT
_SECTION_ALIGN = 64  # inside an 8-bit record every section starts on a 64-byte boundary

# Bytes a parameter of a full chunk, for chunk_numel (the 4 KiB padding aside).
_PER_ELEMENT = {
    "full": 12,
    "packed": 8,
    "split": 10 + 1 / 8,
    "int8": 6 + 8 / BLOCK,
    "split-int8": 4 + 1 / 8 + 8 / BLOCK,
}


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def tie_bytes(n: int) -> int:
    """Bytes of a split master's tie bitmap for ``n`` elements (bit i of byte i // 8, least significant first)."""
    return (n + 7) // 8


def num_blocks(n: int) -> int:
    """8-bit moment scales of an n-element row (the last block may be short)."""
    return -(-n // BLOCK)


def int8_sections(split: bool, n: int) -> tuple[dict[str, tuple[int, int]], int]:
    """{section: (byte offset, bytes)} of an 8-bit record of an n-element chunk, and the record's bytes: the
    master (or its low halves and tie bits), exp_avg's and exp_avg_sq's codes, their block scales."""
    b = num_blocks(n)
    masters = [("lo", 2 * n), ("ties", tie_bytes(n))] if split else [("master", 4 * n)]
    out, at = {}, 0
    for name, size in (*masters, ("m", n), ("v", n), ("m_scales", 4 * b), ("v_scales", 4 * b)):
        out[name] = (at, size)
        at = round_up(at + size, _SECTION_ALIGN)
    return out, round_up(at, _RECORD_ALIGN)


def record_bytes(fmt: str, n: int) -> int:
    """Bytes of the store record of an n-element chunk in format ``fmt``."""
    if fmt == "full":
        return 12 * n
    if fmt == "packed":
        return 8 * n
    if fmt == "split":
        return round_up(10 * n + tie_bytes(n), _RECORD_ALIGN)
    if fmt in ("int8", "split-int8"):
        return int8_sections(fmt == "split-int8", n)[1]
    raise ValueError(f"unknown record format {fmt!r}: one of {', '.join(FORMATS)}")


def chunk_numel(fmt: str, chunk_bytes: int) -> int:
    """Elements of a full chunk of ``chunk_bytes`` of state in format ``fmt`` (whole multiples of ``ROW_ALIGN``)."""
    if fmt not in _PER_ELEMENT:
        raise ValueError(f"unknown record format {fmt!r}: one of {', '.join(FORMATS)}")
    return max(ROW_ALIGN, int(chunk_bytes // _PER_ELEMENT[fmt]) // ROW_ALIGN * ROW_ALIGN)


def pool(nbytes: int) -> int:
    """What a pinned buffer takes of host_budget: io_engine's ``pool_bytes([nbytes])``."""
    return max(PAGE, round_up(nbytes, PAGE))
