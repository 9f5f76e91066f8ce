"""8-bit optimizer moments: blockwise dynamic quantization of ``exp_avg`` and ``exp_avg_sq``.

With ``moments_dtype="int8"`` a chunk keeps each moment as one byte a parameter plus one fp32 scale a block of
``BLOCK`` elements, as the 8-bit optimizers of Dettmers et al. (2022, "8-bit Optimizers via Block-wise
Quantization"; bitsandbytes) do. A block's scale is its largest magnitude (absmax), and each element keeps
the code nearest to its value divided by the scale. The codes are "dynamic": per decade (1e-6 ... 1) a
ladder of evenly spaced fractions, finer in the upper decades, so that small values keep their relative
precision over six decades where a linear code would round them to zero.

- ``SIGNED`` (exp_avg, int8): 0, +/- 126 magnitudes whose largest is exactly 1.0, and +/- inf (codes
  -127 ... 127); int8 -128 is NaN. Symmetric, so the int8 order is the value order, NaN aside.
- ``UNSIGNED`` (exp_avg_sq, uint8): 0, 252 ladder values, exactly 1.0 and +inf (codes 0 ... 254); 255 is NaN.
  A positive value never becomes 0 (it takes the smallest positive code at least): a zero ``exp_avg_sq``
  beside a nonzero ``exp_avg`` would make the step ``lr * m / eps``.

Non-finite moments. One gradient of 1e30 makes torch's ``exp_avg_sq`` inf at that element (its square
overflows fp32), so its update is ``m / inf = 0`` and its weight stays finite; a gradient of inf or NaN makes
that one weight NaN. (So on the CPU and with the foreach AdamW; torch's fused CUDA kernel, which the update
runs there, makes the 1e30 element's exp_avg_sq and weight NaN: the codes keep whichever it gives.) A
block's scale is therefore its largest *finite* magnitude, and inf, -inf and NaN keep
codes of their own that decode to themselves: the other elements of the block quantize as if the non-finite
one were not there, and the optimizer leaves exactly the weights torch's AdamW leaves non-finite. Clamping to
the largest finite value instead would turn ``m / inf = 0`` into a huge finite step, and a scale of inf would
decode the block's zeros as ``0 * inf = NaN``, as it once did. What the code cannot keep is a huge finite
element's neighbours: beside an ``exp_avg`` of 1e29 they round to 0, as in any absmax blockwise code.

Rounding: a value takes code k when it lies in (bounds[k - 1], bounds[k]], the bounds being the midpoints
of adjacent codes: nearest, halfway cases going to the smaller code. That is ``torch.bucketize(y, bounds)``,
which the GPU runs. On a CPU, where a binary search over 255 bounds a value is the host update's bottleneck,
``Code.nearest`` gets the same answer two to three times faster from the value's top 16 bits: a table gives
the code of the lower end of the values sharing them, and since no such interval of finite values straddles
two bounds, one comparison with the next bound finishes it.

A block's absmax element divided by the scale is exactly +/-1.0, a code, so ``quantize(dequantize(q)) ==
q``: decoding and encoding again gives back the same codes and scales bit for bit (for values in fp32's normal
range), which makes saving and loading a checkpoint exact. An all-zero block has scale +0.0 and codes 0, and decodes
to +0.0 (a zero moment's sign changes no step, so -0.0 reads back as +0.0); a scale of 0 decodes inf as inf.

``quantize_blockwise``/``dequantize_blockwise`` are vectorised torch ops on any one device, free of host
syncs (the update runs them on CUDA streams); ``quantize_serial``/``dequantize_serial`` are their
element-by-element twins, the tests' oracle.
"""

from __future__ import annotations

import math
import struct
import threading
from typing import NamedTuple

import torch

from . import codec_kernels
from .sizes import BLOCK, num_blocks

__all__ = ["BLOCK", "FMAX", "SIGNED", "UNSIGNED", "Code", "MomentCodes", "decode_moments", "dequantize_blockwise",
           "dequantize_serial", "encode_moments", "num_blocks", "quantize_blockwise", "quantize_serial"]  # fmt: skip

FMAX = torch.finfo(torch.float32).max


def _ladder(per_decade: list[int]) -> list[float]:
    """Magnitudes in (0, 1): decade i (10**(i - 6), i = 0..6) gets ``per_decade[i]`` values, the midpoints
    of that many equal steps from 0.1 to 1 of it (bitsandbytes' ``create_dynamic_map``)."""
    out: list[float] = []
    for i, k in enumerate(per_decade):
        edges = [0.1 + 0.9 * j / k for j in range(k + 1)]
        out += [10.0 ** (i - 6) * (a + b) / 2 for a, b in zip(edges, edges[1:])]
    return out


class Code:
    """A 256-entry code. ``values``: what each code but NaN's decodes to, ascending, inf last (fp32, code
    ``lowest + k`` for ``values[k]``); ``bounds``: the midpoints between them, which ``bucketize`` rounds by
    (the one between 1.0 and inf is FMAX); ``nan_code``: the one byte left, NaN's; ``decode``: 256 values
    indexed by the code's byte (uint8 view), what ``dequantize`` looks up."""

    def __init__(self, name: str, dtype: torch.dtype, magnitudes: list[float], *, signed: bool):
        self.name, self.dtype, self.signed = name, dtype, signed
        mags = torch.tensor(sorted(magnitudes), dtype=torch.float64)
        zero, inf = torch.zeros(1, dtype=torch.float64), torch.full((1,), float("inf"), dtype=torch.float64)
        vals = torch.cat([-inf, -mags.flip(0), zero, mags, inf] if signed else [zero, mags, inf])
        self.values = vals.float()
        if not (self.values.diff() > 0).all() or self.values[-2] != 1.0 or len(self.values) > 255:
            raise AssertionError(f"code {name}: values must rise to 1.0, then inf; 255 at most")  # an internal bug
        self.lowest = -(len(mags) + 1) if signed else 0
        self.nan_code = -128 if signed else 255  # the byte no value takes
        self.nan_index = self.nan_code - self.lowest  # what ``nearest`` gives a NaN
        bounds = ((vals[:-1] + vals[1:]) / 2).float()  # -inf below -1.0: only -inf takes the -inf code
        bounds[-1] = FMAX  # every finite value at most 1.0's code, inf above it
        if not signed:
            bounds[0] = 0.0  # a positive value never becomes 0 (module doc)
        self.bounds = bounds
        decode = torch.full((256,), float("nan"), dtype=torch.float32)
        codes = torch.arange(self.lowest, self.lowest + len(self.values), dtype=torch.int64)
        decode[codes % 256] = self.values  # the code's byte: int8 -1 is byte 255
        if not torch.isnan(decode[self.nan_code % 256]) or int(torch.isnan(decode).sum()) != 1:
            raise AssertionError(f"code {name}: NaN's byte is taken")  # an internal bug
        self.decode = decode
        # ``nearest``'s CPU tables, built on first use: building them runs torch ops over 65,536 elements, which
        # at import would start torch's OpenMP pool, and a process forked after that (multiprocessing's fork,
        # a DataLoader's workers) hangs at its first parallel torch op, as GNU OpenMP does not survive fork.
        self._top_bits: tuple[torch.Tensor, torch.Tensor] | None = None
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(decode, bounds) on ``device``, copied there once (``ChunkUpdater`` does it when it is built, so that
        no step waits for the copy; on the CPU it builds ``nearest``'s tables too)."""
        tables = self._on.get(device)
        if tables is None:
            with self._lock:
                tables = self._on.get(device)
                if tables is None:
                    tables = self._on[device] = (self.decode.to(device), self.bounds.to(device))
        if device.type == "cpu":
            self.by_top_bits()
        return tables

    def by_top_bits(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``nearest``'s CPU tables (``_by_top_bits``): built on the first call, once."""
        tables = self._top_bits
        if tables is None:
            with self._lock:
                tables = self._top_bits
                if tables is None:
                    tables = self._top_bits = _by_top_bits(self.bounds)
        return tables

    def nearest(self, y: torch.Tensor) -> torch.Tensor:
        """``torch.bucketize(y, self.bounds, out_int32=True)``: the count of bounds below each value, int32,
        shaped as ``y``; a NaN gets ``nan_index``. On the CPU by the table of ``_by_top_bits``."""
        if y.device.type != "cpu":
            k = torch.bucketize(y, self.on(y.device)[1], out_int32=True)
        else:
            first, after = self.by_top_bits()
            top = y.view(torch.int32).bitwise_right_shift(16).bitwise_and_(0xFFFF)
            k = torch.index_select(first, 0, top.view(-1)).view_as(y)
            k += torch.index_select(after, 0, k.view(-1)).view_as(y) < y
        return k.masked_fill_(torch.isnan(y), self.nan_index)


def _by_top_bits(bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``Code.nearest``: ``first`` (int32 [65536]): for each value of an fp32's top 16 bits, the code
    (count of bounds below) of the lower end of the values with those bits; ``after``: the bounds, then +inf.
    Checks that the values with any top bits, NaNs aside, span at most two codes."""
    top = torch.arange(1 << 16, dtype=torch.int64) << 16
    as_f32 = lambda b: ((b + 2**31) % 2**32 - 2**31).to(torch.int32).view(torch.float32)  # noqa: E731
    ends = [as_f32(top), as_f32(top | 0xFFFF)]
    ka, kb = (torch.bucketize(e, bounds) for e in ends)
    finite = torch.isfinite(ends[0]) & torch.isfinite(ends[1])
    if (ka - kb).abs()[finite].max() > 1:
        raise AssertionError("a code finer than bf16's spacing: the table needs another comparison")  # internal bug
    return torch.minimum(ka, kb).to(torch.int32), torch.cat([bounds, torch.tensor([float("inf")], dtype=torch.float32)])


# exp_avg: 126 magnitudes, 1 + 2 + ... + 32 in the lower decades, 62 in the top one, and 1.0 itself (the
# top decade gave one step each way to +/- inf).
SIGNED = Code("signed", torch.int8, [*_ladder([1, 2, 4, 8, 16, 32, 62]), 1.0], signed=True)
# exp_avg_sq: 253 magnitudes, 2 + 4 + ... + 64 a decade, 126 in the top one, and 1.0 itself (two steps of
# the top decade went to inf and NaN).
UNSIGNED = Code("unsigned", torch.uint8, [*_ladder([2, 4, 8, 16, 32, 64, 126]), 1.0], signed=False)


def _blocks(x: torch.Tensor) -> list[tuple[torch.Tensor, slice]]:
    """A flat row as (block rows, their scales' slice): the full blocks as one [k, BLOCK] view, then the short
    last block as [1, r]; the same ops then run on both, with no Python loop over blocks."""
    n = x.numel()
    full = n // BLOCK
    parts = []
    if full:
        parts.append((x[: full * BLOCK].view(full, BLOCK), slice(0, full)))
    if n > full * BLOCK:
        parts.append((x[full * BLOCK :].view(1, -1), slice(full, full + 1)))
    return parts


def quantize_blockwise(x: torch.Tensor, code: Code, codes_out: torch.Tensor, scales_out: torch.Tensor, *,
                       clobber: bool = False) -> None:  # fmt: skip
    """Encode fp32 ``x`` [n] into ``codes_out`` ([n], ``code.dtype``) and ``scales_out`` (fp32 [num_blocks(n)]).
    ``clobber``: ``x`` may be overwritten (it then holds the values divided by their scales), which saves a
    temporary row. All on one device, contiguous. On CUDA one Triton kernel (codec_kernels.py), the same bits."""
    if codec_kernels.available(x, codes_out, scales_out):
        codec_kernels.quantize(x, code.on(x.device)[1], code.lowest, code.nan_code, codes_out, scales_out)
        return
    for rows, s in _blocks(x):
        scales = scales_out[s]
        lo, hi = torch.aminmax(rows, dim=1)  # no |x| temporary
        torch.maximum(hi, lo.neg(), out=scales)
        _finite_absmax(rows, scales)
        scales.abs_()  # an all-zero block's max(-0.0, +0.0) may be -0.0: its scale is +0.0 (module doc)
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(1)  # an all-zero block: 0 / 1
        normal = rows.div_(divisor) if clobber else rows / divisor
        k = code.nearest(normal)
        codes_out[s.start * BLOCK : s.start * BLOCK + rows.numel()].view_as(k).copy_(k.add_(code.lowest))


def _finite_absmax(rows: torch.Tensor, scales: torch.Tensor) -> None:
    """Make each block's scale its largest finite magnitude where ``aminmax`` met an inf or a NaN (module doc).
    On the CPU only those blocks are looked at again; on CUDA every block, branch-free, as a look at the
    scales would make the host wait for the stream."""
    if rows.device.type == "cpu":
        bad = torch.isfinite(scales).logical_not_().nonzero().view(-1)
        if bad.numel():
            mags = rows.index_select(0, bad).abs_()
            scales[bad] = mags.masked_fill_(~(mags <= FMAX), 0.0).amax(1)  # NaN <= FMAX is false
        return
    mags = rows.abs()
    finite = mags.masked_fill_(~(mags <= FMAX), 0.0).amax(1)
    scales.copy_(torch.where(torch.isfinite(scales), scales, finite))


def dequantize_blockwise(codes: torch.Tensor, scales: torch.Tensor, code: Code, out: torch.Tensor) -> torch.Tensor:
    """Decode ``codes`` [n] and ``scales`` [num_blocks(n)] into fp32 ``out`` [n] (contiguous); returns ``out``.
    On CUDA one Triton kernel (codec_kernels.py), the same bits."""
    decode, _ = code.on(codes.device)
    if codec_kernels.available(codes, scales, out):
        codec_kernels.dequantize(codes, scales, decode, out)
        return out
    torch.index_select(decode, 0, codes.view(torch.uint8).to(torch.int32), out=out)
    for rows, s in _blocks(out):
        scale = scales[s]
        rows.mul_(torch.where(scale > 0, scale, 1.0).unsqueeze(1))  # scale 0: zeros stay 0, inf stays inf
    return out


class MomentCodes(NamedTuple):
    """A chunk's 8-bit moments, as views of its record: exp_avg's codes (int8) and block scales, then
    exp_avg_sq's (uint8)."""

    m: torch.Tensor
    m_scales: torch.Tensor
    v: torch.Tensor
    v_scales: torch.Tensor


def decode_moments(q: MomentCodes, m_out: torch.Tensor | None = None,
                   v_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(exp_avg, exp_avg_sq) in fp32, into ``m_out``/``v_out`` (new tensors where None)."""
    m_out = torch.empty(q.m.shape, dtype=torch.float32, device=q.m.device) if m_out is None else m_out
    v_out = torch.empty(q.v.shape, dtype=torch.float32, device=q.v.device) if v_out is None else v_out
    return dequantize_blockwise(q.m, q.m_scales, SIGNED, m_out), dequantize_blockwise(q.v, q.v_scales, UNSIGNED, v_out)


def encode_moments(m: torch.Tensor, v: torch.Tensor, q: MomentCodes, *, clobber: bool = False) -> None:
    """fp32 exp_avg ``m`` and exp_avg_sq ``v`` into the codes ``q`` (``clobber``: as ``quantize_blockwise``)."""
    quantize_blockwise(m, SIGNED, q.m, q.m_scales, clobber=clobber)
    quantize_blockwise(v, UNSIGNED, q.v, q.v_scales, clobber=clobber)


# ------------------------------------------------------------------------------------- the serial twins
def _f32(x: float) -> float:
    """``x`` rounded to fp32 (to nearest even), as a Python float."""
    return struct.unpack("f", struct.pack("f", x))[0]


def quantize_serial(x: list[float], code: Code) -> tuple[list[int], list[float]]:
    """``quantize_blockwise`` element by element, in Python floats: (codes, scales). The oracle of the tests.

    Each step is one fp32 operation: a block's max finite magnitude; the value over it (a double quotient of
    two fp32 numbers, rounded once to fp32, is fp32's own quotient); the count of bounds below it."""
    bounds = code.bounds.tolist()
    codes: list[int] = []
    scales: list[float] = []
    for b in range(0, len(x), BLOCK):
        block = x[b : b + BLOCK]
        scale = max((abs(e) for e in block if math.isfinite(e)), default=0.0)
        scales.append(scale)
        for e in block:
            if math.isnan(e):
                codes.append(code.nan_code)
                continue
            y = _f32(e / scale) if scale > 0 and math.isfinite(e) else e
            k = 0
            while k < len(bounds) and bounds[k] < y:
                k += 1
            codes.append(code.lowest + k)
    return codes, scales


def dequantize_serial(codes: list[int], scales: list[float], code: Code) -> list[float]:
    """``dequantize_blockwise`` element by element: each code's value times its block's scale, in fp32 (the
    double product of two fp32 numbers is exact, so rounding it once is fp32's own product)."""
    values = code.values.tolist()
    out = []
    for i, c in enumerate(codes):
        scale = scales[i // BLOCK]
        out.append(math.nan if c == code.nan_code else _f32(values[c - code.lowest] * (scale if scale > 0 else 1.0)))
    return out
