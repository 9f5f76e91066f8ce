"""Long work shows a progress bar on a terminal (and only there, and only once it has run a while); elsewhere
it logs a line now and then."""

from __future__ import annotations

import io

import torch
from torch import nn

import tiered.progress
from tiered import TieredOptimizer


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def stderr(monkeypatch, out: io.StringIO) -> io.StringIO:
    """Called in the test's body: pytest sets its own capture in sys.stderr after the fixtures' setup."""
    monkeypatch.setattr("sys.stderr", out)
    monkeypatch.setattr(tiered.progress, "DELAY_S", 0.0)  # at once: the work here is quick
    return out


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))


def test_setup_checkpoints_and_state_dicts_show_their_progress(tmp_path, monkeypatch):
    terminal = stderr(monkeypatch, Terminal())
    m = model()
    with TieredOptimizer(m, tmp_path / "nvme", chunk_bytes="24KiB", host_budget="1MiB") as opt:
        assert "tiered: writing the initial state" in terminal.getvalue()
        m(torch.randn(4, 64)).sum().backward()
        opt.step()
        opt.save_checkpoint(tmp_path / "ckpt")
        assert "tiered: saving the checkpoint" in terminal.getvalue()
        opt.load_checkpoint(tmp_path / "ckpt")
        assert "tiered: loading the checkpoint" in terminal.getvalue()
        sd = opt.state_dict()
        assert "tiered: state_dict()" in terminal.getvalue()
        opt.load_state_dict(sd)
        assert "tiered: load_state_dict()" in terminal.getvalue()


def test_no_bar_where_stderr_is_not_a_terminal(tmp_path, monkeypatch):
    out = stderr(monkeypatch, io.StringIO())
    m = model()
    with TieredOptimizer(m, tmp_path / "nvme", chunk_bytes="24KiB", host_budget="1MiB") as opt:
        opt.save_checkpoint(tmp_path / "ckpt")
    assert out.getvalue() == ""


def test_long_work_logs_its_progress_where_stderr_is_not_a_terminal(tmp_path, monkeypatch, caplog):
    """A batch job's log gets a line in the "tiered" logger every LOG_EVERY_S seconds of long work, and one
    at its end; stderr itself stays free of bars."""
    import logging

    out = stderr(monkeypatch, io.StringIO())
    monkeypatch.setattr(tiered.progress, "LOG_EVERY_S", 0.0)  # every update: the work here is quick
    m = model()
    with caplog.at_level(logging.INFO, logger="tiered"):
        with TieredOptimizer(m, tmp_path / "nvme", chunk_bytes="24KiB", host_budget="1MiB") as opt:
            opt.save_checkpoint(tmp_path / "ckpt")
    lines = [r.getMessage() for r in caplog.records if r.name == "tiered"]
    assert any(line.startswith("tiered: writing the initial state: ") and "GiB of" in line for line in lines), lines
    assert any(line.startswith("tiered: saving the checkpoint: 100 %") for line in lines), lines
    assert "tiered: saving the checkpoint: done in" in " ".join(lines), lines
    assert out.getvalue() == ""


def test_quick_work_logs_nothing(tmp_path, monkeypatch, caplog):
    import logging

    stderr(monkeypatch, io.StringIO())  # LOG_EVERY_S as it is: 30 s, far longer than this work
    with caplog.at_level(logging.INFO, logger="tiered"):
        with TieredOptimizer(model(), tmp_path / "nvme", chunk_bytes="24KiB", host_budget="1MiB") as opt:
            opt.save_checkpoint(tmp_path / "ckpt")
    assert not [r for r in caplog.records if r.name == "tiered" and r.getMessage().startswith("tiered: ")]
