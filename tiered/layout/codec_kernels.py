"""Triton kernels for the 8-bit moments' codes on CUDA: one pass where the torch ops take a dozen and more.

With ``moments_dtype="int8"`` every chunk's update decodes both moments into fp32 rows and encodes them again
(moments_codec.py). In torch ops the encoding takes about 18 elementwise kernels a moment (the blocks' largest
finite magnitude, the division, the code search, the NaN codes), each a whole pass over the chunk's fp32 row in
HBM, and the decoding four; on the 4.42B under 24 GB they made each 64 MiB record's update take 4.6 ms against
the link's 2.2 for fp32 moments (bench/RESULTS.md, thirty-ninth and fortieth sessions). Each kernel here reads
its input once and writes its output once, with the same bits as the torch ops, which
``tests/gpu/test_codec_kernels.py`` checks against them (and they against the serial twins):

- ``quantize``: an fp32 row into codes and block scales. A block's scale is its largest finite magnitude; each
  value is divided by it (IEEE division, ``div_rn``, as torch's) and takes the count of the code's bounds
  below it (torch.bucketize's answer, found by an eight-step binary search over the bounds); a NaN takes the
  NaN code.
- ``dequantize``: codes and block scales into an fp32 row: the code's value times its block's scale (1 where
  the scale is 0), one IEEE product, as torch's.

``available(*tensors)``: whether they run for those (contiguous, on CUDA, and Triton importable; torch's CUDA
builds bring it).
Everything else uses the torch ops, which stay the reference.
"""

from __future__ import annotations

import torch

from .sizes import BLOCK

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds: the torch ops do the work
    triton = None

__all__ = ["available", "dequantize", "quantize"]

_ROWS = 8  # blocks a program: 2,048 elements
_FMAX = torch.finfo(torch.float32).max
_MAX_NUMEL = 2**31 - _ROWS * BLOCK  # the last program's offsets stay within int32


def available(*ts: torch.Tensor) -> bool:
    """Whether the kernels can take these tensors: Triton is here, and each is on a GPU, contiguous (the kernels
    index flat memory) and under 2**31 elements (their offsets are int32; a longer row, a chunk_bytes of 9 GB
    and more, takes the torch ops)."""
    return triton is not None and all(t.is_cuda and t.is_contiguous() and t.numel() < _MAX_NUMEL for t in ts)


def quantize(x: torch.Tensor, bounds: torch.Tensor, lowest: int, nan_code: int, codes_out: torch.Tensor,
             scales_out: torch.Tensor) -> None:  # fmt: skip
    """``moments_codec.quantize_blockwise`` of fp32 ``x`` [n] with a code's ``bounds`` (fp32, ascending, on x's
    device), its ``lowest`` code and its ``nan_code``, into ``codes_out`` [n] (int8 or uint8) and ``scales_out``
    (fp32, one a block). All contiguous, on one GPU."""
    n = x.numel()
    blocks = -(-n // BLOCK)
    if n == 0:
        return
    if bounds.numel() >= 256:
        raise AssertionError("the code search takes 255 bounds at most")  # an internal bug: codes are bytes
    _quantize[(triton.cdiv(blocks, _ROWS),)](x, codes_out, scales_out, bounds, n, blocks, bounds.numel(),
                                            LOWEST=lowest, NAN_CODE=nan_code, FMAX=_FMAX, ROWS=_ROWS,
                                            BLOCK=BLOCK)  # fmt: skip


def dequantize(codes: torch.Tensor, scales: torch.Tensor, decode: torch.Tensor, out: torch.Tensor) -> None:
    """``moments_codec.dequantize_blockwise``: ``out`` (fp32 [n]) = ``decode`` (fp32 [256], indexed by the code's
    byte) times the block's scale (1 where it is 0). All contiguous, on one GPU."""
    n = out.numel()
    if n == 0:
        return
    blocks = -(-n // BLOCK)
    _dequantize[(triton.cdiv(blocks, _ROWS),)](codes.view(torch.uint8), scales, decode, out, n, ROWS=_ROWS,
                                              BLOCK=BLOCK)  # fmt: skip


if triton is not None:

    @triton.jit
    def _quantize(x_ptr, codes_ptr, scales_ptr, bounds_ptr, n, n_blocks, n_bounds, LOWEST: tl.constexpr,
                  NAN_CODE: tl.constexpr, FMAX: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        mags = tl.abs(x)
        # The largest finite magnitude (NaN <= FMAX is false); +0.0 for a block of zeros and non-finite values.
        scale = tl.max(tl.where(mags <= FMAX, mags, 0.0), axis=1)
        tl.store(scales_ptr + rows, scale, mask=rows < n_blocks)
        y = tl.div_rn(x, tl.where(scale > 0, scale, 1.0)[:, None])
        # How many bounds lie below y: bit by bit from the top, a step taken while the bound before it is below.
        pos = tl.zeros([ROWS, BLOCK], dtype=tl.int32)
        for i in tl.static_range(8):
            nxt = pos + (128 >> i)
            inside = nxt <= n_bounds
            b = tl.load(bounds_ptr + nxt - 1, mask=mask & inside, other=float("inf"))
            pos = tl.where(inside & (b < y), nxt, pos)
        code = tl.where(y != y, NAN_CODE, pos + LOWEST)  # y != y: a NaN, which no comparison took
        tl.store(codes_ptr + offs, code.to(codes_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _dequantize(codes_ptr, scales_ptr, decode_ptr, out_ptr, n, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        mask = offs < n
        byte = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
        value = tl.load(decode_ptr + byte, mask=mask, other=0.0)
        scale = tl.load(scales_ptr + rows, mask=rows * BLOCK < n, other=1.0)
        tl.store(out_ptr + offs, value * tl.where(scale > 0, scale, 1.0)[:, None], mask=mask)
