"""io_engine.PinnedSlab: one allocation of whole pages, carved into tensors that each own a storage."""

from __future__ import annotations

import pytest
import torch

from io_engine import PAGE, PinnedSlab


def test_carved_tensors_share_the_slab_but_not_a_storage():
    slab = PinnedSlab(3 * PAGE + 1, pin=False)
    assert slab.nbytes == 4 * PAGE and not slab.pinned
    a, b = slab.carve(0, PAGE), slab.carve(PAGE, 2 * PAGE + 1)
    a.fill_(7)
    b.fill_(9)
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()  # tied-weight checks see two tensors
    assert b.data_ptr() - a.data_ptr() == PAGE and slab.holds(a) and slab.holds(b)  # both in the one slab
    assert not slab.holds(torch.empty(8))
    assert int(a.sum()) == 7 * PAGE and int(b.sum()) == 9 * (2 * PAGE + 1)
    assert slab.carve(0, 0).numel() == 0


def test_carving_outside_the_slab_or_after_close_is_refused_and_tensors_outlive_it():
    slab = PinnedSlab(PAGE, pin=False)
    with pytest.raises(ValueError, match="outside the slab"):
        slab.carve(PAGE - 8, 16)
    t = slab.carve(0, 64).view(torch.float32)
    t.copy_(torch.arange(16, dtype=torch.float32))
    slab.close()
    slab.close()  # idempotent
    assert t.tolist() == list(range(16))  # still valid, the mapping goes with the last tensor
    with pytest.raises(ValueError, match="closed"):
        slab.carve(0, 8)
    with pytest.raises(ValueError, match="nbytes"):
        PinnedSlab(-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_slab_is_page_locked_as_torch_sees_it():
    slab = PinnedSlab(5 << 20)
    t = slab.carve(PAGE, 3 << 20)
    assert slab.pinned and t.is_pinned()
    t.copy_(torch.arange(t.numel()) % 251)
    up = t.to("cuda", non_blocking=True)  # a DMA straight from the slab
    torch.cuda.synchronize()
    assert torch.equal(up.cpu(), t)
    slab.close()
