"""The Triton kernels of codec_kernels.py against the torch ops they stand in for, bit for bit, on CUDA."""

from __future__ import annotations

import pytest
import torch

from tiered.layout import codec_kernels
from tiered.layout.moments_codec import (
    BLOCK,
    SIGNED,
    UNSIGNED,
    dequantize_blockwise,
    dequantize_serial,
    num_blocks,
    quantize_blockwise,
    quantize_serial,
)

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if codec_kernels.triton is None:
    pytest.fail("torch's CUDA build comes with Triton; without it 8-bit moments take 40 kernels a chunk")

SIZES = [1, 255, 256, 257, 2047, 2048, 2049, 100_003, (1 << 20) + 5]
CODES = pytest.mark.parametrize("code", [SIGNED, UNSIGNED], ids=["signed", "unsigned"])


def values(n: int, seed: int, *, signed: bool) -> torch.Tensor:
    """fp32 over every class: random bits (the whole exponent range, subnormals, NaNs with payloads, infinities),
    moment-like values over twelve decades, the code's bounds times a scale (the rounding's halfway cases), an
    all-zero block, a block of -0.0, one of non-finite values only and one of subnormals only."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32).clone()
    moment = torch.randn(n, generator=g) * 10.0 ** torch.randint(-9, 3, (n,), generator=g).float()
    pick = torch.rand(n, generator=g)
    x = torch.where(pick < 0.6, moment, x)
    code = SIGNED if signed else UNSIGNED
    for b in range(0, n - BLOCK + 1, 7 * BLOCK):  # every seventh block: a bound exactly, scale 1 (its max is 1.0)
        k = torch.randint(0, code.bounds.numel(), (BLOCK,), generator=g)
        x[b : b + BLOCK] = code.bounds[k].clamp(-1.0, 1.0)
        x[b] = 1.0
    if not signed:
        x = x.abs()
    if n >= 4 * BLOCK:
        x[BLOCK : 2 * BLOCK] = 0.0
        x[2 * BLOCK : 3 * BLOCK] = -0.0
        x[3 * BLOCK : 4 * BLOCK] = float("inf")
        x[3 * BLOCK + 1] = float("nan")
    if n >= 6 * BLOCK:  # a block whose largest magnitude is subnormal (a decayed exp_avg_sq): no flush to zero
        tiny = torch.randint(1, 1 << 23, (BLOCK,), generator=g, dtype=torch.int32).view(torch.float32)
        sign = torch.where(torch.rand(BLOCK, generator=g) < 0.5, -1.0, 1.0) if signed else 1.0
        x[5 * BLOCK : 6 * BLOCK] = tiny * sign
    return x.cuda()


def torch_ops(fn, *args):
    """``fn(*args)`` on the torch ops, the kernels' reference."""
    saved = codec_kernels.available
    codec_kernels.available = lambda *ts: False
    try:
        return fn(*args)
    finally:
        codec_kernels.available = saved


def encode(x: torch.Tensor, code) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.full((x.numel(),), 77, dtype=code.dtype, device=x.device)
    s = torch.full((num_blocks(x.numel()),), -1.0, device=x.device)
    quantize_blockwise(x, code, q, s)
    return q, s


def same_floats(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal bits, except that a NaN need only be a NaN."""
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b))
    assert torch.equal(a.view(torch.int32)[~nan], b.view(torch.int32)[~nan])


@CODES
@pytest.mark.parametrize("n", SIZES)
def test_quantize_kernel_matches_the_torch_ops(n: int, code) -> None:
    x = values(n, n, signed=code.signed)
    assert codec_kernels.available(x)
    q, s = encode(x.clone(), code)
    q_ref, s_ref = torch_ops(encode, x.clone(), code)
    assert torch.equal(s.view(torch.int32), s_ref.view(torch.int32))
    assert torch.equal(q, q_ref)


@CODES
@pytest.mark.parametrize("n", SIZES)
def test_dequantize_kernel_matches_the_torch_ops(n: int, code) -> None:
    g = torch.Generator().manual_seed(n)
    q = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).view(code.dtype).cuda()  # every byte, NaN's too
    s = torch.rand(num_blocks(n), generator=g) * 10.0 ** torch.randint(-30, 30, (num_blocks(n),), generator=g)
    s[::5] = 0.0
    s = s.cuda()
    out = dequantize_blockwise(q, s, code, torch.full((n,), 3.0, device="cuda"))
    ref = torch_ops(dequantize_blockwise, q, s, code, torch.empty(n, device="cuda"))
    same_floats(out, ref)


@CODES
def test_the_kernels_match_the_serial_twins(code) -> None:
    x = values(3 * BLOCK + 17, 11, signed=code.signed)
    # The twins keep to fp32's normal range: values over it divided by their scales stay normal.
    x = torch.where(torch.isfinite(x) & ((x.abs() < 1e-12) | (x.abs() > 1e6)), 0.0, x)
    q, s = encode(x, code)
    want_q, want_s = quantize_serial(x.cpu().tolist(), code)
    assert q.cpu().tolist() == want_q
    assert torch.equal(s.cpu(), torch.tensor(want_s, dtype=torch.float32))
    out = dequantize_blockwise(q, s, code, torch.empty(x.numel(), device="cuda"))
    same_floats(out.cpu(), torch.tensor(dequantize_serial(want_q, want_s, code), dtype=torch.float32))


@CODES
def test_decoding_and_encoding_again_gives_the_same_codes(code) -> None:
    x = values(100_003, 3, signed=code.signed)
    x = torch.where(torch.isfinite(x) & (x.abs() < 1e-30), 0.0, x)
    q, s = encode(x, code)
    q2, s2 = encode(dequantize_blockwise(q, s, code, torch.empty(x.numel(), device="cuda")), code)
    assert torch.equal(q, q2) and torch.equal(s, s2)


def test_a_strided_row_takes_the_torch_ops() -> None:
    x = values(4 * BLOCK, 5, signed=True)
    assert not codec_kernels.available(x[::2])
    wide = torch.empty(2 * BLOCK, 2, device="cuda")
    wide[:, 0] = x[: 2 * BLOCK]
    q, s = encode(wide[:, 0], SIGNED)
    q_ref, s_ref = torch_ops(encode, x[: 2 * BLOCK].clone(), SIGNED)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
