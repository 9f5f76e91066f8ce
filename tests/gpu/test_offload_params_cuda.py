"""Parameters and gradients off the GPU, on CUDA (skipped without it): tiered.offload_model streams a 0.27B
Llama's layers to the GPU one at a time under a memory cap below its weights and gradients, and the weights
after N steps are bitwise those of the same run with the model on the GPU, clipped or not (the offloaded model's
clip takes its norm on the GPU, each gradient copied up once, and scales the gradients as the update reads them:
tiered/optim/shards.py, ``defer``).

Both runs update on the GPU (``update_on="device"``, what "auto" picks for both): the offloaded model's shards
are CPU tensors, its gradients go up and its new weights come down around the same fused AdamW the run on the
GPU runs; the only difference left is where the weights and gradients live, which is what must not change a bit.
"""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import run_bounded
from test_offload_conversions import CASTS, train
from test_offload_params import RUN_TIMEOUT, child, interrupted, run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed"),
]

ON_GPU = dict(device="cuda", shape="wide", update_on="device", split_masters=True, host_budget="3GiB",
              chunk_bytes="64MiB", accumulate=2, steps=(0, 3), keep=False)  # fmt: skip


@pytest.mark.parametrize("dtype, autocast", [("bfloat16", False), ("float32", True)], ids=["bf16", "fp32-autocast"])
def test_offloaded_run_on_cuda_trains_as_on_the_gpu_under_a_cap_the_gpu_run_cannot_fit(tmp_path, dtype, autocast):
    """bf16 weights are bitwise those of the run on the GPU, with a clip that fires and without. fp32 weights under
    autocast are cast per block by FSDP2 rather than per op, so those runs agree to rounding: losses within 1e-3."""
    kw = {**ON_GPU, "dtype": dtype, "autocast": autocast, "split_masters": dtype == "bfloat16"}
    plain = run(tmp_path, "plain", offload=False, **kw)
    params = plain["params"]
    whole = params * 4 if dtype == "bfloat16" else params * 8  # the whole model's weights and gradients
    assert plain["peak"] > whole  # the yardstick: on the GPU the model took all of it
    # The cap: less than the whole model's weights and gradients. Under it the model on the GPU runs out of
    # memory, and the offloaded one trains. (How far below the cap it peaks depends on how far the host runs
    # ahead of the GPU: FSDP2 gathers a block as soon as the host reaches it, bench/offload_memory.py.)
    cap = int(0.75 * whole)
    if dtype == "bfloat16":  # fp32 under autocast: the capped run on the GPU completed (bench/RESULTS.md, open)
        with pytest.raises(torch.cuda.OutOfMemoryError):
            run(tmp_path, "plain-capped", offload=False, gpu_cap=cap, **kw)
        gc.collect()  # the failed run's model, held by its traceback's frames, leaves the GPU before the next
        torch.cuda.empty_cache()
    off = run(tmp_path, "off", offload=True, gpu_cap=cap, **kw)
    assert off["prefetch"]["hits"] > 0  # the next block's weights copied ahead on their own stream, and used
    assert plain["clipped"]
    assert off["losses"] == pytest.approx(plain["losses"], rel=1e-3)
    if dtype == "bfloat16":
        assert off["losses"] == plain["losses"]
        assert off["weights"] == plain["weights"]
        plain = run(tmp_path, "plain-noclip", offload=False, **{**kw, "clip": None})
        off = run(tmp_path, "off-noclip", offload=True, gpu_cap=int(0.75 * whole), **{**kw, "clip": None})
        assert off["losses"] == plain["losses"]
        assert off["weights"] == plain["weights"]


def test_weights_kept_from_forward_to_backward_on_cuda_are_bitwise_the_run_on_the_gpu(tmp_path, monkeypatch):
    """keep_for_backward=True: backward's recompute (gradient checkpointing) uses the weights forward copied up,
    each crossing PCIe once a micro-batch; the weights after three steps are bitwise the run on the GPU's (no
    clip: its norm is summed where the gradients lie), and the run peaks above the streamed one by about the
    weights it kept. Both offloaded runs add their micro-batches' gradients on the GPU, and keep none of those
    sums there (resident_grads off: kept at backward's end, they would raise the streamed run's peak to about
    the kept weights', which peak at forward's end)."""
    from tiered.optim import resident_grads

    monkeypatch.setattr(resident_grads, "ENABLED", False)
    kw = {**ON_GPU, "clip": None, "checkpointing": True}
    plain = run(tmp_path, "plain", offload=False, **kw)
    streamed = run(tmp_path, "streamed", offload=True, **kw)
    kept = run(tmp_path, "kept", offload=True, **{**kw, "keep": True})
    assert kept["losses"] == plain["losses"] == streamed["losses"]
    assert kept["weights"] == plain["weights"] == streamed["weights"]
    assert streamed["prefetch"]["hits"] > 0 and kept["prefetch"]["hits"] > 0
    # The second micro-batch of each step was added to the first on the GPU (offload.accumulation.SUM_ON_DEVICE),
    # every block of it: the bits above are those sums.
    for r in (streamed, kept):
        assert r["sums"]["bytes_summed_on_device"] == r["sums"]["bytes_summed"] > 0
    weights = 2 * plain["params"]
    assert kept["peak"] > streamed["peak"] + weights // 2


@pytest.mark.parametrize("keep", [False, True])
def test_evaluations_on_cuda_leave_no_stale_weights(tmp_path, keep):
    """An evaluation before the optimizer is built and one between each backward and its step (forwards under
    no_grad: no backward drops what they gathered, tiered.offload.reshard does), streamed and with every block
    kept: bitwise the run on the GPU with the same evaluations (no clip: its norm is summed where the gradients
    lie)."""
    kw = {**ON_GPU, "clip": None, "evaluate": True, "evaluate_first": True}
    plain = run(tmp_path, "plain", offload=False, **kw)
    off = run(tmp_path, f"off-{keep}", offload=True, **{**kw, "keep": keep})
    assert off["losses"] == plain["losses"]
    assert off["weights"] == plain["weights"]


@pytest.mark.parametrize(
    "then, micro_batches, failing",
    [("skip", 2, 0), ("keep", 2, 0), ("keep", 3, 1), ("keep", 2, 1)],
    ids=["skip", "keep", "keep-after-the-first", "keep-then-the-step"],
)
def test_a_backward_that_raised_part_way_on_cuda_is_dropped_or_kept_as_on_the_gpu(tmp_path, then, micro_batches,
                                                                                   failing):  # fmt: skip
    """A backward that raises part-way, then the batch skipped (zero_grad) or the next micro-batch's gradients
    added to what it made (or the step taking it, where it was the last): bitwise the run on the GPU (no clip),
    the failed backward ended on FSDP2's streams. On torch before 2.14 (the GPU machine's 2.11)
    offload/failed_pass.py resets FSDP2's fields one by one."""
    kw = dict(where="backward", then=then, device="cuda", clip=None, update_on="device", micro_batches=micro_batches,
              failing=failing)  # fmt: skip
    plain = run_bounded(lambda: interrupted(str(tmp_path / "p"), offload=False, **kw), timeout=RUN_TIMEOUT)
    off = run_bounded(lambda: interrupted(str(tmp_path / "o"), offload=True, **kw), timeout=RUN_TIMEOUT)
    assert off == plain


def test_the_last_blocks_kept_as_the_room_allows_on_cuda_are_bitwise_the_run_on_the_gpu(tmp_path):
    """keep_for_backward="room": after two backwards have measured a pass, as many of the last layers' weights as
    fit the GPU's room stay there from forward to backward (offload/kept_weights.py). Under a cap that leaves
    room for about five layers' weights beside a streamed run's peak and the room's margin (1 GiB and a
    sixteenth: auto_budget.backward_room), some are kept, the run stays under the cap, and the weights after
    three steps of two micro-batches are bitwise the run on the GPU's (clipped)."""
    kw = {**ON_GPU, "checkpointing": True, "steps": (0, 3)}
    plain = run(tmp_path, "plain", offload=False, **kw)
    streamed = run(tmp_path, "streamed", offload=True, **kw)
    layer = 2 * plain["params"] // 16  # about: the wide shape's 16 layers hold nearly all of it
    cap = int((streamed["peak"] + (1 << 30) + 5 * layer) * 16 / 15)
    kept = run(tmp_path, "room", offload=True, gpu_cap=cap, **{**kw, "keep": "room"})
    assert kept["kept_blocks"] > 0
    assert kept["peak"] <= cap
    assert plain["clipped"]
    assert kept["losses"] == plain["losses"]
    assert kept["weights"] == plain["weights"]


def test_offloaded_state_in_hbm_updates_bitwise_as_streamed(tmp_path):
    """An offloaded model's state chunks kept in the GPU's spare memory (gpu_budget) update where they lie, their
    gradients going up and new weights coming down: the weights are bitwise those of the run whose state all
    streams through pinned memory, with a clip and without."""
    for clip in (0.5, None):
        kw = {**ON_GPU, "clip": clip}
        streamed = run(tmp_path, f"streamed-{clip}", offload=True, **kw)
        in_hbm = run(tmp_path, f"hbm-{clip}", offload=True, gpu_budget="512MiB", **kw)
        assert streamed["hbm"] == 0 and in_hbm["hbm"] > 0
        assert in_hbm["losses"] == streamed["losses"]
        assert in_hbm["weights"] == streamed["weights"]


def test_the_clips_gradient_copies_kept_on_the_gpu_update_bitwise_as_sent_again(tmp_path, monkeypatch):
    """The clip's norm copies each offloaded gradient up; where the GPU has room (auto_budget.grad_room) the copies
    stay for the update to read, instead of the host gradients going up a second time. Kept all, half, or none
    (the room forced), the clipped run is bitwise the run on the GPU."""
    import tiered.optim.resident_grads
    import tiered.optim.shards

    monkeypatch.setattr(tiered.optim.resident_grads, "ENABLED", False)  # the clip's own copies, none found
    kw = {**ON_GPU, "clip": 0.5}
    plain = run(tmp_path, "plain", offload=False, **kw)
    whole = run(tmp_path, "whole", offload=True, **kw)
    grads = 2 * plain["params"]  # bf16 gradients
    assert plain["clipped"] and whole["grads_kept"] == grads
    for name, room in (("half", grads // 2), ("none", 0)):
        monkeypatch.setattr(tiered.optim.shards, "grad_room", lambda device, room=room: room)
        part = run(tmp_path, name, offload=True, **kw)
        assert 0 <= part["grads_kept"] <= room and (part["grads_kept"] > 0) == (room > 0)
        assert part["losses"] == plain["losses"] and part["weights"] == plain["weights"], name
    assert whole["losses"] == plain["losses"] and whole["weights"] == plain["weights"]


def test_offloaded_resume_on_cuda_in_a_new_process_is_bitwise_the_straight_run(tmp_path):
    straight = run(tmp_path, "straight", offload=True, **{**ON_GPU, "steps": (0, 4)})
    ckpt = tmp_path / "ckpt"
    child(tmp_path, "first", offload=True, **{**ON_GPU, "steps": [0, 2], "save": str(ckpt)})
    resumed = child(tmp_path, "second", offload=True, **{**ON_GPU, "steps": [2, 4], "load": str(ckpt)})
    assert resumed["losses"] == straight["losses"][4:]
    assert resumed["weights"] == straight["weights"]


def test_the_last_micro_batchs_sums_left_on_the_gpu_clip_and_update_bitwise(tmp_path, monkeypatch):
    """tiered.optim.resident_grads switched on: the last micro-batch's sums, made on the GPU, stay there for the
    clip's norm and the update instead of being copied up again; the clipped run is bitwise the run on the GPU,
    and some of its gradients were found there."""
    import tiered.optim.resident_grads as resident_grads

    kw = {**ON_GPU, "clip": 0.5}
    plain = run(tmp_path, "plain", offload=False, **kw)
    monkeypatch.setattr(resident_grads, "ENABLED", True)
    found = run(tmp_path, "found", offload=True, **kw)
    assert plain["clipped"] and 0 < found["grads_found"] <= found["grads_kept"]
    assert found["losses"] == plain["losses"] and found["weights"] == plain["weights"]
    assert resident_grads.held_bytes() == 0  # the last step took them or the model's close dropped them


def test_a_slow_copy_down_never_reads_another_blocks_gradients(tmp_path, monkeypatch):
    """FSDP2 copies a block's reduced gradients down on the all-reduce hook's stream, yet frees their memory as if
    the copy ran on the reduce-scatter stream; offload.accumulation keeps that memory until the copy is done. Each
    hook here first holds its stream back 20 ms or so (a GPU sleep), so that without the keep the next block's
    reduce-scatter would overwrite the memory under the copy: the run stays bitwise the run on the GPU. (Patch
    ``offload.device_sums.keep_until_copied`` to do nothing and it fails.)"""
    import tiered.offload.accumulation as acc

    add = acc.add_on_device

    def slow(views, reduce_output, held, kept=None):
        torch.cuda._sleep(40_000_000)  # GPU clock cycles, on the hook's stream: ahead of FSDP2's copy down
        return add(views, reduce_output, held, kept)

    kw = {**ON_GPU, "clip": 0.5}
    plain = run(tmp_path, "plain", offload=False, **kw)
    monkeypatch.setattr(acc, "add_on_device", slow)
    off = run(tmp_path, "slow", offload=True, **kw)
    assert off["sums"]["bytes_summed_on_device"] > 0
    assert off["losses"] == plain["losses"] and off["weights"] == plain["weights"]


def test_sums_added_from_the_copies_kept_on_the_gpu_update_bitwise(tmp_path, monkeypatch):
    """offload.accumulation.SUM_FROM_KEPT: a micro-batch's held sums are added from the copies the backward before
    kept on the GPU (none copied up again); the clipped run is bitwise the run on the GPU, and some were."""
    import tiered.offload.accumulation as acc
    import tiered.optim.resident_grads as resident_grads

    kw = {**ON_GPU, "clip": 0.5}
    plain = run(tmp_path, "plain", offload=False, **kw)
    monkeypatch.setattr(resident_grads, "ENABLED", True)
    monkeypatch.setattr(acc, "SUM_FROM_KEPT", True)
    kept = run(tmp_path, "kept", offload=True, **kw)
    assert 0 < kept["sums"]["bytes_summed_from_kept"] <= kept["sums"]["bytes_summed_on_device"]
    assert kept["losses"] == plain["losses"] and kept["weights"] == plain["weights"]


def test_the_first_backwards_keep_no_sums_and_measure_what_a_pass_takes(tmp_path):
    """resident_grads' room (auto_budget.backward_room) is measured above passes that kept nothing: the model's
    first backward (nothing held) and its second (which adds the first's held sums on the GPU) keep no sums there
    and record their peak; the third keeps some, and never more than the limit less that peak and the margin, and
    peaks no higher than that peak plus what it counts as kept (a kept sum holds its block's whole reduced
    gradients: counted by storage, a norm's weight kept alone cannot hide them; bench/RESULTS.md, twenty-third
    session). (The sequence after a zero_grad or a probe: tests/unit/offload/test_offload_accumulation.py.)"""
    from test_offload_params import llama, micro_batch

    import tiered.offload
    from tiered.auto_budget import backward_room
    from tiered.offload import offload_model
    from tiered.optim import resident_grads

    model = llama(torch.bfloat16, "wide")
    offload_model(model, device="cuda", keep_for_backward=False)
    acc = model.tiered_accumulation
    try:
        for k in range(3):
            x = micro_batch(0, k, 8000).cuda()
            if k == 2:
                torch.cuda.reset_peak_memory_stats()
            model(input_ids=x, labels=x).loss.backward()
            if k < 2:
                assert resident_grads.held_bytes(acc) == 0
                assert acc.kept.pass_peak is not None and acc.kept.measured == k + 1
        assert acc.stats()["bytes_summed_on_device"] > 0
        kept = resident_grads.held_bytes(acc)
        assert 0 < kept <= backward_room(torch.device("cuda"), acc.kept.pass_peak, 0)
        assert torch.cuda.max_memory_allocated() <= acc.kept.pass_peak + kept + (16 << 20)
    finally:
        resident_grads.drop(acc)
        tiered.offload.close()


def test_offload_model_holds_one_units_weights_on_the_gpu_at_a_time():
    """fully_shard copies a unit's weights up in place before it shards them to host memory; offload_model let
    every block's copy stay in HBM until its loop ended, and the 13.01B ran out of a 16 GB GPU there (bench/
    RESULTS.md, thirtieth session). Each unit's copy goes before the next is made: HBM peaks near one block and
    the root, far below the model."""
    from test_offload_params import llama

    import tiered.offload
    from tiered.offload import offload_model

    model = llama(torch.bfloat16, "wide")
    size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    blocks = [size(layer) for layer in model.model.layers]
    whole, root = size(model), size(model) - sum(blocks)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        offload_model(model, device="cuda", keep_for_backward=False)
        peak = torch.cuda.max_memory_allocated() - base
        assert peak <= 2 * max(blocks) + root < whole / 2, (peak, max(blocks), root, whole)
    finally:
        tiered.offload.close()


def test_the_example_reports_each_forward_and_backward_against_the_links_floor(tmp_path):
    """examples/big_model.py offloaded on CUDA: the link's pinned rates measured once, then for each step the bytes
    its forward and backward moved each way (the weights up at least once a micro-batch, every micro-batch's
    reduced gradients down) and the least time they take on that link, which the pass cannot beat."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "big_model.py"
    toy = "--hidden 256 --layers 2 --heads 4 --inter 512 --vocab 512 --seq 64 --steps 2 --accumulate 2".split()
    out = tmp_path / "run.json"
    cmd = [sys.executable, str(example), *toy, "--offload", "on", "--nvme-path", str(tmp_path / "state"),
           "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "link (pinned, measured now): h2d" in proc.stdout
    assert len([ln for ln in proc.stdout.splitlines() if ln.startswith("  link, forward and backward:")]) == 2
    link = json.loads(out.read_text())["link"]
    assert min(link["rates_GBps"].values()) > 0 and len(link["floor_s"]) == 2
    for up, down, floor in zip(link["up_bytes"], link["down_bytes"], link["floor_s"]):
        assert up >= down > 0 and floor > 0  # each micro-batch's weights up at least once, its gradients down once


@pytest.mark.parametrize("how", ["to-bf16", "to-device-bf16"])
def test_a_cast_after_offload_on_cuda_stays_in_page_locked_slabs_and_trains_as_on_the_gpu(tmp_path, how):
    """A cast after offload_model (then the frameworks' move to the GPU; or both in one ``.to("cuda", bfloat16)``,
    which cast the buffers alone before) lays the weights out in fresh page-locked slabs of their size, never
    through torch's pinned allocator (which pinned each new tensor alone, rounded up to a power of two), FSDP2 told
    they are pinned; training is bitwise the model cast and trained on the GPU."""
    cast, dtype = CASTS[how]
    kw = dict(cast=cast, dtype=dtype, device="cuda", width=512)
    plain = run_bounded(lambda: train(str(tmp_path / "p"), offload=False, **kw), timeout=RUN_TIMEOUT)
    off = run_bounded(lambda: train(str(tmp_path / "o"), offload=True, **kw), timeout=RUN_TIMEOUT)
    checks = off["checks"]
    assert checks["pinned_handouts"] == 0
    assert all(checks["weights_in_slabs"]) and all(checks["grads_in_slabs"]) and checks["old_closed"]
    assert all(checks["pinned"]) and all(checks["fsdp_pinned"])
    assert {w.dtype for w in off["weights"].values()} == {dtype}
    assert off["losses"] == plain["losses"]
    for group in ("weights", "buffers"):
        for name, value in plain[group].items():
            assert torch.equal(value, off[group][name]), name


@pytest.mark.parametrize("source", ["cuda", "cpu"])
def test_a_data_assignment_on_cuda_trains_as_the_documented_way_round(tmp_path, source):
    """``p.data = t`` on an offloaded model on CUDA (``t`` on the GPU, as a user's EMA shadow is, or in host memory)
    is taken into the parameter's host shard at the next forward: the run is bitwise the one that wrote the same
    values through the way round docs/offload.md gives, ``p.to_local().copy_(t)``, and differs from the run that
    wrote nothing."""
    from test_offload_params import digest, llama, micro_batch

    import tiered.offload
    from tiered import TieredOptimizer
    from tiered.offload import offload_model

    def train(how: str) -> tuple[list[float], list[str]]:
        torch.manual_seed(0)
        model = llama(torch.bfloat16)
        try:
            offload_model(model, device="cuda")
            opt = TieredOptimizer(model, nvme_path=tmp_path / how, lr=1e-2)
            losses = []
            for step in range(3):
                if step == 1 and how != "none":
                    p = dict(model.named_parameters())["model.norm.weight"]
                    t = torch.full(p.shape, 0.3, dtype=p.dtype, device=source)
                    if how == "data":
                        p.data = t
                    else:
                        with torch.no_grad():
                            p.to_local().copy_(t)
                x = micro_batch(step, 0).cuda()
                loss = model(input_ids=x, labels=x).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            weights = [digest(p) for p in model.parameters()]
            opt.close()
            return losses, weights
        finally:
            tiered.offload.close()

    data, way_round, none = train("data"), train("copy"), train("none")
    assert data == way_round
    assert data[0][2] != none[0][2]
