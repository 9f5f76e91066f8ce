"""The control for the GPU test of the new weights' rows: it fails when the rows are allocated wrongly.

    PYTHONPATH=. python3 bench/race_test_control.py      (on a GPU machine; exit status 1 is the expected result)

``AsideUpdate.weights_row`` (tiered/optim/under_backward/aside.py) allocates on the work stream, so that a
row never comes from memory that the compute stream freed while its kernels still fill it. This script
allocates the rows on the compute stream instead, as the third session's withdrawn design did, and then runs
``test_cuda_weights_rows_never_take_memory_backward_is_still_writing``. The test must fail here. If it
passed, it could not catch that race.
"""

import sys

import pytest
import torch

import tiered.optim.under_backward.aside as aside


def on_compute_stream(self, n):
    return torch.empty(n, dtype=torch.bfloat16, device=self.strategy.device)  # from the compute stream's cache


aside.AsideUpdate.weights_row = on_compute_stream
TEST = "tests/gpu/test_under_backward_cuda.py"
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", TEST, "-k", "never_take_memory"]))
