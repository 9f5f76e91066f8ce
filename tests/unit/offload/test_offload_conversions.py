"""Conversions of an offloaded model (``model.to(...)``, ``.half()``: torch's ``nn.Module._apply``), on the CPU
stand-in (tiered/offload/conversions.py).

A dtype cast after ``offload_model`` (Lightning's ``precision="bf16-true"`` casts the model in its setup) trains
bitwise as the model without offload cast the same way, with every weight and gradient in the model's slabs of
their size and the old slabs closed. ``.to(device, dtype)`` casts the parameters too (on the host, where they
stay), as it casts the buffers: "meta" stands in for the GPU here (the same code path: the conversion's tensors
land off the CPU). A cast after the first forward is refused (FSDP2 fixed the dtypes then), the model unchanged.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from helpers import TIMEOUT, run_bounded
from torch import nn

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")

KW = dict(lr=1e-2, weight_decay=0.1, chunk_bytes="16KiB", host_budget="160KiB")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))  # a float buffer: cast alongside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.norm(self.lin(x))) * self.scale


class Net(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(3))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))  # not a float: never cast
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def micro_batch(step: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + k)
    return torch.randn(6, 8, generator=g).to(dtype), torch.randint(0, 4, (6,), generator=g)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def in_slabs(model: nn.Module, tensors: list[torch.Tensor]) -> list[bool]:
    return [any(s.holds(local(t)) for s in model.tiered_slabs) for t in tensors]


def pinned_handouts() -> int:
    """Blocks torch's pinned allocator has handed out in this process (it rounds each up to a power of two)."""
    return torch.cuda.memory.host_memory_stats().get("active_requests.allocated", 0) if torch.cuda.is_available() else 0


def train(nvme: str, *, offload: bool, cast, dtype: torch.dtype, steps: int = 3, accumulate: int = 2,
          device: str = "cpu", width: int = 16) -> dict:  # fmt: skip
    """``cast(model, device)`` after ``offload_model``, then ``model.to(device)`` as the frameworks move it, then
    ``steps`` steps of ``accumulate`` micro-batches with a TieredOptimizer."""
    import tiered.offload
    from tiered import TieredOptimizer
    from tiered.offload.pinning import fsdp_params

    model = Net(width).train()
    checks: dict = {}
    if offload:
        tiered.offload.offload_model(model, device=device)
        checks["old_slabs"] = [weakref.ref(s) for s in model.tiered_slabs]
    handouts = pinned_handouts()
    cast(model, device)
    model.to(device)
    checks["pinned_handouts"] = pinned_handouts() - handouts
    params = list(model.parameters())
    if offload:
        checks["weights_in_slabs"] = in_slabs(model, params)
        checks["old_closed"] = all(r() is None or not r().pinned and r()._block is None for r in checks["old_slabs"])
        checks["pinned"] = [s.pinned for s in model.tiered_slabs]
        checks["fsdp_pinned"] = [fp.pin_memory for m in model.modules() if hasattr(m, "_get_fsdp_state")
                                 for fp in fsdp_params(m)]  # fmt: skip
    opt = TieredOptimizer(model, nvme_path=nvme, **KW)
    losses = []
    try:
        for step in range(steps):
            for k in range(accumulate):
                x, y = (t.to(device) for t in micro_batch(step, k, dtype))
                loss = nn.functional.cross_entropy(model(x).float(), y) / accumulate
                loss.backward()
                losses.append(loss.item())
            if offload and step == 0:  # the summed gradients lie in the homes laid out anew
                checks["grads_in_slabs"] = in_slabs(model, [p.grad for p in params])
                checks["homed"] = model.tiered_accumulation.stats()["bytes_homed"]
            opt.step()
            opt.zero_grad()
        weights = {n: full(p) for n, p in model.named_parameters()}
        buffers = {n: full(b) for n, b in model.named_buffers()}
    finally:
        opt.close()
        if offload:
            tiered.offload.close()
    return dict(losses=losses, weights=weights, buffers=buffers, checks=checks)


CASTS = {
    "to-bf16": (lambda m, device: m.to(torch.bfloat16), torch.bfloat16),
    "half": (lambda m, device: m.half(), torch.float16),
    "to-fp32": (lambda m, device: m.to(torch.float32), torch.float32),  # no cast at all: the slabs stay
    "to-device-bf16": (lambda m, device: m.to(device, torch.bfloat16), torch.bfloat16),  # on the CPU: as to-bf16
}


@pytest.mark.parametrize("how", list(CASTS))
def test_a_cast_after_offload_trains_as_without_offload_in_fresh_slabs(tmp_path, how):
    """FSDP2's own _apply gave every parameter new storage: 0 of the weights stayed in the model's slabs, whose old
    fp32 weights and gradient homes stayed held (page-locked on CUDA) for the model's life, unused, and on CUDA
    each new tensor was pinned alone through torch's rounding pinned allocator."""
    cast, dtype = CASTS[how]
    plain = run_bounded(lambda: train(str(tmp_path / "p"), offload=False, cast=cast, dtype=dtype), timeout=TIMEOUT)
    off = run_bounded(lambda: train(str(tmp_path / "o"), offload=True, cast=cast, dtype=dtype), timeout=TIMEOUT)
    assert {w.dtype for w in off["weights"].values()} == {dtype}
    assert off["losses"] == plain["losses"]
    for group in ("weights", "buffers"):
        assert off[group].keys() == plain[group].keys()
        for name, value in plain[group].items():
            assert value.dtype == off[group][name].dtype and torch.equal(value, off[group][name]), name
    checks = off["checks"]
    assert checks["pinned_handouts"] == 0
    assert all(checks["weights_in_slabs"]) and all(checks["grads_in_slabs"])
    assert checks["homed"] > 0
    # A real cast lays the weights out anew and closes the old slabs; none leaves them as they were.
    assert checks["old_closed"] == (how != "to-fp32")


def test_slabs_after_a_cast_are_of_the_new_size():
    """The fresh slabs hold the cast weights and gradients at their size (whole pages), the old ones dropped."""
    import tiered.offload

    model = Net(width=256)  # weights of many pages each: the slabs' sizes tell the dtypes apart
    tiered.offload.offload_model(model, device="cpu")
    try:
        before = sum(s.nbytes for s in model.tiered_slabs)
        count = len(model.tiered_slabs)
        model.to(torch.bfloat16)
        tensors = [local(p) for p in model.parameters()] * 2  # each weight and its gradient's home
        held = sum(t.numel() * t.element_size() for t in tensors)
        after = sum(s.nbytes for s in model.tiered_slabs)
        assert len(model.tiered_slabs) == count
        assert held <= after < held + len(tensors) * 4096
        assert after < 0.6 * before  # bf16 where fp32 was
        assert len({local(p).untyped_storage().data_ptr() for p in model.parameters()}) == len(tensors) // 2
    finally:
        tiered.offload.close()


def test_to_a_device_with_a_dtype_casts_the_parameters_on_the_host():
    """``model.to("cuda", torch.bfloat16)`` cast the buffers and dropped the dtype for every parameter, silently:
    the model without offload ends all bf16, the offloaded one kept fp32 weights beside bf16 buffers."""
    import tiered.offload

    plain = Net().to("meta", torch.bfloat16)
    model = Net()
    values = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    tiered.offload.offload_model(model, device="cpu")
    try:
        model.to("meta", torch.bfloat16)
        for name, p in model.named_parameters():
            assert p.dtype == torch.bfloat16 and local(p).device.type == "cpu", name  # on the host, cast
            assert torch.equal(full(p), values[name]), name
        assert all(in_slabs(model, list(model.parameters())))
        for (name, b), (_, pb) in zip(model.named_buffers(), plain.named_buffers()):
            assert (b.device.type, b.dtype) == ("meta", pb.dtype), name  # moved, float ones cast, as without offload
        # A move without a dtype leaves the parameters as they are: on the host, in their slabs, bf16.
        model.to("meta")
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert all(in_slabs(model, list(model.parameters())))
    finally:
        tiered.offload.close()


def test_a_block_cast_alone_is_laid_out_again_too():
    """A conversion of one unit (``model.layers[0].half()``) goes through that unit's own ``_apply``."""
    import tiered.offload

    model = Net()
    tiered.offload.offload_model(model, device="cpu")
    try:
        model.layers[0].half()
        assert {p.dtype for p in model.layers[0].parameters()} == {torch.float16}
        assert {p.dtype for p in model.layers[1].parameters()} == {torch.float32}
        assert all(in_slabs(model, list(model.parameters())))
    finally:
        tiered.offload.close()


def _forward_backward(model: nn.Module, dtype: torch.dtype = torch.float32, *, step: int = 0) -> float:
    x, y = micro_batch(step, 0, dtype)
    loss = nn.functional.cross_entropy(model(x).float(), y)
    loss.backward()
    return loss.item()


LATE_CASTS = {
    "to-bf16": lambda m: m.to(torch.bfloat16),
    "half": lambda m: m.half(),
    "to-device-bf16": lambda m: m.to("meta", torch.bfloat16),  # HF Trainer's bf16_full_eval: to(dtype, device)
    "block-half": lambda m: m.layers[1].half(),  # one unit's own _apply
}


@pytest.mark.parametrize("first", ["train", "no_grad"])
@pytest.mark.parametrize("how", list(LATE_CASTS))
def test_a_cast_after_the_first_forward_is_refused_before_anything_changes(how, first):
    """FSDP2 fixes each unit's dtypes at its first forward (the gathered weights, the unsharded parameters, the
    gradients' dtype) and keeps them: a cast after it ran the next forward in the old dtype ("mat1 and mat2 must
    have the same dtype"; an HF model, whose inputs are token ids, ran on in fp32 silently) and failed in backward
    on the gradients' dtype. Plain ``fully_shard`` does the same. The cast is refused, naming the fix, with the
    model as it was: it trains on in its dtype, bitwise as the model that was never asked to cast."""
    import tiered.offload

    def run(cast: bool) -> tuple[list[float], dict]:
        model = Net().train()
        tiered.offload.offload_model(model, device="cpu")
        try:
            if first == "train":
                losses = [_forward_backward(model)]
            else:
                with torch.no_grad():
                    losses = [model(micro_batch(0, 0, torch.float32)[0]).sum().item()]
            model.zero_grad(set_to_none=True)
            if cast:
                with pytest.raises(TypeError, match="before the first forward") as err:
                    LATE_CASTS[how](model)
                assert "fit/train" in str(err.value) and "bf16_full_eval" in str(err.value)
                assert {p.dtype for p in model.parameters()} == {torch.float32}
                assert {b.dtype for n, b in model.named_buffers() if n != "steps"} == {torch.float32}
                assert {b.device.type for b in model.buffers()} == {"cpu"}
                assert all(in_slabs(model, [p for p in model.parameters()]))
            model.to(torch.float32)  # no dtype change: still a no-op
            model.to("cpu")  # a move without a dtype goes on as before
            losses += [_forward_backward(model, step=s) for s in (1, 2)]
            return losses, {n: full(p.grad) for n, p in model.named_parameters()}
        finally:
            tiered.offload.close()

    asked = run_bounded(lambda: run(True), timeout=TIMEOUT)
    never = run_bounded(lambda: run(False), timeout=TIMEOUT)
    assert asked[0] == never[0]
    assert all(torch.equal(asked[1][n], never[1][n]) for n in never[1])


def test_a_cast_before_the_first_forward_after_a_dtype_less_move_still_casts():
    """Lightning moves the model (``.to(device)``) and casts it (``precision="bf16-true"``) in its setup, before any
    forward: not refused, the model trains in bf16."""
    import tiered.offload

    model = Net().train()
    tiered.offload.offload_model(model, device="cpu")
    try:
        model.to("cpu")
        model.to(torch.bfloat16)
        _forward_backward(model, torch.bfloat16)
        assert {p.grad.dtype for p in model.parameters()} == {torch.bfloat16}
    finally:
        tiered.offload.close()


SHARE_SCRIPT = """
import sys
sys.path[:0] = [{tests!r}, {here!r}]
import torch
import tiered.offload
from test_offload_conversions import Net, micro_batch
model = Net()
tiered.offload.offload_model(model, device="cpu")
try:
    model.share_memory()
    print("shared")
except TypeError as e:
    print("refused:", e)
print("params shared:", any(p.to_local().is_shared() for p in model.parameters()))
print("forward:", tuple(model(micro_batch(0, 0, torch.float32)[0]).shape))
tiered.offload.close()
"""


def test_share_memory_of_an_offloaded_model_is_refused_not_a_crash():
    """``model.share_memory()`` (Hogwild-style training over processes) moved each parameter's storage into shared
    memory, torch's ``_share_fd_cpu_`` on a tensor carved from offload_model's slab: the process died of SIGSEGV.
    It is refused by name, the model left as it was (and usable)."""
    import os

    from helpers import TESTS_ROOT, run_script

    here = os.path.dirname(os.path.abspath(__file__))
    proc = run_script(SHARE_SCRIPT.format(tests=TESTS_ROOT, here=here), timeout=10 * TIMEOUT)
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "refused:" in proc.stdout and "share_memory" in proc.stdout, proc.stdout
    assert "params shared: False" in proc.stdout and "forward: (6, 4)" in proc.stdout, proc.stdout
