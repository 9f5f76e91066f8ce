"""Acceptance: TieredOptimizer is torch.optim.AdamW, whatever tier the state sits in."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tiered import TieredOptimizer

STEPS = 20
CHUNK = "12KiB"  # 1024 elements a chunk: many chunks, parameters split across them
PLACEMENTS = {"ddr": "64MiB", "nvme": "36KiB", "mixed": "160KiB"}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))


def transformer() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False), nn.Linear(32, 8))


def batches(model_kind: str, n: int = STEPS):
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        if model_kind == "mlp":
            yield torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        else:
            yield torch.randn(4, 6, 32, generator=g), torch.randn(4, 6, 8, generator=g)


def train(model, opt, kind, *, accumulate=1, clip=None, sched=None, n=STEPS):
    losses = []
    for i, (x, y) in enumerate(batches(kind, n * accumulate)):
        loss = nn.functional.mse_loss(model(x), y) / accumulate
        loss.backward()
        if (i + 1) % accumulate:
            continue
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(float(loss.detach()))
    return losses


def assert_same_params(a: nn.Module, b: nn.Module, rtol=1e-5, atol=1e-6):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("update_on", ["host", "device"])
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_parity_with_torch_adamw(tmp_path, kind, placement, update_on):
    ref = mlp() if kind == "mlp" else transformer()
    model = copy.deepcopy(ref)
    # The transformer's attention key bias has a gradient that is zero up to rounding noise, which Adam
    # normalises to steps of +-lr: any rounding difference between two AdamW kernels grows there. So the
    # transformer is compared with torch's fused kernel (the one tiered calls), the MLP with the default one.
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=kind == "transformer")
    with TieredOptimizer(model, tmp_path, lr=1e-2, weight_decay=0.1, host_budget=PLACEMENTS[placement],
                         chunk_bytes=CHUNK, update_on=update_on) as opt:  # fmt: skip
        train(ref, torch_opt, kind)
        train(model, opt, kind)
        assert_same_params(ref, model)
        st = opt.stats()
        assert st["steps"] == STEPS
        if placement == "ddr":
            assert st["total"]["nvme_read_bytes"] == 0
        if placement == "nvme":
            # nearly all state streams from disk each step
            assert st["last_step"]["nvme_read_bytes"] >= 0.5 * opt.state_bytes


def test_serial_twin_matches_pipelined_bitwise(tmp_path):
    # The serial twin (host update, nothing in flight) against the pipelined step, updating on the host
    # and on the parameters' device (here the CPU: the same code, streams aside).
    results = []
    for depth, update_on in ((0, "host"), (3, "host"), (3, "device"), (0, "device")):
        model = mlp()
        with TieredOptimizer(model, tmp_path / f"d{depth}{update_on}", host_budget="60KiB", chunk_bytes=CHUNK,
                             prefetch_depth=depth, update_on=update_on) as opt:  # fmt: skip
            train(model, opt, "mlp", n=8)
            assert opt.stats()["total"]["nvme_write_bytes"] > 0
            results.append([p.detach().clone() for p in model.parameters()])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("update_on", ["host", "device"])
def test_reads_run_ahead_past_the_resident_set_and_into_the_next_step(tmp_path, monkeypatch, update_on):
    depth = 2
    model = mlp()
    kw = dict(host_budget="60KiB", chunk_bytes=CHUNK, prefetch_depth=depth, update_on=update_on)
    with TieredOptimizer(model, tmp_path, **kw) as opt:
        streamed = [c for c in opt.chunks if not opt.store.is_resident(c.key)]
        assert len(streamed) > depth and opt.chunks[0] not in streamed, "resident chunks first, then streamed"
        events: list[tuple[str, object]] = []
        real_prefetch, real_pin, real_step = opt.store.prefetch, opt.store.pin, opt.step

        def prefetch(keys, *a, **k):
            events.append(("prefetch", list(keys)))
            return real_prefetch(keys, *a, **k)

        def pin(key, *a, **k):
            events.append(("pin", key))
            return real_pin(key, *a, **k)

        def step(*a, **k):
            events.append(("step", None))
            return real_step(*a, **k)

        monkeypatch.setattr(opt.store, "prefetch", prefetch)
        monkeypatch.setattr(opt.store, "pin", pin)
        monkeypatch.setattr(opt, "step", step)
        train(model, opt, "mlp", n=3)
        first_reads = {c.key for c in streamed[:depth]}
        starts = [i for i, (what, _) in enumerate(events) if what == "step"]
        previous_last_pin = 0
        for t, start in enumerate(starts):
            end = starts[t + 1] if t + 1 < len(starts) else len(events)
            pins = [i for i in range(start, end) if events[i][0] == "pin"]
            asked = lambda lo, hi: {k for what, ks in events[lo:hi] if what == "prefetch" for k in ks}  # noqa: E731
            # Before the first chunk (a resident one) updates, the disk already reads the first streamed ones:
            # asked at this step's start, or (from the second step) at the end of the step before.
            assert first_reads <= asked(previous_last_pin, pins[0])
            # After the last chunk, the next step's first reads start: they run during forward and backward.
            assert first_reads <= asked(pins[-1], end)
            previous_last_pin = pins[-1]
        # A streamed chunk is read at most once a step; fewer when its write-back was still in flight when
        # the read-ahead asked for it (the store then keeps the buffer instead of reading it back).
        assert opt.stats()["last_step"]["nvme_read_bytes"] <= sum(c.nbytes for c in streamed)


def test_param_groups_with_own_hyperparameters(tmp_path):
    ref = mlp()
    model = copy.deepcopy(ref)

    def groups(m):
        return [
            {"params": list(m[0].parameters()), "lr": 3e-2, "weight_decay": 0.0, "betas": (0.8, 0.99)},
            {"params": list(m[2].parameters()) + list(m[4].parameters()), "eps": 1e-6},
        ]

    torch_opt = torch.optim.AdamW(groups(ref), lr=1e-2)
    with TieredOptimizer(groups(model), tmp_path, lr=1e-2, host_budget="64KiB", chunk_bytes=CHUNK) as opt:
        train(ref, torch_opt, "mlp")
        train(model, opt, "mlp")
    assert_same_params(ref, model)


def test_lr_scheduler(tmp_path):
    ref = mlp()
    model = copy.deepcopy(ref)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with TieredOptimizer(model, tmp_path, lr=1e-2, host_budget="64KiB", chunk_bytes=CHUNK) as opt:
        s1 = torch.optim.lr_scheduler.OneCycleLR(torch_opt, max_lr=5e-2, total_steps=STEPS)
        s2 = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-2, total_steps=STEPS)
        train(ref, torch_opt, "mlp", sched=s1)
        train(model, opt, "mlp", sched=s2)
        assert opt.param_groups[0]["lr"] == pytest.approx(torch_opt.param_groups[0]["lr"])
    assert_same_params(ref, model)


def test_max_grad_norm_matches_clip_grad_norm(tmp_path):
    ref = mlp()
    model = copy.deepcopy(ref)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with TieredOptimizer(model, tmp_path, lr=1e-2, host_budget="64KiB", chunk_bytes=CHUNK, max_grad_norm=0.05) as opt:
        train(ref, torch_opt, "mlp", clip=0.05)
        train(model, opt, "mlp")
    assert_same_params(ref, model)


def test_gradient_accumulation(tmp_path):
    ref = mlp()
    model = copy.deepcopy(ref)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with TieredOptimizer(model, tmp_path, lr=1e-2, host_budget="64KiB", chunk_bytes=CHUNK) as opt:
        train(ref, torch_opt, "mlp", accumulate=3, n=6)
        train(model, opt, "mlp", accumulate=3, n=6)
    assert_same_params(ref, model)


def test_params_without_grad_are_skipped_like_torch(tmp_path):
    ref = mlp()
    model = copy.deepcopy(ref)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with TieredOptimizer(model, tmp_path, lr=1e-2, host_budget="64KiB", chunk_bytes=CHUNK) as opt:
        for m, o in ((ref, torch_opt), (model, opt)):
            for step, (x, y) in enumerate(batches("mlp", 6)):
                out = m[1](m[0](x)) if step % 2 else m(x)  # odd steps leave the last layers without grads
                loss = out.pow(2).mean() if step % 2 else nn.functional.mse_loss(out, y)
                loss.backward()
                o.step()
                o.zero_grad(set_to_none=True)
        sd = opt.state_dict()
        ref_sd = torch_opt.state_dict()
        assert {k: float(v["step"]) for k, v in sd["state"].items()} == {
            k: float(v["step"]) for k, v in ref_sd["state"].items()
        }
    assert_same_params(ref, model)


@pytest.mark.parametrize("update_on", ["host", "device"])
@pytest.mark.parametrize("split_masters", [True, False], ids=["split", "full"])
def test_bf16_params_keep_fp32_masters(tmp_path, split_masters, update_on):
    """bf16 parameters against torch's fused AdamW over fp32 masters, bit for bit, whether the state keeps
    the masters whole or split against the parameters (master_split.py)."""
    torch.manual_seed(0)
    model = mlp().to(torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-2, fused=True)  # the kernel tiered uses: bitwise comparable
    kw = dict(lr=1e-2, host_budget="64KiB", chunk_bytes=CHUNK, split_masters=split_masters, update_on=update_on)
    with TieredOptimizer(model, tmp_path, **kw) as opt:
        assert opt.stats()["split_chunks"] == (len(opt.chunks) if split_masters else 0)
        for x, y in batches("mlp", 10):
            loss = nn.functional.mse_loss(model(x.bfloat16()).float(), y)
            loss.backward()
            for m, p in zip(masters, model.parameters()):
                m.grad = p.grad.float()
            ref_opt.step()
            opt.step()
            opt.zero_grad()
            for m, p in zip(masters, model.parameters()):
                assert p.dtype == torch.bfloat16
                torch.testing.assert_close(p.detach(), m.detach().to(torch.bfloat16), rtol=0, atol=0)
        assert opt.stats()["total"]["nvme_read_bytes"] > 0, "part of the state must have streamed"
        sd = opt.state_dict()
        for i, m in enumerate(masters):
            assert torch.equal(sd["state"][i]["master"], m.detach())
            assert torch.equal(sd["state"][i]["exp_avg_sq"], ref_opt.state[m]["exp_avg_sq"])


def test_bf16_state_dict_round_trip_with_split_masters(tmp_path):
    """state_dict joins split masters, load_state_dict splits them again: further steps are identical."""

    def run(model, opt, n, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(n):
            model(torch.randn(8, 32, generator=g).bfloat16()).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    model = mlp().to(torch.bfloat16)
    kw = dict(lr=1e-2, host_budget="64KiB", chunk_bytes=CHUNK, split_masters=True)
    with TieredOptimizer(model, tmp_path / "a", **kw) as opt:
        assert opt.stats()["split_chunks"] == len(opt.chunks)
        run(model, opt, 4, 0)
        sd = opt.state_dict()
        twin = copy.deepcopy(model)
        run(model, opt, 4, 1)
    with TieredOptimizer(twin, tmp_path / "b", **kw, prefetch_depth=0) as opt2:
        opt2.load_state_dict(sd)
        run(twin, opt2, 4, 1)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_split_masters_move_five_sixths_of_the_bytes(tmp_path):
    """Most of the state on NVMe: a step reads about 10/12 as much when the masters are split."""
    moved = {}
    for split_masters in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).to(torch.bfloat16)
        folder = tmp_path / str(split_masters)
        with TieredOptimizer(model, folder, lr=1e-2, host_budget="1MiB", chunk_bytes="256KiB",
                             split_masters=split_masters) as opt:  # fmt: skip
            for _ in range(3):
                model(torch.randn(4, 256).bfloat16()).float().pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            last = opt.stats()["last_step"]
            moved[split_masters] = (last["nvme_read_bytes"], opt.state_bytes)
    (read_s, state_s), (read_f, state_f) = moved[True], moved[False]
    assert 0.82 < state_s / state_f < 0.88  # 10 bytes and a bit (page-rounded chunks) against 12
    assert 0.7 < read_s / read_f < 0.9


def test_split_masters_errors_and_fallbacks(tmp_path):
    model = mlp().to(torch.bfloat16)
    with pytest.raises(ValueError, match="split_masters=True cannot apply: moments_dtype is bf16"):
        TieredOptimizer(model, tmp_path / "a", split_masters=True, moments_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="split_masters must be True, False or None"):
        TieredOptimizer(model, tmp_path / "b", split_masters="yes")
    with TieredOptimizer(mlp(), tmp_path / "c", split_masters=True) as opt:  # fp32: nothing to split
        assert opt.stats()["split_chunks"] == 0


def test_defaults_follow_where_the_update_runs(tmp_path):
    """update_on="auto" is the host for a CPU model; split masters default on only where the update runs
    on the device, and quietly stay off where bf16 moments rule them out."""
    model = mlp().to(torch.bfloat16)
    with TieredOptimizer(model, tmp_path / "a") as opt:
        assert opt.update_on == "host" and opt.stats()["split_chunks"] == 0
    with TieredOptimizer(model, tmp_path / "b", update_on="device") as opt:
        assert opt.split_masters and opt.stats()["split_chunks"] == len(opt.chunks)
    with TieredOptimizer(model, tmp_path / "c", update_on="device", moments_dtype=torch.bfloat16) as opt:
        assert not opt.split_masters
    with TieredOptimizer(model, tmp_path / "d", update_on="device", split_masters=False) as opt:
        assert opt.stats()["split_chunks"] == 0


def test_state_dict_round_trip_then_identical_steps(tmp_path):
    model = mlp()
    with TieredOptimizer(model, tmp_path / "a", lr=1e-2, host_budget="64KiB", chunk_bytes=CHUNK) as opt:
        train(model, opt, "mlp", n=5)
        sd = opt.state_dict()
        snapshot = copy.deepcopy(model)
        train(model, opt, "mlp", n=5)
    twin = snapshot
    with TieredOptimizer(twin, tmp_path / "b", lr=1e-2, host_budget="200KiB", chunk_bytes="24KiB") as opt2:
        opt2.load_state_dict(sd)
        train(twin, opt2, "mlp", n=5)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_load_state_dict_from_torch_adamw(tmp_path):
    ref = mlp()
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    train(ref, torch_opt, "mlp", n=5)
    model = copy.deepcopy(ref)
    with TieredOptimizer(model, tmp_path, lr=1e-2, host_budget="64KiB", chunk_bytes=CHUNK) as opt:
        opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
        train(ref, torch_opt, "mlp", n=5)
        train(model, opt, "mlp", n=5)
        # and back: our state dict loads into torch's AdamW
        again = torch.optim.AdamW(copy.deepcopy(model).parameters(), lr=1e-2)
        again.load_state_dict(opt.state_dict())
        assert float(again.state_dict()["state"][0]["step"]) == 10
    assert_same_params(ref, model)


@pytest.mark.parametrize("update_on", ["host", "device"])
def test_bf16_moments_match_a_reference_that_rounds_moments_each_step(tmp_path, update_on):
    # moments_dtype=bf16 stores exp_avg/exp_avg_sq in bf16 between steps and updates in fp32: the same as
    # torch's fused AdamW with its moments rounded to bf16 after every step.
    ref = mlp()
    model = copy.deepcopy(ref)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    with TieredOptimizer(
        model, tmp_path, lr=1e-2, host_budget="48KiB", chunk_bytes="8KiB", moments_dtype="bf16", update_on=update_on
    ) as opt:
        assert opt.state_bytes == 8 * sum(p.numel() for p in model.parameters())  # 12 with fp32 moments
        for x, y in batches("mlp", 10):
            for m, o in ((ref, torch_opt), (model, opt)):
                nn.functional.mse_loss(m(x), y).backward()
                o.step()
                o.zero_grad()
            for st in torch_opt.state.values():
                for k in ("exp_avg", "exp_avg_sq"):
                    st[k].copy_(st[k].bfloat16())
        for a, b in zip(ref.parameters(), model.parameters()):
            assert torch.equal(a, b)
        sd = opt.state_dict()
        for i, p in enumerate(ref.parameters()):
            assert torch.equal(sd["state"][i]["exp_avg"], torch_opt.state[p]["exp_avg"])
        assert opt.stats()["last_step"]["nvme_read_bytes"] > 0


@pytest.mark.parametrize("update_on", ["host", "device"])
@pytest.mark.parametrize("moments", ["fp32", "bf16"])
def test_hbm_resident_chunks_update_in_place(tmp_path, monkeypatch, moments, update_on):
    # The HBM tier's path, run in CI on a stand-in device made of CPU tensors (as the store's own tests do):
    # chunks that fit gpu_budget update where they live; the others stream through host memory.
    import tiered.assembly
    from tiered.store import TieredStore

    class FakeHBMStore(TieredStore):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.gpu_budget, self._device = 40 * 1024, torch.device("cpu")  # three 12 KiB chunks

    monkeypatch.setattr(tiered.assembly, "TieredStore", FakeHBMStore)
    ref = mlp()
    model = copy.deepcopy(ref)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    with pytest.warns(RuntimeWarning, match="gpu_budget is ignored"):
        opt = TieredOptimizer(model, tmp_path, lr=1e-2, host_budget="24KiB", chunk_bytes=CHUNK,
                              gpu_budget="40KiB", moments_dtype=moments, update_on=update_on)  # fmt: skip
    with opt:
        tiers = [opt.store.info(c.key).tier for c in opt.chunks]
        assert tiers.count("gpu") == (3 if moments == "fp32" else 5) and len(set(tiers)) > 1
        for x, y in batches("mlp", 8):
            for m, o in ((ref, torch_opt), (model, opt)):
                nn.functional.mse_loss(m(x), y).backward()
                o.step()
                o.zero_grad()
            if moments == "bf16":
                for st in torch_opt.state.values():
                    for k in ("exp_avg", "exp_avg_sq"):
                        st[k].copy_(st[k].bfloat16())
        after = [opt.store.info(c.key).tier for c in opt.chunks]
        assert [t == "gpu" for t in after] == [t == "gpu" for t in tiers]  # HBM chunks stayed there
        assert opt.stats()["total"]["nvme_write_bytes"] > 0  # and the others streamed
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
