"""`tiered-bench plan`: the capacity model against the optimizer's own code, hand-computed boxes, the advice
for a model that does not fit (checked by planning again with it), the CLI, and the figures in the docs."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from io_engine import parse_size
from tiered import cli
from tiered.bench.plan import (
    OPTIONS,
    Assumptions,
    Box,
    PlanResult,
    chunk_numel,
    host_budget_max,
    plan,
    recommend_host_budget,
    record_bytes,
    state_split,
    tiered_gpu_bytes,
)
from tiered.bench.report import render_plan
from tiered.config import TierConfig
from tiered.layout.chunking import FULL, INT8, PACKED, SPLIT, SPLIT_INT8, Layout, plan_chunks
from tiered.optim.budget import plan_budget

ROOT = Path(__file__).resolve().parents[2]  # the repository
KiB, MiB, GiB, GB = 1 << 10, 1 << 20, 1 << 30, 10**9
FORMATS = {"full": FULL, "packed": PACKED, "split": SPLIT, "int8": INT8, "split-int8": SPLIT_INT8}
MOMENTS = {"packed": torch.bfloat16, "int8": torch.int8, "split-int8": torch.int8}
H200 = Box(gpu=141 * GB, ram=125 * GiB, disk=64 * GB)  # the project's GPU machine
CONSUMER = Box(gpu=24 * GB, ram=64 * GiB, disk=1000 * GB)


def option(result: PlanResult, key: str):
    (o,) = [o for o in result.options if o.key == key]
    return o


# ------------------------------------------------------------------------ the model against the optimizer
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("chunk_bytes", [4096, 12 * KiB, 100_000, 64 * MiB, 256 * MiB])
def test_the_plans_chunk_sizes_are_the_optimizers(fmt, chunk_bytes):
    """The planner names formats as the optimizer's layout picks them from its knobs."""
    moments = MOMENTS.get(fmt, torch.float32)
    layout = Layout(chunk_bytes, moments, split_masters=fmt.startswith("split"), all_bf16=True)
    assert chunk_numel(fmt, chunk_bytes) == layout.numel
    param = torch.zeros(3000, dtype=torch.bfloat16 if fmt.startswith("split") else torch.float32)
    assert {c.fmt.name for c in layout.plan([[param]])} == {fmt}


@pytest.mark.parametrize("fmt", FORMATS)
def test_record_bytes_are_the_bytes_of_the_records_the_formats_pack(fmt):
    """tiered.layout.sizes counts what the formats build: a record packed from fp32 rows holds exactly
    ``record_bytes`` bytes, and every view of it lies inside them."""
    for n in (1, 7, 255, 257, 1000, 4097, 70_000):
        record = FORMATS[fmt].pack(torch.randn(3, n))
        assert record.numel() * record.element_size() == record_bytes(fmt, n) == FORMATS[fmt].nbytes(n)


def test_state_split_is_plan_budget_in_closed_form():
    """Resident chunks, stream reserve, read-ahead and NVMe bytes as tiered.optim.budget.plan_budget gives them for
    the chunks tiered.layout.chunking cuts, over random sizes, budgets and depths (the refusals included), for the
    update on the GPU the plan assumes (its window of three chunks open)."""
    rng = random.Random(0)
    refused = 0
    for _ in range(600):
        fmt = rng.choice(list(FORMATS))
        a = Assumptions(
            chunk_bytes=rng.choice([4096, 12 * KiB, 100_000, 256 * KiB]), prefetch_depth=rng.choice([0, 1, 8])
        )
        n = chunk_numel(fmt, a.chunk_bytes)
        params = rng.randint(1, 30 * n)
        sizes = [c.nbytes for c in plan_chunks([[(0, params)]], n, lambda ps, f=FORMATS[fmt]: f)]
        budget = rng.randint(0, sum(sizes) + 12 * max(sizes))
        got = state_split(params, fmt, budget, a)
        try:
            want = plan_budget(sizes, budget, 0, a.prefetch_depth, in_flight=3)  # the device update's window
        except ValueError:
            refused += 1
            assert got is None
            continue
        assert got is not None
        assert (got.nvme_bytes, got.stream_reserve, got.prefetch_depth, got.chunks) == (
            want.disk_bytes, want.stream_reserve, want.prefetch_depth, len(sizes),
        )  # fmt: skip
        assert got.resident_bytes + got.nvme_bytes == got.state_bytes
    assert 0 < refused < 100  # both branches ran


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_optimizer_keeps_and_streams_what_the_plan_says(tmp_path, fmt):
    """A real TieredOptimizer (CPU, two tensors in one group, the update "on the device" as on the GPU the plan
    assumes, so with its window): its scan policy's resident and streaming bytes are the plan's DDR and NVMe bytes
    for the same parameter count, budget and chunk size."""
    from tiered import TieredOptimizer

    dtype = torch.float32 if fmt == "full" else torch.bfloat16
    params = [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in (100_000, 37_123)]
    knobs = dict(split_masters=fmt.startswith("split")) if fmt != "full" else {}
    knobs.update(moments_dtype=MOMENTS.get(fmt, torch.float32), update_on="device")
    budget, chunk = 600_000, 48 * KiB
    with TieredOptimizer(params, nvme_path=tmp_path, host_budget=budget, chunk_bytes=chunk, **knobs) as opt:
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        stats = opt.stats()
    policy = stats["store"]["policy"]
    want = state_split(137_123, fmt, budget, Assumptions(chunk_bytes=chunk))
    assert (stats["chunks"], stats["prefetch_depth"]) == (want.chunks, want.prefetch_depth)
    assert (policy["resident_bytes"], policy["streaming_bytes"]) == (want.resident_bytes, want.nvme_bytes)
    assert 0 < want.resident_bytes and 0 < want.nvme_bytes


def test_host_budget_max_is_what_the_optimizer_accepts():
    assert host_budget_max(100 * GiB, 8 * GiB) == 90 * GiB  # 90 % binds
    assert host_budget_max(64 * GiB, 8 * GiB) == 56 * GiB  # the reserve binds
    assert host_budget_max(125 * GiB, 8 * GiB) == 115200 * MiB
    assert host_budget_max(8 * GiB, 8 * GiB) == 0
    ram = psutil.virtual_memory().total  # TierConfig checks this machine's RAM
    TierConfig(host_budget=host_budget_max(ram, 0))
    with pytest.raises(ValueError, match="90 %"):
        TierConfig(host_budget=ram * 9 // 10 + MiB)


# ---------------------------------------------------------------------------------- hand-computed boxes
def test_largest_tiered_model_is_ram_plus_disk_less_the_stream_reserve():
    """100 GiB of RAM, 50 GiB of disk, fp32 masters (12 B/param) in 12 MiB chunks of 1 Mi parameters:
    host_budget is 90 GiB (90 % of RAM; 100 - 8 GiB reserve is more), eleven chunks of which (read-ahead 8, the
    three the update on the GPU keeps open) stay free for streaming, so the state holds 90 GiB - 132 MiB + 50 GiB."""
    box = Box(gpu=10**13, ram=100 * GiB, disk=50 * GiB)
    a = Assumptions(chunk_bytes=12 * MiB)
    o = option(plan(box, assumptions=a), "tiered-fp32-masters")
    assert o.largest_params == (90 * GiB - 11 * 12 * MiB + 50 * GiB) // 12 == 12_515_453_610
    assert o.bound_by == "host RAM + NVMe"
    assert state_split(o.largest_params, "full", 90 * GiB, a).nvme_bytes <= 50 * GiB
    assert state_split(o.largest_params + 1, "full", 90 * GiB, a).nvme_bytes > 50 * GiB
    # The default format (split masters, 10.1255 B/param with its 4 KiB padding) within one chunk of the same.
    d = option(plan(box), "tiered")
    n = chunk_numel("split", 64 * MiB)
    s = record_bytes("split", n)
    assert abs(d.largest_params - (90 * GiB - 11 * s + 50 * GiB) * n / s) < n
    assert d.bytes_per_param["state"] == round(s / n, 4) == 10.1255


def test_largest_deepspeed_models_hand_computed():
    box = Box(gpu=10**13, ram=100 * GiB, disk=50 * GiB)
    r = plan(box)
    offload, infinity = option(r, "zero-offload"), option(r, "zero-infinity")
    assert (offload.largest_params, offload.bound_by) == (92 * GiB // 18, "host RAM")  # 100 GiB less 8 GiB
    assert (infinity.largest_params, infinity.bound_by) == (50 * GiB // 16, "NVMe")
    # Its host side: 2 B/param of bf16 gradients + 4 swap buffers and a gradient buffer of 1e9 fp32 elements.
    assert infinity.limits["host RAM"] == (92 * GiB - 5 * 4 * 10**9) // 2


def test_deepspeed_with_its_weights_offloaded_hand_computed():
    """ZeRO-3's offload_param: 2 B a parameter of bf16 weights moves off the GPU, to RAM beside ZeRO-Offload's 18
    (cpu) or to NVMe beside ZeRO-Infinity's 16 (nvme, with its 1 GB of pinned weight buffers); the GPU holds the
    gathered weights (at most 1e9 of them), the gradient bucket, activations and reserve, whatever the depth."""
    box = Box(gpu=24 * GB, ram=100 * GiB, disk=50 * GiB)
    r = plan(box)
    cpu, nvme = option(r, "zero-offload-params"), option(r, "zero-infinity-params")
    assert (cpu.largest_params, cpu.bound_by) == (92 * GiB // 20, "host RAM") and cpu.limits["GPU memory"] is None
    assert (nvme.largest_params, nvme.bound_by) == (50 * GiB // 18, "NVMe")
    assert nvme.limits["host RAM"] == (92 * GiB - 5 * 4 * 10**9 - 10**9) // 2
    fit = option(plan(box, 4 * 10**9), "zero-offload-params").fit
    assert fit.fits and fit.gpu_bytes == 2 * 10**9 + 2 * 500_000_000 + 8 * GiB + 2 * GiB
    assert fit.host_bytes == 20 * 4 * 10**9
    small = option(plan(box, 10**8), "zero-infinity-params").fit
    assert small.gpu_bytes == 2 * 10**8 + 2 * 500_000_000 + 8 * GiB + 2 * GiB and small.nvme_bytes == 18 * 10**8
    assert plan(Box(gpu=10 * GiB, ram=100 * GiB, disk=50 * GiB)).options[-1].largest_params == 0  # no room at all


def test_a_small_gpu_binds_and_is_named():
    r = plan(CONSUMER)
    tiered = option(r, "tiered")
    n = chunk_numel("split", 64 * MiB)
    scratch = 3 * record_bytes("split", n) + (4 + 2 + 2 + 8) * n  # DeviceUpdate's three records and rows, the join
    assert tiered.bound_by == "GPU memory"
    assert tiered.largest_params == (24 * GB - 8 * GiB - 2 * GiB - scratch) // 4
    infinity = option(r, "zero-infinity")  # gradients leave the GPU in buckets: 2 B/param there, not 4
    assert infinity.bound_by == "GPU memory"
    assert infinity.largest_params == (24 * GB - 2 * 500_000_000 - 8 * GiB - 2 * GiB) // 2
    assert option(r, "zero-offload").bound_by == "host RAM"


@pytest.mark.parametrize("box", [H200, CONSUMER, Box(gpu=80 * GB, ram=512 * GiB, disk=4000 * GB)])
def test_largest_fits_and_one_more_does_not(box):
    r = plan(box)
    for o in r.options:
        assert option(plan(box, o.largest_params), o.key).fit.fits, o.key
        assert not option(plan(box, o.largest_params + 1), o.key).fit.fits, o.key


# ------------------------------------------------------------------------------------- a model on a box
def test_13b_on_the_h200_streams_part_of_its_state():
    fit = option(plan(H200, 13 * 10**9), "tiered").fit
    assert fit.fits and fit.host_budget == "115200MiB" and fit.host_bytes == 115200 * MiB
    split = state_split(13 * 10**9, "split", 115200 * MiB)
    assert fit.nvme_bytes == split.nvme_bytes > 0 and fit.nvme_bytes_per_step == 2 * split.nvme_bytes
    assert fit.ddr_state_bytes + fit.nvme_bytes == split.state_bytes
    assert fit.gpu_bytes == tiered_gpu_bytes(13 * 10**9, "split") < 141 * GB


def test_a_state_that_fits_in_ram_needs_no_disk():
    box = dataclasses.replace(H200, disk=0)
    fit = option(plan(box, 5 * 10**9), "tiered").fit
    assert fit.fits and fit.nvme_bytes == 0 and fit.min_disk == 0
    budget = parse_size(fit.host_budget)
    assert budget == recommend_host_budget(5 * 10**9, "split", box.ram) <= host_budget_max(box.ram, 8 * GiB)
    assert budget - GiB < state_split(5 * 10**9, "split", 1 << 62).state_bytes <= budget  # whole GiB, just enough
    # With room for the update under backward's second copy: twice the state where RAM allows, else the maximum.
    state = state_split(5 * 10**9, "split", 1 << 62).state_bytes
    spare = recommend_host_budget(5 * 10**9, "split", box.ram, spare=True)
    assert spare - GiB < 2 * state <= spare < host_budget_max(box.ram, 8 * GiB)
    assert recommend_host_budget(8 * 10**9, "split", box.ram, spare=True) == host_budget_max(box.ram, 8 * GiB)
    assert option(plan(box, 5 * 10**9), "zero-infinity").fit.short == ["NVMe: needs 80.0 GB, has 0.0 GB"]


def test_a_model_too_large_for_the_disk_says_what_would_fit():
    r = plan(H200, 20 * 10**9)
    o = option(r, "tiered")
    fit = o.fit
    assert not fit.fits and [s.split(":")[0] for s in fit.short] == ["host RAM + NVMe"]
    assert "20.00B parameters do not fit" in r.verdict and "18.17B" in r.verdict
    assert any("bfloat16" in s for s in fit.instead)  # 8 B/param fits where 10.1 does not
    assert option(r, "tiered-bf16-moments").fit.fits
    # The advice works, and is the least that works.
    more_disk = dataclasses.replace(H200, disk=fit.min_disk)
    assert option(plan(more_disk, fit.params), "tiered").fit.fits
    assert not option(plan(dataclasses.replace(H200, disk=fit.min_disk - 1), fit.params), "tiered").fit.fits
    more_ram = dataclasses.replace(H200, ram=fit.min_ram)
    assert option(plan(more_ram, fit.params), "tiered").fit.fits
    assert not option(plan(dataclasses.replace(H200, ram=fit.min_ram - GiB), fit.params), "tiered").fit.fits
    assert fit.min_ram == 145 * GiB and math.ceil(fit.min_disk / 1e8) == 825  # needs are rounded up, never down
    assert fit.would_fit == ["82.5 GB of free NVMe with this RAM or 145 GiB of RAM with this disk"]


def test_a_model_too_large_for_the_gpu_says_so():
    r = plan(CONSUMER, 10 * 10**9)
    fit = option(r, "tiered").fit
    assert not fit.fits and fit.short == ["GPU memory: needs 51.1 GB, has 24.0 GB"]
    assert fit.would_fit == ["a GPU of 51.1 GB or more"]  # 40 GB of weights and gradients: activations cannot help
    assert fit.instead[1:] == ["a model of at most 3.23B parameters"]
    assert fit.instead[0].startswith("tiered.offload_model(model)")  # 54 GB of pinned RAM for them, 64 GiB here
    assert option(r, "tiered-offload").fit.fits
    # A 13B's weights and gradients, pinned in slabs of their size, take 52 GB, which 64 GiB less its reserve
    # holds; a 16B's 64 GB it does not hold: offloading is not offered.
    assert option(plan(CONSUMER, 13 * 10**9), "tiered").fit.instead[0].startswith("tiered.offload_model(model)")
    big = option(plan(CONSUMER, 16 * 10**9), "tiered").fit
    assert big.instead == ["a model of at most 3.23B parameters"]
    assert option(plan(dataclasses.replace(CONSUMER, gpu=fit.gpu_bytes), fit.params), "tiered").fit.fits
    # Where fewer activations would do, the plan says how few.
    fit = option(plan(CONSUMER, 4 * 10**9), "tiered").fit
    (fix,) = fit.would_fit
    room = float(re.search(r"at most ([0-9.]+) GB of activations", fix).group(1)) * GB
    a = Assumptions(activations=int(room))
    assert option(plan(CONSUMER, 4 * 10**9, a), "tiered").fit.fits


def test_the_activations_advice_fits_when_taken_at_every_size():
    # Rounded to the nearest 0.1 GB it could name more room than there is: the plan, rerun with it, still did
    # not fit (3.01B under 16 GB). Rounded down, it fits, whatever the model.
    box = Box(16 * 10**9, 64 * GiB, 10**12)
    advised = 0
    for n in range(2_900_000_000, 3_600_000_000, 10_000_000):
        (fix, *_) = option(plan(box, n, Assumptions(activations=4 * 10**9)), "tiered").fit.would_fit or [""]
        m = re.search(r"at most ([0-9.]+) GB of activations", fix)
        if m:
            advised += 1
            assert option(plan(box, n, Assumptions(activations=round(float(m.group(1)) * GB))), "tiered").fit.fits, n
    assert advised > 10


def advised_gpu(fit) -> int | None:
    """The GPU a fix names, in bytes, read as --gpu reads "X GB" (exactly: no float rounding)."""
    m = re.search(r"a GPU of ([0-9.]+) GB or more", " ".join(fit.would_fit))
    return None if m is None else int(m.group(1).replace(".", "")) * 10**8  # one decimal: tenths of a GB


def test_a_count_past_the_gpu_search_still_gets_gpu_advice():
    """plan() in Python takes any count; past the search for the least GPU (2**50 tenths of a GB) a bare
    AssertionError came out of it. The advice is then the need at the box's own activations, as before."""
    from tiered.bench.plan_memory import default_activations

    box = Box(gpu=24 * GB, ram=128 * GiB, disk=10**12)
    result = plan(box, 10**24, Assumptions(activations=default_activations(box.gpu)), activations_default=True)
    advice = [s for o in result.options for s in o.fit.would_fit if s.startswith("a GPU of ")]
    assert advice and not result.options[0].fit.fits, result.options[0].fit


def test_the_gpu_advice_fits_when_passed_back_with_the_default_activations(capsys):
    """Without --activations the CLI assumes a quarter of the GPU (at most 8 GiB), so a larger GPU brings larger
    activations. The fix named the GPU the model needs with the current GPU's: docs/capacity.md's 10B on 24 GB was
    told 48.4 GB, and `--gpu 48.4GB` then assumed 8 GiB of activations, not 6 GB, and did not fit. The GPU named
    must fit when passed back, and be the least (to the 0.1 GB it prints) that does."""
    from tiered.bench.plan_memory import default_activations

    @functools.cache
    def rerun(gpu: int, n: int) -> PlanResult:  # as `tiered-bench plan --gpu ...` without --activations
        a = Assumptions(activations=default_activations(gpu))
        return plan(Box(gpu, 256 * GiB, 1000 * GB), n, a, activations_default=True)

    def gpu_short(gpu: int, n: int, key: str) -> bool:
        return any(s.startswith("GPU memory") for s in option(rerun(gpu, n), key).fit.short)

    advised = set()
    for gpu, n in itertools.product((8 * GB, 16 * GB, 24 * GB, 40 * GB, 80 * GB), (2, 7, 13, 40)):
        for o in rerun(gpu, n * 10**9).options:
            g = advised_gpu(o.fit)
            if g is not None:
                advised.add(o.key)
                assert not gpu_short(g, n * 10**9, o.key), (o.key, gpu, n, g)  # it fits, and is the least that does
                assert gpu_short(g - 10**8, n * 10**9, o.key), (o.key, gpu, n, g)
    assert {"tiered", "tiered-bf16-moments", "zero-offload", "zero-infinity", "tiered-offload"} <= advised
    # The CLI, on docs/capacity.md's example, and its advice taken.
    box = "--params 10B --gpu {} --ram 125GiB --disk 60GB"
    assert cli.main(["plan", *box.format("24GB").split()]) == 0
    gpu = re.search(r"a GPU of ([0-9.]+) GB or more", " ".join(capsys.readouterr().out.split())).group(1)
    assert cli.main(["plan", *box.format(f"{gpu}GB").split()]) == 0
    assert re.search(r"^  tiered \(defaults\) +yes ", capsys.readouterr().out, re.M), gpu
    # Activations given are the user's: the GPU named is the need with them, as before.
    assert option(plan(CONSUMER, 10 * 10**9), "tiered").fit.would_fit == ["a GPU of 51.1 GB or more"]


def test_an_option_that_fits_no_model_offers_no_model_of_zero():
    tiny = Box(10**9, 64 * GiB, 10**12)  # a 1 GB GPU: nothing trains there without offload
    fit = option(plan(tiny, 10**9), "tiered").fit
    assert not fit.fits and not [s for s in fit.instead if "at most 0 " in s]


def test_a_box_where_nothing_binds_names_no_largest_model_and_no_bound(capsys):
    """Where no constraint limits a model (every limit None), the plan printed the search's cap, 2**50 parameters
    (1125899.90B), as the largest model, "bound by GPU": a limit no constraint sets. It says there is none."""
    huge = Box(10**21, 10**21, 10**21)
    for o in plan(huge, 10**12).options:
        assert set(o.limits.values()) == {None}, o.key
        assert o.largest_params is None and o.bound_by is None, o.key
        assert o.fit.fits and not [s for s in o.fit.instead if "a model of at most" in s], o.key
    assert cli.main("plan --gpu 1000000TB --ram 1000000TB --disk 1000000TB".split()) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  tiered (defaults) ")]
    assert rows and re.match(r"  tiered \(defaults\) +4 GPU \+ 10\.13 DDR/NVMe +no limit +- +GPU -, RAM\+NVMe -$",
                             rows[0]), rows  # fmt: skip
    p = run_cli("plan", "--gpu", "1000000TB", "--ram", "1000000TB", "--disk", "1000000TB", "--json")
    first = json.loads(p.stdout)["options"][0]
    assert (first["largest_params"], first["bound_by"]) == (None, None)
    # A limit set by one constraint is still named with it.
    o = option(plan(dataclasses.replace(huge, gpu=24 * GB)), "tiered")
    assert o.bound_by == "GPU memory" and o.largest_params == o.limits["GPU memory"] > 0


# -------------------------------------------------------------------------- parameters off the GPU
def test_offloaded_parameters_put_a_window_on_the_gpu_and_their_pinned_blocks_in_ram():
    """tiered.offload_model: the GPU holds the window, activations and reserve, whatever the model's size, and
    keeps state in what they leave; RAM holds the pinned bf16 weights and gradients first (4 B/param, in slabs
    of their size), and host_budget is what they leave."""
    from tiered.bench.plan_memory import (
        OFFLOAD_HOST,
        device_scratch_bytes,
        offload_gpu_bytes,
        offload_hbm_params,
        offload_host_budget,
        offload_host_bytes,
    )

    box = Box(gpu=24 * GB, ram=128 * GiB, disk=1000 * GB)
    r = plan(box)
    o = option(r, "tiered-offload")
    assert o.exact and o.bytes_per_param == {"gpu": 0.0, "host": 4.0, "state": 10.1255} and OFFLOAD_HOST == 4
    assert o.limits["GPU memory"] is None  # no limit: the window does not grow with depth
    most = o.limits["host RAM"]  # the most parameters whose pinned slabs the RAM less its reserve holds
    assert offload_host_bytes(most) <= 120 * GiB < offload_host_bytes(most + 1)
    largest = o.largest_params
    assert o.bound_by == "host RAM + NVMe" and 32 * 10**9 < largest < 33 * 10**9
    n = largest + 1  # one more does not fit: RAM, the host budget they leave, HBM and the disk together
    split = state_split(n - offload_hbm_params(n, box.gpu, "split"), "split", offload_host_budget(n, box.ram))
    assert split is None or split.nvme_bytes > box.disk  # None: what is left of RAM holds not one chunk
    assert largest > 9 * option(r, "tiered").largest_params  # where the GPU bound the defaults at 3.23B
    fit = option(plan(box, 10 * 10**9), "tiered-offload").fit
    scratch = device_scratch_bytes(10 * 10**9, "split", offloaded=True)  # 0.27 GB at 64 MiB chunks
    assert fit.fits and fit.gpu_bytes == offload_gpu_bytes(10 * 10**9, "split") == 14 * GiB + scratch
    assert 0 < fit.nvme_bytes < 30 * GB
    in_hbm = offload_hbm_params(10 * 10**9, box.gpu, "split")
    assert 7 * GB < fit.hbm_state_bytes < 9 * GB and in_hbm * 10 < fit.hbm_state_bytes < in_hbm * 10.2
    assert fit.host_bytes == recommend_host_budget(10 * 10**9 - in_hbm, "split", 128 * GiB - 40 * 10**9)
    # A GPU too small for a 1B's window and the activations: the plan names the GPU; the models that fit are those
    # whose window, their whole weights and gradients (4 B/param), is smaller than the default.
    small = option(plan(Box(gpu=12 * GB, ram=128 * GiB, disk=1000 * GB), 10**9), "tiered-offload")
    assert 0 < small.largest_params < Assumptions().offload_window // 4
    assert small.fit.short[0].startswith("GPU memory: needs 15.1 GB")


def test_an_offloaded_model_whose_weights_the_gpu_keeps_counts_them_there():
    """keep_for_backward="auto" keeps an offloaded model's weights on the GPU from forward to backward where they
    take at most KEEP_SHARE of it (tiered.shares, the rule tiered.offload applies): its fit counts them instead
    of the window, so less state is planned for HBM (the 4.42B on a 24 GB cap ran with 3 GiB there; the window
    rule planned 8.1 GiB). The search for the largest model counts the window (its limit grows with the size)."""
    from tiered.bench.plan_memory import kept, offload_gpu_bytes, offload_hbm_params
    from tiered.shares import KEEP_SHARE

    box = Box(gpu=24 * GB, ram=125 * GiB, disk=64 * GB)
    small, large = 4_420_000_000, 10 * 10**9
    assert 2 * small <= KEEP_SHARE * box.gpu < 2 * large
    assert kept(small, box.gpu, "split") and not kept(large, box.gpu, "split")
    fit = option(plan(box, small), "tiered-offload").fit
    assert fit.gpu_bytes == 2 * small + offload_gpu_bytes(small, "split") - Assumptions().offload_window
    streamed_hbm = offload_hbm_params(small, box.gpu, "split", keep=False)
    assert 0 < fit.hbm_state_bytes < streamed_hbm * 10.2 - 4 * GiB  # the weights' 8.8 GB less the 4 GiB window
    assert 3 * GiB < fit.hbm_state_bytes < 4.5 * GiB
    streamed = option(plan(box, large), "tiered-offload").fit
    assert streamed.gpu_bytes == offload_gpu_bytes(large, "split")  # the window
    # Kept, beside the activations and the scratch: it would not fit; with fewer activations, it does.
    assert 2 * 2.5e9 <= KEEP_SHARE * 12 * GB and not kept(2_500_000_000, 12 * GB, "split")
    assert kept(2_500_000_000, 12 * GB, "split", Assumptions(activations=4 * GiB))
    largest = [option(plan(box, n), "tiered-offload").largest_params for n in (None, small)]
    assert largest[0] == largest[1]


def test_the_10b_target_box_fits_only_with_parameters_offloaded():
    box = Box(gpu=24 * GB, ram=125 * GiB, disk=60 * GB)  # the GPU machine capped to 24 GB, its free disk
    r = plan(box, 10 * 10**9)
    assert [o.key for o in r.options if o.fit.fits] == ["tiered-offload", "tiered-offload-int8"]
    fit = option(r, "tiered-offload").fit
    assert 0 < fit.nvme_bytes < 60 * GB
    assert "Also fits: tiered, parameters offloaded; tiered, offloaded, 8-bit moments." in r.verdict


def test_a_model_that_fits_holds_every_figure_it_prints_within_the_box():
    """Over a grid of boxes, sizes and chunk sizes: an option that says a model fits prints GPU bytes (with the
    state kept in HBM), host bytes and NVMe bytes within the box, and the model is at most its largest. A 13B on
    an 80 GB GPU keeps its weights there (keep_for_backward="auto"), which leaves 15.7 GB of state for a 10 GB
    disk: it does not fit, and streaming the weights again (keep_for_backward=False) is offered instead."""
    from tiered.bench.plan_memory import default_activations, offload_host_budget, offload_host_bytes

    checked = 0
    for gpu, ram, disk, chunk in itertools.product(
        (12 * GB, 24 * GB, 80 * GB, 141 * GB), (32 * GiB, 125 * GiB, 256 * GiB), (0, 10 * GB, 64 * GB, 1000 * GB),
        (64 * MiB, 1 * GiB),
    ):  # fmt: skip
        box, a = Box(gpu, ram, disk), Assumptions(activations=default_activations(gpu), chunk_bytes=chunk)
        for n in (10**9, 7 * 10**9, 13 * 10**9, 20 * 10**9, 30 * 10**9, 70 * 10**9):
            for o in plan(box, n, a).options:
                f, where = o.fit, (o.key, gpu, ram, disk, chunk, n)
                if not f.fits:
                    assert n > o.largest_params or any("keep_for_backward=False" in s for s in f.instead), where
                    continue
                checked += 1
                assert n <= o.largest_params and not f.short, where
                assert f.gpu_bytes + f.hbm_state_bytes <= gpu and f.nvme_bytes <= disk, where
                if o.key.startswith("tiered-offload"):
                    assert f.host_bytes <= offload_host_budget(n, ram, a), where
                    assert offload_host_bytes(n) <= ram - a.ram_reserve, where
                elif o.key.startswith("tiered"):
                    assert f.host_bytes <= host_budget_max(ram, a.ram_reserve), where
                else:
                    assert f.host_bytes <= ram - a.ram_reserve, where
    assert checked > 500
    r = plan(Box(gpu=80 * GB, ram=125 * GiB, disk=10 * GB), 13 * 10**9, Assumptions(activations=8 * GiB))
    fit = option(r, "tiered-offload").fit
    assert not fit.fits and fit.nvme_bytes > 10 * GB and fit.short[0].startswith("host RAM + NVMe: needs 15.9 GB")
    assert fit.instead[0].startswith("keep_for_backward=False in tiered.offload_model")
    assert (
        "tiered, parameters offloaded (host RAM + NVMe)" in r.verdict
        and "Also fits: tiered, parameters" not in r.verdict
    )


def test_the_largest_offloaded_model_is_judged_as_the_run_places_it():
    """On the H200 box the largest offloaded model keeps its weights on the GPU (they take under KEEP_SHARE of it):
    the largest is found with them there, so that it fits and one more does not."""
    from tiered.bench.plan_memory import kept

    o = option(plan(H200), "tiered-offload")
    assert kept(o.largest_params, H200.gpu, "split")
    assert option(plan(H200, o.largest_params), "tiered-offload").fit.fits
    assert not option(plan(H200, o.largest_params + 1), "tiered-offload").fit.fits
    assert o.limits["host RAM + NVMe"] == o.largest_params


@pytest.mark.parametrize("key, fmt", [("tiered-offload", "split"), ("tiered-offload-int8", "split-int8")])
def test_the_largest_small_offloaded_model_counts_weights_kept_under_the_window(key, fmt):
    """On a small box the largest offloaded model's weights are kept and smaller than the window, so they leave
    the state more HBM room than streaming would: the largest is searched with that room. It was searched with
    the window's alone, and printed 0.77B where 0.9B fits (and offered that figure as "a model of at most")."""
    from tiered.bench.plan_memory import default_activations, kept

    box = Box(gpu=12 * GB, ram=16 * GiB, disk=0)
    a = Assumptions(activations=default_activations(box.gpu))  # as the CLI sizes them: 12 GB leaves room
    o = option(plan(box, None, a), key)
    assert kept(o.largest_params, box.gpu, fmt, a) and 2 * o.largest_params < a.offload_window
    assert option(plan(box, o.largest_params, a), key).fit.fits
    assert option(plan(box, 900_000_000, a), key).fit.fits and o.largest_params >= 900_000_000
    for step in (1, o.largest_params // 100):
        assert not option(plan(box, o.largest_params + step, a), key).fit.fits


@pytest.mark.parametrize("params", [1, 350_000_000])
def test_a_small_offloaded_model_counts_no_window_larger_than_its_weights_and_gradients(params):
    """The window holds some of the model's bf16 weights and gradients (4 B a parameter), never more: the default
    4 GiB charged to a 350M model judged it not to fit an 8 GB card offloaded (8.8 GB of GPU) while it fit with its
    weights on the GPU (5.85 GB). Offloading only takes bytes off the GPU."""
    from tiered.bench.plan_memory import default_activations, device_scratch_bytes, offload_gpu_bytes

    box = Box(gpu=8 * GB, ram=64 * GiB, disk=100 * GB)
    a = Assumptions(activations=default_activations(box.gpu))
    r = plan(box, params, a, activations_default=True)
    on_gpu, off = option(r, "tiered").fit, option(r, "tiered-offload").fit
    scratch = device_scratch_bytes(params, "split", a), device_scratch_bytes(params, "split", a, offloaded=True)
    assert on_gpu.fits and off.fits  # but for the staging rows of the gradients the host holds:
    assert off.gpu_bytes - scratch[1] <= on_gpu.gpu_bytes - scratch[0]
    rest = a.activations + a.gpu_reserve + scratch[1]
    assert offload_gpu_bytes(params, "split", a) == min(a.offload_window, 4 * params) + rest


def test_a_model_that_does_not_fit_is_never_offered_a_larger_one():
    """Where the GPU keeps an offloaded model's weights, a 10B does not fit a box whose largest is 11B (a larger
    model streams them): the remedies offered "a model of at most 11.03B parameters" for the 10B."""
    from tiered.bench.plan import count_str
    from tiered.bench.plan_memory import default_activations

    box = Box(gpu=46 * GB, ram=125 * GiB, disk=0)
    a = Assumptions(activations=default_activations(box.gpu))
    o = option(plan(box, 10 * 10**9, a), "tiered-offload")
    assert not o.fit.fits and o.largest_params > 10 * 10**9
    assert not [w for w in o.fit.instead if "a model of at most" in w], o.fit.instead
    assert any("keep_for_backward=False" in w for w in o.fit.instead)
    smaller = option(plan(box, 12 * 10**9, a), "tiered-offload")  # over the largest: it is offered still
    assert f"a model of at most {count_str(smaller.largest_params)} parameters" in smaller.fit.instead


def test_offloaded_options_count_the_optimizers_gpu_scratch():
    """The update on the GPU takes three chunk records and a few rows there whatever else the GPU holds
    (DeviceUpdate): at 4 GiB chunks a 7B offloaded on a 24 GB card needs 22 GB of scratch beside the window and
    activations, and the offloaded options say GPU memory, as the option without offload does."""
    from tiered.bench.plan_memory import default_activations, device_scratch_bytes, offload_gpu_bytes

    n, a = 7 * 10**9, Assumptions(activations=default_activations(24 * GB), chunk_bytes=4 * GiB)
    r = plan(Box(gpu=24 * GB, ram=125 * GiB, disk=1000 * GB), n, a)
    for key, fmt in (("tiered-offload", "split"), ("tiered-offload-int8", "split-int8")):
        fit = option(r, key).fit
        scratch = device_scratch_bytes(n, fmt, a, offloaded=True)
        assert scratch > 22 * GB and fit.gpu_bytes == a.offload_window + a.activations + a.gpu_reserve + scratch
        assert fit.gpu_bytes == offload_gpu_bytes(n, fmt, a)
        assert not fit.fits and fit.short[0].startswith("GPU memory: needs"), key
        assert option(r, key).limits["GPU memory"] is not None  # one chunk's scratch binds every model past it
    assert not option(r, "tiered").fit.fits and option(r, "tiered").fit.short[0].startswith("GPU memory")
    # At the default 64 MiB chunks the same model fits offloaded, its GPU figure with the scratch in it.
    fit = option(plan(Box(gpu=24 * GB, ram=125 * GiB, disk=1000 * GB), n), "tiered-offload").fit
    scratch = device_scratch_bytes(n, "split", offloaded=True)
    assert fit.fits and fit.gpu_bytes == 4 * GiB + 8 * GiB + 2 * GiB + scratch and 0.3 * GB < scratch < 0.4 * GB


def test_a_verdict_with_no_other_way_ends_its_sentence():
    """An 8 GiB laptop: the RAM reserve leaves no host_budget and no other option fits; the verdict says what more
    RAM would do and ends there."""
    r = plan(Box(gpu=24 * GB, ram=8 * GiB, disk=1000 * GB), 10**9)
    assert option(r, "tiered").fit.instead == []
    assert "It would fit with 9 GiB of RAM with this disk. Does not fit:" in r.verdict
    assert "or with ." not in r.verdict and " ." not in r.verdict


@pytest.mark.parametrize("flag", ["--gpu", "--ram", "--disk"])
def test_a_size_without_a_unit_is_refused_with_the_likely_meaning(capsys, flag):
    argv = {"--gpu": "24GB", "--ram": "64GiB", "--disk": "1TB"}
    argv[flag] = "24"
    assert cli.main(["plan", *[x for kv in argv.items() for x in kv]]) == 2
    err = capsys.readouterr().err
    assert f"{flag} 24 is 24 bytes: give a unit (did you mean 24GB?)" in err and "Traceback" not in err
    assert cli.main(["plan", "--gpu", "24GB", "--ram", "64GiB", "--disk", "0"]) == 0  # no disk is a size
    capsys.readouterr()


def test_a_host_budget_too_small_for_one_chunk_is_named():
    box = Box(gpu=141 * GB, ram=8 * GiB, disk=64 * GB)  # the 8 GiB reserve leaves no host_budget
    r = plan(box, 10**9)
    fit = option(r, "tiered").fit
    assert option(r, "tiered").largest_params == 0 and not fit.fits
    assert fit.short == ["host RAM + NVMe: host_budget 0.0 GB cannot hold one chunk"]
    assert option(plan(dataclasses.replace(box, ram=fit.min_ram), 10**9), "tiered").fit.fits


def test_bad_arguments_to_the_function():
    with pytest.raises(ValueError, match="must be > 0"):
        Box(gpu=0, ram=GiB, disk=0)
    with pytest.raises(ValueError, match="byte count"):
        Box(gpu=-1, ram=GiB, disk=0)
    with pytest.raises(ValueError, match="whole number >= 1"):
        plan(H200, 0)
    with pytest.raises(ValueError, match="activations"):
        Assumptions(activations=-1)


def test_the_report_names_every_option_and_says_it_is_computed():
    text = render_plan(plan(H200, 13 * 10**9))
    assert "computed by tiered-bench plan" in text and "not measured" in text
    for o in OPTIONS:
        assert text.count(o.label) >= 2, o.label
    assert 'host_budget="115200MiB"' in text


def test_a_gpu_the_assumed_activations_fill_says_to_give_them():
    """Under a 10 GB GPU the default activations (8 GiB) and reserve leave no option room (the 12.4B trained on 12 GB
    at 2 x 2048 tokens): the report says the activations are the assumption to give, and says nothing of it where
    they fit."""
    small = render_plan(plan(Box(gpu=10 * GB, ram=125 * GiB, disk=64 * GB)))
    assert "leave no room on this GPU for" in small and "--activations" in small
    assert "for tiered (defaults); tiered, parameters offloaded; tiered, offloaded, 8-bit moments;" in " ".join(
        small.split()
    )
    roomy = plan(Box(gpu=12 * GB, ram=125 * GiB, disk=64 * GB), assumptions=Assumptions(activations=3 * GiB))
    assert option(roomy, "tiered-offload").largest_params > 10**10
    assert "note:" not in render_plan(roomy) and "note:" not in render_plan(plan(H200))


# ------------------------------------------------------------------------------------------------ the CLI
def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "tiered.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_cli_json_is_the_plan():
    p = run_cli("plan", "--params", "13B", "--gpu", "141GB", "--ram", "125GiB", "--disk", "64GB", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert (doc.pop("schema"), doc.pop("command")) == (1, "plan")
    assert doc == json.loads(json.dumps(dataclasses.asdict(plan(H200, 13 * 10**9, activations_default=True))))
    assert doc["options"][0]["fit"]["fits"] and doc["options"][0]["fit"]["host_budget"] == "115200MiB"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--params", "-1"], "argument --params: cannot parse --params '-1'"),
        (["--params", "abc"], "argument --params: cannot parse --params 'abc'"),
        (["--params", "0"], "--params must be a whole number >= 1"),
        (["--params", "1.5"], "--params must be a whole number >= 1"),
        (["--gpu", "lots"], "argument --gpu: cannot parse size 'lots'"),
    ],
)
def test_cli_bad_values_are_one_line_errors(capsys, args, message):
    argv = ["plan", "--gpu", "141GB", "--ram", "125GiB", "--disk", "64GB", *args]
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_rejects_a_box_without_ram_and_a_missing_size(capsys):
    assert cli.main(["plan", "--gpu", "24GB", "--ram", "0", "--disk", "1TB"]) == 2
    assert "error: the box needs GPU memory and RAM" in capsys.readouterr().err
    assert cli.main(["plan", "--gpu", "24GB", "--ram", "64GiB", "--disk", "1TB", "--chunk-bytes", "1KiB"]) == 2
    assert "chunk_bytes must be at least 4 KiB" in capsys.readouterr().err  # as TieredOptimizer refuses it
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--gpu", "24GB", "--ram", "64GiB"])
    assert e.value.code == 2 and "--disk" in capsys.readouterr().err
    p = run_cli("plan", "--params", "abc", "--gpu", "24GB", "--ram", "64GiB", "--disk", "1TB")
    assert p.returncode == 2 and "Traceback" not in p.stderr and "cannot parse --params 'abc'" in p.stderr


def test_importing_the_planner_needs_no_torch():
    code = "import sys, tiered.bench.plan as p; p.plan(p.Box(gpu=10**11, ram=2**37, disk=10**12), 10**9); "
    code += "print('torch' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stderr


# ---------------------------------------------------------------------------------------------- the docs
def pasted_plans() -> list[tuple[str, str, str]]:
    """Every ```text block in README.md and docs/capacity.md that starts with `$ tiered-bench plan ...`."""
    out = []
    for name in ("README.md", "docs/capacity.md"):
        for block in re.findall(r"```text\n(.*?)```", (ROOT / name).read_text(), re.S):
            first, _, rest = block.partition("\n")
            if first.startswith("$ tiered-bench plan "):
                out.append((name, first.removeprefix("$ tiered-bench "), rest))
    return out


def test_the_docs_paste_what_the_tool_prints(capsys):
    pasted = pasted_plans()
    assert {name for name, _, _ in pasted} == {"README.md", "docs/capacity.md"}
    for name, command, text in pasted:
        assert cli.main(command.split()) == 0
        assert capsys.readouterr().out == text, f"{name}: rerun `tiered-bench {command}` and paste its output"


def test_recommend_gpu_budget_keeps_what_training_leaves_spare():
    from tiered.bench.plan import device_scratch_bytes, recommend_gpu_budget

    a, allowed, params = Assumptions(), 140 * GiB, 13_000_000_000
    got = recommend_gpu_budget(60 * GiB, allowed, params, "split", a)
    spare = allowed - 60 * GiB - device_scratch_bytes(params, "split", a) - a.gpu_reserve - allowed // 20
    assert got % GiB == 0 and spare - GiB < got <= spare
    assert recommend_gpu_budget(allowed, allowed, params, "split", a) == 0  # nothing spare
    small = state_split(1_000_000, "split", 1 << 62, a)
    assert recommend_gpu_budget(GiB, allowed, 1_000_000, "split", a) == -(-small.state_bytes // MiB) * MiB  # all of it
    # The host budget is planned for what HBM leaves: whole chunks there, the rest in DDR.
    ram = 4096 * GiB
    whole = recommend_host_budget(params, "split", ram, a)
    less = recommend_host_budget(params, "split", ram, a, gpu_budget=40 * GiB)
    assert 40 * GiB - record_bytes("split", chunk_numel("split", a.chunk_bytes)) - GiB <= whole - less <= 40 * GiB + GiB


def test_without_activations_the_cli_assumes_a_quarter_of_the_gpu(capsys):
    """On a 12 GB card 8 GiB of activations would leave no model room; a card that size runs small micro-batches
    (the project's runs under a 12 GB cap: 2 x 2048 tokens). At most 8 GiB, on any card."""
    assert cli.main("plan --gpu 12GB --ram 128GiB --disk 1TB".split()) == 0
    out = capsys.readouterr().out
    assert "activations 3.0 GB," in out and "note: the assumed activations" not in out
    offloaded = next(line for line in out.splitlines() if line.lstrip().startswith("tiered, parameters offloaded"))
    assert float(re.search(r"([0-9.]+)B\s+RAM", offloaded).group(1)) > 10
    assert cli.main("plan --gpu 141GB --ram 128GiB --disk 1TB".split()) == 0
    assert "activations 8.6 GB," in capsys.readouterr().out
    assert cli.main("plan --gpu 10GB --ram 128GiB --disk 1TB --activations 8GiB".split()) == 0
    assert "note: the assumed activations (8.6 GB)" in capsys.readouterr().out  # given: as given


def test_the_offloaded_window_is_an_assumption_the_cli_takes(capsys):
    """An 8 GB card: the default window (4 GiB, a 10B-30B Llama's blocks) leaves an offloaded model room only where
    its whole weights and gradients are smaller (under 1.07B); a 1B Llama's blocks take under 1 GB, and with
    --offload-window 1GiB the card trains 5B offloaded."""

    def largest_offloaded(argv: str) -> str:
        assert cli.main(argv.split()) == 0
        out = capsys.readouterr().out
        assert "note:" not in out
        line = next(line for line in out.splitlines() if line.lstrip().startswith("tiered, parameters offloaded"))
        return line.split()[-8]

    small = largest_offloaded("plan --gpu 8GB --ram 32GiB --disk 1TB")
    assert small.endswith("M") and 4 * float(small[:-1]) * 1e6 < 4 * GiB
    assert float(largest_offloaded("plan --gpu 8GB --ram 32GiB --disk 1TB --offload-window 1GiB")[:-1]) > 5


def test_capacity_md_states_the_offloaded_scratch_the_plan_counts():
    """docs/capacity.md's prose figures for the optimizer's GPU scratch with the parameters offloaded are the
    code's (it said 0.67 GB with 8-bit moments where the plan counts 0.65 GB)."""
    from tiered.bench.plan_memory import device_scratch_bytes

    text = " ".join((ROOT / "docs" / "capacity.md").read_text().split())
    split = device_scratch_bytes(13 * 10**9, "split", offloaded=True) / 1e9
    int8 = device_scratch_bytes(13 * 10**9, "split-int8", offloaded=True) / 1e9
    big = device_scratch_bytes(7 * 10**9, "split", Assumptions(chunk_bytes=4 * GiB), offloaded=True) / 1e9
    assert f"({split:.2f} GB at the default `chunk_bytes`, {int8:.2f} GB with 8-bit moments" in text
    assert f"`--chunk-bytes 4GiB`: {big:.1f} GB)" in text


def test_the_docs_prose_states_the_plans_figures_on_a_24gb_card():
    """Prose figures worked out with the 8 GiB of activations the plan assumed before it sized them to the GPU (6 GB
    on 24 GB) outlived that change: docs/offload.md's 24 GB card capping a model at "about 3.3B" (the plan: 3.90B),
    docs/capacity.md's state an offloaded model keeps in HBM on 24 GB, "about 8.7 GB" with its weights streamed and
    "about 4.1 GB" for the 4.42B with them kept. Each is the plan's, as the CLI computes it without --activations."""
    from tiered.bench.plan_memory import default_activations

    a = Assumptions(activations=default_activations(24 * GB))
    on_gpu = option(plan(Box(24 * GB, 64 * GiB, 1000 * GB), None, a, activations_default=True), "tiered")
    offload = " ".join((ROOT / "docs" / "offload.md").read_text().split())
    assert f"On a 24 GB card that caps a model at about {on_gpu.largest_params / 1e9:.1f}B parameters" in offload

    def in_hbm(n: int) -> str:
        fit = option(plan(Box(24 * GB, 128 * GiB, 1000 * GB), n, a, activations_default=True), "tiered-offload").fit
        return f"{fit.hbm_state_bytes / 1e9:.1f} GB"

    capacity = " ".join((ROOT / "docs" / "capacity.md").read_text().split())
    assert f"on a 24 GB GPU about {in_hbm(10 * 10**9)} of it for a model whose weights are streamed" in capacity
    assert f"(the 4.42B: 8.8 GB) leaves less, about {in_hbm(4_420_000_000)} (" in capacity


def test_the_readme_names_the_bound_the_plan_names_for_an_offloaded_model_on_a_24gb_card():
    """README.md said the largest model with the parameters offloaded on a 24 GB GPU, 128 GiB of RAM and 1 TB of
    disk was "bound by RAM", where the plan (and docs/capacity.md's pasted block) names RAM + NVMe: the state's room,
    what the weights and gradients leave of RAM plus the disk, binds before the weights and gradients alone do."""
    from tiered.bench.plan_memory import default_activations

    a = Assumptions(activations=default_activations(24 * GB))
    r = plan(Box(24 * GB, 128 * GiB, 1000 * GB), None, a, activations_default=True)
    bound = option(r, "tiered-offload").bound_by
    readme = " ".join((ROOT / "README.md").read_text().split())
    said = re.findall(r"the largest model goes from [\d.]+B to [\d.]+B, bound by (.+?) \(docs/capacity\.md\)", readme)
    assert said == [{"GPU memory": "the GPU", "host RAM": "RAM", "host RAM + NVMe": "RAM + NVMe"}[bound]]
