"""update_in_backward and writes to the parameters between backward and ``step()`` that torch's version counter
does not see: through ``.data`` (in place, or a new tensor: new storage), as an EMA swap does.

The update under backward read the parameters before the write; ``step()`` sees that their bits changed (a
fingerprint of what the update read, taken beside it) and redoes those chunks, so that the weights equal, bit for
bit, those of the plain step, which reads the parameters as they are when it runs (test_under_backward.py has
the other changes between backward and step; test_under_backward_cuda.py the GPU twin of this file).
"""

from __future__ import annotations

import pytest
import torch
from test_under_backward import PausedUpdate, assert_same_weights, backward, make, model
from torch import nn

REDONE = "parameters' bits changed"


def _copy(m: nn.Module, s: int, ema: list[torch.Tensor]) -> None:
    p = m[4].weight
    g = torch.Generator().manual_seed(50 + s)
    p.data.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.1)


def _mul(m: nn.Module, s: int, ema: list[torch.Tensor]) -> None:
    m[4].weight.data.mul_(0.9)


def _assign(m: nn.Module, s: int, ema: list[torch.Tensor]) -> None:
    p = m[4].weight
    p.data = p.data * 0.9  # a new tensor: the parameter's storage is replaced


def _ema_swap(m: nn.Module, s: int, ema: list[torch.Tensor]) -> None:
    """Every parameter swaps storage with its EMA copy (as EMA helpers do around an evaluation)."""
    for p, e in zip(m.parameters(), ema):
        p.data, e.data = e.data, p.data


WRITES = {"copy_": _copy, "mul_": _mul, "assign": _assign, "ema_swap": _ema_swap}

DTYPES = [
    pytest.param(torch.float32, None, id="fp32"),
    pytest.param(torch.bfloat16, False, id="bf16"),
    pytest.param(torch.bfloat16, True, id="bf16-split"),
]


def train_pair_writing(tmp_path, write, dtype, split_masters, steps: int = 4, drain: bool = True, **kw):
    """Train two copies, with and without the update under backward, ``write(m, step, ema)`` between backward
    and ``step()`` on every step; ``drain``: first wait for the updates backward handed over to have read the
    parameters (else the write races them: exact either way). Returns the early optimizer's stats."""
    out = []
    for early in (True, False):
        m = model(dtype=dtype)
        ema = [(p.detach() * 0.5).clone() for p in m.parameters()]
        opt = make(m, tmp_path / str(early), early, split_masters=split_masters, **kw)
        for s in range(steps):
            backward(m, s, dtype)
            if drain and early:
                opt.stats()  # the updates backward handed over have read the parameters
            write(m, s, ema)
            opt.step()
            opt.zero_grad()
        stats = opt.stats()
        opt.close()
        out.append((m, stats))
    (a, stats), (b, _) = out
    assert_same_weights(a, b)
    return stats


@pytest.mark.parametrize("dtype, split_masters", DTYPES)
@pytest.mark.parametrize("write", list(WRITES))
def test_a_write_through_data_between_backward_and_step_is_kept(tmp_path, write, dtype, split_masters):
    stats = train_pair_writing(tmp_path, WRITES[write], dtype, split_masters)
    assert stats["split_chunks"] == (stats["chunks"] if split_masters else 0), stats
    ub = stats["under_backward"]
    assert ub["started"] > 0 and ub["redone"].get(REDONE, 0) > 0, ub
    assert set(ub["redone"]) == {REDONE}, ub  # no version counter moved: the fingerprint alone saw the write
    if write == "ema_swap":  # every parameter written: every chunk redone
        assert ub["kept"] == 0 and ub["redone"][REDONE] == ub["started"], ub
    else:  # one parameter written: the chunks holding it redone, the others kept
        assert ub["kept"] > 0 and ub["redone"][REDONE] + ub["kept"] == ub["started"], ub


@pytest.mark.parametrize("dtype, split_masters", DTYPES)
def test_a_write_racing_the_updates_under_backward_is_exact(tmp_path, dtype, split_masters):
    """No wait: the worker may read the parameters before the write, after it, or during it. Whatever it read,
    the fingerprint is of those very bits, so step() keeps only an update that read what it would read itself."""

    def write(m, s, ema):
        (_copy, _mul, _assign, _ema_swap)[s % 4](m, s, ema)

    train_pair_writing(tmp_path, write, dtype, split_masters, steps=8, drain=False)


def test_a_new_tensor_with_the_same_bits_is_kept(tmp_path):
    """``p.data = p.data.clone()``: new storage, the same bits. The update read those bits: kept, and its new
    weights go into the new storage (the step reads and writes the parameter as it is now, not a tensor it
    held on to), as the plain step's do."""

    def write(m, s, ema):
        for p in m.parameters():
            p.data = p.data.clone()

    stats = train_pair_writing(tmp_path, write, torch.float32, None)
    ub = stats["under_backward"]
    assert ub["kept"] == ub["started"] > 0 and ub["redone"] == {}, ub


def test_a_changed_shape_through_data_is_refused_by_name(tmp_path):
    """``p.data = t`` of another shape: step() refuses it before anything changes, with or without the update
    under backward; the updates backward started are dropped with the next backward's."""
    m = model()
    with make(m, tmp_path, True) as opt:
        backward(m, 0)
        # The updates backward handed over have started (else, on a loaded machine, zero_grad can come before
        # the worker picks them up, and none is dropped: what the last assertion counts).
        opt.stats()
        saved = m[2].weight.data
        m[2].weight.data = torch.zeros(3, 3)
        with pytest.raises(ValueError, match="changed after the optimizer was built"):
            opt.step()
        m[2].weight.data = saved
        opt.zero_grad()
        backward(m, 1)
        opt.step()
        ub = opt.stats()["under_backward"]
        assert ub["kept"] > 0 and set(ub["redone"]) == {"zero_grad"}, ub


@pytest.mark.parametrize("dtype, split_masters", DTYPES)
def test_a_write_torch_sees_redoes_even_with_the_same_bits(tmp_path, dtype, split_masters):
    """``p.mul_(1.0)`` under no_grad keeps the bits but moves the version counter, after which the plain step
    takes the parameter as written (a split chunk's masters drop their low halves): the version check redoes
    the chunk, whatever the fingerprint says."""

    def write(m, s, ema):
        with torch.no_grad():
            m[4].weight.mul_(1.0)

    stats = train_pair_writing(tmp_path, write, dtype, split_masters)
    ub = stats["under_backward"]
    assert ub["kept"] > 0 and set(ub["redone"]) == {"parameters or hyperparameters changed"}, ub


@pytest.mark.parametrize("dtype, split_masters", DTYPES)
def test_a_write_torch_sees_while_the_updates_under_backward_run_is_exact(tmp_path, monkeypatch, dtype, split_masters):
    """The updates under backward take the parameters torch saw written (a split chunk's masters drop their low
    halves for those) once, as the first update after backward's end begins. A ``mul_`` under no_grad landing
    while that update runs, before a later chunk's began: the later update read the new bits as unwritten (old
    low halves), and was judged by the version counters as they were after it, the write's: kept, unlike the
    plain step. Judged by the versions its written set was taken at, it is redone: the plain step's weights."""
    pause = PausedUpdate(monkeypatch)
    out = []
    for early in (True, False):
        m = model(dtype=dtype)
        with make(m, tmp_path / str(early), early, split_masters=split_masters, chunk_bytes="12KiB") as opt:
            assert len(opt.chunks) > 2 and opt.chunks[0].pieces[0].param == 0  # m[0].weight's chunks start last
            try:
                for s in range(4):
                    pause.arm(1, 2)
                    backward(m, s, dtype)
                    if early:  # the first update held until backward ended: the second begins after it
                        pause.wait_inside(1)
                        pause.release(1)
                        pause.wait_inside(2)
                    with torch.no_grad():
                        m[0].weight.mul_(0.9)
                    pause.release()
                    opt.step()
                    opt.zero_grad()
            finally:
                pause.release()
            out.append((m, opt.stats()["under_backward"]))
    (a, ub), (b, _) = out
    assert_same_weights(a, b)
    assert ub["kept"] > 0 and set(ub["redone"]) == {"parameters or hyperparameters changed"}, ub
