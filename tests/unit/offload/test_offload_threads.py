"""One forward at a time per offloaded model, on the CPU stand-in.

FSDP2 gathers and frees a unit's weights in state it keeps per module, which no lock guards: two threads running
``generate`` (or any forward) of one offloaded model at once crashed inside torch ("aten.mm.default got mixed
torch.Tensor and DTensor", setStorage errors). A second thread's forward while another's runs is now refused by
name, before anything of it runs; the forward already inside goes on unharmed, and a forward that raised (an
error, or a Ctrl-C, which skips torch's ``always_call`` hooks) leaves nothing behind that refuses the next one.
A gate in the second block holds the first thread's forward inside, on events (no timing).
"""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import TIMEOUT, run_bounded
from torch import nn

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")


class Gate(nn.Module):
    """Passes its input through; while ``hold`` is set, says so (``entered``) and waits for ``release`` first,
    then raises ``fail`` if one is set."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = False
        self.fail: BaseException | None = None
        self.entered = threading.Event()
        self.release = threading.Event()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.hold:
            self.entered.set()
            assert self.release.wait(TIMEOUT), "the test never released the gate"
            if self.fail is not None:
                raise self.fail
        return h


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.gate = Gate()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = self.layers[0](h)
        h = self.gate(h)  # inside the forward, the root's weights gathered and a block's freed behind it
        for layer in self.layers[1:]:
            h = layer(h)
        return self.out(h)


X = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))


def offloaded() -> tuple[Net, torch.Tensor]:
    import tiered.offload

    model = Net()
    with torch.no_grad():
        want = model(X)
    tiered.offload.offload_model(model, device="cpu", blocks=list(model.layers))
    return model, want


def held_forward(model: Net, fail: BaseException | None = None) -> tuple[threading.Thread, dict]:
    """A thread whose no-grad forward of ``model`` waits inside at the gate; its result or error lands in the dict."""
    gate = model.gate
    gate.hold, gate.fail = True, fail
    gate.entered.clear()
    gate.release.clear()
    box: dict = {}

    def run() -> None:
        try:
            with torch.no_grad():
                box["out"] = model(X)
        except BaseException as e:  # noqa: BLE001 - a KeyboardInterrupt too: handed to the test
            box["error"] = e

    thread = threading.Thread(target=run, name="first", daemon=True)
    thread.start()
    assert gate.entered.wait(TIMEOUT), "the first thread's forward never reached the gate"
    return thread, box


def finish(model: Net, thread: threading.Thread) -> None:
    model.gate.release.set()
    thread.join(TIMEOUT)
    assert not thread.is_alive()
    model.gate.hold = False


def forward(model: Net) -> torch.Tensor:
    with torch.no_grad():
        return model(X)


def test_a_second_thread_is_refused_while_a_forward_runs_and_the_first_goes_on():
    model, want = offloaded()
    thread, box = held_forward(model)
    try:
        refused = r"while thread 'first' runs a forward.*one forward at a time.*threading.Lock"
        with pytest.raises(RuntimeError, match=refused):
            run_bounded(lambda: forward(model))  # refused at once: it never waits for the first
    finally:
        finish(model, thread)
    assert "error" not in box, box.get("error")
    torch.testing.assert_close(box["out"], want, rtol=0, atol=0)  # the first forward was not disturbed
    torch.testing.assert_close(run_bounded(lambda: forward(model)), want, rtol=0, atol=0)  # nothing left inside


@pytest.mark.parametrize("fail", [ValueError("boom"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_a_forward_that_raised_leaves_nothing_that_refuses_another_thread(fail):
    """torch runs ``always_call`` forward hooks on an Exception only: a Ctrl-C (KeyboardInterrupt) skips them, and
    the forward it ended must not be taken for one still running."""
    model, want = offloaded()
    thread, box = held_forward(model, fail)
    finish(model, thread)
    assert type(box.get("error")) is type(fail)
    torch.testing.assert_close(run_bounded(lambda: forward(model)), want, rtol=0, atol=0)  # another thread
    torch.testing.assert_close(forward(model), want, rtol=0, atol=0)  # and the one it raised in


def test_two_threads_taking_turns_get_the_exact_result():
    """One forward at a time, from any thread: a lock around the calls is the fix the refusal names."""
    model, want = offloaded()
    lock = threading.Lock()
    outs: list[torch.Tensor] = []

    def work() -> None:
        for _ in range(3):
            with lock:
                outs.append(forward(model))

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads) and len(outs) == 6
    for out in outs:
        torch.testing.assert_close(out, want, rtol=0, atol=0)
