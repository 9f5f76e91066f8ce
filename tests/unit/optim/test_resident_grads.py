"""tiered/optim/resident_grads.py: a device copy offered beside a host gradient is taken back only while the host
tensor is unchanged, only where switched on, and the clip's norm over found copies is bitwise its norm over
copies it makes (``Shards.total_norm_on``), the found ones kept for the update."""

from __future__ import annotations

import pytest
import torch

from tiered.optim import resident_grads
from tiered.optim.shards import total_norm_on


@pytest.fixture
def enabled(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(resident_grads, "ENABLED", True)
    yield
    resident_grads.drop(None)  # entries offered without an owner in these tests
    assert resident_grads.held_bytes() == 0


def grad(n: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_switched_off_nothing_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resident_grads, "ENABLED", False)
    host = grad()
    assert not resident_grads.offer(None, host, host.clone())
    assert resident_grads.take(host) is None and resident_grads.held_bytes() == 0


def test_a_copy_is_taken_once_while_its_host_tensor_is_unchanged(enabled) -> None:
    host, copy = grad(), grad().clone()
    assert resident_grads.offer(None, host, copy)
    assert resident_grads.held_bytes() == copy.numel() * copy.element_size()
    assert resident_grads.take(host) is copy
    assert resident_grads.take(host) is None  # taken: the caller holds it now


def test_a_host_tensor_written_since_is_read_from_the_host(enabled) -> None:
    """A scaler's unscale_, a user's own clip, a zero_grad that zeroes in place: each bumps the version counter."""
    host = grad()
    resident_grads.offer(None, host, host.clone())
    host.mul_(0.5)
    assert resident_grads.take(host) is None
    resident_grads.offer(None, host, host.clone())
    host[:4].zero_()  # through a view: the same counter
    assert resident_grads.take(host) is None


def test_a_copy_of_another_shape_dtype_or_address_is_refused(enabled) -> None:
    host = grad(64)
    assert not resident_grads.offer(None, host, grad(32))
    assert not resident_grads.offer(None, host, host.float())
    assert not resident_grads.offer(None, host, host)  # the tensor itself is no copy
    odd = torch.empty(65, dtype=torch.bfloat16)[1:]  # 2 bytes past an aligned start: torch's norm would vectorise
    assert odd.data_ptr() % resident_grads.ALIGN
    assert not resident_grads.offer(None, host, odd.copy_(host))


def test_drop_forgets_only_its_owners_copies(enabled) -> None:
    a, b = grad(seed=1), grad(seed=2)
    mine, theirs = object(), object()
    resident_grads.offer(mine, a, a.clone())
    resident_grads.offer(theirs, b, b.clone())
    resident_grads.drop(mine)
    assert resident_grads.take(a) is None and resident_grads.take(b) is not None


def test_the_norm_over_found_copies_is_the_norm_over_made_ones_and_keeps_them(enabled) -> None:
    grads = [grad(64, seed=s) for s in range(4)] + [grad(48, seed=9).float()]
    device = torch.device("cpu")
    expected = torch.nn.utils.get_total_norm(grads)
    copies = {1: grads[1].clone(), 4: grads[4].clone()}
    for i, c in copies.items():
        resident_grads.offer(None, grads[i], c)
    kept: dict[int, torch.Tensor] = {}
    found: set[int] = set()
    norm = total_norm_on(grads, device, 0, kept, found)  # no room for new copies: only the found ones kept
    assert torch.equal(norm, expected)
    assert found == {1, 4} and kept.keys() == copies.keys() and all(kept[i] is copies[i] for i in copies)
    assert resident_grads.held_bytes() == 0
