"""The small things a new user meets first: knobs refused by name at the public boundary."""

from __future__ import annotations

import pytest
import torch

from tiered import TieredOptimizer


@pytest.mark.parametrize("bad", [0, "0", 1, "64", 4095])
def test_a_chunk_smaller_than_a_page_is_refused_by_name(tmp_path, bad):
    """chunk_bytes=0 (or 64, meant as MiB) used to be accepted and rounded up to one row without a word."""
    params = [torch.nn.Parameter(torch.randn(1000))]
    with pytest.raises(ValueError, match=r"chunk_bytes must be at least 4 KiB .*got"):
        TieredOptimizer(params, tmp_path, chunk_bytes=bad)
    assert not any(tmp_path.iterdir())  # refused before a folder was made


def test_the_smallest_chunk_still_works(tmp_path):
    params = [torch.nn.Parameter(torch.randn(5000))]
    with TieredOptimizer(params, tmp_path, chunk_bytes="4KiB") as opt:
        params[0].grad = torch.ones(5000)
        opt.step()
        assert len(opt.chunks) > 1
