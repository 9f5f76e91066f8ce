"""tiered.bench.pcie's arithmetic, without a GPU: the pinned rates a run reports, and the link's floor for the
bytes a pass moves (examples/big_model.py reports each step's forward and backward against it)."""

from __future__ import annotations

import pytest

from tiered.bench.common import Stat
from tiered.bench.pcie import PcieResult, PcieRow, link_floor_s, pinned_rates

RATES = {"h2d": 50.0, "d2h": 40.0, "both": 80.0}  # GB/s


def test_pinned_rates_are_the_pinned_rows_medians():
    rows = [PcieRow(kind, d, Stat.of([x, 2 * x, 3 * x])) for kind, x in (("pageable", 1.0), ("pinned", 10.0))
            for d in ("h2d", "d2h", "both")]  # fmt: skip
    result = PcieResult(True, None, "a GPU", 1 << 20, 1, 3, rows)
    assert pinned_rates(result) == {"h2d": 20.0, "d2h": 20.0, "both": 20.0}


@pytest.mark.parametrize(
    "up, down, floor",
    [
        (100e9, 0, 2.0),  # up alone: at the upward rate
        (0, 100e9, 2.5),  # down alone: at the downward rate
        (100e9, 20e9, 2.0),  # both, the upward direction binds
        (100e9, 90e9, 2.375),  # both, the link's full-duplex rate binds: 190 GB at 80 GB/s
    ],
)
def test_the_link_floor_is_the_slowest_of_each_direction_and_both(up, down, floor):
    assert link_floor_s(int(up), int(down), RATES) == pytest.approx(floor)


def test_the_link_floor_refuses_what_cannot_be():
    with pytest.raises(ValueError, match="byte counts"):
        link_floor_s(-1, 0, RATES)
    with pytest.raises(ValueError, match="rates"):
        link_floor_s(1, 1, {**RATES, "both": 0.0})
