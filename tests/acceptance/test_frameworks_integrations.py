"""tiered.integrations beyond the resume parity in test_frameworks_hf.py / test_frameworks_lightning.py:
accelerate's ``load_state`` resumes as an uninterrupted run ends, and asks ``torch.load`` to map;
``TieredCheckpointIO`` saves atomically (a failed save leaves the previous checkpoint and no temporary
file; a killed one's is removed by the next save) and hands other filesystems to Lightning's own
``TorchCheckpointIO``; the framework modules only load with their framework, never with ``import tiered``."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import frameworks_common as fc  # first: it takes the HF libraries offline before they load

# isort: split
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from helpers import REPO, run_script, wait_until
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from torch.utils.data import DataLoader

from tiered.integrations._loading import is_tiered, mmap_loads
from tiered.integrations.accelerate import load_state
from tiered.integrations.lightning import TieredCheckpointIO

pytestmark = pytest.mark.frameworks

BATCHES = 8


@pytest.fixture
def accelerator():
    """A fresh CPU Accelerator (accelerate keeps its state in process-wide singletons; reset as its tests do)."""

    def new() -> Accelerator:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        return Accelerator(cpu=True)

    yield new
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_accelerate_load_state_resumes_as_uninterrupted_and_maps_the_file(tmp_path, accelerator, monkeypatch):
    half = BATCHES // 2
    dl = lambda: DataLoader(fc.tokens(BATCHES * fc.BATCH), batch_size=fc.BATCH, shuffle=False)  # noqa: E731
    acc = accelerator()
    model = fc.tiny_llama()
    opt = fc.make_optimizer("tiered", model, tmp_path / "nvme")
    model, popt, loader = acc.prepare(model, opt, dl())
    for i, batch in enumerate(loader):
        acc.backward(model(input_ids=batch, labels=batch).loss)
        popt.step()
        popt.zero_grad()
        if i + 1 == half:
            acc.save_state(str(tmp_path / "state"))
    final = fc.weights(model)
    fc.assert_used_disk(opt)
    fc.close(opt)
    del acc, model, opt, popt, loader
    gc.collect()

    loads = []
    real_load = torch.load
    monkeypatch.setattr(
        torch, "load", lambda f, *a, **kw: loads.append((str(f), kw.get("mmap"))) or real_load(f, *a, **kw)
    )
    acc = accelerator()
    model = fc.tiny_llama(seed=1)  # other weights: load_state must bring the saved ones back
    opt = fc.make_optimizer("tiered", model, tmp_path / "nvme")
    model, popt, loader = acc.prepare(model, opt, dl())
    load_state(acc, str(tmp_path / "state"))
    monkeypatch.undo()
    assert [m for f, m in loads if f.endswith("optimizer.bin")] == [True], loads
    assert fc.step_count(opt) == half
    for batch in acc.skip_first_batches(loader, half):
        acc.backward(model(input_ids=batch, labels=batch).loss)
        popt.step()
        popt.zero_grad()
    assert fc.step_count(opt) == BATCHES
    fc.assert_same_weights(final, fc.weights(model), "accelerate load_state (mapped): resumed vs uninterrupted")
    assert is_tiered(popt) and not is_tiered(torch.optim.AdamW(fc.tiny_llama().parameters()))
    fc.close(opt)


def mixed(acc: Accelerator, nvme):
    """A TieredOptimizer for the body and torch's AdamW for the head, prepared together (optimizer.bin and
    optimizer_1.bin in a checkpoint), after one step: the model, the tiered one and the AdamW one."""
    model = fc.tiny_llama()
    cls, kw = fc.optimizer_kwargs("tiered", nvme)
    body = cls(list(model.model.parameters()), **kw)
    head = torch.optim.AdamW(model.lm_head.parameters(), lr=fc.LR)
    model, pbody, phead = acc.prepare(model, body, head)
    x = fc.tokens(fc.BATCH)
    acc.backward(model(input_ids=x, labels=x).loss)
    pbody.step()
    phead.step()
    return model, body, head


def test_accelerate_load_state_maps_only_the_tiered_optimizers_files(tmp_path, accelerator, monkeypatch):
    """torch's AdamW keeps the tensors it loads as its state: loaded mapped, its file stayed mapped after the
    checkpoint was deleted (a total_limit rotation, a clean-up), its disk space held for the rest of the run."""
    acc = accelerator()
    model, body, head = mixed(acc, tmp_path / "nvme")
    acc.save_state(str(tmp_path / "state"))
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda f, *a, **kw: loads.append((os.path.basename(str(f)), kw.get("mmap")))
                        or real_load(f, *a, **kw))  # fmt: skip
    load_state(acc, str(tmp_path / "state"))
    monkeypatch.undo()
    assert [m for f, m in loads if f.startswith("optimizer")] == [True, None], loads
    assert fc.step_count(body) == fc.step_count(head) == 1
    shutil.rmtree(tmp_path / "state")
    gc.collect()
    assert mappings(tmp_path / "state") == [], "a deleted checkpoint stays mapped (its disk space held)"
    fc.close(body)


def test_accelerate_load_state_on_gpus_loads_the_tiered_state_onto_the_cpu(tmp_path, accelerator, monkeypatch):
    """Under DDP on GPUs accelerate loads each optimizer's file onto this rank's GPU ("on_device"): the whole
    TieredOptimizer state went to the GPU before load_state_dict took it back to the host, out of GPU memory for a
    state larger than the GPU. Here rank 0 of two GPUs as accelerate sees it, on the CPU, with torch.load spied;
    AdamW's file keeps accelerate's choice."""
    import accelerate.checkpointing as checkpointing

    acc = accelerator()
    model, body, head = mixed(acc, tmp_path / "nvme")
    acc.save_state(str(tmp_path / "state"))
    loads = fc.spy_loads(monkeypatch)
    monkeypatch.setattr(Accelerator, "num_processes", property(lambda self: 2))
    monkeypatch.setattr(Accelerator, "multi_device", property(lambda self: True))
    monkeypatch.setattr(checkpointing, "PartialState", lambda: SimpleNamespace(device=torch.device("cuda", 0)))
    monkeypatch.setattr(checkpointing, "load_model", lambda *a, **kw: None)  # the weights (safetensors): not at stake
    with pytest.raises(fc.LoadOntoGPU):
        load_state(acc, str(tmp_path / "state"))
    monkeypatch.undo()
    assert loads == [("optimizer.bin", "cpu", True), ("optimizer_1.bin", torch.device("cuda", 0), None)], loads
    assert fc.step_count(body) == 1
    fc.close(body)


def test_accelerate_load_state_refuses_what_is_not_an_accelerator(tmp_path):
    with pytest.raises(TypeError, match="accelerate.Accelerator, got str"):
        load_state("not an accelerator", str(tmp_path))


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot pickle this (the test's failing save)")


def test_lightning_checkpoint_io_save_is_atomic_and_loads_mapped(tmp_path):
    io = TieredCheckpointIO()
    path = tmp_path / "ckpts" / "last.ckpt"
    first = {"state_dict": torch.nn.Linear(10, 100).state_dict(), "epoch": 1}  # a module's, as Lightning's is
    io.save_checkpoint(first, path)
    assert sorted(os.listdir(path.parent)) == ["last.ckpt"]  # no temporary file left
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o666 & ~_umask())
    with pytest.raises(RuntimeError, match="the test's failing save"):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(1000)}, "bad": Unpicklable()}, path)
    assert sorted(os.listdir(path.parent)) == ["last.ckpt"], "the failed save's temporary file is gone"
    loaded = io.load_checkpoint(path, weights_only=True)
    assert loaded["epoch"] == 1 and torch.equal(loaded["state_dict"]["weight"], first["state_dict"]["weight"])
    assert mapped_from(loaded["state_dict"]["weight"], path), "the loaded tensor is a copy, not the file's pages"


def test_lightning_checkpoint_io_maps_only_what_is_copied_out(tmp_path):
    """torch's optimizers keep the tensors they load as their state, and callbacks theirs: loaded mapped, they
    kept the whole checkpoint mapped, its disk space held for the rest of the run once ModelCheckpoint replaced
    or deleted it. Only a TieredOptimizer's state and the module's weights, which are copied out of, stay pages
    of the file; a checkpoint saved otherwise does not say which optimizer was tiered, so each state stays."""
    model = fc.tiny_llama()
    cls, kw = fc.optimizer_kwargs("tiered", tmp_path / "nvme")
    body = cls(list(model.model.parameters()), **kw)
    head = torch.optim.AdamW(model.lm_head.parameters(), lr=fc.LR)
    x = fc.tokens(fc.BATCH)
    model(input_ids=x, labels=x).loss.backward()
    body.step()
    head.step()
    checkpoint = {"state_dict": model.state_dict(), "optimizer_states": [body.state_dict(), head.state_dict()],
                  "callbacks": {"EarlyStopping": {"best_score": torch.tensor(0.5)}}, "epoch": 1}  # fmt: skip
    path, other = tmp_path / "last.ckpt", tmp_path / "saved-otherwise.ckpt"
    io = TieredCheckpointIO()
    io.save_checkpoint(checkpoint, path)
    torch.save(checkpoint, other)  # as Lightning's own TorchCheckpointIO saves
    assert sorted(checkpoint) == ["callbacks", "epoch", "optimizer_states", "state_dict"]  # the caller's, as it was

    loaded = io.load_checkpoint(path, weights_only=True)
    assert sorted(loaded) == sorted(checkpoint)
    tiered, plain = loaded["optimizer_states"]
    assert mapped_from(tiered["state"][0]["exp_avg"], path)
    assert mapped_from(loaded["state_dict"]["lm_head.weight"], path)
    assert not mapped_from(plain["state"][0]["exp_avg"], path)
    assert not mapped_from(plain["state"][0]["step"], path)
    assert not mapped_from(loaded["callbacks"]["EarlyStopping"]["best_score"], path)
    assert float(loaded["callbacks"]["EarlyStopping"]["best_score"]) == 0.5
    for got, want in ((tiered, body.state_dict()), (plain, head.state_dict())):
        assert got["param_groups"] == want["param_groups"]
        for i, entry in want["state"].items():
            for k, v in entry.items():
                assert torch.equal(got["state"][i][k], v), (i, k)
    # What Lightning does with it: the module and both optimizers load; then the file is replaced.
    model.load_state_dict(loaded["state_dict"])
    body.load_state_dict(tiered)
    head.load_state_dict(plain)
    del loaded, tiered, plain
    gc.collect()
    os.unlink(path)
    assert mappings(path) == [], "a replaced checkpoint stays mapped (its disk space held) after the resume"

    loaded = io.load_checkpoint(other, weights_only=True)
    assert all(mapped_from(s["state"][0]["exp_avg"], other) for s in loaded["optimizer_states"])
    assert not mapped_from(loaded["callbacks"]["EarlyStopping"]["best_score"], other)
    # Fabric's save of the user's own dict: its load without the plugin hands back every key it does not know,
    # so nothing is added to it (it loads as a checkpoint saved otherwise).
    fabric = {"model": model.state_dict(), "optimizer": body.state_dict(), "iter": 3}
    io.save_checkpoint(fabric, tmp_path / "fabric.ckpt")
    assert sorted(torch.load(tmp_path / "fabric.ckpt", weights_only=True)) == ["iter", "model", "optimizer"]
    fc.close(body)


def test_lightning_checkpoint_io_saves_any_name_torch_save_takes(tmp_path):
    # The temporary file's name (.NAME.tmp-HOST-PID-RAND) adds up to ~50 bytes to the checkpoint's: a Lightning
    # checkpoint name of 200-255 bytes, which TorchCheckpointIO saves, failed with ENAMETOOLONG.
    io = TieredCheckpointIO()
    for n in (200, 240, 255):
        path = tmp_path / ("x" * (n - 5) + ".ckpt")
        io.save_checkpoint({"state_dict": {"w": torch.arange(10.0)}, "n": n}, path)
        assert io.load_checkpoint(path, weights_only=True)["n"] == n
    assert len(os.listdir(tmp_path)) == 3  # no temporary file left


# A TieredCheckpointIO save that has written its temporary file in full and stops before the rename (at the fsync),
# telling the test by making argv[2], until it is killed there.
STALLED_SAVE = """
import os, sys, time, torch
from tiered.integrations.lightning import TieredCheckpointIO

def stall(fd):
    open(sys.argv[2], "w").close()
    time.sleep(300)

os.fsync = stall
TieredCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(1 << 18)}}, sys.argv[1])
"""


def _stalled_save(path, marker) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", STALLED_SAVE, str(path), str(marker)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def _stalled(p: subprocess.Popen, marker) -> None:
    if not wait_until(lambda: os.path.exists(marker) or p.poll() is not None, timeout=180):
        p.kill()
        pytest.fail(f"the save did not reach its fsync in 180 s: {p.communicate(timeout=60)[0]}")
    assert p.poll() is None, f"the save ended instead of stalling: {p.communicate(timeout=60)[0]}"


def _kill(p: subprocess.Popen) -> None:
    p.kill()
    p.wait(timeout=60)  # reaped: a dead saver, not a zombie that still counts as alive


def test_lightning_checkpoint_io_removes_what_killed_saves_left(tmp_path):
    # Each save killed mid-way (preemption, the OOM killer) left its temporary file, as large as the checkpoint, for
    # good: its name (random) did not tell a dead saver's from a live one's, and no save removed it. The next save
    # removes those of savers that are gone (on this host), as tiered's own checkpoint writer does, never a live one's.
    path = tmp_path / "ckpts" / "last.ckpt"
    path.parent.mkdir()
    killed = [(_stalled_save(path, tmp_path / f"killed-{i}"), tmp_path / f"killed-{i}") for i in range(2)]
    try:
        for p, marker in killed:
            _stalled(p, marker)
    finally:
        for p, _ in killed:
            _kill(p)
    left = set(os.listdir(path.parent))  # each temporary file, and the lock file its save held beside it
    temps = {e for e in left if not e.endswith(".lock")}
    assert left == temps | {e + ".lock" for e in temps} and len(temps) == 2, left
    assert all(os.path.getsize(path.parent / e) >= 1 << 20 for e in temps), left
    live = _stalled_save(path, tmp_path / "live")
    try:
        _stalled(live, tmp_path / "live")
        its = set(os.listdir(path.parent)) - left
        TieredCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(8)}}, path)
        assert sorted(os.listdir(path.parent)) == sorted([*its, "last.ckpt"]), "only the live saver's file stays"
    finally:
        _kill(live)
    TieredCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(8)}}, path)
    assert os.listdir(path.parent) == ["last.ckpt"]


def test_lightning_checkpoint_io_resolves_paths_as_lightning_does(tmp_path, monkeypatch):
    """``~/...`` and the ``file:``/``local:`` URL forms were saved under the current directory (in a folder named
    ``~``, ``file:`` or ``local:``), and a ``~`` path was never mapped on load: each names the file Lightning's
    own TorchCheckpointIO writes, reads and removes."""
    home, cwd, folder = tmp_path / "home", tmp_path / "cwd", tmp_path / "ckpts"
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    names = {"~/ckpts/a.ckpt": home / "ckpts" / "a.ckpt", f"local://{folder}/b.ckpt": folder / "b.ckpt",
             f"local:{folder}/c.ckpt": folder / "c.ckpt", f"file:{folder}/d.ckpt": folder / "d.ckpt",
             f"file://{folder}/e.ckpt": folder / "e.ckpt", "rel/f.ckpt": cwd / "rel" / "f.ckpt"}  # fmt: skip
    for io in (TorchCheckpointIO(), TieredCheckpointIO()):
        for name, file in names.items():
            io.save_checkpoint({"state_dict": torch.nn.Linear(10, 100).state_dict(), "name": name}, name)
            assert file.is_file(), (type(io).__name__, name, sorted(str(p) for p in tmp_path.rglob("*")))
            loaded = io.load_checkpoint(name, weights_only=True)
            assert loaded["name"] == name
            if isinstance(io, TieredCheckpointIO):
                assert mapped_from(loaded["state_dict"]["weight"], file), name
            del loaded
            io.remove_checkpoint(name)
            assert not file.exists(), name
        assert sorted(os.listdir(cwd)) == ["rel"], type(io).__name__


def test_lightning_checkpoint_io_hands_other_filesystems_to_lightning():
    io = TieredCheckpointIO()
    io.save_checkpoint({"w": torch.ones(3)}, "memory://tiered-test/last.ckpt")
    try:
        assert torch.equal(io.load_checkpoint("memory://tiered-test/last.ckpt")["w"], torch.ones(3))
        with pytest.raises(TypeError, match="storage_options"):  # Lightning's own refusal, unchanged
            io.save_checkpoint({"w": torch.ones(3)}, "unused.ckpt", storage_options={"x": 1})
        with pytest.raises(FileNotFoundError):
            io.load_checkpoint("/nonexistent/tiered/last.ckpt")
    finally:
        io.remove_checkpoint("memory://tiered-test/last.ckpt")


def test_mmap_loads_is_scoped(tmp_path):
    torch.save({"w": torch.ones(4)}, tmp_path / "x.pt")
    torch.save({"w": torch.ones(4)}, tmp_path / "y.pt")
    with mmap_loads({"x.pt"}):
        assert mapped_from(torch.load(tmp_path / "x.pt")["w"], tmp_path / "x.pt")
        assert not mapped_from(torch.load(tmp_path / "y.pt")["w"], tmp_path / "y.pt")  # not named: as it was
    assert not mapped_from(torch.load(tmp_path / "x.pt")["w"], tmp_path / "x.pt")
    with mmap_loads(()):
        assert not mapped_from(torch.load(tmp_path / "x.pt")["w"], tmp_path / "x.pt")


def test_mmap_loads_leaves_a_load_from_a_stream_and_a_dcp_load_alone(tmp_path):
    """A sharded FSDP resume through TieredTrainer loads the optimizer with torch.distributed.checkpoint, whose
    reader torch.loads from in-memory streams; torch's process-wide mmap default, switched on for the resume,
    failed every such load ("f must be a file path in order to use the mmap argument")."""
    import io as std_io

    import torch.distributed.checkpoint as dcp

    buffer = std_io.BytesIO()
    torch.save({"w": torch.ones(4)}, buffer)
    state = {"w": torch.arange(4.0)}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    with mmap_loads({"optimizer.pt", "optimizer.bin"}):
        buffer.seek(0)
        assert torch.equal(torch.load(buffer)["w"], torch.ones(4))
        got = {"w": torch.zeros(4)}
        dcp.load(got, checkpoint_id=str(tmp_path / "dcp"))
        assert torch.equal(got["w"], state["w"])
    assert torch.load is torch.serialization.load


def test_import_tiered_loads_no_framework():
    code = ("import sys, tiered, tiered.integrations; from tiered import TieredOptimizer; "
            "print(sorted(m for m in ('transformers', 'accelerate', 'lightning') if m in sys.modules))")  # fmt: skip
    p = run_script(code, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]", p.stdout
    assert sys.executable


def mapped_from(t: torch.Tensor, path) -> bool:
    """Whether ``t``'s data lies in a mapping of the file ``path`` (/proc/self/maps), rather than in RAM."""
    addr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == str(path):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo <= addr < hi:
                    return True
    return False


def mappings(path) -> list[str]:
    """The lines of /proc/self/maps that map the file ``path`` (also once it is deleted), or a file under it."""
    with open("/proc/self/maps") as f:
        return [
            line for line in f if len(line.split(maxsplit=5)) == 6 and line.split(maxsplit=5)[5].startswith(str(path))
        ]


def _umask() -> int:
    mask = os.umask(0o22)
    os.umask(mask)
    return mask
