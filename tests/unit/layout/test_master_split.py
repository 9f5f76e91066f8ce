"""Split fp32 masters (tiered/layout/master_split.py): bf16 high half in the parameter, low half and a tie bit
in the state. Joining must give back every master bit for bit, with the vectorised code checked against
its element-by-element twin. Both ways of handling the tie bits run here on the CPU: by index (the CPU's)
and dense (the GPU's, which must never make the host wait)."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tiered.layout.master_split import TIE, join, join_reference, split, split_reference, tie_bytes


def from_bits(bits: list[int]) -> torch.Tensor:
    """fp32 tensor with exactly these bit patterns (unsigned 32-bit ints)."""
    return torch.tensor([(b + 2**31) % 2**32 - 2**31 for b in bits], dtype=torch.int32).view(torch.float32)


DENSE = pytest.mark.parametrize("dense", [False, True], ids=["by-index", "dense"])


def run_split(master: torch.Tensor, dense: bool = False):
    n = master.numel()
    p = torch.empty(n, dtype=torch.bfloat16)
    lo = torch.empty(n, dtype=torch.int16)
    ties = torch.full((tie_bytes(n),), 0xFF, dtype=torch.uint8)  # split must clear stale bits
    split(master, p, lo, ties, dense=dense)
    return p, lo, ties


def joined(p, lo, ties, dense: bool = False) -> torch.Tensor:
    n = p.numel()
    return join(p, lo, ties, torch.empty(n), torch.empty(n, dtype=torch.int32), dense=dense)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), "a NaN master must join to a NaN, and only a NaN"
    assert torch.equal(got.view(torch.int32)[~nan], want.view(torch.int32)[~nan])


# Bit patterns where rounding to bf16 is delicate: both kinds of tie, both signs, zeros, subnormals,
# the largest finite values (whose rounding overflows to inf), infinities.
EDGES = [
    0x00000000, 0x80000000, 0x00008000, 0x80008000, 0x00018000, 0x80018000, 0x3F808000, 0x3F818000,
    0x3F80FFFF, 0x3F807FFF, 0x3F808001, 0x00000001, 0x807FFFFF, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF,
    0xFF7F8000, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7F7F0000, 0x3F800000, 0xBF808000,
]  # fmt: skip


@DENSE
def test_edge_patterns_join_back_bit_for_bit_and_the_parameter_is_torchs_rounding(dense):
    master = from_bits(EDGES)
    p, lo, ties = run_split(master, dense)
    assert torch.equal(p.view(torch.int16), master.to(torch.bfloat16).view(torch.int16))
    assert_same_bits(joined(p, lo, ties, dense), master)


@DENSE
def test_ties_rounding_up_and_down_are_told_apart(dense):
    # 0x3F808000 rounds down to even 0x3F80 (r = +0x8000); 0x3F818000 rounds up to 0x3F82 (r = -0x8000).
    master = from_bits([0x3F808000, 0x3F818000])
    p, lo, ties = run_split(master, dense)
    assert lo.tolist() == [TIE, TIE]
    assert ties[0].item() == 0b10, "only the tie that rounded up carries the bit"
    assert_same_bits(joined(p, lo, ties, dense), master)


@DENSE
def test_nan_joins_to_nan(dense):
    master = torch.tensor([float("nan"), -float("nan"), 1.0])
    p, lo, ties = run_split(master, dense)
    got = joined(p, lo, ties, dense)
    assert torch.isnan(got[:2]).all() and got[2].item() == 1.0


@pytest.mark.parametrize("n", [1, 7, 8, 9, 4095, 4096, 4097, 3 * 4096 + 5, 100_003])
@DENSE
def test_every_size_with_many_ties_round_trips(n, dense):
    g = torch.Generator().manual_seed(n)
    master = torch.randn(n, generator=g) * 10
    bits = master.view(torch.int32)
    third = torch.arange(n) % 3 == 0
    bits[third] = (bits[third] & ~0xFFFF) | 0x8000  # a third of the elements are exact ties
    p, lo, ties = run_split(master, dense)
    assert_same_bits(joined(p, lo, ties, dense), master)
    assert torch.equal(p, master.to(torch.bfloat16))


@DENSE
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300), st.integers(0, 2))
@example(bits=[0x7F808000, 0xFF808000, 0x7FFF8000, 0x7F7F8000, 0xFF7F8000], tie_every=0)  # tie-shaped NaNs; ties to inf
def test_vectorised_code_matches_its_serial_twin(dense, bits, tie_every):
    if tie_every:  # force ties on a share of the elements
        bits = [(b & ~0xFFFF) | 0x8000 if i % (tie_every + 1) == 0 else b for i, b in enumerate(bits)]
    master = from_bits(bits)
    p, lo, ties = run_split(master, dense)
    p_ref, lo_ref, ties_ref = split_reference(master)
    assert torch.equal(p.view(torch.int16), p_ref.view(torch.int16))
    assert lo.tolist() == lo_ref
    set_bits = [i for i in range(len(bits)) if ties[i // 8].item() >> (i % 8) & 1]
    assert set_bits == ties_ref
    assert_same_bits(joined(p, lo, ties, dense), master)
    assert_same_bits(join_reference(p_ref, lo_ref, ties_ref), master)


@DENSE
def test_a_master_that_is_already_bf16_splits_to_nothing(dense):
    """Why a fresh optimizer's split record is all zeros: a bf16 weight is its own master."""
    w = torch.randn(1000).to(torch.bfloat16)
    p, lo, ties = run_split(w.float(), dense)
    assert torch.equal(p, w) and not lo.any() and not ties.any()


def test_tie_constant_is_int16_min():
    # _tie_positions finds ties with a min reduction: that only works if TIE is the smallest int16.
    assert TIE == torch.iinfo(torch.int16).min
    assert struct.pack("<h", TIE) == b"\x00\x80"


@pytest.mark.parametrize("n", [1, 9, 4096, 100_003])
def test_both_ways_write_the_same_bytes_and_read_each_other(n):
    g = torch.Generator().manual_seed(n)
    master = torch.randn(n, generator=g)
    bits = master.view(torch.int32)
    half = torch.arange(n) % 2 == 0
    bits[half] = (bits[half] & ~0xFFFF) | 0x8000
    by_index, dense = run_split(master, dense=False), run_split(master, dense=True)
    for a, b in zip(by_index, dense):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert_same_bits(joined(*by_index, dense=True), master)
    assert_same_bits(joined(*dense, dense=False), master)


@pytest.mark.parametrize("moments", [torch.float32, "int8"], ids=["fp32", "int8"])
def test_split_chunks_first_records_are_the_packed_parameters(tmp_path, moments):
    """write_initial_state packs one blank record per size for split chunks: it must equal, byte for byte,
    the record packed from the chunk's own parameters (masters exactly the bf16 values, moments zero)."""
    from tiered import TieredOptimizer

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 40)).to(torch.bfloat16)
    with TieredOptimizer(m, nvme_path=tmp_path, update_on="device", chunk_bytes="24KiB", moments_dtype=moments,
                         host_budget="1MiB") as opt:  # fmt: skip
        assert len({c.numel for c in opt.chunks}) > 1 and all(c.split for c in opt.chunks)
        for c in opt.chunks:
            rows = torch.zeros(3, c.numel)
            opt._strategy.gather_params(c, rows[0])
            assert rows[0].abs().sum() > 0
            assert torch.equal(opt.store.get(c.key).view(torch.uint8), c.fmt.pack(rows).view(torch.uint8)), c.key


@pytest.mark.parametrize("moments", [torch.float32, "int8"], ids=["fp32", "int8"])
def test_split_chunks_first_records_on_nvme_are_allocated_not_written(tmp_path, monkeypatch, moments):
    """A split chunk's first record is all zero bytes (the masters' low halves and the moments), so where the
    store places it on NVMe its file is allocated, not written (TieredStore.put(..., zeros=True)): nothing is
    written to build the optimizer, and two steps from there are bitwise those of the same run whose first
    records were written."""
    from tiered import TieredOptimizer
    from tiered.store import TieredStore

    def run(folder) -> tuple[dict, list[torch.Tensor]]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(256, 384), torch.nn.Linear(384, 160)).to(torch.bfloat16)
        with TieredOptimizer(m, nvme_path=folder, update_on="device", chunk_bytes="64KiB", moments_dtype=moments,
                             host_budget="256KiB") as opt:  # fmt: skip
            built = opt.store.stats()["nvme"]
            assert sum(opt.store.info(c.key).tier == "nvme" for c in opt.chunks) > 1
            for step in range(2):
                x = torch.randn(8, 256, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
                m(x).float().square().mean().backward()
                opt.step()
                opt.zero_grad()
        return built, [p.detach().clone() for p in m.parameters()]

    allocated, ours = run(tmp_path / "allocated")
    put = TieredStore.put
    monkeypatch.setattr(TieredStore, "put", lambda self, key, t, **kw: put(self, key, t, **{**kw, "zeros": False}))
    written, theirs = run(tmp_path / "written")
    assert allocated["bytes_written"] == 0 < written["bytes_written"]
    for a, b in zip(ours, theirs):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
