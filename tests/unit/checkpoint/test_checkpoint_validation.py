"""Checkpoints as a validated boundary: a damaged or hostile checkpoint is refused by name, before anything
is read from outside its folder, allocated, or changed in the optimizer (issue 13, items 8 and 9).

Each hostile edit here keeps the manifest's own CRC valid (``reseal``): an attacker recomputes it, so the
CRC proves nothing about intent, only about accidents.
"""

from __future__ import annotations

import builtins
import io
import json
import math
import os
import re
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch
from helpers import run_script
from torch import nn

from tiered import TieredOptimizer
from tiered import cli as bench_cli
from tiered.checkpoint import (
    CheckpointError,
    CheckpointFormatError,
    InsufficientMemoryError,
    export_model_state_dict,
    export_torch_state_dict,
    import_torch_state_dict,
    inspect_checkpoint,
    latest_checkpoint,
    regular_files,
    verify_checkpoint,
)
from tiered.checkpoint.cli import main as ckpt_main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))  # 0.weight [16, 8], 0.bias, 1.weight, 1.bias


def make(model: nn.Module, path) -> TieredOptimizer:
    return TieredOptimizer(model, path, lr=1e-2, weight_decay=0.1, chunk_bytes="12KiB", host_budget="64KiB")


def train(model: nn.Module, opt: TieredOptimizer, steps: int) -> None:
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        nn.functional.mse_loss(model(torch.randn(4, 8, generator=g)), torch.randn(4, 4, generator=g)).backward()
        opt.step()
        opt.zero_grad()


@pytest.fixture
def saved(tmp_path):
    """A tiny model trained 2 steps and saved to ckpt/step-2; yields the checkpoint's path."""
    model = tiny()
    with make(model, tmp_path / "nvme-saver") as opt:
        train(model, opt, 2)
        yield opt.save_checkpoint(tmp_path / "ckpt" / "step-2", extra={"epoch": 1})


# --------------------------------------------------------------------------------------------- tampering
def reseal(path: str, edit) -> None:
    """Apply ``edit(body)`` to the manifest and recompute its manifest_crc32 (canonical JSON, sorted keys)."""
    mpath = os.path.join(path, "manifest.json")
    with open(mpath) as f:
        body = json.load(f)
    body.pop("manifest_crc32")
    edit(body)
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    body["manifest_crc32"] = zlib.crc32(canon.encode())
    with open(mpath, "w") as f:
        json.dump(body, f, indent=1, sort_keys=True)


def file_entry(data: bytes) -> dict:
    crc = zlib.crc32(data)
    return {"nbytes": len(data), "crc32": crc, "segments": [[0, len(data), crc]]}


def rewrite_objects(path: str, edit) -> None:
    """Change objects.pt (``edit(objs)``) and list its new size and CRC in a resealed manifest."""
    opath = os.path.join(path, "objects.pt")
    objs = torch.load(opath, weights_only=True)
    edit(objs)
    buf = io.BytesIO()
    torch.save(objs, buf)
    data = buf.getvalue()
    with open(opath, "wb") as f:
        f.write(data)
    reseal(path, lambda b: b["files"].__setitem__("objects.pt", file_entry(data)))


def set_group(key, value):
    return lambda objs: objs["param_groups"][0].__setitem__(key, value)


def set_param(i, key, value):
    return lambda body: body["params"][i].__setitem__(key, value)


# Hostile manifests: (edit, words the message must hold). Each passed today's checks.
HOSTILE = {
    "negative global step": (lambda b: b.__setitem__("step", -5), "-5"),
    "string global step": (lambda b: b.__setitem__("step", "2"), "'2'"),
    "negative dims": (set_param(0, "shape", [-16, -8]), "-16"),
    "float offset": (set_param(1, "offset", 128.0), "128.0"),
    "group out of range": (set_param(0, "group", 7), "7"),
    "dtype not a float dtype": (set_param(0, "dtype", "load"), "'load'"),
    "created in year 10^292": (lambda b: b.__setitem__("created_unix", 1e300), "1e+300"),
    "rows point elsewhere": (lambda b: b["rows"].__setitem__("master", "/etc/passwd"), "/etc/passwd"),
    "save id not one": (lambda b: b["source"].__setitem__("save_id", ["x"]), "source.save_id is ['x']"),
}

# Hostile param groups in objects.pt: each is what a constructor would refuse.
HOSTILE_GROUPS = {
    "lr nan": (set_group("lr", float("nan")), "nan"),
    "lr inf": (set_group("lr", float("inf")), "inf"),
    "negative eps": (set_group("eps", -1e-8), "-1e-08"),
    "beta of 1": (set_group("betas", (1.0, 0.999)), "1.0"),
    "string weight decay": (set_group("weight_decay", "0.1"), "'0.1'"),
    "maximize as text": (set_group("maximize", "no"), "'no'"),
    "lr missing": (lambda objs: objs["param_groups"][0].pop("lr"), "'lr'"),
    "amsgrad on": (set_group("amsgrad", True), "amsgrad"),
}


def snapshot(model: nn.Module, opt: TieredOptimizer) -> dict:
    sd = opt.state_dict()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "state": {i: {k: v.clone() for k, v in s.items()} for i, s in sd["state"].items()},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "steps": (opt.step_counts, opt.global_step),
    }


def assert_unchanged(before: dict, after: dict) -> None:
    assert before["params"].keys() == after["params"].keys()
    for n, t in before["params"].items():
        assert torch.equal(t, after["params"][n]), n
    assert before["state"].keys() == after["state"].keys()
    for i, s in before["state"].items():
        assert s.keys() == after["state"][i].keys()
        for k, t in s.items():
            assert torch.equal(t, after["state"][i][k]), (i, k)
    assert before["groups"] == after["groups"] and before["steps"] == after["steps"]


def assert_refused_everywhere(path: str, tmp_path, capsys, words: str, *, hparams: bool = False) -> None:
    """load_checkpoint, inspect, verify, the exporters and both CLIs refuse ``path`` with a
    CheckpointFormatError that names ``words``; the loading optimizer stays bitwise unchanged."""
    model = tiny()
    with make(model, tmp_path / "nvme-loader") as opt:
        train(model, opt, 1)  # a state of its own, which a refused load must keep
        before = snapshot(model, opt)
        with pytest.raises(CheckpointFormatError) as e:
            opt.load_checkpoint(path)
        assert words in str(e.value), str(e.value)
        assert_unchanged(before, snapshot(model, opt))
    with pytest.raises(CheckpointFormatError, match="load another checkpoint"):
        export_torch_state_dict(path)
    if hparams:
        return  # inspect and verify read the manifest and the data, not the hyperparameters
    for fn in (inspect_checkpoint, verify_checkpoint, export_model_state_dict):
        with pytest.raises(CheckpointFormatError) as e:
            fn(path)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    capsys.readouterr()
    for main in (bench_cli.main, ckpt_main):
        for command in ("inspect", "verify"):
            assert main([command, path]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "CheckpointFormatError" in err and words in err, err


# -------------------------------------------------------------------------------- item 9: numbers, types
@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_manifest_values_are_refused_by_name(saved, tmp_path, capsys, kind):
    edit, words = HOSTILE[kind]
    reseal(saved, edit)
    assert_refused_everywhere(saved, tmp_path, capsys, words)


@pytest.mark.parametrize("kind", sorted(HOSTILE_GROUPS))
def test_param_groups_pass_the_constructors_checks_before_anything_is_touched(saved, tmp_path, capsys, kind):
    edit, words = HOSTILE_GROUPS[kind]
    rewrite_objects(saved, edit)
    assert_refused_everywhere(saved, tmp_path, capsys, words, hparams=True)
    model = tiny()
    with make(model, tmp_path / "keep") as opt:  # hparams="keep" never uses the saved groups: it loads
        opt.load_checkpoint(saved, hparams="keep")
        assert opt.global_step == 2 and opt.param_groups[0]["lr"] == 1e-2
        train(model, opt, 1)
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_global_step_is_checked_before_the_optimizer_is_touched(saved, tmp_path):
    # The user's report: step -5 replaced every weight and all state, then raised a bare ValueError.
    reseal(saved, lambda b: b.__setitem__("step", -5))
    model = tiny()
    with make(model, tmp_path / "nvme-loader") as opt:
        train(model, opt, 1)
        before = snapshot(model, opt)
        for verify in ("stream", "first"):
            with pytest.raises(CheckpointFormatError, match=r"step.*-5.*>= 0"):
                opt.load_checkpoint(saved, verify=verify)
            assert_unchanged(before, snapshot(model, opt))


# --------------------------------------------------------------------------- item 8: names outside the folder
@pytest.fixture
def secret(tmp_path):
    """A file outside the checkpoint, of an odd size nothing else has."""
    path = tmp_path / "secret.txt"
    path.write_bytes(b"s" * 7919)
    return str(path)


@pytest.fixture
def spy(monkeypatch):
    """Every path handed to os.stat / os.lstat / os.open / open, so a test can say what was never touched."""
    seen: list[str] = []
    for mod, name in ((os, "stat"), (os, "lstat"), (os, "open"), (builtins, "open")):
        real = getattr(mod, name)

        def wrapper(p, *a, _real=real, **kw):
            if isinstance(p, (str, bytes, os.PathLike)):
                seen.append(os.fsdecode(p))
            return _real(p, *a, **kw)

        monkeypatch.setattr(mod, name, wrapper)
    return seen


def _names(secret: str) -> dict[str, str]:
    rel = os.path.relpath(secret, os.path.join(os.path.dirname(secret), "ckpt", "step-2"))
    return {"absolute": secret, "dotdot": rel, "separator": "sub/master.bin", "dot": ".", "empty": ""}


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "separator", "dot", "empty"])
def test_file_names_outside_the_fixed_set_are_refused_unopened(saved, tmp_path, capsys, secret, spy, kind):
    name = _names(secret)[kind]
    with open(secret, "rb") as f:
        entry = file_entry(f.read())  # the right size and CRC: today verify says OK, an oracle
    reseal(saved, lambda b: b["files"].__setitem__(name, entry))
    spy.clear()
    assert_refused_everywhere(saved, tmp_path, capsys, repr(name))
    assert not [p for p in spy if "secret" in p], "a file outside the checkpoint was stat'ed or opened"
    with pytest.raises(CheckpointFormatError) as e:
        inspect_checkpoint(saved)
    assert "7919" not in str(e.value).replace(secret, "")  # its size does not leak


def test_a_listed_file_replaced_by_another_name_is_refused(saved, tmp_path, capsys):
    def rename(b):
        b["files"]["../step-2/master.bin"] = b["files"].pop("master.bin")

    reseal(saved, rename)
    assert_refused_everywhere(saved, tmp_path, capsys, "'../step-2/master.bin'")


@pytest.mark.parametrize("name", ["manifest.json", "objects.pt", "master.bin", "exp_avg_sq.bin"])
def test_files_that_are_symlinks_are_refused(saved, tmp_path, capsys, name):
    # The link points at the checkpoint's own bytes, moved out: sizes and CRCs all match.
    outside = tmp_path / f"moved-{name}"
    os.rename(os.path.join(saved, name), outside)
    os.symlink(outside, os.path.join(saved, name))
    assert_refused_everywhere(saved, tmp_path, capsys, "symbolic link")


# ------------------------------------------------------------------------------------ item 9: JSON depth
DEEP = "[" * 100_000 + "]" * 100_000


def test_deeply_nested_manifest_is_a_format_error_not_a_recursion_error(saved, tmp_path, capsys):
    with open(os.path.join(saved, "manifest.json"), "w") as f:
        f.write(DEEP)
    assert_refused_everywhere(saved, tmp_path, capsys, "nested")


def test_nesting_within_a_sealed_manifest_is_bounded(saved, tmp_path, capsys):
    deep: dict = {}
    for _ in range(200):  # json and its CRC cope with 200; a manifest never needs more than a handful
        deep = {"x": deep}
    reseal(saved, lambda b: b.__setitem__("source", deep))
    assert_refused_everywhere(saved, tmp_path, capsys, "nested")


def test_deep_manifest_in_a_subprocess_exits_2_with_one_line(saved):
    with open(os.path.join(saved, "manifest.json"), "w") as f:
        f.write(DEEP)
    for command in ("inspect", "verify"):
        code = f"import sys; from tiered.cli import main; sys.exit(main([{command!r}, {saved!r}]))"
        p = run_script(code, cwd=REPO, env={"PYTHONPATH": REPO})
        assert p.returncode == 2, p.stderr
        lines = p.stderr.strip().splitlines()
        assert "Traceback" not in p.stderr and len(lines) == 1 and "nested" in lines[0], p.stderr


def test_latest_and_pruning_skip_a_deep_manifest(saved, tmp_path):
    root = os.path.dirname(saved)
    hostile = os.path.join(root, "step-9")
    os.mkdir(hostile)
    with open(os.path.join(hostile, "manifest.json"), "w") as f:
        f.write(DEEP)
    assert latest_checkpoint(root) == saved
    model = tiny()
    with make(model, tmp_path / "nvme-pruner") as opt:
        opt.save_checkpoint(os.path.join(root, "step-10"), keep_last=1)
    assert os.path.isdir(hostile) and not os.path.exists(saved)  # unreadable: left alone


def test_an_oversized_manifest_is_refused_before_it_is_parsed(saved, monkeypatch):
    monkeypatch.setattr(regular_files, "MAX_MANIFEST_BYTES", 1024)
    with pytest.raises(CheckpointFormatError, match=r"manifest\.json is larger than 1024 bytes"):
        inspect_checkpoint(saved)


# ------------------------------------------------------------------------------ sizes that cannot be met
def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def test_a_manifest_claiming_2_33_elements_is_refused_before_any_allocation(saved):
    # A sealed manifest listing one parameter of 2^33 elements, over sparse row files of that size (so the
    # files' sizes agree with it): exporting it would need 96 GiB of host memory, named, not allocated.
    huge = 1 << 33
    if _mem_available() >= 3 * 4 * huge:
        pytest.skip("this machine has the 96 GiB the export would take: nothing to refuse")
    for row in ("master.bin", "exp_avg.bin", "exp_avg_sq.bin"):
        os.truncate(os.path.join(saved, row), 4 * huge)

    def edit(body):
        body["params"] = [{**body["params"][0], "name": "huge", "shape": [huge], "offset": 0, "numel": huge}]
        body["numel"] = huge
        for row in ("master.bin", "exp_avg.bin", "exp_avg_sq.bin"):
            body["files"][row] = {"nbytes": 4 * huge, "crc32": 0, "segments": [[0, 4 * huge, 0]]}

    reseal(saved, edit)
    with pytest.raises(InsufficientMemoryError, match=r"needs 96.00 GiB of host memory.*opt\.load_checkpoint") as e:
        export_torch_state_dict(saved)
    assert isinstance(e.value, CheckpointError) and isinstance(e.value, OSError) and e.value.need == 3 * 4 * huge
    if _mem_available() < 4 * huge:
        with pytest.raises(InsufficientMemoryError, match="needs 32.00 GiB"):
            export_model_state_dict(saved)


# ------------------------------------------------------------------------------- import: refused up front
def test_import_refuses_what_the_loader_would_refuse(tmp_path):
    model = tiny()
    adamw = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.999))
    nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 4)).backward()
    adamw.step()
    sd = adamw.state_dict()
    sd["param_groups"][0]["betas"] = (1.0, 0.999)  # torch does not check a loaded dict: tiered must
    with pytest.raises(ValueError, match=r"param group 0.*betas.*\(1\.0, 0\.999\)"):
        import_torch_state_dict(sd, model, tmp_path / "imported")
    sd["param_groups"][0]["betas"] = (0.9, 0.999)
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        import_torch_state_dict(sd, model, tmp_path / "imported", step=-5)
    assert not os.path.exists(tmp_path / "imported")
    path = import_torch_state_dict(sd, model, tmp_path / "imported")
    with make(tiny(), tmp_path / "nvme-loader") as opt:
        assert opt.load_checkpoint(path)["step"] == 1


@pytest.mark.parametrize(
    "hparams",
    [{"betas": (torch.tensor(0.9), torch.tensor(0.999))}, {"lr": np.float32(1e-3)}, {"lr": torch.tensor(1e-3)}],
    ids=["tensor-betas", "numpy-lr", "tensor-lr"],
)
def test_import_takes_the_hyperparameters_the_constructor_takes(tmp_path, hparams):
    # Tensor betas (torch's recipe for compiled and capturable steps) and an np.float32 lr were refused ("it must be
    # a number"), though TieredOptimizer(...), load_state_dict and save_checkpoint take them: stored as plain numbers.
    model = tiny()
    adamw = torch.optim.AdamW(model.parameters(), **hparams)
    nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 4)).backward()
    adamw.step()
    path = import_torch_state_dict(adamw.state_dict(), model, tmp_path / "imported")
    group = inspect_checkpoint(path)["param_groups"][0]
    with TieredOptimizer(tiny(), tmp_path / "nvme", **hparams) as own:
        saved = inspect_checkpoint(own.save_checkpoint(tmp_path / "own"))["param_groups"][0]
    assert [group[k] for k in ("lr", "betas")] == [saved[k] for k in ("lr", "betas")]
    assert all(type(v) is float for v in (group["lr"], *group["betas"]))
    with make(tiny(), tmp_path / "nvme-loader") as opt:
        assert opt.load_checkpoint(path)["step"] == 1
        assert opt.param_groups[0]["lr"] == group["lr"] and list(opt.param_groups[0]["betas"]) == group["betas"]


@pytest.mark.parametrize(
    "dtype,error",
    [("bfloat16", TypeError), (16, TypeError), (torch.int8, ValueError), (torch.complex64, ValueError)],
    ids=["a-name", "a-number", "int8", "complex64"],
)
def test_export_model_state_dict_takes_floating_dtypes_only(saved, dtype, error):
    # A dtype's name gave torch's "Invalid device string", a number "Cannot access accelerator device", and an
    # integer dtype weights silently truncated (to zeros here).
    with pytest.raises(error, match=rf"dtype must be a floating torch\.dtype.*got '?{re.escape(str(dtype))}"):
        export_model_state_dict(saved, dtype=dtype)
    weights = export_model_state_dict(saved, dtype=torch.bfloat16)
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    assert all(torch.equal(w, v.bfloat16()) for w, v in zip(weights.values(), export_model_state_dict(saved).values()))


# ------------------------------------------------------------------------------------------- sanity
def test_the_untampered_checkpoint_still_loads_everywhere(saved, tmp_path, capsys):
    model = tiny()
    with make(model, tmp_path / "nvme-loader") as opt:
        assert opt.load_checkpoint(saved)["extra"] == {"epoch": 1}
        assert opt.global_step == 2
    sd = export_torch_state_dict(saved)
    assert len(sd["state"]) == 4 and math.isclose(sd["param_groups"][0]["lr"], 1e-2)
    assert set(export_model_state_dict(saved)) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert ckpt_main(["inspect", saved]) == 0 and ckpt_main(["verify", saved]) == 0


def test_python_m_tiered_checkpoint_ends_quietly_when_its_reader_goes_away(saved):
    # `python -m tiered.checkpoint inspect PATH --json | head` after head has exited printed a BrokenPipeError
    # traceback (tiered-bench already ended quietly, with the shell's 141).
    cmd = [sys.executable, "-m", "tiered.checkpoint", "inspect", saved, "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": REPO})  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # no reader: the first write fails
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err


def test_ctrl_c_during_a_verify_is_one_line_and_exit_130(saved, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("tiered.checkpoint.cli.verify_files", interrupted)
    assert ckpt_main(["verify", saved]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
