"""The checkpoint tools as a user meets them: `tiered-bench inspect|verify` and `python -m tiered.checkpoint`.

What the environment or the folder's permissions make them say: one line on stderr (never a traceback), the
exit code of the table in tiered/checkpoint/cli.py, and with --json the ``{"ok": false, ...}`` document.
The checkpoints' own damage is tested in tests/unit/checkpoint/.
"""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch
from torch import nn

from tiered import TieredOptimizer
from tiered import cli as bench_cli
from tiered.checkpoint.cli import main as checkpoint_main

CLIS = {"tiered-bench": bench_cli.main, "python -m tiered.checkpoint": checkpoint_main}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    """A small intact checkpoint (one process), saved with the default IOConfig."""
    root = tmp_path_factory.mktemp("ck")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TIERED_IO_CONFIG", raising=False)
        with TieredOptimizer(model, root / "nvme", lr=1e-2, chunk_bytes="12KiB", host_budget="64KiB") as opt:
            model(torch.randn(4, 32)).sum().backward()
            opt.step()
            return opt.save_checkpoint(root / "ck")


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


# ------------------------------------------------------------------------------- a bad $TIERED_IO_CONFIG
@pytest.mark.parametrize(
    "content, words",
    [
        ('{"threads": 0}', "threads must be an int >= 1, got 0"),
        ('{"threads": 4, "bogus": 1}', "unknown IOConfig field(s) ['bogus']"),  # a newer version's file
        ("threads = 4", "is not an IOConfig JSON file"),
    ],
    ids=["bad-value", "unknown-key", "not-json"],
)
@pytest.mark.parametrize("prog", CLIS)
def test_verify_with_a_bad_io_config_file_says_so_in_one_line(ckpt, tmp_path, monkeypatch, capsys, prog, content,
                                                              words):  # fmt: skip
    # It was a traceback ending in ValueError, and under --json nothing at all on stdout.
    bad = tmp_path / "io.json"
    bad.write_text(content)
    monkeypatch.setenv("TIERED_IO_CONFIG", str(bad))
    assert CLIS[prog](["verify", ckpt]) == 1  # a read that failed for another reason than the checkpoint
    err = one_line(capsys.readouterr().err)
    assert err.startswith(f"{prog}: ") and "$TIERED_IO_CONFIG" in err and str(bad) in err and words in err, err
    assert "damaged" not in err
    assert CLIS[prog](["verify", ckpt, "--json"]) == 1
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["ok"] is False and doc["path"] == ckpt and doc["error"] == "ValueError"
    assert len(doc["problems"]) == 1 and "$TIERED_IO_CONFIG" in doc["problems"][0] and words in doc["problems"][0]
    one_line(err)
    assert CLIS[prog](["inspect", ckpt]) == 0  # inspect reads no data: it needs no IOConfig


@pytest.mark.parametrize("name", ["gone.json", "."], ids=["missing", "a-folder"])
def test_verify_with_an_io_config_file_it_cannot_read_says_so_in_one_line(ckpt, tmp_path, monkeypatch, capsys, name):
    # A folder gave a bare IsADirectoryError naming neither the variable nor the file's part in it.
    monkeypatch.setenv("TIERED_IO_CONFIG", str(tmp_path / name))
    assert checkpoint_main(["verify", ckpt, "--json"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["error"] == "ValueError" and "$TIERED_IO_CONFIG names" in one_line(err)


@pytest.mark.parametrize("prog", CLIS)
def test_verify_with_a_bad_huge_pages_setting_says_so_in_one_line(ckpt, monkeypatch, capsys, prog):
    # verify's buffers read $TIERED_HUGE_PAGES: a value neither on nor off was a traceback from the first one, and
    # under --json nothing on stdout. Now said as a bad $TIERED_IO_CONFIG is.
    monkeypatch.setenv("TIERED_HUGE_PAGES", "bogus")
    assert CLIS[prog](["verify", ckpt]) == 1
    err = one_line(capsys.readouterr().err)
    assert err.startswith(f"{prog}: ValueError: ") and "$TIERED_HUGE_PAGES='bogus'" in err, err
    assert CLIS[prog](["verify", ckpt, "--json"]) == 1
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["ok"] is False and doc["path"] == ckpt and doc["error"] == "ValueError"
    assert len(doc["problems"]) == 1 and "$TIERED_HUGE_PAGES='bogus'" in doc["problems"][0]
    one_line(err)
    assert CLIS[prog](["inspect", ckpt]) == 0  # inspect reads no data: it makes no buffer


# --------------------------------------------------------------------------- a folder it may not read
@pytest.mark.parametrize("command", ["inspect", "verify"])
@pytest.mark.parametrize("prog", CLIS)
def test_a_checkpoint_folder_this_user_may_not_read_is_one_clear_line(ckpt, monkeypatch, capsys, prog, command):
    # As a user meets a folder of mode 000 (root ignores modes, so the open is refused here): exit 1, "a read that
    # failed for another reason", with what to change. It said only "[Errno 13] Permission denied: 'PATH'".
    real_open = os.open

    def refused(path, flags, *args, **kw):
        if os.fspath(path) == ckpt and flags & os.O_DIRECTORY:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", refused)
    assert CLIS[prog]([command, ckpt]) == 1
    err = one_line(capsys.readouterr().err)
    assert err.startswith(f"{prog}: PermissionError: this user may not read {ckpt} (Permission denied)"), err
    assert "nothing says the checkpoint is damaged" in err and "Load an earlier" not in err
    assert CLIS[prog]([command, ckpt, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["error"] == "PermissionError" and "read access" in doc["problems"][0]
