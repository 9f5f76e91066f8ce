"""How far each step is from the disk's floor, what bounds it, and what it costs the SSD.

After every step ``opt.stats()["telemetry"]`` holds (``report``):

- ``nvme_gbps``: the NVMe bytes the step moved (read + written) over its time;
- ``floor_s``: those bytes at the disk's calibrated bandwidth (read bytes / read GB/s + written bytes / write
  GB/s), and ``over_floor``, the step's time over it (near 1: the step is as fast as the disk allows);
- ``bound``: the phase that took the most of the step: "disk" (waiting for reads or write-backs), "PCIe"
  (gradients down, weights up), "CPU" or "GPU" (the update itself);
- ``wear``: bytes written a step, terabytes per 1000 steps, and with ``run_steps`` the run's projection.

The calibrated bandwidth (``disk_rate``) is calibration.py's: the disk as fast as the engine drives it at the
optimizer's IOConfig (a 1 GiB file, 64 MiB requests 8 in flight, overwrite then read), measured once and cached
with its provenance (method, file size, requests, IOConfig, machine, boot, device, filesystem, time), which
``stats()["telemetry"]["disk_rate"]`` holds and ``summary_line`` shows in a few words. A cached figure from
another machine, boot, device, IOConfig or method is not used: the disk is measured again and the figure says
which it refused. Only an optimizer whose state does not fit its host budget measures; a failed measurement
(a full disk) leaves the floor unknown (None), never the optimizer broken.

SSD wear: with ``tbw`` (the drive's rated endurance, in terabytes written) and ``run_steps``, a run projected
to write more than ``wear_share`` of it is warned about once, naming the knobs that write less.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from io_engine import format_size

from .calibration import CALIBRATE_NAME, DiskRate, describe, disk_rate

if TYPE_CHECKING:
    import torch

__all__ = ["DiskRate", "disk_rate", "report", "summary_line", "Wear", "CALIBRATE_NAME"]

_log = logging.getLogger("tiered")


def report(phases: dict[str, float], rate: DiskRate | None, update_on: str, device_type: str) -> dict[str, Any]:
    """The telemetry of one step from its phases (``step_stats.PHASES``). ``device_type``: the type of the
    device the parameters are updated on with ``update_on="device"`` ("cpu" for parameters on the CPU)."""
    step = phases["step_s"]
    r, w = phases["nvme_read_bytes"], phases["nvme_write_bytes"]
    floor = None
    if rate is not None and rate.read_gbps > 0 and rate.write_gbps > 0 and r + w:  # a rate <= 0 or NaN: no floor
        floor = r / (rate.read_gbps * 1e9) + w / (rate.write_gbps * 1e9)  # rather than a step that divides by it
    parts = {
        "disk": phases["read_wait_s"] + phases["write_wait_s"],
        "PCIe": phases["grad_d2h_s"] + phases["h2d_s"],
        # update_on="device" runs the update where the parameters are, which may be the CPU
        "GPU" if update_on == "device" and device_type != "cpu" else "CPU": phases["update_s"],
    }
    return {
        "nvme_gbps": round((r + w) / step / 1e9, 3) if step > 0 else 0.0,
        "floor_s": None if floor is None else round(floor, 4),
        "over_floor": None if not floor else round(step / floor, 3),
        "bound": max(parts, key=lambda k: parts[k]),
        "disk_rate": None if rate is None else asdict(rate),
    }


def summary_line(steps: int, phases: dict[str, float], tele: dict[str, Any], *, floor: bool = True) -> str:
    """One line for a progress bar or a log: the last step against its floor, what bounds it, the wear.
    ``floor=False``: without the ratio to the floor, for a report that gives its own from a rate it measured
    (tiered-bench optim): one such figure a report. The ratio says what rates it divides by and where they
    came from (calibration.describe)."""
    r, w = phases["nvme_read_bytes"], phases["nvme_write_bytes"]
    out = f"step {steps}: {phases['step_s']:.3f} s"
    if floor and tele.get("over_floor") is not None:
        out += f", {tele['over_floor']:.2f}x the disk floor"
        if tele.get("disk_rate"):
            out += f" ({describe(tele['disk_rate'])})"
    out += f", {tele['bound']}-bound"
    if r + w:
        out += f"; NVMe {format_size(int(r))} read + {format_size(int(w))} written at {tele['nvme_gbps']:.2f} GB/s"
    wear = tele.get("wear") or {}
    if wear.get("tb_per_1000_steps"):
        out += f"; {wear['tb_per_1000_steps']:.2f} TB written per 1000 steps"
    return out


# What the wear warning advises beside a larger host_budget (or gpu_budget, where it applies), by the optimizer's
# moments dtype: only moments that write fewer bytes a step than these (bf16 records are 8 B a parameter, 8-bit ones
# 4.2 to 6.0, fp32 ones 10.1 to 12), so 8-bit moments are offered none and bf16 ones only 8-bit.
_FEWER_BYTES = {
    "float32": ", moments_dtype=torch.bfloat16 (a third fewer bytes a step) or moments_dtype='int8' (a half to three "
    "fifths fewer; neither is exact AdamW)",
    "bfloat16": " or moments_dtype='int8' (a quarter to a half fewer bytes a step; not exact AdamW either)",
    "int8": "",
}


class Wear:
    """SSD wear: bytes written a step, and the warning once a run would wear more than its share, naming the knobs
    that write less than the optimizer's ``moments_dtype`` does. ``hbm``: state can live in HBM (the parameters on
    a GPU, or streamed to one with the update there), so a larger gpu_budget writes less; elsewhere it is ignored,
    and not advised."""

    def __init__(self, tbw: float | None, run_steps: int | None, share: float,
                 moments_dtype: torch.dtype | str = "float32", *, hbm: bool = False):  # fmt: skip
        self.tbw, self.run_steps, self.share = tbw, run_steps, share
        self._fewer_bytes = _FEWER_BYTES[str(moments_dtype).removeprefix("torch.")]  # a TierConfig's: checked
        self._budgets = "host_budget or gpu_budget" if hbm else "host_budget"
        self._warned = False

    def report(self, written_per_step: float, written_total: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "bytes_written_per_step": int(written_per_step),
            "bytes_written_total": int(written_total),
            "tb_per_1000_steps": round(written_per_step * 1000 / 1e12, 4),
        }
        if self.run_steps:
            run_tb = written_per_step * self.run_steps / 1e12
            out["run_tb"] = round(run_tb, 3)
            if self.tbw:
                out["run_share_of_tbw"] = round(run_tb / self.tbw, 4)
                if run_tb > self.share * self.tbw and not self._warned:
                    self._warned = True
                    _log.warning(
                        "TieredOptimizer: %d steps at %s written a step would write %.1f TB, %.0f %% of the drive's "
                        "rated %.0f TBW (wear_share=%.2f). Write less with a larger %s (more of the state stays in "
                        "memory)%s.",
                        self.run_steps, format_size(int(written_per_step)), run_tb, 100 * run_tb / self.tbw,
                        self.tbw, self.share, self._budgets, self._fewer_bytes,
                    )  # fmt: skip
        return out
