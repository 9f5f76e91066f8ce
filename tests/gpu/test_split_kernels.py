"""The Triton kernels of split_kernels.py against the torch ops they stand in for, bit for bit, on CUDA."""

from __future__ import annotations

import pytest
import torch

from tiered.layout import master_split, split_kernels
from tiered.optim.under_backward.aside import grad_fingerprint

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if split_kernels.triton is None:
    pytest.fail("torch's CUDA build comes with Triton; without it split masters run a dozen kernels a chunk")

SIZES = [1, 7, 8, 4095, 4096, 4097, 100_003]


def masters(n: int, seed: int) -> torch.Tensor:
    """fp32 values over the whole exponent range, with ties (low half 0x8000), NaNs, infinities and zeros."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    tie = torch.rand(n, generator=g) < 0.2
    bits[tie] = (bits[tie] & ~0xFFFF) | 0x8000
    special = torch.tensor([0x7FC00000, 0x7F800000, -0x800000, 0, -(2**31)], dtype=torch.int32)
    k = min(n, special.numel())
    bits[:k] = special[:k]
    return bits.view(torch.float32).cuda()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal bits, except that a NaN need only be a NaN (its payload is the rounding's business)."""
    nan = torch.isnan(a.float())
    assert torch.equal(nan, torch.isnan(b.float()))
    ia, ib = (t.view(torch.int16 if t.element_size() == 2 else torch.int32) for t in (a, b))
    assert torch.equal(ia[~nan], ib[~nan])


@pytest.mark.parametrize("n", SIZES)
def test_split_kernel_matches_the_torch_ops(n: int) -> None:
    m = masters(n, n)
    outs = []
    for dense in (True, None):  # None: the kernel
        p = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        lo = torch.empty(n, dtype=torch.int16, device="cuda")
        ties = torch.full((master_split.tie_bytes(n),), 0xA5, dtype=torch.uint8, device="cuda")
        master_split.split(m, p, lo, ties, dense=dense)
        outs.append((p, lo, ties))
    (p1, lo1, t1), (p2, lo2, t2) = outs
    same_bits(p1, p2)
    assert torch.equal(lo1, lo2) and torch.equal(t1, t2)
    assert int(t2.sum()) > 0 or n < 4096  # ties rounded up were packed


@pytest.mark.parametrize("n", SIZES)
def test_join_params_kernel_matches_join_and_the_masters_check(n: int) -> None:
    m = masters(n, n + 1)
    p = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    lo = torch.empty(n, dtype=torch.int16, device="cuda")
    ties = torch.empty(master_split.tie_bytes(n), dtype=torch.uint8, device="cuda")
    master_split.split(m, p, lo, ties, dense=True)
    scratch = torch.empty(n, dtype=torch.int32, device="cuda")
    # Untouched parameters: the exact masters back.
    back = master_split.join_params(p, lo, ties, torch.empty(n, device="cuda"), scratch)
    same_bits(back, m)
    # Parameters written since the split (a step either way on a fifth of them): those masters become the
    # parameters, the others stay, as join followed by torch's where does it.
    g = torch.Generator().manual_seed(n)
    moved = (torch.rand(n, generator=g) < 0.2).cuda()
    p.view(torch.int16)[moved] += 1
    want = master_split.join(p, lo, ties, torch.empty(n, device="cuda"), scratch, dense=True)
    want = torch.where(want.to(torch.bfloat16) == p, want, p.float())
    got = master_split.join_params(p, lo, ties, torch.full((n,), 3.0, device="cuda"), scratch)
    same_bits(got, want)
    assert torch.equal(got[moved & ~torch.isnan(p.float())].to(torch.bfloat16), p[moved & ~torch.isnan(p.float())])


@pytest.mark.parametrize("n", SIZES)
def test_fingerprint_kernel_matches_grad_fingerprint(n: int) -> None:
    row = masters(n, n + 2)
    positions = torch.arange(n, dtype=torch.int32, device="cuda") % split_kernels.WEIGHTS + 1
    assert torch.equal(split_kernels.fingerprint(row), grad_fingerprint(row, positions))
