"""Triton kernels for the split masters' per-chunk bit work on CUDA: one launch where torch needs a dozen.

``update_on="device"`` joins, updates and splits every chunk on the GPU (master_split.py). In torch ops the
join, the masters' check against the parameters and the split take about 25 elementwise kernels a chunk,
each a few microseconds of the GPU but also a few of the host's to queue; over a 1B model's 142 chunks the
host's queueing became the step's limit (bench/RESULTS.md, "Fewer launches a chunk"). Each kernel here does one of those
jobs in one pass, in integer arithmetic, with the same bits as the torch ops (a NaN stays a NaN, its
payload aside), which ``tests/gpu/test_split_kernels.py`` checks against them:

- ``join_params``: masters from the bf16 parameters, the low halves and the tie bits (``join``), each
  replaced by its parameter where it does not round to it (the masters' check, ``ChunkUpdater.sync_masters``).
- ``split``: a master row into its bf16 rounding, low halves and packed tie bits.
- ``fingerprint``: ``device_update.grad_fingerprint`` of a row, or of two in one launch (a chunk's gradients,
  fp32, and its parameters: fp32 values, or a split chunk's bf16 bits).

``available(t)``: whether they run for tensor ``t`` (CUDA, and Triton importable; torch's CUDA builds
bring it). Everything else uses the torch ops, which stay the reference.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds: the torch ops do the work
    triton = None

__all__ = ["available", "fingerprint", "join_params", "split"]

_BLOCK = 4096  # elements a program: a multiple of 8, so each program packs whole tie bytes
WEIGHTS = 1 << 16  # the fingerprint's position weights cycle through 1..WEIGHTS


def available(t: torch.Tensor) -> bool:
    """Whether the kernels run for ``t``: on CUDA with Triton, and under 2**31 elements (the kernels' offsets are
    int32; a longer row, a chunk_bytes of 8 GB and more, takes the torch ops)."""
    return triton is not None and t.is_cuda and t.numel() < 2**31 - _BLOCK


def join_params(p: torch.Tensor, lo: torch.Tensor, ties: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (fp32 [n]) = join(p, lo, ties), where it rounds to p; elsewhere p itself (as fp32)."""
    n = out.numel()
    _join_params[(triton.cdiv(n, _BLOCK),)](p.view(torch.int16), lo, ties, out.view(torch.int32), n, BLOCK=_BLOCK)
    return out


def split(master: torch.Tensor, p_out: torch.Tensor, lo_out: torch.Tensor, ties_out: torch.Tensor) -> None:
    """``master_split.split`` in one pass: p_out = bf16(master), lo_out its low halves, ties_out the tie bits."""
    n = master.numel()
    grid = (triton.cdiv(n, _BLOCK),)
    _split[grid](master.view(torch.int32), p_out.view(torch.int16), lo_out, ties_out, n, ties_out.numel(),
                 BLOCK=_BLOCK)  # fmt: skip


def fingerprint(row: torch.Tensor, other: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [2]: the sum of the row's bits as int32 (an fp32 row's; a 16-bit row's as int16, sign-extended),
    and of those bits times (i % 65536 + 1), the products wrapping in int32. With ``other`` (a row as long,
    of either width), int64 [4]: then its two sums, in the same launch. Each program adds its sums into
    ``out`` (zeros, made here if None) atomically: integer sums, exact in any order."""
    n = row.numel()
    if out is None:
        out = torch.zeros(2 if other is None else 4, dtype=torch.int64, device=row.device)
    two = other is not None
    _fingerprint[(triton.cdiv(n, _BLOCK),)](_bits(row), _bits(other if other is not None else row), out, n, TWO=two,
                                             WEIGHTS=WEIGHTS, BLOCK=_BLOCK)  # fmt: skip
    return out


def _bits(row: torch.Tensor) -> torch.Tensor:
    return row.view(torch.int32 if row.element_size() == 4 else torch.int16)


if triton is not None:

    @triton.jit
    def _bf16(bits):
        """torch's fp32 -> bf16 on CUDA, in integers (exactly, whatever a backend's own conversion does): round
        to nearest, ties to even; a NaN becomes the canonical 0x7FFF. The 16 bits, in an int32."""
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        return tl.where(nan, 0x7FFF, ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF)

    @triton.jit
    def _join_params(p_ptr, lo_ptr, ties_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        r = tl.load(lo_ptr + offs, mask=mask, other=0).to(tl.int32)
        tie = (tl.load(ties_ptr + offs // 8, mask=mask, other=0).to(tl.int32) >> (offs % 8)) & 1
        r = tl.where((r == -0x8000) & (tie == 0), 0x8000, r)  # tie bit clear: r was +0x8000
        bits = (p << 16) + r
        # torch's check, as numbers: the master rounded to bf16 equals the parameter (never for a NaN; +0 == -0).
        rounded = _bf16(bits)
        same = ((rounded == p) | (((rounded | p) & 0x7FFF) == 0)) & ((p & 0x7FFF) <= 0x7F80)
        tl.store(out_ptr + offs, tl.where(same, bits, p << 16), mask=mask)

    @triton.jit
    def _split(m_ptr, p_ptr, lo_ptr, ties_ptr, n, n_bytes, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        bits = tl.load(m_ptr + offs, mask=mask, other=0)
        p = _bf16(bits)
        lo = bits & 0xFFFF
        tl.store(p_ptr + offs, p.to(tl.int16), mask=mask)
        tl.store(lo_ptr + offs, lo.to(tl.int16), mask=mask)
        # A tie where rounding went up: p's bits are the master's high half plus one (16 bits, wrapping).
        up = (lo == 0x8000) & (((p - ((bits >> 16) & 0xFFFF)) & 0xFFFF) == 1)
        shifted = tl.reshape(up.to(tl.int32), (BLOCK // 8, 8)) << tl.arange(0, 8)[None, :]
        packed = tl.sum(shifted, axis=1)  # distinct bits: the sum is their OR
        boffs = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        tl.store(ties_ptr + boffs, packed.to(tl.uint8), mask=boffs < n_bytes)

    @triton.jit
    def _sums(ptr, offs, n, WEIGHTS: tl.constexpr):
        bits = tl.load(ptr + offs, mask=offs < n, other=0).to(tl.int32)  # int16 bits: sign-extended
        weighted = bits * (offs % WEIGHTS + 1)  # int32, wrapping as torch's int32 product does
        return tl.sum(bits.to(tl.int64), axis=0), tl.sum(weighted.to(tl.int64), axis=0)

    @triton.jit
    def _fingerprint(g_ptr, h_ptr, out_ptr, n, TWO: tl.constexpr, WEIGHTS: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        s0, s1 = _sums(g_ptr, offs, n, WEIGHTS)
        tl.atomic_add(out_ptr, s0)
        tl.atomic_add(out_ptr + 1, s1)
        if TWO:
            s2, s3 = _sums(h_ptr, offs, n, WEIGHTS)
            tl.atomic_add(out_ptr + 2, s2)
            tl.atomic_add(out_ptr + 3, s3)
