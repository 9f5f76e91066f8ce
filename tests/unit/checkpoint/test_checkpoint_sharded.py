"""Checkpoints sharded across ranks (FSDP2) as a validated boundary, and loaded by a plain process.

A sharded checkpoint's ``shards.json`` maps each rank's part onto the global parameters; a loader finds a row
by offset in a part's files, so a map that lies loads other rows' bytes (or zeros) without any CRC failing.
Here each such map is refused by name before the optimizer is touched: an accident by the map's own CRC, a
hostile edit (``reseal`` recomputes the CRC, as an attacker would) by the rules it must keep and by the parts'
own records. A collective load checks everything on every rank, agrees, and only then installs. A plain
process (no process group) loads such a checkpoint as world size 1, and exports it.

The ranks are CPU processes over gloo (distributed_common.py); one module-wide save at world size 2.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
import zlib

import pytest
import torch
from distributed_common import run_ranks
from helpers import flip_byte
from torch import nn

from tiered import TieredOptimizer
from tiered import cli as bench_cli
from tiered.checkpoint import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    export_model_state_dict,
    export_torch_state_dict,
    fsops,
    inspect_checkpoint,
    verify_checkpoint,
)
from tiered.checkpoint.reader import CheckpointReader

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")

KW = dict(lr=1e-2, weight_decay=0.1, chunk_bytes="12KiB", host_budget="96KiB")
SHARDS = "shards.json"


def model() -> nn.Module:
    torch.manual_seed(0)
    # 0.weight has 32 rows: at world size 2, rank 0 holds rows 0..16 and rank 1 rows 16..32.
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def fsdp(m: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(m, mesh=mesh)


def train(m: nn.Module, opt: TieredOptimizer, steps: range, rank: int = 0, world: int = 1) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        per = 8 // world
        nn.functional.mse_loss(m(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def full_state(m: nn.Module, opt: TieredOptimizer) -> list[torch.Tensor]:
    """Every weight, then every exp_avg and exp_avg_sq, whole."""
    sd = opt.state_dict()["state"]
    return [full(p) for p in m.parameters()] + [full(sd[i][k]) for i in sorted(sd) for k in ("exp_avg", "exp_avg_sq")]


def fresh() -> nn.Module:
    m = model()
    for p in m.parameters():  # nothing of the saved run survives but what the checkpoint brings
        p.data.normal_()
    return m


# --------------------------------------------------------------------------------------- the saved runs
def _save(rank: int, world: int, root: str, ckpt: str) -> list:
    m = fsdp(model())
    opt = TieredOptimizer(m, root, **KW)
    train(m, opt, range(2), rank, world)
    opt.save_checkpoint(ckpt, extra={"epoch": 2})
    state = full_state(m, opt)
    train(m, opt, range(2, 3), rank, world)
    opt.save_checkpoint(ckpt + "-next")  # the run's next checkpoint, to commit over the first one
    return state


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> tuple[str, list]:
    """A checkpoint saved by 2 FSDP2 ranks after 2 steps, and the whole state it holds; beside it, "-next", the
    checkpoint of the same run one step later."""
    tmp = tmp_path_factory.mktemp("sharded")
    ckpt = str(tmp / "ckpt")
    state = run_ranks(_save, 2, str(tmp / "nvme"), ckpt)[0]
    return ckpt, state


@pytest.fixture
def copy_of(sharded, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(sharded[0], ckpt, symlinks=True)
    return ckpt


def read_map(ckpt: str) -> dict:
    with open(os.path.join(ckpt, SHARDS)) as f:
        return json.load(f)


def write_map(ckpt: str, doc: dict, *, reseal: bool) -> None:
    """Write ``doc`` as the map; ``reseal`` recomputes its CRC (a hostile edit), else the old CRC stays (damage)."""
    if reseal:
        body = {k: v for k, v in doc.items() if k != "shards_crc32"}
        canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        doc = {**body, "shards_crc32": zlib.crc32(canon.encode())}
    with open(os.path.join(ckpt, SHARDS), "w") as f:
        json.dump(doc, f)


def snapshot(m: nn.Module, opt: TieredOptimizer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in m.parameters()] + [torch.tensor(opt.step_counts, dtype=torch.float64)]


def assert_unchanged(before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))


# ----------------------------------------------------------------------------- a plain process loads it
def test_a_plain_process_loads_a_sharded_checkpoint_as_world_size_1(sharded, tmp_path):
    ckpt, state = sharded
    m = fresh()
    with TieredOptimizer(m, tmp_path / "nvme", **KW) as opt:
        info = opt.load_checkpoint(ckpt)  # no process group: every parameter gathered whole from both parts
        assert info["step"] == 2 and info["extra"] == {"epoch": 2} and info["path"] == ckpt
        assert opt.step_counts == [2] * 4
        got = full_state(m, opt)
        assert len(got) == len(state) and all(torch.equal(a, b) for a, b in zip(state, got))  # weights, moments
        train(m, opt, range(2, 3))  # and it trains on
    weights = export_model_state_dict(ckpt)
    assert list(weights) == [n for n, _ in model().named_parameters()]
    assert all(torch.equal(w, s) for w, s in zip(weights.values(), state[:4]))
    sd = export_torch_state_dict(ckpt)
    assert all(torch.equal(sd["state"][i]["exp_avg"], state[4 + 2 * i]) for i in range(4))
    assert [list(p.shape) for p in model().parameters()] == [list(sd["state"][i]["exp_avg"].shape) for i in range(4)]


@pytest.mark.parametrize("verify", ["first", "stream"])
def test_a_plain_process_refuses_a_sharded_checkpoint_whose_other_part_s_objects_are_damaged(copy_of, tmp_path,
                                                                                            verify):  # fmt: skip
    # Only rank 0's objects.pt is unpickled at another layout, so rank 1's went unread: a damaged one loaded without
    # a word here, where a load at the saved world size and `tiered-bench verify` refuse the same checkpoint.
    objects = os.path.join(copy_of, "rank-00001", "objects.pt")
    flip_byte(objects, os.path.getsize(objects) // 2)
    m = fresh()
    with TieredOptimizer(m, tmp_path / "nvme", **KW) as opt:
        before = snapshot(m, opt)
        with pytest.raises(CheckpointCorruptError) as e:
            opt.load_checkpoint(copy_of, verify=verify)
        assert "rank-00001/objects.pt" in str(e.value) and "crc32" in str(e.value), str(e.value)
        assert e.value.partial_load is False
        assert_unchanged(before, snapshot(m, opt))
        train(m, opt, range(1))  # nothing was changed: it trains on
    with pytest.raises(CheckpointCorruptError, match="rank-00001/objects.pt"):
        verify_checkpoint(copy_of)  # what the load now agrees with


@pytest.mark.parametrize("writable", [True, False], ids=["put-back", "read-only"])
def test_a_sharded_checkpoint_an_overwrite_left_aside_loads_by_its_name(sharded, copy_of, tmp_path, monkeypatch,
                                                                       writable):  # fmt: skip
    # An overwrite of a sharded checkpoint killed between its renames (no atomic exchange): the load looked for
    # shards.json at the missing path, then took the aside for a single-process checkpoint, put it back and
    # refused it ("the folder has no manifest.json"); on a read-only folder it raised OSError(EROFS).
    ckpt, state = copy_of, sharded[1]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    aside = os.path.join(os.path.dirname(ckpt), f".{os.path.basename(ckpt)}.old-{fsops._HOST}-{dead.pid}-0123abcd")
    os.rename(ckpt, aside)
    if not writable:

        def refused(src, dst, *args, **kw):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), src, None, dst)

        monkeypatch.setattr(os, "rename", refused)
    m = fresh()
    with TieredOptimizer(m, tmp_path / "nvme", **KW) as opt:
        said = "restored the previous checkpoint" if writable else "cannot rename back"
        with pytest.warns(RuntimeWarning, match=said):
            info = opt.load_checkpoint(ckpt)
        assert info["step"] == 2 and info["path"] == (ckpt if writable else aside)
        got = full_state(m, opt)
        assert len(got) == len(state) and all(torch.equal(a, b) for a, b in zip(state, got))
    assert os.path.isdir(ckpt) == writable and os.path.isdir(aside) != writable


@pytest.mark.parametrize("old_deleted", [False, True], ids=["old-renamed-aside", "old-deleted"])
def test_a_load_never_mixes_the_parts_of_two_checkpoints_committed_at_one_path(sharded, tmp_path, monkeypatch,
                                                                               old_deleted):  # fmt: skip
    # An evaluator loading "latest" (2 parts) while the trainer commits its next "latest" between the reads of
    # part 0 and part 1: the map and each part were opened by path, so part 1 came from the new checkpoint and the
    # load succeeded with rows of two steps. Here the commit comes from a hook, at exactly that moment.
    ckpt, state = sharded
    latest, new = str(tmp_path / "latest"), str(tmp_path / "new")
    shutil.copytree(ckpt, latest)
    shutil.copytree(ckpt + "-next", new)
    real, streams = CheckpointReader.stream, []

    @contextlib.contextmanager
    def commit_after_part_0(self, io=None):
        with real(self, io) as s:
            yield s
        streams.append(self.path)
        if len(streams) == 1:  # fsops.commit's fallback: the old one renamed aside, the new one in, the old deleted
            os.rename(latest, latest + ".old")
            os.rename(new, latest)
            if old_deleted:
                shutil.rmtree(latest + ".old")

    monkeypatch.setattr(CheckpointReader, "stream", commit_after_part_0)
    m = fresh()
    with TieredOptimizer(m, tmp_path / "nvme", **KW) as opt:
        before = snapshot(m, opt)
        if old_deleted:  # its part 1 is gone: refused by name, nothing changed, nothing of the new one read
            with pytest.raises(CheckpointNotFoundError, match="replaced or deleted this checkpoint while it was read"):
                opt.load_checkpoint(latest)
            assert_unchanged(before, snapshot(m, opt))
            assert streams == [os.path.join(latest, "rank-00000")]
            monkeypatch.undo()
            assert opt.load_checkpoint(latest)["step"] == 3  # loading again takes the new one, whole
        else:  # every part from the checkpoint whose map it opened
            assert opt.load_checkpoint(latest)["step"] == 2
            got = full_state(m, opt)
            assert len(got) == len(state) and all(torch.equal(a, b) for a, b in zip(state, got))


def test_inspect_and_verify_check_the_map_and_every_part(copy_of, capsys):
    ok = verify_checkpoint(copy_of)
    assert ok["ok"] and ok["ranks"] == 2 and ok["step"] == 2 and len(ok["files"]) == 8
    summary = inspect_checkpoint(copy_of)
    assert summary["ranks"] == 2 and not summary["problems"]
    assert [p["shape"] for p in summary["params"]] == [list(p.shape) for p in model().parameters()]
    assert bench_cli.main(["verify", copy_of]) == 0 and bench_cli.main(["inspect", copy_of]) == 0
    with open(os.path.join(copy_of, "rank-00001", "exp_avg.bin"), "r+b") as f:
        f.seek(40)
        f.write(b"\xff\xff\xff\xff")  # damaged: verify names the part, and exits 2 as for any unusable checkpoint
    with pytest.raises(CheckpointCorruptError, match="rank-00001"):
        verify_checkpoint(copy_of)
    capsys.readouterr()
    assert bench_cli.main(["verify", copy_of]) == 2
    assert "rank-00001/exp_avg.bin" in capsys.readouterr().err
    os.truncate(os.path.join(copy_of, "rank-00000", "master.bin"), 8)
    assert bench_cli.main(["inspect", copy_of]) == 2  # a wrong-sized file: a problem inspect finds


def test_inspect_json_of_a_sharded_checkpoint_gives_the_whole_checkpoints_figures(sharded, capsys):
    # `inspect --json` gave rank 0's "bytes" (half of the files it listed, on 2 ranks) and each parameter's rank 0
    # "numel" beside its global "shape".
    ckpt = sharded[0]
    assert bench_cli.main(["inspect", ckpt, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert bench_cli.main(["verify", ckpt, "--json"]) == 0
    v = json.loads(capsys.readouterr().out)
    on_disk = sum(os.path.getsize(os.path.join(ckpt, name)) for name in s["files"])
    assert s["bytes"] == sum(f["nbytes"] for f in s["files"].values()) == v["bytes"] == on_disk
    assert [(p["name"], p["shape"], p["numel"]) for p in s["params"]] == [
        (n, list(p.shape), p.numel()) for n, p in model().named_parameters()
    ]
    assert s["numel"] == sum(p["numel"] for p in s["params"])


# ------------------------------------------------------------------------------------ the map, damaged
def _flip_first_row(doc: dict) -> None:
    doc["ranks"][1]["params"][0][2] = 14  # rank 1's rows of 0.weight: 16 -> 14


def _overlap(doc: dict) -> None:
    doc["ranks"][0]["params"][0][3] = 18  # rank 0: rows 0..18, rank 1: 16..32


def _gap(doc: dict) -> None:
    doc["ranks"][1]["params"][0][3] = 14  # rank 1: rows 16..30; 30..32 held by none


def _swap_lists(doc: dict) -> None:
    a, b = doc["ranks"]
    a["params"], b["params"] = b["params"], a["params"]  # still tiles every parameter


def _dir_is_a_path(doc: dict) -> None:
    doc["ranks"][1]["dir"] = "../elsewhere"


def _old_format(doc: dict) -> None:
    doc.pop("shards_crc32", None)
    doc["format"] = 1


# name: (edit, the words the error must hold)
HOSTILE = {
    "flipped first row": (_flip_first_row, "overlap"),
    "overlapping ranges": (_overlap, "overlap"),
    "a gap": (_gap, "cover 0..30 of its 32"),
    "swapped lists": (_swap_lists, "the map and the part disagree"),
    "dir a path": (_dir_is_a_path, "'../elsewhere'"),
    "another save's id": (lambda doc: doc.__setitem__("save_id", "0" * 32), "was written by another save"),
    "save id a path": (lambda doc: doc.__setitem__("save_id", "../x"), "save_id is '../x'"),
}


def _load_refused(ckpt: str, tmp_path, error: type, words: str) -> None:
    """A plain process's load is refused with ``error`` holding ``words``, and the optimizer is untouched."""
    m = fresh()
    with TieredOptimizer(m, tmp_path / "nvme", **KW) as opt:
        before = snapshot(m, opt)
        with pytest.raises(error) as e:
            opt.load_checkpoint(ckpt)
        assert words in str(e.value) and SHARDS in str(e.value), str(e.value)
        assert_unchanged(before, snapshot(m, opt))


def test_a_flipped_digit_in_the_map_is_damage(copy_of, tmp_path, capsys):
    doc = read_map(copy_of)
    _flip_first_row(doc)
    write_map(copy_of, doc, reseal=False)  # an accident: the map's CRC no longer matches
    _load_refused(copy_of, tmp_path, CheckpointCorruptError, "does not match its shards_crc32")
    with pytest.raises(CheckpointCorruptError, match="shards_crc32"):
        export_model_state_dict(copy_of)
    capsys.readouterr()
    for command in ("inspect", "verify"):
        assert bench_cli.main([command, copy_of]) == 2
        assert "shards_crc32" in capsys.readouterr().err


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_map_that_lies_is_refused_by_name(copy_of, tmp_path, capsys, kind):
    edit, words = HOSTILE[kind]
    doc = read_map(copy_of)
    edit(doc)
    write_map(copy_of, doc, reseal=True)
    _load_refused(copy_of, tmp_path, CheckpointFormatError, words)
    for fn in (inspect_checkpoint, verify_checkpoint, export_torch_state_dict):
        with pytest.raises(CheckpointFormatError, match=re.escape(words)):
            fn(copy_of)
    capsys.readouterr()
    for command in ("inspect", "verify"):
        assert bench_cli.main([command, copy_of]) == 2
        err = capsys.readouterr().err
        assert "CheckpointFormatError" in err and "Traceback" not in err, err


def test_swapped_rank_folders_are_refused(copy_of, tmp_path):
    os.rename(os.path.join(copy_of, "rank-00000"), os.path.join(copy_of, "swap"))
    os.rename(os.path.join(copy_of, "rank-00001"), os.path.join(copy_of, "rank-00000"))
    os.rename(os.path.join(copy_of, "swap"), os.path.join(copy_of, "rank-00001"))
    _load_refused(copy_of, tmp_path, CheckpointFormatError, "says it holds rank 1 of 2's shards")


def test_a_rank_folder_replaced_by_a_link_is_not_followed(copy_of, tmp_path, capsys):
    part = os.path.join(copy_of, "rank-00001")
    shutil.rmtree(part)
    os.symlink("rank-00000", part)  # rank 0's rows, under rank 1's name
    _load_refused(copy_of, tmp_path, CheckpointFormatError, "symbolic link")
    capsys.readouterr()
    assert bench_cli.main(["verify", copy_of]) == 2 and "symbolic link" in capsys.readouterr().err


def test_a_map_of_the_old_format_is_refused_with_the_fix(copy_of, tmp_path):
    doc = read_map(copy_of)
    _old_format(doc)
    write_map(copy_of, doc, reseal=False)
    _load_refused(copy_of, tmp_path, CheckpointFormatError, "format 1")
    with pytest.raises(CheckpointFormatError, match="save it again"):
        verify_checkpoint(copy_of)


def test_a_missing_part_is_named(copy_of, tmp_path):
    shutil.rmtree(os.path.join(copy_of, "rank-00001"))
    _load_refused(copy_of, tmp_path, CheckpointCorruptError, "rank-00001")


def test_a_part_of_another_save_of_the_same_layout_is_refused(sharded, copy_of, tmp_path):
    # The run's next checkpoint holds the same rows in rank 1's part, with a record of itself the map agrees with:
    # only the save's identity tells that the part is not this checkpoint's.
    shutil.rmtree(os.path.join(copy_of, "rank-00001"))
    shutil.copytree(os.path.join(sharded[0] + "-next", "rank-00001"), os.path.join(copy_of, "rank-00001"))
    _load_refused(copy_of, tmp_path, CheckpointFormatError, "was written by another save")


def strip_save_ids(ckpt: str) -> None:
    """Make ``ckpt`` (sharded or not) as a tiered of before save ids saved it: no save id in its map nor in its
    manifests."""
    parts = sorted(p for p in os.listdir(ckpt) if p.startswith("rank-"))
    if parts:
        doc = read_map(ckpt)
        doc.pop("save_id", None)  # (none in a checkpoint saved before save ids)
        write_map(ckpt, doc, reseal=True)
    for part in parts or [""]:
        path = os.path.join(ckpt, part, "manifest.json")
        with open(path) as f:
            body = json.load(f)
        del body["manifest_crc32"]
        body["source"].pop("save_id", None)
        canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
        body["manifest_crc32"] = zlib.crc32(canon.encode())
        with open(path, "w") as f:
            json.dump(body, f, indent=1, sort_keys=True)


def test_every_save_has_an_identity_and_one_saved_before_save_ids_is_known_by_its_manifest(sharded, tmp_path):
    # What ranks that open one path compare: the same for the same checkpoint, another for any other save, even of
    # the same state (two saves in a row here).
    from tiered.checkpoint.reshard import Parts

    def identity(path: str) -> str:
        with Parts(path) as parts:
            return parts.identity()

    m = model()
    with TieredOptimizer(m, tmp_path / "nvme", **KW) as opt:
        train(m, opt, range(1))
        plain = [opt.save_checkpoint(tmp_path / name) for name in ("a", "b")]
    ckpt = sharded[0]
    saved = [ckpt, ckpt + "-next", *plain]
    ids = [identity(p) for p in saved]
    assert len(set(ids)) == 4 and ids[0] == read_map(ckpt)["save_id"] and identity(ckpt) == ids[0]
    old = []
    for p in saved:
        old.append(str(tmp_path / "old" / os.path.basename(p)))
        shutil.copytree(p, old[-1])
        strip_save_ids(old[-1])
    ids = [identity(p) for p in old]
    assert len(set(ids)) == 4 and all(i.startswith("manifest-sha256:") for i in ids) and identity(old[0]) == ids[0]


# ------------------------------------------------------------------------- collective loads, under FSDP2
def _load_while_another_save_commits(rank: int, world: int, root: str, latest: str, new: str, signals: str) -> dict:
    """A collective load of ``latest`` whose ranks open it at different moments, with another job's commit of
    ``new`` over it in between: rank 0 opens the old checkpoint, rank 1 the new one. Then a load again."""
    from tiered.checkpoint import fsops
    from tiered.checkpoint.reshard import Parts

    m = fsdp(fresh())
    opt = TieredOptimizer(m, root, **KW)  # collective (the ranks' optimizers compared): before the ranks part
    before = snapshot(m, opt)
    committed = os.path.join(signals, "committed")
    if rank == 0:  # the other job's save commits (fsops.commit's exchange) right after rank 0 opened the checkpoint
        opened = Parts._open

        def open_then_commit(self):
            opened(self)
            if not os.path.exists(committed):
                assert fsops.exchange(new, latest)  # commit's exchange; the old checkpoint, at ``new``, is kept
                open(committed, "w").close()

        Parts._open = open_then_commit
    else:  # rank 1 comes to its load a moment later, after the commit
        deadline = time.monotonic() + 60
        while not os.path.exists(committed) and time.monotonic() < deadline:
            time.sleep(0.01)
    out: dict = {}
    try:
        opt.load_checkpoint(latest)
        out["error"] = None
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        out["error"] = (type(e).__name__, str(e))
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, snapshot(m, opt)))
    out["step"] = opt.load_checkpoint(latest)["step"]  # again: every rank opens the new one
    out["state"] = full_state(m, opt)
    return out


@pytest.mark.parametrize("saved_before_ids", [False, True], ids=["save-id", "saved-before-save-ids"])
def test_a_collective_load_refuses_on_every_rank_when_the_ranks_open_two_checkpoints(sharded, tmp_path,
                                                                                    saved_before_ids):  # fmt: skip
    # An evaluator (2 ranks) loading "latest" while the trainer commits its next "latest": each rank opened one
    # whole checkpoint, but not the same one, and the load succeeded with rank 0's shards of step 2 and rank 1's
    # of step 3. The ranks now agree on which checkpoint they opened before any installs.
    ckpt, _ = sharded
    latest, new = str(tmp_path / "latest"), str(tmp_path / "new")
    shutil.copytree(ckpt, latest)
    shutil.copytree(ckpt + "-next", new)
    if saved_before_ids:  # such checkpoints are told apart by their first part's manifest
        strip_save_ids(latest)
        strip_save_ids(new)
    signals = str(tmp_path / "signals")
    os.mkdir(signals)
    results = run_ranks(_load_while_another_save_commits, 2, str(tmp_path / "nvme"), latest, new, signals)
    for r in results:
        assert r["error"] is not None, "the ranks loaded different checkpoints"
        kind, message = r["error"]
        assert kind == "CheckpointNotFoundError" and "another save replaced it while the ranks opened it" in message
        assert "rank 0: the one of step 2; rank 1: the one of step 3" in message and "Load it again" in message
        assert r["unchanged"] and r["step"] == 3
    m = fresh()
    with TieredOptimizer(m, tmp_path / "nvme-plain", **KW) as opt:
        opt.load_checkpoint(latest)  # the new checkpoint, whole: what the load again put on the ranks
        expected = full_state(m, opt)
    assert len(expected) == len(results[0]["state"]) == 12
    assert all(torch.equal(a, b) for a, b in zip(expected, results[0]["state"]))


def _collective_loads(rank: int, world: int, root: str, ckpt: str, damaged: str, plain: str) -> dict:
    """Loads at world size 2: of a checkpoint whose rank-1 part is damaged; of an intact one whose install fails
    on rank 1 after every rank checked it; of a folder with no checkpoint; of a single-process checkpoint."""
    out: dict = {}
    m = fsdp(fresh())
    opt = TieredOptimizer(m, root, **KW)
    before = snapshot(m, opt)
    try:
        opt.load_checkpoint(damaged)
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        out["damaged"] = (type(e).__name__, str(e), getattr(e, "partial_load", None), isinstance(e, OSError))
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, snapshot(m, opt)))

    install = opt.chunked_state.install_chunk_rows
    calls = []

    def failing(chunk, rows):
        calls.append(chunk.key)
        if rank == 1:
            raise OSError(5, "injected I/O error while installing")
        return install(chunk, rows)

    opt.chunked_state.install_chunk_rows = failing
    try:
        opt.load_checkpoint(ckpt)
    except Exception as e:  # noqa: BLE001 - as above
        out["install"] = (
            type(e).__name__,
            str(e),
            getattr(e, "partial_load", None),
            bool(calls),
            isinstance(e, OSError),
        )
    del opt.chunked_state.install_chunk_rows
    try:
        opt.step()  # an optimizer partly loaded must not train on
        out["broken"] = False
    except RuntimeError as e:
        out["broken"] = type(e).__name__ == "OptimizerBrokenError"

    try:
        opt.load_checkpoint(os.path.join(root, "nothing-here"))
    except Exception as e:  # noqa: BLE001 - as above
        out["missing"] = (type(e).__name__, str(e))

    opt.load_checkpoint(ckpt)  # intact: the optimizer is whole again, and every rank holds its rows
    out["loaded"] = full_state(m, opt)
    m2 = fsdp(fresh())
    opt2 = TieredOptimizer(m2, root + "-2", **KW)
    try:
        info = opt2.load_checkpoint(plain)  # saved by one process, without shards.json: loaded at world size 2
        out["plain"] = (info["step"], full_state(m2, opt2))
    except Exception as e:  # noqa: BLE001 - as above
        out["plain"] = (type(e).__name__, str(e))
    return out


def _save_plain(root: str, ckpt: str) -> list:
    m = model()
    with TieredOptimizer(m, root, **KW) as opt:
        train(m, opt, range(3))
        opt.save_checkpoint(ckpt)
        return full_state(m, opt)


@pytest.fixture(scope="module")
def collective(sharded, tmp_path_factory) -> tuple[dict, list, list]:
    tmp = tmp_path_factory.mktemp("collective")
    damaged = str(tmp / "damaged")
    shutil.copytree(sharded[0], damaged)
    with open(os.path.join(damaged, "rank-00001", "exp_avg_sq.bin"), "r+b") as f:
        f.seek(8)
        f.write(b"\xff\xff\xff\xff")  # only rank 1 reads it: rank 0's own part is intact
    plain = str(tmp / "plain")
    plain_state = _save_plain(str(tmp / "nvme-plain"), plain)
    results = run_ranks(_collective_loads, 2, str(tmp / "nvme"), sharded[0], damaged, plain)
    return results, sharded[1], plain_state


def test_a_collective_load_changes_no_rank_when_one_rank_finds_damage(collective):
    results, _, _ = collective
    assert [r["unchanged"] for r in results] == [True, True]  # rank 0 read its intact part and installed none of it
    kind, message, partial, _ = results[1]["damaged"]
    assert kind == "CheckpointCorruptError" and "rank-00001/exp_avg_sq.bin" in message and partial is False, message
    # The rank that found nothing wrong raises the failing rank's class too: an OSError, as in one process.
    kind, message, partial, oserror = results[0]["damaged"]
    assert kind == "CheckpointCorruptError" and oserror and partial is False, message
    assert "rank 1: CheckpointCorruptError" in message and "no rank's optimizer was changed" in message


def test_an_install_that_fails_after_the_agreement_is_raised_on_every_rank(collective):
    results, state, _ = collective
    for r in results:
        kind, message, partial, installed, oserror = r["install"]
        # checked, then installing; the OSError's class kept on every rank, partial_load set (the optimizer is broken)
        assert kind == "OSError" and oserror and partial is True and installed, message
        assert "rank 1: OSError" in message and "injected I/O error" in message and "partly loaded" in message
    assert all(len(r["loaded"]) == len(state) and all(torch.equal(a, b) for a, b in zip(state, r["loaded"]))
               for r in results)  # fmt: skip


def test_a_partly_loaded_optimizer_is_broken_on_every_rank(collective):
    results, _, _ = collective
    assert all(r["broken"] for r in results)


def _checkpoint_errors() -> list[BaseException]:
    import tiered.checkpoint as ck
    from tiered.checkpoint.rank_errors import Failure, collective_lost, rank_error

    corrupt = ck.CheckpointCorruptError("/ck", [("/ck/rank-00001/exp_avg.bin", "checksum mismatch")])
    return [
        ck.CheckpointNotFoundError("/ck", "nothing there"),
        corrupt,
        ck.CheckpointCorruptError("/ck", [("/ck/a.bin", "truncated")], partial_load=True),
        ck.CheckpointPathError(errno.EEXIST, "a file is in the way", "/ck"),
        ck.CheckpointCommittedError("/ck", "syncing its folder", OSError(errno.EIO, "injected")),
        ck.CheckpointNotSharedError("/ck", [1, 2]),
        ck.CheckpointFormatError("format 9 is newer than this tiered"),
        ck.CheckpointMismatchError("/ck", ["group 0 has 3 tensors, the checkpoint 2"], "load it into the model saved"),
        ck.InsufficientMemoryError("/ck", 10 << 30, 1 << 30, "lower the host budget"),
        ck.InsufficientSpaceError("/ck", 10 << 30, 1 << 30, previous=True),
        rank_error([Failure.of(1, corrupt)], "the collective load of /ck failed", partial_load=True),
        collective_lost(
            RuntimeError("Connection closed by peer"),
            "the collective load of /ck failed",
            call="load",
            partial_load=True,
        ),  # fmt: skip
        rank_error([Failure.of(1, OSError(errno.EIO, "injected", "/ck/f"))], "the collective load", partial_load=True),
    ]


def _described(e: BaseException) -> str:
    from tiered.checkpoint import CheckpointError

    return "|".join(map(str, (type(e).__name__, isinstance(e, CheckpointError), getattr(e, "partial_load", None),
                              getattr(e, "errno", None), getattr(e, "filename", None), e)))  # fmt: skip


def test_checkpoint_errors_cross_a_process_boundary_that_pickles_them_and_copy():
    # A launcher that pickles a rank's exception (concurrent.futures, multiprocessing, Ray) lost it: tiered's errors
    # were rebuilt by calling their constructors with the builtin's args (TypeError), and the class made at run time
    # for a collective load's partial_load error could not be found by pickle. copy.copy failed the same way.
    errors = _checkpoint_errors()
    code = (
        "import json, pickle, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from test_checkpoint_sharded import _described\n"
        "print(json.dumps([_described(e) for e in pickle.loads(sys.stdin.buffer.read())]))\n"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", code, here], input=pickle.dumps(errors), capture_output=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})  # fmt: skip
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert json.loads(out.stdout) == [_described(e) for e in errors]
    for e in errors:
        assert _described(copy.copy(e)) == _described(copy.deepcopy(e)) == _described(e)
    assert _described(errors[-1]).startswith(f"OSError|True|True|{errno.EIO}|/ck/f|")


def test_under_fsdp2_a_missing_map_is_named_and_a_single_process_checkpoint_loads(collective):
    results, _, plain_state = collective
    for r in results:
        kind, message = r["missing"]
        assert kind == "CheckpointNotFoundError" and "nothing there" in message, message  # not a TypeError
        step, got = r["plain"]
        assert step == 3 and len(got) == len(plain_state), r["plain"]
        assert all(torch.equal(a, b) for a, b in zip(plain_state, got))


# ------------------------------------------------------------------------------ state of a frozen layer
def _frozen_layer(rank: int, world: int, root: str, ckpt: str) -> dict:
    """Staged fine-tuning under FSDP2: the first layer trains, is frozen (its state kept), a save; the same model
    built with that layer frozen loads it (collective) and the run goes on, the layer thawed later, as the run
    that saved it goes on."""
    out: dict = {}
    for run in ("saved", "resumed"):
        m = fsdp(model() if run == "saved" else fresh())
        if run == "resumed":
            m[0].requires_grad_(False)  # as at the save
        opt = TieredOptimizer(list(m.parameters()), root, **KW)  # a list: it follows freezes and thaws
        if run == "saved":
            train(m, opt, range(2), rank, world)
            m[0].requires_grad_(False)
            train(m, opt, range(2, 3), rank, world)
            opt.save_checkpoint(ckpt)
            out["at_save"] = full_state(m, opt)
        else:
            opt.load_checkpoint(ckpt)
            out["loaded"] = full_state(m, opt)
        train(m, opt, range(3, 4), rank, world)
        m[0].requires_grad_(True)
        train(m, opt, range(4, 6), rank, world)
        out[run] = full_state(m, opt)
        opt.close()
    return out


def test_state_of_a_layer_frozen_at_a_sharded_save_loads_where_it_is_frozen(tmp_path):
    """The load refused such a checkpoint ("shape [32, 8] in the checkpoint, [0] here": the empty stand-in of a
    frozen parameter) at any world size; it now lays the layer's state out first, as load_state_dict does."""
    ckpt = str(tmp_path / "ckpt")
    results = run_ranks(_frozen_layer, 2, str(tmp_path / "nvme"), ckpt)
    for r in results:
        assert len(r["loaded"]) == len(r["at_save"]) == 12  # four weights, four exp_avg, four exp_avg_sq
        assert all(torch.equal(a, b) for a, b in zip(r["at_save"], r["loaded"]))
        assert all(torch.equal(a, b) for a, b in zip(r["saved"], r["resumed"]))
    m = fresh()
    m[0].requires_grad_(False)
    with TieredOptimizer(list(m.parameters()), tmp_path / "plain", **KW) as opt:  # a plain process: gathered whole
        opt.load_checkpoint(ckpt)
        assert opt.step_counts == [2, 2, 3, 3]
        assert all(torch.equal(a, b) for a, b in zip(results[0]["at_save"], full_state(m, opt)))


def _frozen_from_the_start(rank: int, world: int, root: str, ckpt: str) -> bool:
    """All of the model's parameters given, the first layer's weight frozen throughout: its entry holds no state."""
    m = model()
    m[0].weight.requires_grad_(False)
    m = fsdp(m)
    with TieredOptimizer(list(m.named_parameters()), root, **KW) as opt:
        train(m, opt, range(2), rank, world)
        opt.save_checkpoint(ckpt)
    return True


def test_a_parameter_frozen_at_a_sharded_save_is_left_out_of_the_model_export(tmp_path):
    """Exported in a plain process, the frozen weight came out as the checkpoint's empty [0] entry, and
    ``model.load_state_dict(export_model_state_dict(path), strict=False)`` failed with a size mismatch. It is left
    out: the model keeps its own."""
    ckpt = str(tmp_path / "ckpt")
    run_ranks(_frozen_from_the_start, 2, str(tmp_path / "nvme"), ckpt)
    weights = export_model_state_dict(ckpt)
    assert list(weights) == ["0.bias", "2.weight", "2.bias"]
    m = fresh()
    own = m[0].weight.detach().clone()
    assert m.load_state_dict(weights, strict=False).missing_keys == ["0.weight"]
    assert torch.equal(m[0].weight, own) and all(torch.equal(m.state_dict()[n], w) for n, w in weights.items())


# ------------------------------------------------------------------------------------- a save that fails
def _failing_saves(rank: int, world: int, root: str, folder: str) -> dict:
    """Saves at world size 2 that fail: into a folder rank 0 does not see rank 1's part in (what a disk local to
    each node does), with a bad argument, and with rank 1's disk full. What each rank raised is the result."""
    from tiered.checkpoint import sharded, writer

    out: dict = {}
    m = fsdp(model())
    opt = TieredOptimizer(m, root, **KW)
    train(m, opt, range(1), rank, world)
    ckpt = os.path.join(folder, "ck")
    opt.save_checkpoint(ckpt)  # a good one, which no failed save may touch
    saved = inspect_checkpoint(ckpt)["created_unix"] if rank == 0 else None
    train(m, opt, range(1, 2), rank, world)

    def attempt(key: str, path: str = ckpt, **kw) -> None:
        try:
            opt.save_checkpoint(path, **kw)
            out[key] = None
        except Exception as e:  # noqa: BLE001 - the result
            out[key] = (type(e).__name__, str(e), isinstance(e, OSError), isinstance(e, TypeError))

    write = sharded.write_checkpoint
    if rank == 1:  # rank 1 writes its part where rank 0 cannot see it: gone from the folder they name alike

        def elsewhere(o, path, **kw):
            written = write(o, path, **kw)
            shutil.rmtree(written)
            return written

        sharded.write_checkpoint = elsewhere
    attempt("not_shared")
    sharded.write_checkpoint = write
    attempt("bad_argument", extra=5)
    asked = os.path.join(folder, f"ck-rank{rank}")  # a name of each rank's own (a per-rank timestamp in it, say)
    attempt("paths_differ", path=asked)
    out["asked_exists"] = os.path.lexists(asked)
    other = os.path.join(folder, "other") if rank == 0 else os.path.join(folder, ".", "sub", "..", "other")
    out["spelled_otherwise"] = opt.save_checkpoint(other)  # the same folder: one save
    before = snapshot(m, opt)
    try:  # each rank a checkpoint of its own: a latest_checkpoint(root) each, one node's listing behind
        opt.load_checkpoint(ckpt if rank == 0 else other)
        out["load_paths_differ"] = None
    except Exception as e:  # noqa: BLE001 - the result
        out["load_paths_differ"] = (type(e).__name__, str(e))
    out["load_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, snapshot(m, opt)))
    if rank == 1:
        writer.free_bytes = lambda path: 0  # rank 1's disk is full; rank 0's has room
    attempt("disk_full")
    torch.distributed.barrier()  # every rank has cleaned up after the last failure
    out["hidden"] = [e for e in os.listdir(folder) if e.startswith(".")]
    if rank == 0:
        out["intact"] = inspect_checkpoint(ckpt)["created_unix"] == saved and verify_checkpoint(ckpt)["ok"]
    return out


@pytest.fixture(scope="module")
def failing_saves(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("failing")
    os.mkdir(tmp / "ckpts")
    return run_ranks(_failing_saves, 2, str(tmp / "nvme"), str(tmp / "ckpts"))


def test_a_save_to_a_folder_the_ranks_do_not_share_fails_on_every_rank(failing_saves):
    # Rank 0 once committed a checkpoint holding its own part only and every rank was told it had saved.
    for r in failing_saves:
        kind, message, oserror, _ = r["not_shared"]
        assert kind == "CheckpointNotSharedError" and oserror, message
        assert "rank(s) [1]" in message and "every rank sees" in message and "/ck " in message, message
    assert failing_saves[0]["intact"] and [r["hidden"] for r in failing_saves] == [[], []]


def test_a_collective_save_or_load_whose_ranks_pass_different_paths_is_refused_on_every_rank(failing_saves):
    # The save went to rank 0's path alone and returned it on every rank, rank 1's never made and nothing said; the
    # load blamed a save that never ran ("another save replaced it while the ranks opened it ... Load it again").
    for r in failing_saves:
        assert r["paths_differ"] is not None, "the save went to rank 0's path and told rank 1 it saved to its own"
        kind, message, _, _ = r["paths_differ"]
        assert kind == "ValueError" and "different paths to save_checkpoint" in message, message
        assert re.search(r"rank 0: /\S+/ck-rank0; rank 1: /\S+/ck-rank1\)", message) and "nothing was saved" in message
        assert not r["asked_exists"] and r["spelled_otherwise"] == failing_saves[0]["spelled_otherwise"]
        assert r["load_paths_differ"] is not None, "the ranks loaded different checkpoints"
        kind, message = r["load_paths_differ"]
        assert kind == "ValueError" and "different paths to load_checkpoint" in message, message
        assert re.search(r"rank 0: /\S+/ck; rank 1: /\S+/other\)", message) and "replaced" not in message, message
        assert r["load_unchanged"]
    assert failing_saves[0]["intact"] and [r["hidden"] for r in failing_saves] == [[], []]


def test_a_failed_collective_save_keeps_the_failing_rank_s_class_and_names_the_user_s_path(failing_saves):
    # They were a bare CheckpointError (not an OSError nor a TypeError) naming the hidden temp folder.
    for r in failing_saves:
        kind, message, oserror, typeerror = r["bad_argument"]
        assert kind == "TypeError" and typeerror and "extra must be a dict" in message, message
        kind, message, oserror, _ = r["disk_full"]
        assert kind == "InsufficientSpaceError" and oserror and "rank 1: InsufficientSpaceError" in message, message
        assert ".tmp-" not in message and "/ck/rank-00001" in message and "nothing was committed" in message, message


def test_every_failure_a_rank_can_raise_is_rebuilt_with_its_message_and_partial_load():
    # MemoryError (BudgetError) with partial_load, ExceptionGroup and UnicodeDecodeError made rank_error itself raise
    # TypeError or give an empty message: every rank's failure and the flag the optimizer reads were lost.
    import builtins
    import pickle

    from tiered.checkpoint.rank_errors import Failure, rank_error
    from tiered.store.records import BudgetError

    def raised(make):
        try:
            make()
        except Exception as e:
            return e

    errors = [BudgetError("over budget"), MemoryError("none left"), TypeError("bad"), KeyError("param"),
              raised(lambda: b"\xff".decode()), FileNotFoundError(2, "No such file", "/tmp/x")]  # fmt: skip
    group = getattr(builtins, "ExceptionGroup", None)  # Python 3.11 on
    if group is not None:
        errors.append(group("g", [ValueError("v")]))
    for e in errors:
        for partial in (False, True):
            f = pickle.loads(pickle.dumps(Failure.of(1, e)))
            err = rank_error([f], "the collective load failed", partial_load=partial)
            assert isinstance(err, Exception) and type(err) is not Exception, (e, partial, type(err))
            assert "the collective load failed: rank 1" in str(err) and type(e).__name__ in str(err), (e, str(err))
            assert getattr(err, "partial_load", False) is partial, (e, partial)
            if isinstance(e, (TypeError, KeyError, OSError)):
                assert isinstance(err, type(e)), (e, type(err))


def _hidden_once_every_rank_cleaned_up(folder: str) -> list[str]:
    """The hidden entries beside the checkpoints once every rank has cleaned up after a save; returns once every
    rank has looked, so that rank 0's next save makes its temp folder only after. (The checkpoint itself can be read
    after: no rank commits before every rank has joined that next save.)"""
    torch.distributed.barrier()
    hidden = [e for e in os.listdir(folder) if e.startswith(".")]
    torch.distributed.barrier()
    return hidden


# -------------------------------------------------------------------------------- a Ctrl-C on rank 0 of a save
def _interrupted_saves(rank: int, world: int, root: str, folder: str) -> dict:
    """Saves at world size 2 that rank 0 is interrupted in (a KeyboardInterrupt raised in its part's write, a real
    SIGINT as it prepares, as it publishes, and in the commit of a keep_last save), each caught as an ``except
    KeyboardInterrupt`` would, the process going on. What each rank raised is the result."""
    import signal

    from tiered.checkpoint import sharded

    out: dict = {}
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    m = fsdp(model())
    opt = TieredOptimizer(m, root, **KW)
    train(m, opt, range(1), rank, world)
    ckpt = os.path.join(folder, "ck")
    opt.save_checkpoint(ckpt)  # a good one, which no interrupted save may touch
    opt.save_checkpoint(os.path.join(folder, "step-1"))
    train(m, opt, range(1, 2), rank, world)

    def on_rank0(module, name: str, act) -> None:
        real = getattr(module, name)

        def wrapped(*args, **kw):
            if rank == 0 and (name != "fsync_dir" or args[0] == folder):
                act()
            return real(*args, **kw)

        setattr(module, name, wrapped)
        out["restore"] = lambda: setattr(module, name, real)

    def raised() -> None:
        raise KeyboardInterrupt

    def pressed() -> None:
        os.kill(os.getpid(), signal.SIGINT)  # its handler runs before the next bytecode here

    for key, module, name, act in [
        ("write", sharded, "write_checkpoint", raised),
        ("prepare", sharded, "sweep", pressed),
        ("publish", sharded, "check_parts", pressed),
        ("commit", fsops, "fsync_dir", pressed),
    ]:
        on_rank0(module, name, act)
        path, kw = (os.path.join(folder, "step-2"), {"keep_last": 1}) if key == "commit" else (ckpt, {})
        try:
            out[key] = ("returned", opt.save_checkpoint(path, **kw))
        except BaseException as e:  # noqa: BLE001 - the result
            out[key] = (type(e).__name__, str(e))
        finally:
            out.pop("restore")()
        out[key + "_hidden"] = _hidden_once_every_rank_cleaned_up(folder)
    signal.signal(signal.SIGINT, before)
    out["listing"] = sorted(os.listdir(folder))
    out["intact"] = inspect_checkpoint(ckpt)["step"] == 1 and verify_checkpoint(ckpt)["ok"]
    out["committed"] = inspect_checkpoint(os.path.join(folder, "step-2"))["step"] == 2
    out["next"] = opt.save_checkpoint(ckpt) == ckpt and inspect_checkpoint(ckpt)["step"] == 2
    return out


def test_a_ctrl_c_on_rank_0_of_a_collective_save_stops_every_rank_at_once(tmp_path):
    # Rank 0 left the save alone: rank 1 waited in a collective for as long as rank 0's process lived (up to the
    # process group's timeout, 30 min by default), then said that a rank had left, or that it could not tell whether
    # rank 0 had committed; a part written was left in a hidden folder.
    os.mkdir(tmp_path / "ckpts")
    folder = str(tmp_path / "ckpts")
    r0, r1 = run_ranks(_interrupted_saves, 2, str(tmp_path / "nvme"), folder, timeout=150)
    for key in ("write", "prepare", "publish"):
        assert r0[key] == ("KeyboardInterrupt", ""), r0[key]
        kind, message = r1[key]
        assert kind == "KeyboardInterrupt", message
        assert "nothing was committed: rank 0: KeyboardInterrupt: interrupted" in message, message
        assert r0[key + "_hidden"] == r1[key + "_hidden"] == []
    # Held over the commit and keep_last's pruning, the press lands on rank 0 once the save is in and rank 1 is told.
    assert r0["commit"][0] == "KeyboardInterrupt" and "holds the new checkpoint, whole" in r0["commit"][1], r0["commit"]
    assert r1["commit"] == ("returned", os.path.join(folder, "step-2"))
    assert r0["listing"] == ["ck", "step-2"] and r0["intact"] and r0["committed"]
    assert r0["next"] and r1["next"]


def _pressed_in_the_cleanup(rank: int, world: int, root: str, folder: str) -> dict:
    """A save at world size 2 that rank 0 is interrupted in as it publishes (a real SIGINT), then again each time it
    begins to remove the temp folder; then, the handlers back, a save that commits. What
    each rank raised, and what is left beside the checkpoints, is the result."""
    import signal

    from tiered.checkpoint import hidden, sharded

    out: dict = {}
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    m = fsdp(model())
    opt = TieredOptimizer(m, root, **KW)
    train(m, opt, range(1), rank, world)
    ckpt = os.path.join(folder, "ck")
    opt.save_checkpoint(ckpt)  # a good one, which the interrupted save may not touch
    train(m, opt, range(1, 2), rank, world)
    under_way = set(hidden._UNDER_WAY)
    real_check, real_rmtree = sharded.check_parts, shutil.rmtree

    def check_parts(*args, **kw):
        os.kill(os.getpid(), signal.SIGINT)  # its handler runs before the next bytecode here
        return real_check(*args, **kw)

    def rmtree(path, *args, **kw):
        if os.path.basename(path).startswith(".ck.tmp-"):  # rank 0's part stays in it, rank 1 removes its own
            os.kill(os.getpid(), signal.SIGINT)  # another press, as the removal begins
        return real_rmtree(path, *args, **kw)

    if rank == 0:
        sharded.check_parts, shutil.rmtree = check_parts, rmtree
    try:
        out["save"] = ("returned", opt.save_checkpoint(ckpt))
    except BaseException as e:  # noqa: BLE001 - the result
        out["save"] = (type(e).__name__, str(e))
    finally:
        sharded.check_parts, shutil.rmtree = real_check, real_rmtree
    out["handler_back"] = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    out["under_way"] = hidden._UNDER_WAY == under_way
    out["hidden"] = _hidden_once_every_rank_cleaned_up(folder)
    out["intact"] = inspect_checkpoint(ckpt)["step"] == 1 and verify_checkpoint(ckpt)["ok"]
    signal.signal(signal.SIGINT, before)
    out["next"] = opt.save_checkpoint(ckpt) == ckpt and inspect_checkpoint(ckpt)["step"] == 2
    out["next"] = out["next"] and signal.getsignal(signal.SIGINT) is before  # no handler left behind by the saves
    out["next_hidden"] = [e for e in os.listdir(folder) if e.startswith(".")]
    return out


def test_a_ctrl_c_as_rank_0_removes_a_failed_collective_save_s_temp_folder_leaves_nothing_behind(tmp_path):
    # Rank 0 removed the temp folder of a failed save (a press as it published) with Ctrl-C let through: a second
    # press there stopped the removal, the folder half removed and its lock file stayed beside the checkpoint until
    # the next save's sweep. Rank 0 now ends the save's temp folder with Ctrl-C held, as the writer does.
    os.mkdir(tmp_path / "ckpts")
    folder = str(tmp_path / "ckpts")
    r0, r1 = run_ranks(_pressed_in_the_cleanup, 2, str(tmp_path / "nvme"), folder, timeout=150)
    assert r0["save"] == ("KeyboardInterrupt", ""), r0["save"]
    kind, message = r1["save"]
    assert kind == "KeyboardInterrupt" and "rank 0: KeyboardInterrupt" in message, message
    for r in (r0, r1):
        assert r["hidden"] == [] and r["intact"] and r["handler_back"] and r["under_way"], r
        assert r["next"] and r["next_hidden"] == [], r


def _pressed_on_rank_1(rank: int, world: int, root: str, folder: str) -> dict:
    """Saves at world size 2 with a Ctrl-C on rank 1: while it waits in the outcomes' gather for rank 0, held in its
    part's write until rank 1 is there (a file marks it), then over rank 0's commit broadcast. What each rank
    raised is the result."""
    import signal

    from tiered.checkpoint import sharded

    out: dict = {}
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    m = fsdp(model())
    opt = TieredOptimizer(m, root, **KW)
    train(m, opt, range(1), rank, world)
    ckpt = os.path.join(folder, "ck")
    opt.save_checkpoint(ckpt)  # a good one, which the interrupted save may not touch
    train(m, opt, range(1, 2), rank, world)
    marker = os.path.join(os.path.dirname(folder), "rank-1-waits")
    real_all, real_write, real_bcast = sharded._all, sharded.write_checkpoint, torch.distributed.broadcast_object_list
    calls = []

    def gathered(*args, **kw):
        calls.append(1)
        if rank == 1 and len(calls) == 2:  # the outcomes' gather, this rank's part written
            os.kill(os.getpid(), signal.SIGINT)  # held to the gather's end
            open(marker, "w").close()
        return real_all(*args, **kw)

    def write(*args, **kw):
        deadline = time.monotonic() + 60
        while rank == 0 and not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.01)  # polls for the marker: rank 0 writes on once rank 1 waits in the gather
        return real_write(*args, **kw)

    def broadcast(*args, **kw):
        if rank == 1 and not calls:
            calls.append(1)
            os.kill(os.getpid(), signal.SIGINT)  # held over the broadcast, rank 0 committing
        return real_bcast(*args, **kw)

    for key, module, name, fn in [("gather", sharded, "_all", gathered), ("broadcast", torch.distributed,
                                  "broadcast_object_list", broadcast)]:  # fmt: skip
        setattr(module, name, fn)
        sharded.write_checkpoint = write
        calls.clear()
        try:
            out[key] = ("returned", opt.save_checkpoint(os.path.join(folder, key) if key == "broadcast" else ckpt))
        except BaseException as e:  # noqa: BLE001 - the result
            out[key] = (type(e).__name__, str(e))
        finally:
            sharded._all, sharded.write_checkpoint = real_all, real_write
            torch.distributed.broadcast_object_list = real_bcast
        out[key + "_hidden"] = _hidden_once_every_rank_cleaned_up(folder)
        out[key + "_intact"] = inspect_checkpoint(ckpt)["step"] == 1 and verify_checkpoint(ckpt)["ok"]
    signal.signal(signal.SIGINT, before)
    out["committed"] = inspect_checkpoint(os.path.join(folder, "broadcast"))["step"] == 2
    out["next"] = opt.save_checkpoint(ckpt) == ckpt and inspect_checkpoint(ckpt)["step"] == 2
    return out


def test_a_ctrl_c_on_rank_1_waiting_for_rank_0_in_a_collective_save_stops_every_rank_before_the_commit(tmp_path):
    # Rank 1's press, held in the gather where it waited for a slower rank 0, reached rank 0 only after it had
    # committed: rank 0 returned and trained on into collectives rank 1 had left (a hang until the launcher or the
    # process group's timeout ended it), and rank 1 raised a bare KeyboardInterrupt, not saying it had committed.
    os.mkdir(tmp_path / "ckpts")
    folder = str(tmp_path / "ckpts")
    r0, r1 = run_ranks(_pressed_on_rank_1, 2, str(tmp_path / "nvme"), folder, timeout=150)
    assert r1["gather"] == ("KeyboardInterrupt", ""), r1["gather"]
    kind, message = r0["gather"]
    assert kind == "KeyboardInterrupt", message
    assert "nothing was committed: rank 1: KeyboardInterrupt: interrupted" in message, message
    assert r0["gather_hidden"] == r1["gather_hidden"] == [] and r0["gather_intact"] and r1["gather_intact"]
    # Held over rank 0's commit broadcast, it lands after the commit, saying so; rank 0 returns.
    assert r0["broadcast"] == ("returned", os.path.join(folder, "broadcast")), r0["broadcast"]
    kind, message = r1["broadcast"]
    assert kind == "KeyboardInterrupt" and "committed" in message and "new checkpoint, whole" in message, message
    assert r0["broadcast_hidden"] == [] and r0["committed"] and r0["next"] and r1["next"]
