"""``state_dict()`` where its backing files do not fit: the tensors it returns are files in the optimizer's
folder (tiered/optim/state_dicts.py), so a full disk meets it. The error must say which file and how many bytes,
keep the errno, and leave the optimizer as it was."""

from __future__ import annotations

import copy
import errno
import gc
import os
import subprocess

import pytest
import torch
from helpers import run_bounded, run_script, small_tmpfs
from torch import nn

from io_engine import format_size
from tiered import TieredOptimizer
from tiered.optim import state_dicts
from tiered.optimizer import StateDictFileError
from tiered.store.workdir import EXPORT_PREFIX


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


def export_mappings(folder: str) -> int:
    """Memory mappings of state dict files in ``folder`` this process has now."""
    with open("/proc/self/maps") as maps:
        return sum(f"{os.path.realpath(folder)}/" in line and EXPORT_PREFIX in line for line in maps)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the process's mappings")
def test_a_state_dict_of_many_parameters_takes_few_mappings_and_each_tensor_its_own_memory(tmp_path):
    """Once each tensor was a file of its own, mapped: 2 mappings an fp32 parameter, 3 a bf16 one, so a model of
    more than ~22k bf16 parameters (a large MoE) passed Linux's vm.max_map_count (65,530) and state_dict() failed
    with a bare RuntimeError from mmap; 10,000 small ones took 20 s to export and 35 s to drop. Each tensor must
    still have memory of its own, so that deepcopy copies only it (and torch deep-copies FSDP2's DTensors)."""
    torch.manual_seed(0)
    fp32 = [nn.Parameter(torch.randn(3 + i % 5)) for i in range(200)]
    bf16 = [nn.Parameter(torch.randn(2 + i % 3).to(torch.bfloat16)) for i in range(200)]
    ref = [nn.Parameter(p.detach().clone()) for p in fp32]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    with TieredOptimizer(fp32 + bf16, tmp_path, lr=1e-2, host_budget="8MiB", chunk_bytes="64KiB") as opt:
        for ps, o in ((fp32 + bf16, opt), (ref, ref_opt)):
            for p in ps:
                p.grad = torch.linspace(-1, 1, p.numel()).to(p.dtype)
            o.step()
        before = export_mappings(opt.workdir)
        sd = run_bounded(opt.state_dict, 60)
        assert export_mappings(opt.workdir) - before <= 2, "one mapping a tensor: a large model passes the limit"
        tensors = [t for s in sd["state"].values() for k, t in s.items() if k != "step"]
        assert len(tensors) == 2 * 200 + 3 * 200
        for t in tensors:
            assert t.untyped_storage().nbytes() == t.numel() * 4, "a tensor's memory is its own"
        for i, p in enumerate(ref):
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(sd["state"][i][key], ref_opt.state[p][key])
        for i, p in enumerate(bf16, start=len(fp32)):
            assert torch.equal(sd["state"][i]["master"].to(torch.bfloat16), p.detach())
        one = copy.deepcopy(sd["state"][3])
        assert one["exp_avg"].untyped_storage().nbytes() == 4 * fp32[3].numel()
        one["exp_avg"].add_(1)  # the copy is its own: the dict keeps its values
        assert torch.equal(sd["state"][3]["exp_avg"], ref_opt.state[ref[3]]["exp_avg"])
        del sd, tensors, t
        gc.collect()
        assert export_mappings(opt.workdir) == before, "the files go with the dict"


# A state dict of 64 MiB (a moment of 32 MiB, fp32 parameter) under an address-space limit with 16 MiB to spare:
# the kernel refuses its mapping with ENOMEM, as when the process has vm.max_map_count mappings.
MAPPING_REFUSED = """
import resource, torch
from torch import nn
from tiered import TieredOptimizer
from tiered.optim import state_dicts
from tiered.optimizer import StateDictFileError
p = nn.Parameter(torch.zeros(8 << 20))
with TieredOptimizer([p], {root!r}, lr=1e-2, host_budget="256MiB", chunk_bytes="16MiB") as opt:
    p.grad = torch.ones_like(p)
    opt.step()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (used + (16 << 20), hard))
    try:
        opt.state_dict()
    except BaseException as e:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        print("RAISED", type(e).__name__, getattr(e, "errno", None), str(e).replace(chr(10), " "))
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    p.grad = torch.ones_like(p)
    opt.step()
    print("AFTER", float(opt.state_dict()["state"][0]["step"]))
"""


def test_a_mapping_the_kernel_refuses_is_a_state_dict_file_error_naming_the_limit(tmp_path):
    """Once torch.from_file's bare RuntimeError ('unable to mmap ... Cannot allocate memory') came out, naming
    neither the cause nor the limit to raise."""
    out = run_script(MAPPING_REFUSED.format(root=str(tmp_path)), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    raised = [line for line in out.stdout.splitlines() if line.startswith("RAISED")]
    assert raised, out.stdout
    assert raised[0].startswith(f"RAISED StateDictFileError {errno.ENOMEM} "), raised[0]
    assert "vm.max_map_count" in raised[0] and "ulimit -v" in raised[0], raised[0]
    assert "could not map" in raised[0] and "exp_avg of 'group0.param0'" in raised[0], raised[0]
    assert "AFTER 2.0" in out.stdout, out.stdout + out.stderr[-3000:]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the process's mappings")
def test_a_state_dict_cut_into_several_files_keeps_only_the_file_of_a_tensor_kept(tmp_path, monkeypatch):
    """Files of 1 KiB at least, 4 for the dict: the tensors are cut into files in order (each about a quarter),
    their values are the state's, and a tensor kept after the dict is dropped keeps its own file alone."""
    monkeypatch.setattr(state_dicts, "FILE_BYTES", 1024)
    monkeypatch.setattr(state_dicts, "FILES", 4)
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5 + i % 7)) for i in range(100)] + [nn.Parameter(torch.randn(2000))]
    ref = [nn.Parameter(p.detach().clone()) for p in params]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    with TieredOptimizer(params, tmp_path, lr=1e-2, host_budget="8MiB", chunk_bytes="64KiB") as opt:
        for ps, o in ((params, opt), (ref, ref_opt)):
            for p in ps:
                p.grad = torch.linspace(-1, 1, p.numel())
            o.step()
        sd = run_bounded(opt.state_dict, 60)
        assert 4 <= export_mappings(opt.workdir) <= 2 * 4 + 1
        for i, p in enumerate(ref):
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(sd["state"][i][key], ref_opt.state[p][key]), (i, key)
        kept = sd["state"][100]["exp_avg_sq"]  # the largest: a file of its own (16 KB > a quarter of the dict)
        del sd
        gc.collect()
        assert export_mappings(opt.workdir) == 1
        assert torch.equal(kept, ref_opt.state[ref[100]]["exp_avg_sq"])
        del kept
        gc.collect()
        assert export_mappings(opt.workdir) == 0


def _stepped(tmp_path, n: int) -> tuple[nn.Module, TieredOptimizer]:
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(n)))
    opt = TieredOptimizer(model, nvme_path=str(tmp_path), lr=1e-2, host_budget="1MiB", chunk_bytes="12KiB")
    model(torch.randn(2, 4)).square().mean().backward()
    opt.step()
    return model, opt


def test_state_dicts_held_keep_no_file_descriptors_open(tmp_path):
    """Python's mmap (before 3.13) keeps a duplicate of its file's descriptor for the mapping's life: each
    ``opt.state[p]`` held kept one open, and under ``ulimit -n 1024`` holding those of ~1,000 parameters failed
    with EMFILE. A mapping holds no descriptor, as torch.from_file's did."""
    model, opt = _stepped(tmp_path, 20)
    with opt:
        before = len(os.listdir("/proc/self/fd"))
        held = [opt.state[p] for p in model.parameters()] + [opt.state_dict() for _ in range(3)]
        assert len(os.listdir("/proc/self/fd")) == before
        assert all(torch.isfinite(s["exp_avg"]).all() for s in held[:40])


def test_a_state_dict_that_failed_part_way_holds_no_file_while_its_error_is_held(tmp_path, monkeypatch):
    """The last file made before a failure stayed mapped (a local of the failed frame, which the error's traceback
    keeps) for as long as the error was held: its disk space and memory with it. Now none does."""
    model, opt = _stepped(tmp_path, 8)
    monkeypatch.setattr(state_dicts, "FILE_BYTES", 64)  # a file a tensor: the third one fails
    real, calls = os.posix_fallocate, [0]

    def fallocate(fd: int, offset: int, size: int) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, size)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    with opt:
        try:
            opt.state_dict()
        except StateDictFileError as e:  # the public name README gives
            held = e
        mine = [line for line in open("/proc/self/maps") if EXPORT_PREFIX in line]
        assert held.errno == errno.ENOSPC and mine == [], mine
