"""``state_dict()`` where its backing files do not fit: the tensors it returns are files in the optimizer's
folder (tiered/optim/state_dicts.py), so a full disk meets it. The error must say which file and how many bytes,
keep the errno, and leave the optimizer as it was."""

from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch
from helpers import run_bounded, small_tmpfs
from torch import nn

from io_engine import format_size
from tiered import TieredOptimizer


def remount(path: str, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", path], check=True, capture_output=True)


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_state_dict_on_a_full_disk_names_the_file_and_bytes_and_stays_usable():
    torch.manual_seed(0)
    model = nn.Linear(256, 512)  # 131,584 fp32 parameters: 1.0 MiB of moments in the state dict
    reference = nn.Linear(256, 512)
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    x = torch.randn(8, 256)
    with small_tmpfs("1m") as d:
        try:
            # The whole state fits the host budget, so the store needs no disk; the state dict's files do.
            with TieredOptimizer(model, nvme_path=d, lr=1e-2, host_budget="8MiB", chunk_bytes="1MiB") as opt:
                for m, o in ((model, opt), (reference, ref_opt)):
                    m(x).square().mean().backward()
                    o.step()
                    o.zero_grad()
                before = free_bytes(d)
                with pytest.raises(OSError) as ei:
                    run_bounded(opt.state_dict, 60)
                e = ei.value
                assert type(e) is not OSError, "a bare OSError names neither the file nor the bytes"
                assert e.errno == errno.ENOSPC
                assert e.filename and os.path.dirname(e.filename) == opt.workdir, e.filename
                assert e.filename in str(e)
                assert e.total == 8 * 131_584 and format_size(e.total) in str(e), str(e)  # what the dict needs
                assert format_size(e.size) in str(e), str(e)  # and the file
                assert "exp_avg" in str(e) and ("'weight'" in str(e) or "'bias'" in str(e)), str(e)
                assert free_bytes(d) == before, "the files made before the failure are given back"
                assert [n for n in os.listdir(opt.workdir) if n.startswith("state_dict-")] == []

                # Usable: a step runs, and once there is room the state dict is AdamW's.
                remount(d, "size=8m")
                for m, o in ((model, opt), (reference, ref_opt)):
                    m(x).square().mean().backward()
                    o.step()
                    o.zero_grad()
                sd = run_bounded(opt.state_dict, 60)
                for i, p in enumerate(reference.parameters()):
                    for key in ("exp_avg", "exp_avg_sq"):
                        torch.testing.assert_close(sd["state"][i][key], ref_opt.state[p][key])
                    assert float(sd["state"][i]["step"]) == 2
                torch.testing.assert_close(model.weight.detach(), reference.weight.detach())
                del sd
        finally:
            remount(d, "size=8m")
