"""8-bit moments (``moments_dtype="int8"``): the codec against its serial twin, its round trip and error bounds,
the record formats, and the optimizer with them: AdamW with its moments encoded after every step, bit for bit;
split and fp32 masters alike; on NVMe; through checkpoints and state dicts."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from tiered import TieredOptimizer
from tiered.layout.chunking import INT8, SPLIT, SPLIT_INT8, Layout, split_views
from tiered.layout.master_split import join
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

SIZES = [1, 5, 255, 256, 257, 700, 1024]


def spread(n: int, *, signed: bool, seed: int = 0) -> torch.Tensor:
    """Values over twelve decades, as moments are (exp_avg_sq: squares), with a zero block and exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-9, 3, (n,), generator=g).float()
    x = x if signed else x.square()
    x[::17] = 0.0
    if n > 2 * BLOCK:
        x[BLOCK : 2 * BLOCK] = 0.0  # an all-zero block
    return x


def encode(x: torch.Tensor, code) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty(x.numel(), dtype=code.dtype)
    s = torch.empty(num_blocks(x.numel()))
    quantize_blockwise(x, code, q, s)
    return q, s


def decode(q: torch.Tensor, s: torch.Tensor, code) -> torch.Tensor:
    return dequantize_blockwise(q, s, code, torch.empty(q.numel()))


# ----------------------------------------------------------------------------------------------- the codes
def test_the_codes_are_dynamic_and_reach_one():
    s, u = SIGNED.values, UNSIGNED.values
    inf = float("inf")
    assert len(s) == 255 and torch.equal(s, -s.flip(0)) and s[0] == -inf and s[1] == -1.0 and s[127] == 0.0
    assert s[-2] == 1.0 and s[-1] == inf
    assert len(u) == 255 and u[0] == 0.0 and u[-2] == 1.0 and u[-1] == inf and bool((u.diff() > 0).all())
    for values in (s[128:-1], u[1:-1]):  # every decade from 1e-6 to 1 has codes, finer towards 1
        decades = torch.floor(torch.log10(values)).long().clamp(max=-1)
        assert set(decades.tolist()) == set(range(-7, 0)) or set(decades.tolist()) == set(range(-6, 0))
        top = values[values >= 0.1]
        assert float((top.diff() / top[:-1]).max()) < 0.16  # relative steps of at most 16 % in the top decade
    assert torch.isnan(SIGNED.decode[128]) and torch.isnan(UNSIGNED.decode[255])  # NaN's own byte each
    assert int(torch.isnan(SIGNED.decode).sum()) == int(torch.isnan(UNSIGNED.decode).sum()) == 1


# ----------------------------------------------------------------------------------------------- the codec
@pytest.mark.parametrize("code", [SIGNED, UNSIGNED], ids=["signed", "unsigned"])
def test_nearest_is_bucketize_for_every_fp32_class(code):
    """The table lookup by top bits gives torch.bucketize's codes (a NaN: NaN's own code): random bit patterns
    (every exponent, both signs, NaNs, infinities, subnormals), every top-16-bit value at both ends, the bounds
    themselves and their neighbours."""
    g = torch.Generator().manual_seed(3)
    bits = torch.randint(-(2**31), 2**31, (1 << 20,), generator=g, dtype=torch.int64)
    top = torch.arange(1 << 16, dtype=torch.int64) << 16
    bounds = code.bounds.view(torch.int32).long()
    every = torch.cat([bits, top, top | 0xFFFF, bounds, bounds + 1, bounds - 1])
    y = ((every + 2**31) % 2**32 - 2**31).to(torch.int32).view(torch.float32)
    y = torch.cat([y, torch.rand(1 << 16, generator=g) * 2 - 1, torch.tensor([0.0, -0.0, 1.0, -1.0])])
    want = torch.bucketize(y, code.bounds, out_int32=True).masked_fill_(torch.isnan(y), code.nan_index)
    assert torch.equal(code.nearest(y), want)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("code", [SIGNED, UNSIGNED], ids=["signed", "unsigned"])
def test_codec_matches_its_serial_twin(n, code):
    x = spread(n, signed=code.signed, seed=n)
    q, s = encode(x, code)
    want_q, want_s = quantize_serial(x.tolist(), code)
    assert q.tolist() == want_q and s.tolist() == want_s
    assert decode(q, s, code).tolist() == dequantize_serial(want_q, want_s, code)
    # clobbering the input gives the same codes
    q2, s2 = torch.empty_like(q), torch.empty_like(s)
    quantize_blockwise(x.clone(), code, q2, s2, clobber=True)
    assert torch.equal(q, q2) and torch.equal(s, s2)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("code", [SIGNED, UNSIGNED], ids=["signed", "unsigned"])
def test_decoding_and_encoding_again_is_exact(n, code):
    q, s = encode(spread(n, signed=code.signed, seed=n + 1), code)
    y = decode(q, s, code)
    q2, s2 = encode(y, code)
    assert torch.equal(q, q2) and torch.equal(s, s2)
    assert torch.equal(decode(q2, s2, code).view(torch.int32), y.view(torch.int32))


@pytest.mark.parametrize("code", [SIGNED, UNSIGNED], ids=["signed", "unsigned"])
def test_each_blocks_absmax_is_exact_and_zero_blocks_stay_zero(code):
    x = spread(1000, signed=code.signed)
    q, s = encode(x, code)
    top = code.lowest + len(code.values) - 2  # 1.0's code: inf's is above it
    for b in range(num_blocks(1000)):
        block = x[b * BLOCK : (b + 1) * BLOCK]
        assert s[b] == block.abs().max()
        if s[b] == 0:
            assert (q[b * BLOCK : (b + 1) * BLOCK] == 0).all()
            continue
        i = int(block.abs().argmax())
        assert int(q[b * BLOCK + i]) == (top if block[i] > 0 else -top)
        assert decode(q, s, code)[b * BLOCK + i] == block[i]  # exactly
    assert (decode(q, s, code)[x == 0] == 0).all()


def test_exp_avg_sq_error_is_within_the_code_spacing():
    """Each value takes the nearest code; so the relative error of a nonzero exp_avg_sq element is at most the
    relative gap between the two codes around it. Below the smallest positive code a value takes that code,
    never 0 (a zero exp_avg_sq under a nonzero exp_avg would divide by eps)."""
    x = spread(4096, signed=False, seed=3)
    q, s = encode(x, UNSIGNED)
    y = decode(q, s, UNSIGNED)
    scale = s.repeat_interleave(BLOCK)[: x.numel()].double()
    v = UNSIGNED.values.double()
    norm = x.double() / torch.where(scale > 0, scale, 1)
    k = torch.searchsorted(v, norm).clamp(1, len(v) - 1)  # v[k - 1] < norm <= v[k]
    lo, hi = v[k - 1], v[k]
    above = (x > 0) & (norm >= v[1])
    rel = ((y.double() - x.double()).abs() / x.double())[above]
    assert bool((rel <= ((hi - lo) / lo)[above] * (1 + 1e-6)).all())
    err, nearest = (y.double() - x.double()).abs(), torch.minimum(norm - lo, hi - norm) * scale
    assert bool((err <= nearest + 1e-6 * x.double())[above].all())  # the nearest code, to fp32's rounding
    tiny = (x > 0) & (norm < v[1])
    assert tiny.any() and (q[tiny] == 1).all()
    assert (q[x == 0] == 0).all()


def test_exp_avg_error_is_within_the_code_spacing():
    x = spread(4096, signed=True, seed=4)
    q, s = encode(x, SIGNED)
    y = decode(q, s, SIGNED)
    scale = s.repeat_interleave(BLOCK)[: x.numel()].double()
    mags = SIGNED.values[127:].double()  # 0 and the positive magnitudes
    norm = (x.double() / torch.where(scale > 0, scale, 1)).abs()
    k = torch.searchsorted(mags, norm).clamp(1, len(mags) - 1)
    gap = (mags[k] - mags[k - 1]) * scale
    assert bool(((y.double() - x.double()).abs() <= gap / 2 * (1 + 1e-6)).all())
    assert bool((torch.sign(y) * torch.sign(x) >= 0).all())  # never the wrong sign


# --------------------------------------------------------------------- huge and non-finite moments, zeros
def test_non_finite_elements_keep_their_values_and_spare_their_block():
    """An inf or NaN moment decodes as itself, and its block's other elements as if it were not there: the
    scale is the block's largest finite magnitude, which stays exact."""
    inf, nan = float("inf"), float("nan")
    for code, specials in ((SIGNED, [inf, -inf, nan]), (UNSIGNED, [inf, nan])):
        x = spread(3 * BLOCK, signed=code.signed, seed=7)
        clean = x.clone()
        for i, e in enumerate(specials):
            x[5 + 40 * i] = e
            clean[5 + 40 * i] = 0.0
        x[BLOCK : 2 * BLOCK] = 0.0  # a block of zeros and one inf: its scale is 0, the inf still decodes as inf
        x[BLOCK + 3] = inf
        clean[BLOCK : 2 * BLOCK] = 0.0
        q, s = encode(x, code)
        y = decode(q, s, code)
        want = decode(*encode(clean, code), code)
        special = ~torch.isfinite(x)
        assert torch.equal(s, encode(clean, code)[1])  # the finite absmax: other elements keep their codes
        assert torch.equal(y[~special], want[~special])
        torch.testing.assert_close(y[special], x[special], rtol=0, atol=0, equal_nan=True)
        q2, s2 = encode(y, code)  # decoding and encoding again is exact with them too
        assert torch.equal(q2, q) and torch.equal(s2, s)
        want_q, want_s = quantize_serial(x.tolist(), code)  # the serial twin agrees
        assert q.tolist() == want_q and s.tolist() == want_s
        torch.testing.assert_close(
            torch.tensor(dequantize_serial(want_q, want_s, code)), y, rtol=0, atol=0, equal_nan=True
        )


@pytest.mark.parametrize("code", [SIGNED, UNSIGNED], ids=["signed", "unsigned"])
@pytest.mark.parametrize("zero", [0.0, -0.0], ids=["plus", "minus"])
def test_an_all_zero_block_has_scale_plus_zero_and_round_trips_bit_for_bit(code, zero):
    x = torch.full((BLOCK + 7,), zero)
    q, s = encode(x, code)
    assert s.view(torch.int32).tolist() == [0, 0]  # +0.0, not -0.0
    assert quantize_serial(x.tolist(), code)[1] == [0.0, 0.0] and not any(
        str(v).startswith("-") for v in quantize_serial(x.tolist(), code)[1]
    )
    y = decode(q, s, code)
    assert (y.view(torch.int32) == 0).all()  # +0.0 each: no sign bit set by the scale
    q2, s2 = encode(y, code)
    assert torch.equal(q2, q) and torch.equal(s2.view(torch.int32), s.view(torch.int32))


@pytest.mark.parametrize("big", [1e30, -1e30, 3e38, float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("update_on", ["host", "device"])
def test_one_huge_gradient_leaves_as_many_non_finite_weights_as_adamw(tmp_path, big, update_on):
    """One gradient element of 1e30 makes torch's exp_avg_sq inf there and its update 0 (no NaN weight); inf or
    NaN makes that one weight NaN. With 8-bit moments the same weights, and only those, are non-finite, and the
    rest is AdamW with its moments encoded after each step, bit for bit, through the following steps."""
    torch.manual_seed(0)
    ref = [nn.Parameter(torch.randn(4 * BLOCK + 30)), nn.Parameter(torch.randn(300))]
    params = [nn.Parameter(p.detach().clone()) for p in ref]
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    g = torch.Generator().manual_seed(2)
    with TieredOptimizer(params, tmp_path, lr=1e-2, moments_dtype="int8", update_on=update_on) as opt:
        for i in range(4):
            grads = [torch.randn(p.shape, generator=g) for p in ref]
            if i == 1:
                grads[0][BLOCK + 17] = big
            for ps in (ref, params):
                for p, gr in zip(ps, grads):
                    p.grad = gr.clone()
            torch_opt.step()
            opt.step()
            encode_like_the_chunks(opt, torch_opt, ref)
            for a, b in zip(ref, params):
                assert torch.equal(torch.isfinite(a), torch.isfinite(b))
                torch.testing.assert_close(b.detach(), a.detach(), rtol=0, atol=0, equal_nan=True)
        bad = sum(int((~torch.isfinite(p)).sum()) for p in params)
        assert bad == (0 if abs(big) < float("inf") else 1)


# ------------------------------------------------------------------------------------------ record formats
@pytest.mark.parametrize("fmt", [INT8, SPLIT_INT8], ids=lambda f: f.name)
@pytest.mark.parametrize("n", [1, 300, 1024, 5000])
def test_records_hold_the_rows_they_were_packed_from(fmt, n):
    g = torch.Generator().manual_seed(n)
    rows = torch.stack([torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-3,
                        torch.rand(n, generator=g) * 1e-6])  # fmt: skip
    record = fmt.pack(rows)
    assert record.numel() * record.element_size() == fmt.nbytes(n) and fmt.nbytes(n) % 4096 == 0
    sections, end = fmt.sections(n)
    spans = sorted(sections.values())
    assert all(at % 64 == 0 for at, _ in spans) and spans[-1][0] + spans[-1][1] <= end
    assert all(a + size <= b for (a, size), (b, _) in zip(spans, spans[1:]))  # no overlaps
    m, v = (decode(*encode(rows[r], c), c) for r, c in ((1, SIGNED), (2, UNSIGNED)))
    q = fmt.moment_codes(record, n)
    assert torch.equal(decode(q.m, q.m_scales, SIGNED), m) and torch.equal(decode(q.v, q.v_scales, UNSIGNED), v)
    if fmt.split:  # the masters' low halves as SPLIT keeps them; the bf16 high halves rebuild them exactly
        assert record.dtype == torch.int8
        lo, ties = SPLIT_INT8.master_halves(record, n)
        _, _, lo_s, ties_s = split_views(SPLIT.pack(rows), n)
        assert torch.equal(lo, lo_s) and torch.equal(ties, ties_s)
        master = join(rows[0].bfloat16(), lo, ties, torch.empty(n), torch.empty(n, dtype=torch.int32))
        assert torch.equal(master, rows[0])
    else:
        assert torch.equal(record[0, :n], rows[0])  # row 0 begins with the master, as the update strategies read it


def test_bytes_a_parameter():
    for fmt, moments, split, want in ((INT8, torch.int8, False, 6.0313), (SPLIT_INT8, torch.int8, True, 4.1563)):
        n = Layout(64 << 20, moments, split, all_bf16=True).numel
        assert round(fmt.nbytes(n) / n, 4) == want
        assert fmt.nbytes(n) <= 64 << 20


# ------------------------------------------------------------------------------------------- the optimizer
def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))


def batches(n: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        yield torch.randn(16, 32, generator=g).to(dtype), torch.randn(16, 8, generator=g)


def step(model, opt, x, y):
    nn.functional.mse_loss(model(x).float(), y).backward()
    opt.step()
    opt.zero_grad()


def encode_like_the_chunks(opt, torch_opt, params):
    """torch's AdamW state as an 8-bit optimizer keeps it: each chunk's moments, laid end to end as in its
    record, encoded and decoded again."""
    for chunk in opt.chunks:
        for key, code in (("exp_avg", SIGNED), ("exp_avg_sq", UNSIGNED)):
            row = torch.zeros(chunk.numel)
            flat = [torch_opt.state[params[pc.param]][key].view(-1) for pc in chunk.pieces]
            for pc, f in zip(chunk.pieces, flat):
                row[pc.chunk_start : pc.chunk_start + pc.numel] = f[pc.param_start : pc.param_start + pc.numel]
            row = decode(*encode(row, code), code)
            for pc, f in zip(chunk.pieces, flat):
                f[pc.param_start : pc.param_start + pc.numel] = row[pc.chunk_start : pc.chunk_start + pc.numel]


@pytest.mark.parametrize("update_on", ["host", "device"])
def test_int8_moments_are_adamw_with_its_moments_encoded_each_step(tmp_path, update_on):
    """With fp32 parameters: torch's fused AdamW, its moments encoded and decoded per chunk after each step,
    bit for bit; most chunks streamed through NVMe."""
    ref = mlp()
    model = copy.deepcopy(ref)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    with TieredOptimizer(model, tmp_path, lr=1e-2, host_budget="48KiB", chunk_bytes="12KiB", moments_dtype="int8",
                         update_on=update_on) as opt:  # fmt: skip
        assert {c.fmt for c in opt.chunks} == {INT8} and opt.moments_dtype == torch.int8
        assert opt.state_bytes == sum(INT8.nbytes(c.numel) for c in opt.chunks)
        assert all(opt.store.info(c.key).nbytes == c.nbytes for c in opt.chunks)
        for x, y in batches(8):
            step(ref, torch_opt, x, y)
            step(model, opt, x, y)
            encode_like_the_chunks(opt, torch_opt, list(ref.parameters()))
        for a, b in zip(ref.parameters(), model.parameters()):
            assert torch.equal(a, b)
        sd = opt.state_dict()
        for i, p in enumerate(ref.parameters()):
            for key in ("exp_avg", "exp_avg_sq"):
                assert sd["state"][i][key].dtype == torch.float32
                assert torch.equal(sd["state"][i][key], torch_opt.state[p][key])
        assert opt.stats()["last_step"]["nvme_read_bytes"] > 0


@pytest.mark.parametrize("update_on", ["host", "device"])
def test_hbm_resident_chunks_with_int8_moments(tmp_path, monkeypatch, update_on):
    """Chunks kept in gpu_budget update where they live, with scratch rows of their own (a stand-in device of
    CPU tensors, as tests/acceptance/test_optimizer_parity.py runs the HBM tier in CI); the others stream."""
    import tiered.optim.assembly
    from tiered.store import TieredStore

    class FakeHBMStore(TieredStore):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.gpu_budget, self._device = 24 * 1024, torch.device("cpu")

    monkeypatch.setattr(tiered.optim.assembly, "TieredStore", FakeHBMStore)
    ref = mlp()
    model = copy.deepcopy(ref)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    with pytest.warns(RuntimeWarning, match="gpu_budget is ignored"):
        opt = TieredOptimizer(model, tmp_path, lr=1e-2, host_budget="32KiB", chunk_bytes="12KiB", gpu_budget="24KiB",
                              moments_dtype="int8", update_on=update_on)  # fmt: skip
    with opt:
        tiers = [opt.store.info(c.key).tier for c in opt.chunks]
        assert tiers.count("gpu") == 3 and len(set(tiers)) > 1
        for x, y in batches(5):
            step(ref, torch_opt, x, y)
            step(model, opt, x, y)
            encode_like_the_chunks(opt, torch_opt, list(ref.parameters()))
        assert opt.stats()["total"]["nvme_write_bytes"] > 0
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_int8_moments_track_adamw(tmp_path):
    """Loosely: the same training with exact AdamW moves the weights by much more than the two runs differ."""
    ref = mlp()
    start = [p.detach().clone() for p in ref.parameters()]
    model = copy.deepcopy(ref)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    kw = dict(host_budget="48KiB", chunk_bytes="12KiB", moments_dtype=torch.int8)
    with TieredOptimizer(model, tmp_path, lr=1e-3, **kw) as opt:
        for x, y in batches(20):
            step(ref, torch_opt, x, y)
            step(model, opt, x, y)
    with torch.no_grad():
        moved = max(float((p - s).abs().max()) for p, s in zip(ref.parameters(), start))
        apart = max(float((a - b).abs().max()) for a, b in zip(ref.parameters(), model.parameters()))
    assert moved > 0.01 and apart < 0.1 * moved  # about 5 % apart


@pytest.mark.parametrize("update_on", ["host", "device"])
def test_split_masters_with_int8_moments_are_the_fp32_masters_bit_for_bit(tmp_path, update_on):
    """bf16 parameters: split masters keep the same fp32 masters, so the runs with split and with whole masters
    (both 8-bit moments) are equal bit for bit, at 4.16 against 6.03 bytes a parameter."""
    runs = {}
    for split in (True, False):
        model = mlp().to(torch.bfloat16)
        with TieredOptimizer(model, tmp_path / str(split), lr=1e-2, host_budget="24KiB", chunk_bytes="12KiB",
                             moments_dtype="int8", split_masters=split, update_on=update_on) as opt:  # fmt: skip
            assert {c.fmt for c in opt.chunks} == {SPLIT_INT8 if split else INT8}
            for x, y in batches(6, torch.bfloat16):
                step(model, opt, x, y)
            sd = opt.state_dict()
            runs[split] = ([p.detach().clone() for p in model.parameters()], sd, opt.state_bytes)
            assert opt.stats()["last_step"]["nvme_read_bytes"] > 0
    (p_split, sd_split, bytes_split), (p_full, sd_full, bytes_full) = runs[True], runs[False]
    assert all(torch.equal(a, b) for a, b in zip(p_split, p_full))
    for i, s in sd_full["state"].items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sd_split["state"][i][key], s[key])
    assert bytes_split < 0.75 * bytes_full


def test_split_masters_are_on_by_default_with_int8_moments_on_the_device(tmp_path):
    model = mlp().to(torch.bfloat16)
    with TieredOptimizer(model, tmp_path / "a", update_on="device", moments_dtype="int8") as opt:
        assert opt.split_masters and {c.fmt for c in opt.chunks} == {SPLIT_INT8}
    with TieredOptimizer(model, tmp_path / "b", moments_dtype="int8") as opt:  # the host: off, as for fp32
        assert not opt.split_masters and {c.fmt for c in opt.chunks} == {INT8}
    with pytest.raises(ValueError, match="moments_dtype is bf16"):
        TieredOptimizer(model, tmp_path / "c", split_masters=True, moments_dtype="bf16")


@pytest.mark.parametrize("bad", [torch.float16, torch.uint8, "int4", "fp8", 8])
def test_a_bad_moments_dtype_names_the_accepted_ones(tmp_path, bad):
    with pytest.raises(ValueError, match=r"moments_dtype must be torch.float32 .*torch.bfloat16 or 'int8'"):
        TieredOptimizer(mlp(), tmp_path, moments_dtype=bad)


def checkpoint_files(path) -> dict[str, bytes]:
    """Every data file of a checkpoint (not the manifest, which records when it was written)."""
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            if f != "manifest.json":
                p = Path(root, f)
                out[str(p.relative_to(path))] = p.read_bytes()
    return out


def records(opt) -> list[bytes]:
    out = []
    for c in opt.chunks:
        with opt.store.pin(c.key, tier="host") as t:
            out.append(t.view(-1).view(torch.uint8).numpy().tobytes())
    return out


@pytest.mark.parametrize("split", [False, True], ids=["fp32-masters", "split-masters"])
def test_checkpoints_save_load_save_bit_for_bit(tmp_path, split):
    """Saving exports the moments' fp32 values; loading encodes them into the same codes and scales: the
    records, a second checkpoint and the training after it are all identical."""
    kw = dict(lr=1e-2, host_budget="40KiB", chunk_bytes="12KiB", moments_dtype="int8", split_masters=split,
              update_on="device")  # fmt: skip
    model = mlp().to(torch.bfloat16)
    with TieredOptimizer(model, tmp_path / "a", **kw) as opt:
        for x, y in batches(4, torch.bfloat16):
            step(model, opt, x, y)
        first = opt.save_checkpoint(tmp_path / "ck1")
        before = records(opt)
        other = mlp().to(torch.bfloat16)
        with torch.no_grad():
            for p in other.parameters():
                p.mul_(0.5)
        with TieredOptimizer(other, tmp_path / "b", **kw) as opt2:
            opt2.load_checkpoint(first)
            assert records(opt2) == before
            second = opt2.save_checkpoint(tmp_path / "ck2")
            assert checkpoint_files(first) == checkpoint_files(second)
            for x, y in batches(3, torch.bfloat16):
                step(model, opt, x, y)
                step(other, opt2, x, y)
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
            assert records(opt2) == records(opt)


def test_an_fp32_checkpoint_loads_quantized(tmp_path):
    """fp32 moments saved, then loaded into an 8-bit optimizer: encoded, each chunk's moments as the codec
    makes them; saved again, the 8-bit optimizer's checkpoint loads back into it exactly."""
    model = mlp()
    with TieredOptimizer(model, tmp_path / "a", lr=1e-2, chunk_bytes="12KiB") as opt:
        for x, y in batches(3):
            step(model, opt, x, y)
        path = opt.save_checkpoint(tmp_path / "fp32")
        exact = opt.state_dict()
    other = mlp()
    with TieredOptimizer(other, tmp_path / "b", lr=1e-2, chunk_bytes="12KiB", moments_dtype="int8") as opt8:
        opt8.load_checkpoint(path)
        loaded = opt8.state_dict()
        torch_opt = torch.optim.AdamW(mlp().parameters(), lr=1e-2)
        torch_opt.load_state_dict(copy.deepcopy(exact))
        encode_like_the_chunks(opt8, torch_opt, list(torch_opt.param_groups[0]["params"]))
        for i, p in enumerate(torch_opt.param_groups[0]["params"]):
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(loaded["state"][i][key], torch_opt.state[p][key])
                assert not torch.equal(loaded["state"][i][key], exact["state"][i][key])  # it was rounded
        before = records(opt8)
        again = opt8.save_checkpoint(tmp_path / "int8")
        opt8.load_checkpoint(again)
        assert records(opt8) == before


def test_state_dict_exports_fp32_moments_that_torch_adamw_loads(tmp_path):
    model = mlp()
    with TieredOptimizer(model, tmp_path / "a", lr=1e-2, host_budget="40KiB", chunk_bytes="12KiB",
                         moments_dtype="int8") as opt:  # fmt: skip
        for x, y in batches(3):
            step(model, opt, x, y)
        sd = opt.state_dict()
        p0 = next(model.parameters())
        assert torch.equal(opt.state[p0]["exp_avg"], sd["state"][0]["exp_avg"])
        # into torch's AdamW, which then trains on from it
        twin = copy.deepcopy(model)
        torch_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
        torch_opt.load_state_dict(copy.deepcopy(sd))
        for p in twin.parameters():
            st = torch_opt.state[p]
            assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32 and float(st["step"]) == 3
        for x, y in batches(1):
            step(twin, torch_opt, x, y)
        # and back into an 8-bit optimizer with the same chunks (other chunks put other elements in a block,
        # which encodes them anew): the same state, exactly
        with TieredOptimizer(copy.deepcopy(model), tmp_path / "b", lr=1e-2, chunk_bytes="12KiB",
                             moments_dtype="int8") as opt2:  # fmt: skip
            opt2.load_state_dict(copy.deepcopy(sd))
            back = opt2.state_dict()
    for i, s in sd["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(back["state"][i][key], s[key])


# ------------------------------------------------------------------------------------------ on the GPU
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the GPU machine)")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("code", [SIGNED, UNSIGNED], ids=["signed", "unsigned"])
def test_the_codec_on_cuda_is_the_codec_on_the_cpu(code):
    x = spread(100_000, signed=code.signed, seed=5)
    q, s = encode(x, code)
    qc = torch.empty(x.numel(), dtype=code.dtype, device="cuda")
    sc = torch.empty(num_blocks(x.numel()), device="cuda")
    quantize_blockwise(x.cuda(), code, qc, sc)
    assert torch.equal(qc.cpu(), q) and torch.equal(sc.cpu(), s)
    y = dequantize_blockwise(qc, sc, code, torch.empty(x.numel(), device="cuda"))
    assert torch.equal(y.cpu(), decode(q, s, code))


@pytest.mark.gpu
@cuda
def test_int8_moments_on_cuda_are_adamw_with_its_moments_encoded(tmp_path):
    """The update on the GPU (8-bit moments decoded and encoded there, on the side streams): torch's fused
    AdamW on CUDA, its moments encoded per chunk after each step (the CPU's codec: the same bits), exactly."""
    ref = mlp().cuda()
    model = copy.deepcopy(ref)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    with TieredOptimizer(model, tmp_path, lr=1e-2, host_budget="48KiB", chunk_bytes="12KiB", moments_dtype="int8",
                         update_on="device") as opt:  # fmt: skip
        assert {c.fmt for c in opt.chunks} == {INT8}
        for x, y in batches(6):
            step(ref, torch_opt, x.cuda(), y.cuda())
            step(model, opt, x.cuda(), y.cuda())
            encode_like_the_chunks(opt, torch_opt, list(ref.parameters()))
        assert opt.stats()["last_step"]["nvme_read_bytes"] > 0
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.gpu
@cuda
def test_split_masters_with_int8_moments_on_cuda(tmp_path):
    """bf16 parameters on the GPU: split and whole masters, both with 8-bit moments, train bit for bit alike."""
    runs = []
    for split in (True, False):
        model = mlp().to("cuda", torch.bfloat16)
        with TieredOptimizer(model, tmp_path / str(split), lr=1e-2, host_budget="24KiB", chunk_bytes="12KiB",
                             moments_dtype="int8", split_masters=split) as opt:  # fmt: skip
            assert opt.update_on == "device" and {c.fmt for c in opt.chunks} == {SPLIT_INT8 if split else INT8}
            for x, y in batches(5, torch.bfloat16):
                step(model, opt, x.cuda(), y.cuda())
            runs.append(([p.detach().clone() for p in model.parameters()], opt.state_dict()))
    (p_split, sd_split), (p_full, sd_full) = runs
    assert all(torch.equal(a, b) for a, b in zip(p_split, p_full))
    for i, st in sd_full["state"].items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sd_split["state"][i][key], st[key])


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("code", [SIGNED, UNSIGNED], ids=["signed", "unsigned"])
def test_non_finite_moments_on_cuda_encode_as_on_the_cpu(code):
    """The branch-free CUDA path for blocks with inf or NaN gives the CPU's codes and scales."""
    x = spread(10 * BLOCK + 3, signed=code.signed, seed=9)
    x[7], x[BLOCK + 1], x[3 * BLOCK : 4 * BLOCK] = float("inf"), float("nan"), 0.0
    x[3 * BLOCK + 5], x[5 * BLOCK : 6 * BLOCK] = float("inf"), -0.0
    if code.signed:
        x[2 * BLOCK + 9] = float("-inf")
    q, s = encode(x, code)
    qc = torch.empty(x.numel(), dtype=code.dtype, device="cuda")
    sc = torch.empty(num_blocks(x.numel()), device="cuda")
    quantize_blockwise(x.cuda(), code, qc, sc)
    assert torch.equal(qc.cpu(), q) and torch.equal(sc.cpu().view(torch.int32), s.view(torch.int32))
    y = dequantize_blockwise(qc, sc, code, torch.empty(x.numel(), device="cuda"))
    torch.testing.assert_close(y.cpu(), decode(q, s, code), rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("big", [1e30, float("inf")])
def test_one_huge_gradient_on_cuda_leaves_as_many_non_finite_weights_as_adamw(tmp_path, big):
    """Against torch's fused AdamW, the kernel the update runs. On CUDA it differs from the CPU's and from the
    foreach AdamW here: for a gradient of 1e30 it leaves that one weight NaN (exp_avg_sq NaN, measured on the
    H200), where they leave it finite; with 8-bit moments the same weights, and only those, are non-finite."""
    torch.manual_seed(0)
    ref = [nn.Parameter(torch.randn(4 * BLOCK + 30, device="cuda"))]
    params = [nn.Parameter(p.detach().clone()) for p in ref]
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    with TieredOptimizer(params, tmp_path, lr=1e-2, moments_dtype="int8") as opt:
        for i in range(3):
            g = torch.randn(ref[0].shape, device="cuda")
            if i == 0:
                g[BLOCK + 17] = big
            ref[0].grad, params[0].grad = g.clone(), g.clone()
            torch_opt.step()
            opt.step()
            assert torch.equal(torch.isfinite(ref[0]), torch.isfinite(params[0]))
    assert int((~torch.isfinite(params[0])).sum()) == int((~torch.isfinite(ref[0])).sum()) <= 1
