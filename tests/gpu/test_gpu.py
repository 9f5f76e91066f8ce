"""The CUDA path, run on the GPU machine (skipped elsewhere): side streams, pinned buffers, bf16 masters."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from io_engine import IOEngine, PinnedBufferPool
from tiered import TieredOptimizer

pytestmark = pytest.mark.gpu


def mlp(dtype=torch.float32):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 16))
    return m.to(device="cuda", dtype=dtype)


def data(steps, dtype=torch.float32):
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(steps):
        yield (
            torch.randn(32, 64, device="cuda", generator=g).to(dtype),
            torch.randn(32, 16, device="cuda", generator=g),
        )


def test_pool_pins_and_engine_reads_into_pinned(tmp_path):
    with PinnedBufferPool("8MiB") as pool, IOEngine() as eng:
        buf = pool.acquire(3 << 20)
        assert buf.tensor.is_pinned()
        assert buf.tensor.data_ptr() % 4096 == 0
        src = torch.randint(0, 255, (3 << 20,), dtype=torch.uint8)
        eng.write(src, tmp_path / "f.bin")
        eng.read(buf.tensor, tmp_path / "f.bin")
        assert torch.equal(buf.tensor, src)
        gpu = buf.tensor.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(gpu.cpu(), src)
        buf.release()


UPDATE_ON = pytest.mark.parametrize("update_on", ["host", "device"])


@UPDATE_ON
@pytest.mark.parametrize("host_budget", ["256MiB", "512KiB"])
def test_cuda_fp32_parity_with_torch_adamw(tmp_path, host_budget, update_on):
    ref = mlp()
    model = copy.deepcopy(ref)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    kw = dict(lr=1e-3, host_budget=host_budget, chunk_bytes="96KiB", update_on=update_on)
    with TieredOptimizer(model, tmp_path, **kw) as opt:
        for x, y in data(20):
            for m, o in ((ref, torch_opt), (model, opt)):
                nn.functional.mse_loss(m(x), y).backward()
                o.step()
                o.zero_grad()
        if host_budget == "512KiB":  # half of the 1 MB state: part of it streams from disk
            assert opt.stats()["last_step"]["nvme_read_bytes"] > 0
    for a, b in zip(ref.parameters(), model.parameters()):
        if update_on == "device":  # torch's own CUDA kernel on the same numbers: bit for bit
            assert torch.equal(a, b)
        else:  # the CPU kernel against the CUDA one: float rounding
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@UPDATE_ON
@pytest.mark.parametrize("split_masters", [True, False], ids=["split", "full"])
def test_cuda_bf16_params_match_fp32_master_reference(tmp_path, split_masters, update_on):
    model = mlp(torch.bfloat16)
    where = "cuda" if update_on == "device" else "cpu"  # the kernel tiered runs: bitwise comparable
    masters = [p.detach().float().to(where).requires_grad_() for p in model.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-3, fused=True)
    kw = dict(lr=1e-3, host_budget="1MiB", chunk_bytes="96KiB", split_masters=split_masters, update_on=update_on)
    with TieredOptimizer(model, tmp_path, **kw) as opt:
        assert (opt.stats()["split_chunks"] > 0) == split_masters
        for x, y in data(10, torch.bfloat16):
            nn.functional.mse_loss(model(x).float(), y).backward()
            for m, p in zip(masters, model.parameters()):
                m.grad = p.grad.float().to(where)
            ref_opt.step()
            opt.step()
            opt.zero_grad()
            for m, p in zip(masters, model.parameters()):
                assert p.dtype == torch.bfloat16 and p.is_cuda
                assert torch.equal(p.detach().cpu(), m.detach().to(torch.bfloat16).cpu())
        sd = opt.state_dict()
        for i, m in enumerate(masters):
            assert torch.equal(sd["state"][i]["master"], m.detach().cpu())


@UPDATE_ON
def test_cuda_serial_twin_matches_pipelined(tmp_path, update_on):
    results = []
    for depth in (0, 3):
        model = mlp(torch.bfloat16)
        with TieredOptimizer(model, tmp_path / str(depth), host_budget="2MiB", chunk_bytes="96KiB",
                             prefetch_depth=depth, update_on=update_on, split_masters=True) as opt:  # fmt: skip
            for x, y in data(6, torch.bfloat16):
                nn.functional.mse_loss(model(x).float(), y).backward()
                opt.step()
                opt.zero_grad()
            results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@UPDATE_ON
def test_cuda_fp16_autocast_grad_scaler_as_with_adamw(tmp_path, update_on):
    """The AMP recipe (fp32 parameters, fp16 autocast, GradScaler): an overflow step is skipped by the scaler
    itself, as for torch's AdamW, and the two train alike. (fp16 parameters are refused by GradScaler's
    unscale, "Attempting to unscale FP16 gradients", for this optimizer as for torch's AdamW.)"""
    ref, model = mlp(), mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    kw = dict(lr=1e-3, host_budget="512KiB", chunk_bytes="96KiB", update_on=update_on)
    with TieredOptimizer(model, tmp_path, **kw) as opt:
        for m, o in ((ref, ref_opt), (model, opt)):
            scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
            before = [p.detach().clone() for p in m.parameters()]
            for i, (x, y) in enumerate(data(4)):
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = nn.functional.mse_loss(m(x).float(), y)
                scaler.scale(loss).backward()
                if i == 0:
                    next(m.parameters()).grad[0, 0] = float("inf")
                scaler.step(o)
                scaler.update()
                o.zero_grad()
                if i == 0:  # skipped: nothing moved
                    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
        assert opt.state_dict()["state"][0]["step"] == 3
        for a, b in zip(ref.parameters(), model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@UPDATE_ON
def test_cuda_default_chunk_size_does_not_stall(tmp_path, update_on):
    # Regression: gradient staging slots are charged in whole pages; the default chunk size once left the
    # last slot without room, and the constructor waited for it forever.
    for dtype in (torch.float32, torch.bfloat16):  # bf16 with split masters: they stage the weights too
        model = nn.Linear(2048, 2048).to("cuda", dtype)
        split = dtype == torch.bfloat16
        kw = dict(host_budget="512MiB", split_masters=split, update_on=update_on)
        with TieredOptimizer(model, tmp_path / f"{dtype}{update_on}", **kw) as opt:
            model(torch.randn(4, 2048, device="cuda", dtype=dtype)).sum().backward()
            opt.step()
            assert opt.stats()["steps"] == 1


def test_cuda_split_masters_checkpoint_into_full_masters(tmp_path):
    model = mlp(torch.bfloat16)
    kw = dict(lr=1e-3, host_budget="1MiB", chunk_bytes="96KiB")
    with TieredOptimizer(model, tmp_path / "a", split_masters=True, **kw) as opt:
        for x, y in data(3, torch.bfloat16):
            nn.functional.mse_loss(model(x).float(), y).backward()
            opt.step()
            opt.zero_grad()
        path = opt.save_checkpoint(tmp_path / "ck")
        twin = mlp(torch.bfloat16)
        with TieredOptimizer(twin, tmp_path / "b", split_masters=False, **kw) as opt2:
            opt2.load_checkpoint(path)
            for x, y in data(3, torch.bfloat16):
                for m, o in ((model, opt), (twin, opt2)):
                    nn.functional.mse_loss(m(x).float(), y).backward()
                    o.step()
                    o.zero_grad()
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


@pytest.mark.parametrize("early", [False, True], ids=["at-step", "under-backward"])
def test_cuda_hbm_tier_split_chunks_equal_streamed_ones(tmp_path, early):
    """bf16 parameters, split masters: chunks in gpu_budget update in HBM on the work stream, through the same
    kernels as streamed chunks, beside the update under backward (which leaves them to step()). Bitwise the
    twin's weights that streams every chunk through host memory."""
    out = []
    for budget in ("400KiB", 0):
        model = mlp(torch.bfloat16)
        with TieredOptimizer(model, tmp_path / str(budget), lr=1e-3, host_budget="8MiB", gpu_budget=budget,
                             chunk_bytes="96KiB", update_in_backward=early) as opt:  # fmt: skip
            tiers = [opt.store.info(c.key).tier for c in opt.chunks]
            assert all(c.split for c in opt.chunks)
            assert ("gpu" in tiers and "host" in tiers) if budget else "gpu" not in tiers
            for x, y in data(8, torch.bfloat16):
                nn.functional.mse_loss(model(x).float(), y).backward()
                opt.step()
                opt.zero_grad()
            if early:
                assert opt.stats()["under_backward"]["kept"] > 0
            out.append(model)
    for a, b in zip(out[0].parameters(), out[1].parameters()):
        assert torch.equal(a, b)


def test_cuda_state_dicts_and_checkpoints_leave_hbm_chunks_in_hbm(tmp_path):
    """A pass over the state holds a chunk kept in HBM as a host copy and leaves it there; loads write
    through to it, and restore it exactly (the state dict after the model's weights, as with split masters)."""
    model = mlp(torch.bfloat16)
    with TieredOptimizer(model, tmp_path / "s", lr=1e-3, host_budget="8MiB", gpu_budget="400KiB",
                         chunk_bytes="96KiB") as opt:  # fmt: skip
        where = lambda: [opt.store.info(c.key).tier for c in opt.chunks]  # noqa: E731

        def train(n):
            for x, y in data(n, torch.bfloat16):
                nn.functional.mse_loss(model(x).float(), y).backward()
                opt.step()
                opt.zero_grad()

        train(3)
        tiers = where()
        assert "gpu" in tiers and "host" in tiers
        sd = copy.deepcopy(opt.state_dict())
        weights = copy.deepcopy(model.state_dict())
        opt.save_checkpoint(tmp_path / "ck")
        assert where() == tiers

        def load_dicts():  # weights first: split masters keep only the low halves (README, load_state_dict)
            model.load_state_dict(weights)
            opt.load_state_dict(sd)

        for load in (load_dicts, lambda: opt.load_checkpoint(tmp_path / "ck")):
            train(1)
            load()
            assert where() == tiers
            now = opt.state_dict()["state"]
            assert all(torch.equal(now[i][k], sd["state"][i][k]) for i in now for k in ("exp_avg", "master"))


def test_cuda_hbm_tier_chunks_update_on_the_gpu(tmp_path):
    ref = mlp()
    model = copy.deepcopy(ref)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    with TieredOptimizer(model, tmp_path, lr=1e-3, host_budget="1MiB", gpu_budget="400KiB", chunk_bytes="96KiB") as opt:
        tiers = [opt.store.info(c.key).tier for c in opt.chunks]
        assert "gpu" in tiers and len(set(tiers)) > 1
        for x, y in data(10):
            for m, o in ((ref, torch_opt), (model, opt)):
                nn.functional.mse_loss(m(x), y).backward()
                o.step()
                o.zero_grad()
        assert opt.store.stats()["gpu"]["peak"] <= 400 * 1024
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@UPDATE_ON
def test_cuda_step_counts_the_bytes_it_moves_over_the_link(tmp_path, update_on):
    """fp32 parameters on the GPU, the state in DDR: on the device each chunk's record goes up and comes back
    (the step's state bytes, each way); on the host each chunk's fp32 gradients come down and its fp32 masters go
    up (4 B a parameter, each way). Nothing else crosses (optim/link.py)."""
    model = mlp()
    n = sum(p.numel() for p in model.parameters())
    kw = dict(lr=1e-3, host_budget="256MiB", chunk_bytes="96KiB", update_on=update_on, update_in_backward=False)
    with TieredOptimizer(model, tmp_path, **kw) as opt:
        for x, y in data(2):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        st = opt.stats()
    each_way = st["state_bytes"] if update_on == "device" else 4 * n
    assert (st["last_step"]["link_up_bytes"], st["last_step"]["link_down_bytes"]) == (each_way, each_way)
    assert st["total"]["link_up_bytes"] == 2 * each_way


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_norm_copied_up_one_tensor_at_a_time_is_torchs_bitwise(dtype):
    """The offloaded clip's norm (tiered.optim.shards.total_norm_on): gradients in pinned host memory copied up
    one at a time give the bits get_total_norm gives with all of them on the GPU at once, for tensors of many
    sizes (one chunk of _foreach_norm's and many) and a mixed-dtype list."""
    from tiered.optim.shards import total_norm_on

    g = torch.Generator().manual_seed(3)
    sizes = [7, 65536, 65537, 3 * 65536 + 5, 4096 * 1024, 1, 300_000]
    host = [(torch.randn(n, generator=g) * (i + 1)).to(dtype).pin_memory() for i, n in enumerate(sizes)]
    mixed = [t if i % 2 else t.float().pin_memory() for i, t in enumerate(host)]
    for tensors in (host, mixed):
        ref = torch.nn.utils.get_total_norm([t.cuda() for t in tensors])
        ours = total_norm_on(tensors, torch.device("cuda", torch.cuda.current_device()))
        assert ours.dtype == ref.dtype and torch.equal(ours, ref)
