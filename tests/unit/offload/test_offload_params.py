"""Parameters and gradients off the GPU (tiered.offload_model), on the CPU stand-in: FSDP2's CPU offload over a
one-rank gloo group, the optimizer updating its CPU shards.

The claim under test: with the same micro-batches, the weights after N steps are bitwise those of the same run
with the parameters left where they are (plain model, no FSDP2), with global-norm clipping that fires, gradient
accumulation, bf16 weights or fp32 weights under bf16 autocast, and a checkpoint resume in a new process.
The runs happen in this process (offload_model makes and closes its own process group), bounded in time; the
resume runs in child processes (this file run as a script).
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TESTS_ROOT, TIMEOUT, run_bounded

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")

# A whole training run, here or in a child process that imports torch and builds its own process group; a step of
# this tiny model takes well under a second: only reached when something hangs.
RUN_TIMEOUT = 10 * TIMEOUT
VOCAB, SEQ, LAYERS = 96, 16, 3
KW = dict(lr=1e-2, weight_decay=0.1, chunk_bytes="16KiB", host_budget="160KiB")  # several chunks, some on disk


SHAPES = {  # hidden, intermediate, layers, vocab
    "tiny": (32, 64, LAYERS, VOCAB),
    # 0.27B, nearly all in its 16 layers (a small vocabulary keeps the root unit, embeddings and head, small):
    # weights large against a layer's window and one micro-batch's activations (the CUDA test).
    "wide": (1024, 4096, 16, 8000),
}


def llama(dtype: torch.dtype, shape: str = "tiny", **config) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, vocab = SHAPES[shape]
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        use_cache=False,
        **config,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype).train()


def checkpoint_layers(model: torch.nn.Module) -> None:
    """HF's activation checkpointing (backward recomputes each layer's forward) as examples/big_model.py sets it,
    by either of its names (transformers 5 renamed it)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def micro_batch(step: int, k: int, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + k)
    return torch.randint(0, vocab, (2, SEQ), generator=g)


def full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()


def digest(p: torch.Tensor) -> str:
    """The weight's exact bits, as a SHA-256 of its values (fp32-widened, which loses none): bitwise equal
    weights give equal digests, and a child process can print it."""
    return hashlib.sha256(full(p).cpu().numpy().tobytes()).hexdigest()


def train(nvme: str, *, offload: bool, dtype: str = "bfloat16", autocast: bool = False, clip: float | None = 0.5,
          accumulate: int = 2, steps: tuple[int, int] = (0, 3), save: str | None = None, load: str | None = None,
          device: str = "cpu", shape: str = "tiny", gpu_cap: int | None = None, keep: bool | str = "auto",
          checkpointing: bool = False, evaluate: bool | str = False, evaluate_first: bool | str = False,
          save_dicts: str | None = None, load_dicts: str | None = None, write: str | None = None,
          **opt_kw) -> dict:  # fmt: skip
    """Steps ``range(*steps)`` of one run on ``device`` (offloaded: the model built on the host, streamed to
    ``device``, ``keep`` its ``keep_for_backward``); ``checkpointing``: HF's gradient checkpointing (backward
    recomputes each layer's forward); ``evaluate``: a forward under no_grad between backward and each step
    (``"grad"``: with grad, its loss never used; ``"inference"``: under inference_mode); ``evaluate_first``: one
    under no_grad (``"inference"``: inference_mode, as Lightning's sanity check) before the optimizer is built
    (HF Trainer's ``evaluate()`` before ``train()``), its loss the first of the losses; ``save_dicts``,
    ``load_dicts``: the model's and the optimizer's state dicts saved to / loaded from one torch.save file (a
    framework's checkpoint) after / before; ``write``: a write into the weights before the second step
    (``write_weights``).
    Returns the weights' digests, the losses, whether any step clipped, and on CUDA the peak of allocated GPU
    memory (under ``gpu_cap`` bytes, if given)."""
    import tiered
    from tiered import TieredOptimizer
    from tiered.offload import offload_model

    cuda = device == "cuda"
    if cuda:  # blocks an earlier run (or test) left in torch's cache are reused past a cap set later: give them back
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    model = llama(getattr(torch, dtype), shape)
    if checkpointing:
        checkpoint_layers(model)
    if offload:
        offload_model(model, device=device, keep_for_backward=keep)
    else:
        model.to(device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if gpu_cap:
            torch.cuda.set_per_process_memory_fraction(gpu_cap / torch.cuda.get_device_properties(0).total_memory)
    losses = []
    if evaluate_first:
        with without_grad(evaluate_first):
            x = micro_batch(-1, 0, SHAPES[shape][3]).to(device)
            losses.append(model(input_ids=x, labels=x).loss.item())
    opt = TieredOptimizer(model, nvme_path=nvme, max_grad_norm=clip, **{**KW, **opt_kw})
    try:
        if load:
            opt.load_checkpoint(load)
        if load_dicts:
            dicts = torch.load(load_dicts, weights_only=False)
            model.load_state_dict(dicts["model"])
            opt.load_state_dict(dicts["optimizer"])
        clipped, masters_written = False, None
        for step in range(*steps):
            if write and step == steps[0] + 1:
                masters_written = write_weights(model, opt, write)
            for k in range(accumulate):
                x = micro_batch(step, k, SHAPES[shape][3]).to(device)
                with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                    loss = model(input_ids=x, labels=x).loss / accumulate
                loss.backward()
                losses.append(loss.item())
            if clip is not None:  # the same norm as the optimizer's own clip: would it have scaled?
                grads = [full(p.grad) for p in model.parameters() if p.grad is not None]
                clipped |= bool(torch.nn.utils.get_total_norm(grads) > clip)
            if evaluate:
                with without_grad(evaluate):
                    x = micro_batch(step, accumulate, SHAPES[shape][3]).to(device)
                    losses.append(model(input_ids=x, labels=x).loss.item())
            opt.step()
            opt.zero_grad()
        if save:
            opt.save_checkpoint(save)
        if save_dicts:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, save_dicts)
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        hbm = opt.store.stats()["gpu"]["in_use"]  # state bytes kept in HBM (gpu_budget)
        prefetch = model.tiered_prefetch.stats() if offload else None
        sums = model.tiered_accumulation.stats() if offload else None  # where the micro-batches were summed
        kept = opt.stats()["grads_kept_bytes"]  # the last step's clip's gradient copies left on the GPU
        found = opt.stats()["grads_found_bytes"]  # of those, sums backward left there (resident_grads)
        weights = {n: digest(p) for n, p in model.named_parameters()}
        kept_blocks = getattr(getattr(model, "tiered_kept_weights", None), "count", None)
    finally:
        opt.close()
        if cuda:
            torch.cuda.set_per_process_memory_fraction(1.0)
        if offload:
            tiered.offload.close()
    params = sum(p.numel() for p in model.parameters())
    return {"weights": weights, "losses": losses, "clipped": clipped, "peak": peak, "params": params, "hbm": hbm,
            "prefetch": prefetch, "grads_kept": kept, "grads_found": found, "sums": sums,
            "kept_blocks": kept_blocks, "masters_written": masters_written}  # fmt: skip


def write_weights(model: torch.nn.Module, opt, how: str) -> bool:
    """Halve every weight between steps, by ``how``: ``"load_state_dict"`` (the model's own, halved) or
    ``"in place"`` (``p.mul_`` under no_grad). Returns whether the optimizer's masters are then the written
    weights, as torch's AdamW keeps a write."""
    if how == "load_state_dict":
        model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()})
    else:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
    state = opt.state_dict()["state"]
    return all(torch.equal(full(state[i]["master"]), full(p)) for i, p in enumerate(model.parameters()))


def without_grad(kind: bool | str):
    """An evaluation's context: ``"inference"``: inference_mode; ``"grad"``: grad on (a forward whose loss is never
    used); anything else no_grad."""
    if kind == "inference":
        return torch.inference_mode()
    return torch.set_grad_enabled(kind == "grad")


def run(tmp_path: Path, name: str, **kw) -> dict:
    nvme = tmp_path / name
    nvme.mkdir()
    return run_bounded(lambda: train(str(nvme), **kw), timeout=RUN_TIMEOUT)


def assert_bitwise(a: dict, b: dict) -> None:
    assert a["weights"].keys() == b["weights"].keys()
    differ = [n for n in a["weights"] if a["weights"][n] != b["weights"][n]]
    assert not differ, f"weights differ in {differ}"


def offloaded_as_plain(tmp_path: Path, keep: bool | str | int, **kw) -> dict:
    """The offloaded run with ``keep_for_backward=keep`` (``kw``: ``train``'s), asserted to clip and to equal the
    plain run of the same ``kw`` loss for loss and bit for bit; returns it."""
    plain = run(tmp_path, "plain", offload=False, **kw)
    off = run(tmp_path, f"off-{keep}", offload=True, keep=keep, **kw)
    assert plain["clipped"]
    assert off["losses"] == plain["losses"]
    assert_bitwise(off, plain)
    return off


@pytest.mark.parametrize("dtype, autocast", [("bfloat16", False), ("float32", True)], ids=["bf16", "fp32-autocast"])
def test_offloaded_run_is_bitwise_the_run_on_the_device(tmp_path, dtype, autocast):
    plain = run(tmp_path, "plain", offload=False, dtype=dtype, autocast=autocast)
    off = run(tmp_path, "off", offload=True, dtype=dtype, autocast=autocast)
    assert plain["clipped"], "the test must clip to test clipping: lower clip"
    assert off["losses"] == plain["losses"]
    assert_bitwise(off, plain)
    # The comparison can fail: without the clip the weights are others.
    unclipped = run(tmp_path, "unclipped", offload=True, dtype=dtype, autocast=autocast, clip=None)
    assert unclipped["weights"] != off["weights"]


def test_micro_batches_summed_on_the_device_train_bitwise_as_on_the_device(tmp_path, monkeypatch):
    """The GPU's way of summing micro-batches (offload.accumulation.SUM_ON_DEVICE: the held gradients added into
    FSDP2's reduced ones before they come down), the CPU standing in for the GPU: bitwise the plain run, clipped,
    every later micro-batch summed that way."""
    import tiered.offload.accumulation as acc

    monkeypatch.setattr(acc, "SUM_ON_DEVICE", True)
    plain = run(tmp_path, "plain", offload=False)
    off = run(tmp_path, "off", offload=True)
    assert plain["clipped"]
    assert off["sums"]["bytes_summed_on_device"] == off["sums"]["bytes_summed"] > 0
    assert off["losses"] == plain["losses"]
    assert_bitwise(off, plain)


@pytest.mark.parametrize("evaluate", [False, True], ids=["train", "evaluate-before-step"])
def test_weights_kept_from_forward_to_backward_are_bitwise_the_run_on_the_device(tmp_path, evaluate):
    """keep_for_backward=True (FSDP2's reshard_after_forward=False): backward and its recompute use the weights
    forward copied. Bitwise the plain run with clipping, accumulation and gradient checkpointing; and with an
    evaluation forward between backward and each step, whose kept weights the step must drop (else the next
    forward reuses the old ones)."""
    offloaded_as_plain(tmp_path, True, checkpointing=True, evaluate=evaluate)


def test_the_next_blocks_weights_are_copied_ahead_and_the_run_stays_bitwise(tmp_path):
    """At world size 1 FSDP2 copies each block's weights in line with its kernels; offload/prefetch.py copies the
    next block's while the one before runs. Streamed again for backward (checkpointing, not kept), forward and
    backward both use copies made ahead, and the weights after 3 steps of 2 micro-batches are bitwise the plain
    run's."""
    off = offloaded_as_plain(tmp_path, False, checkpointing=True)
    got = off["prefetch"]
    # Each of the 6 micro-batches unshards the root and 3 layers in forward and 3 layers again in backward. The
    # first micro-batch's 7 have no copy (the order is learned there), and every forward's first (the root's); in
    # backward the root, whose weights FSDP2 keeps from forward, passes the order on, so the last layer's is
    # copied ahead too.
    assert got["hits"] + got["misses"] == 6 * 7 and got["misses"] == 7 + 5, got
    # The weights' traffic up, copied ahead or in line: each micro-batch's forward every unit's bf16 weights, its
    # backward the layers' again; down, each micro-batch's reduced gradients of every unit.
    model = llama(torch.bfloat16)
    weights = sum(2 * p.numel() for p in model.parameters())
    layers = sum(2 * p.numel() for p in model.model.layers.parameters())
    assert got["bytes"] > 0 and got["bytes"] + got["bytes_inline"] == 6 * (weights + layers), got
    assert off["sums"]["bytes_reduced"] == 6 * weights and off["sums"]["bytes_held_up"] == 0  # summed on the worker


def test_a_copy_made_ahead_never_outlives_a_pass():
    """A write into the weights between two forwards (a user's, a load_state_dict's) is what the next forward
    computes with: no copy made ahead in one pass is used in the next."""
    import tiered.offload

    model, plain = llama(torch.bfloat16), llama(torch.bfloat16)
    tiered.offload.offload_model(model, device="cpu")
    try:
        x = micro_batch(0, 0)
        with torch.no_grad():
            for _ in range(3):  # passes enough to learn any order there is to learn, the next pass's start too
                model(input_ids=x)
            for m in (model, plain):  # every weight written, the root's (embeddings, head) and each layer's
                for p in m.parameters():
                    local = p.to_local() if hasattr(p, "to_local") else p
                    local.mul_(0.5)
            assert torch.equal(model(input_ids=x).logits, plain(input_ids=x).logits)
        assert model.tiered_prefetch.stats()["hits"] > 0
    finally:
        tiered.offload.close()


def test_no_room_for_a_copy_ahead_leaves_the_unit_to_fsdp2(monkeypatch):
    """Where the GPU has no room for one block more, the copy ahead is not made (``no_room``) and FSDP2 copies the
    unit in line, as it would without offload/prefetch.py: the forward runs, its logits those of the plain model."""
    import tiered.offload

    model, plain = llama(torch.bfloat16), llama(torch.bfloat16)
    tiered.offload.offload_model(model, device="cpu")
    to = torch.Tensor.to

    def no_room(self: torch.Tensor, *args, **kw):
        if kw.get("copy"):  # only the copy ahead asks for a copy on the stand-in
            raise torch.OutOfMemoryError("no room")
        return to(self, *args, **kw)

    try:
        x = micro_batch(0, 0)
        with torch.no_grad():
            model(input_ids=x)
            monkeypatch.setattr(torch.Tensor, "to", no_room)
            for _ in range(2):
                assert torch.equal(model(input_ids=x).logits, plain(input_ids=x).logits)
            monkeypatch.undo()
        got = model.tiered_prefetch.stats()
        # Each pass after the first asks a copy of every layer but the first (the root stays unsharded after forward).
        assert got["no_room"] >= 2 * (LAYERS - 1) and got["hits"] == 0, got
    finally:
        tiered.offload.close()


def test_kept_weights_stay_until_backward_and_leave_the_gradients_where_clipping_reads_them():
    from torch.distributed.tensor import DTensor

    import tiered.offload

    def sharded(module: torch.nn.Module) -> bool:
        return all(isinstance(p, DTensor) for p in module.parameters())

    for keep in (True, False):
        model = llama(torch.bfloat16)
        checkpoint_layers(model)
        tiered.offload.offload_model(model, device="cpu", keep_for_backward=keep)
        try:
            assert model.tiered_offload.kept_for_backward is keep
            x = micro_batch(0, 0)
            loss = model(input_ids=x, labels=x).loss
            # After forward each decoder layer holds the weights it ran with (kept) or its host shards again.
            assert all(sharded(layer) is not keep for layer in model.model.layers)
            loss.backward()
            assert sharded(model)  # backward's end: the host shards, each with its gradient, whatever keep says
            assert all(p.grad is not None for p in model.parameters())
            assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)) > 0
        finally:
            tiered.offload.close()


@pytest.mark.parametrize("keep", [2, "room"])
def test_the_last_blocks_kept_from_forward_to_backward_are_bitwise_the_run_on_the_device(tmp_path, keep):
    """keep_for_backward=n keeps the last n decoder layers' weights from forward to backward and streams the first
    again; "room" keeps as many as the GPU has room for once two backwards have measured a pass (on the CPU
    stand-in every layer, from the third micro-batch on). Bitwise the plain run, clipped, with accumulation and
    gradient checkpointing (backward's recompute reads the weights kept)."""
    kept = offloaded_as_plain(tmp_path, keep, checkpointing=True)
    assert kept["kept_blocks"] == (2 if keep == 2 else LAYERS)
    # What it is for: fewer bytes up the link. Each of the 6 micro-batches' forwards copies every unit's weights;
    # backward copies again only the layers not kept (with "room", all of them in the first two micro-batches).
    model = llama(torch.bfloat16)
    weights = sum(2 * p.numel() for p in model.parameters())
    layer = [sum(2 * p.numel() for p in m.parameters()) for m in model.model.layers]
    again = 6 * layer[0] if keep == 2 else 2 * sum(layer)
    got = kept["prefetch"]
    assert got["bytes"] + got["bytes_inline"] == 6 * weights + again, got


def test_a_number_keeps_the_last_blocks_and_room_sizes_itself_after_two_backwards():
    from torch.distributed.tensor import DTensor

    import tiered.offload
    from tiered.offload.kept_sums import MEASURED_PASSES

    def sharded(module: torch.nn.Module) -> bool:
        return all(isinstance(p, DTensor) for p in module.parameters())

    model = llama(torch.bfloat16)
    checkpoint_layers(model)
    tiered.offload.offload_model(model, device="cpu", keep_for_backward=2)
    try:
        assert not model.tiered_offload.kept_for_backward and model.tiered_kept_weights.count == 2
        x = micro_batch(0, 0)
        loss = model(input_ids=x, labels=x).loss
        assert [sharded(layer) for layer in model.model.layers] == [True, False, False]  # the first streams again
        loss.backward()
        assert sharded(model) and all(p.grad is not None for p in model.parameters())
    finally:
        tiered.offload.close()
    model = llama(torch.bfloat16)
    checkpoint_layers(model)
    tiered.offload.offload_model(model, device="cpu", keep_for_backward="room")
    try:
        kept = model.tiered_kept_weights
        for k in range(MEASURED_PASSES + 1):
            assert kept.count == (0 if k < MEASURED_PASSES else LAYERS)
            x = micro_batch(0, k)
            loss = model(input_ids=x, labels=x).loss
            assert all(sharded(layer) for layer in model.model.layers) is (k < MEASURED_PASSES)
            loss.backward()
            assert sharded(model)
        # The kept sums measure a pass again, now that it holds the weights kept.
        assert model.tiered_accumulation.kept.measured == MEASURED_PASSES - 1
    finally:
        tiered.offload.close()


def test_the_room_keeps_whole_blocks_from_the_last():
    from tiered.offload.kept_weights import KeptWeights

    units = [torch.nn.Linear(4, 4, bias=False) for _ in range(3)]  # 16 fp32 weights: 64 bytes each
    kept = KeptWeights(units, torch.device("cpu"))
    assert [kept.fit(room) for room in (0, 63, 64, 127, 128, 192, 1 << 40)] == [0, 0, 1, 1, 2, 3, 3]
    assert KeptWeights(units, torch.device("cpu"), torch.bfloat16).fit(64) == 2  # sized in the dtype unsharded


def test_keep_for_backward_auto_follows_the_gpu_budget():
    from tiered.offload import KEEP_SHARE, keeps_for_backward

    model = llama(torch.bfloat16)
    weights = sum(p.numel() * 2 for p in model.parameters())
    assert keeps_for_backward(model, int(weights / KEEP_SHARE) + 1)
    assert not keeps_for_backward(model, int(weights / KEEP_SHARE) - 1)
    assert not keeps_for_backward(model, 0)
    assert keeps_for_backward(model, int(2 * weights / KEEP_SHARE) + 2, param_dtype=torch.float32)
    assert not keeps_for_backward(model, int(2 * weights / KEEP_SHARE) - 2, param_dtype=torch.float32)


def test_offload_model_shards_the_decoder_layers_and_says_so_once(tmp_path, caplog):
    import torch.distributed as dist

    import tiered.offload

    model = llama(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="tiered"):
        out = tiered.offload.offload_model(model, device="cpu")
    try:
        assert out is model
        info = model.tiered_offload
        assert (info.offloaded, info.blocks, info.block_class) == (True, LAYERS, "LlamaDecoderLayer")
        assert info.made_process_group and dist.is_initialized() and dist.get_world_size() == 1
        assert all(type(p).__name__ == "DTensor" and p.device.type == "cpu" for p in model.parameters())
        said = [r for r in caplog.records if "off the GPU" in r.getMessage()]
        assert len(said) == 1 and "LlamaDecoderLayer" in said[0].getMessage()
        with pytest.raises(ValueError, match="already applied"):
            tiered.offload.offload_model(model, device="cpu")
    finally:
        tiered.offload.close()
    assert not dist.is_initialized()
    tiered.offload.close()  # idempotent


FORK_SCRIPT = """
import os, signal, sys, tempfile, torch
import torch.distributed as dist
import tiered.offload
from tiered import TieredOptimizer
from tiered.offload.process_group import _own_group
torch.set_num_threads(1)  # tiny ops never start OpenMP's pool, which does not survive a fork: the child's own hang
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
tiered.offload.offload_model(model, device="cpu", blocks="Linear")
opt = None
{before}
folder = _own_group["folder"]
pid = os.fork()
if pid == 0:  # a helper forked from the training process that ends the usual way (its exit runs atexit)
    signal.alarm(60)  # an exit that waits for ever is killed by SIGALRM (exit -14)
    {child}
    sys.exit(0)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status), flush=True)
print("group folder kept", os.path.isdir(folder), flush=True)
if os.path.isdir(folder):  # without its store's file, a new group waited for ever
    t = torch.ones(1)
    dist.all_reduce(t, group=dist.new_group([0]))
    print("new group reduces", float(t), flush=True)
if opt is not None:
    opt.close()
tiered.offload.close()
print("closed", dist.is_initialized(), os.path.isdir(folder), flush=True)
"""

BEFORE_FORK = {
    "after a backward": "model(torch.randn(2, 16)).sum().backward()",
    "before any pass": "pass",
    "before any pass, an optimizer open": "opt = TieredOptimizer(torch.nn.Linear(8, 8), nvme_path=tempfile.mkdtemp())",
}


@pytest.mark.parametrize("before", list(BEFORE_FORK))
@pytest.mark.parametrize("child", ["pass", "tiered.offload.close()"])
def test_a_forked_child_that_exits_normally_leaves_the_parents_process_group(child, before):
    """A child of os.fork() that ended with sys.exit ran offload's exit hook: it removed the folder of the parent's
    one-rank group's FileStore, and the parent's next dist.new_group waited for ever. And a child forked before
    the offloaded model's first pass freed its copy of the group as its interpreter ended: torch's gloo group
    then joins its worker threads and destroys the condition variables they waited on, threads which do not
    exist in the child, so the child's exit waited for ever (or, with an optimizer open, died of SIGSEGV)."""
    from helpers import run_script

    proc = run_script(FORK_SCRIPT.format(child=child, before=BEFORE_FORK[before]), timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in ("child exit 0", "group folder kept True", "new group reduces 1.0", "closed False False"):
        assert line in proc.stdout, proc.stdout + proc.stderr


SAVER_SCRIPT = """
import os, signal, tempfile, torch
from torch import nn
import tiered.offload
torch.manual_seed(0)
torch.set_num_threads(1)  # tiny ops never start OpenMP's pool, which does not survive a fork
model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2)))
tiered.offload.offload_model(model, device="cpu", blocks=list(model))
model(torch.randn(2, 16)).square().mean().backward()
local = lambda t: t.to_local() if hasattr(t, "to_local") else t
sd = model.state_dict()  # in the parent: views of the slabs the weights live in
grads = {n: local(p.grad) for n, p in model.named_parameters()}  # their gradient homes
kept = {**{k: v.clone() for k, v in sd.items()}, **{n: g.clone() for n, g in grads.items()}}
path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
pid = os.fork()
if pid == 0:  # a fork-based background checkpoint: the child saves what the parent took
    signal.alarm(60)
    torch.save({**{k: local(v) for k, v in sd.items()}, **grads}, path)
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status), flush=True)
saved = torch.load(path)
print("saved", sorted(saved) == sorted(kept), all(torch.equal(saved[k], kept[k]) for k in kept), flush=True)
print("zeros", [k for k in kept if kept[k].any() and not saved[k].any()], flush=True)
tiered.offload.close()
"""


def test_a_state_dict_taken_in_the_parent_is_saved_whole_by_a_forked_child():
    """A fork-based background checkpoint: the parent takes ``model.state_dict()`` of an offloaded model (views of
    the slabs its weights live in) and a forked child saves it. With the slabs private and wiped on fork, the child
    read zeros there and saved a checkpoint of zeros, silently; its gradients too. The slabs are shared with the
    child, as they were before huge pages: the child saves the parent's weights and gradients."""
    from helpers import run_script

    proc = run_script(SAVER_SCRIPT, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in ("child exit 0", "saved True True", "zeros []"):
        assert line in proc.stdout, proc.stdout + proc.stderr


def test_a_group_the_user_destroyed_leaves_no_folder_behind(tmp_path, monkeypatch):
    """A script or notebook that offloads several models in one process, each run ending with torch's own
    ``destroy_process_group()``: each next offload_model made a new group and forgot the old one's FileStore
    folder, which stayed in the temp folder after close() and exit. The next group made removes it."""
    import tempfile

    import torch.distributed as dist

    import tiered.offload

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    try:
        for _ in range(3):
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
            tiered.offload.offload_model(model, device="cpu", blocks="Linear")
            model(torch.randn(2, 4)).sum().backward()
            dist.destroy_process_group()  # the script's teardown
            assert len(list(tmp_path.glob("tiered-pg-*"))) == 1  # the last group's, until the next or close()
    finally:
        tiered.offload.close()
    assert not list(tmp_path.glob("tiered-pg-*"))


def test_offloaded_weights_live_in_slabs_of_their_size_each_its_own_storage(tmp_path):
    """offload.pinning.rehome: every sharded weight lies in one of the model's slabs (page-locked on CUDA, where
    torch's allocator would round each up to a power of two), with its values, each with a storage of its own,
    so that save_pretrained (which takes tensors sharing a storage for tied weights) saves and loads them all."""
    from transformers import LlamaForCausalLM

    import tiered.offload

    model = llama(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tiered.offload.offload_model(model, device="cpu")
    try:
        slabs = model.tiered_slabs
        assert len(slabs) == 2 * (LAYERS + 1)  # weights and gradients of each decoder layer and the root's
        for step in range(2):  # the second backward sums into the homes the first one's gradients moved to
            x = micro_batch(step, 0)
            model(input_ids=x, labels=x).loss.backward()
        locals_ = {n: p.to_local() for n, p in model.named_parameters()}
        grads = {n: p.grad.to_local() for n, p in model.named_parameters()}
        tensors = [*locals_.values(), *grads.values()]
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors)
        held = sum(t.numel() * t.element_size() for t in tensors)
        assert held <= sum(s.nbytes for s in slabs) < held + len(tensors) * 4096  # whole pages, nothing more
        for name, t in [*locals_.items(), *grads.items()]:
            assert any(s.holds(t) for s in slabs), name
        for name, t in locals_.items():
            assert torch.equal(t, before[name]), name
        model.save_pretrained(tmp_path / "hf")
        again = LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.bfloat16)
        for name, p in again.named_parameters():
            assert torch.equal(p, before[name]), name
    finally:
        tiered.offload.close()


def test_a_count_of_blocks_may_be_numpys_and_more_than_the_blocks():
    import numpy as np

    import tiered.offload

    try:
        for n, count, every in ((np.int64(1), 1, False), (LAYERS + 5, LAYERS, True)):
            model = llama(torch.float32)
            tiered.offload.offload_model(model, device="cpu", keep_for_backward=n)
            assert model.tiered_kept_weights.count == count and model.tiered_offload.kept_for_backward is every
    finally:
        tiered.offload.close()


def test_blocks_are_found_or_named():
    from torch import nn

    from tiered.offload import find_blocks

    model = llama(torch.float32)
    assert [type(b).__name__ for b in find_blocks(model)] == ["LlamaDecoderLayer"] * LAYERS
    assert find_blocks(model, ["LlamaMLP"]) == [layer.mlp for layer in model.model.layers]
    assert find_blocks(model, "LlamaMLP") == [layer.mlp for layer in model.model.layers]  # one name, not its letters
    seq = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
    assert find_blocks(seq) == list(seq[1])  # no _no_split_modules: the largest ModuleList's children
    with pytest.raises(ValueError, match="NoSuchLayer"):
        find_blocks(model, ["NoSuchLayer"])
    with pytest.raises(ValueError, match="not submodules"):
        find_blocks(model, [nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="blocks="):
        find_blocks(nn.Linear(2, 2))
    # Refused before anything is sharded (FSDP2 failed part-way on these, leaving the model half-sharded):
    layer = model.model.layers[0]
    with pytest.raises(ValueError, match="nested"):
        find_blocks(model, [layer, layer.mlp])  # outer first (inner first FSDP2 took)
    with pytest.raises(ValueError, match="twice"):
        find_blocks(model, [layer, layer])
    with pytest.raises(ValueError, match="LlamaRotaryEmbedding has no parameters"):
        find_blocks(model, [model.model.rotary_emb])
    with pytest.raises(ValueError, match="no parameters"):
        find_blocks(model, "LlamaRotaryEmbedding")
    shared = nn.Linear(2, 2)
    tied = nn.Sequential(nn.ModuleList([nn.Sequential(shared), nn.Sequential(shared, nn.Linear(2, 2))]))
    with pytest.raises(ValueError, match="share a parameter"):
        find_blocks(tied)


def test_bad_arguments_are_refused_by_name():
    from tiered.offload import offload_model

    model = llama(torch.float32)
    with pytest.raises(ValueError, match="enabled"):
        offload_model(model, enabled="sometimes")
    with pytest.raises(ValueError, match="keep_for_backward"):
        offload_model(model, keep_for_backward="yes")
    for bad in (-1, 1.5, "most"):
        with pytest.raises(ValueError, match="number of blocks"):
            offload_model(model, keep_for_backward=bad)
    with pytest.raises(TypeError, match="param_dtype"):
        offload_model(model, param_dtype="bf16")
    with pytest.raises(ValueError, match="device"):
        offload_model(model, device="meta")
    with pytest.raises(TypeError, match="nn.Module"):
        offload_model([torch.zeros(2)])
    with pytest.raises(TypeError, match="DeviceMesh"):
        offload_model(model, device="cpu", mesh="x")
    with pytest.raises(ValueError, match="gpu_budget"):
        offload_model(model, device="cpu", gpu_budget="lots")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            offload_model(model, device=0)
    assert not hasattr(model, "tiered_offload")  # nothing was done
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
            offload_model(model, device="cpu", pin_memory=True)
    with torch.device("meta"):
        on_meta = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)]))
    with pytest.raises(ValueError, match="to_empty"):
        offload_model(on_meta, device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only answer of enabled='auto'")
def test_auto_leaves_the_model_alone_without_a_gpu():
    import torch.distributed as dist

    from tiered.offload import offload_model

    model = llama(torch.float32)
    offload_model(model, enabled="auto")
    assert not model.tiered_offload.offloaded and not dist.is_initialized()
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert "no CUDA device" in model.tiered_offload.reason  # not "fit 60% of the GPU budget 0 B"


def test_auto_that_declined_leaves_an_explicit_offload_free():
    """A model ``enabled="auto"`` left alone was not offloaded: asking for the offload afterwards does it (it was
    refused as "already applied"), and the reason recorded for the first call names the device, not a budget."""
    import tiered.offload
    from tiered.offload import offload_model

    model = llama(torch.float32)
    offload_model(model, device="cpu", enabled="auto")
    assert not model.tiered_offload.offloaded
    reason = model.tiered_offload.reason
    assert ("is not a GPU" if torch.cuda.is_available() else "no CUDA device") in reason and "budget" not in reason
    try:
        offload_model(model, device="cpu")
        assert model.tiered_offload.offloaded and model.tiered_offload.blocks == LAYERS
        with pytest.raises(ValueError, match="already applied"):
            offload_model(model, device="cpu")
    finally:
        tiered.offload.close()


@pytest.mark.parametrize(
    "keep, evaluate, first",
    [(False, True, False), (False, "grad", False), (1, True, False), (False, False, True), (True, False, True),
     (False, "inference", "inference"), (True, "inference", "inference"), (1, False, "inference")],
    ids=["evaluate", "forward-unused", "evaluate-kept-last", "evaluate-first", "evaluate-first-kept",
         "inference-mode", "inference-mode-kept", "inference-mode-first-kept-last"],
)  # fmt: skip
def test_a_forward_without_backward_leaves_no_stale_weights(tmp_path, caplog, keep, evaluate, first):
    """A forward without backward keeps what it gathered: the root unit's weights (FSDP2 keeps the root's from
    forward to backward), and the blocks kept. Unless they are dropped, the step updates the host shards while
    the next forward runs on the stale copies, and an optimizer built after an evaluation holds the copies
    (with every block kept, all of them: it trained nothing). Bitwise the plain run, whatever came between, the
    evaluations' losses included; and no such pass is taken for one that failed part-way (offload/failed_pass.py).
    Under inference_mode too, before the first training forward (Lightning's sanity check): FSDP2's one-rank unshard
    failed there ("Inference tensors do not track version counter")."""
    offloaded_as_plain(tmp_path, keep, evaluate=evaluate, evaluate_first=first)
    assert not [r for r in caplog.records if "raised part-way" in r.getMessage()]


@pytest.mark.parametrize("keep", [False, True])
def test_state_dicts_after_an_evaluation_are_the_shards(keep):
    """After a forward under no_grad the model's parameters would be its gathered copies: ``state_dict`` would
    give them, ``load_state_dict`` would fail (a DTensor copied into a plain tensor). Both see the shards."""
    import tiered.offload
    from tiered.offload import offload_model

    x = micro_batch(0, 0)
    other = llama(torch.float32)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
        want = other(input_ids=x).logits
    model = llama(torch.float32)
    try:
        offload_model(model, device="cpu", keep_for_backward=keep)
        with torch.no_grad():
            model(input_ids=x)
        assert all(type(p) is not torch.nn.Parameter for p in model.parameters())  # the shards (DTensors)
        model.load_state_dict(other.state_dict())
        with torch.no_grad():
            assert torch.equal(model(input_ids=x).logits, want)
        got = model.state_dict()
        assert all(torch.equal(got[k], v) for k, v in other.state_dict().items())
    finally:
        tiered.offload.close()


def test_tied_embeddings_load_a_full_state_dict():
    """A model whose output head is its input embedding (tie_word_embeddings) has one parameter under two names:
    a full state dict (its own, a Lightning resume's) carries both, and each must become a shard to load."""
    import tiered.offload
    from tiered.offload import offload_model

    x = micro_batch(0, 0)
    other = llama(torch.float32, tie_word_embeddings=True)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
        want = other(input_ids=x).logits
    model = llama(torch.float32, tie_word_embeddings=True)
    try:
        offload_model(model, device="cpu")
        assert model.lm_head.weight is model.model.embed_tokens.weight
        model.load_state_dict(model.state_dict())
        model.load_state_dict(other.state_dict())
        with torch.no_grad():
            assert torch.equal(model(input_ids=x).logits, want)
    finally:
        tiered.offload.close()


@pytest.mark.parametrize("strict", [True, False])
def test_a_state_dict_of_another_shape_is_refused_as_without_offload(strict):
    """A tensor of another shape than its parameter's (a checkpoint of another config) is torch's "size mismatch",
    naming the checkpoint's shape, as without offload: labelled a DTensor of the parameter's shape it passed the
    check, and a ``[1]`` was broadcast into all of a ``[32]``. The weights are left as they were."""
    import tiered.offload
    from tiered.offload import offload_model

    bad = {"model.norm.weight": torch.full((1,), 2.0), "lm_head.weight": torch.zeros(3, 3)}
    plain = llama(torch.float32)
    model = llama(torch.float32)
    try:
        offload_model(model, device="cpu")
        before = {k: v.clone() for k, v in model.state_dict().items()}
        for key, value in bad.items():
            with pytest.raises(RuntimeError, match="size mismatch") as want:
                plain.load_state_dict({key: value}, strict=strict)
            with pytest.raises(RuntimeError, match="size mismatch") as got:
                model.load_state_dict({key: value}, strict=strict)
            assert f"torch.Size({list(value.shape)})" in str(got.value)
            mismatch = [line for line in str(want.value).splitlines() if "size mismatch" in line]
            assert all(line in str(got.value) for line in mismatch)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    finally:
        tiered.offload.close()


def test_a_root_module_called_outside_the_models_forward_is_refused_by_name(tmp_path):
    """The input embeddings called to build ``inputs_embeds``, or the backbone called alone, hold weights of the
    root unit, which FSDP2 gathers only in the model's forward: they failed inside torch ("mixed torch.Tensor and
    DTensor"). Each call says what to call instead, and the model trains on. Made inside the forward of a module
    that holds the model, offloaded in its place, the same calls train bitwise as without offload."""
    import tiered.offload
    from tiered import TieredOptimizer
    from tiered.offload import offload_model

    class WithEmbeds(torch.nn.Module):
        def __init__(self, llm: torch.nn.Module) -> None:
            super().__init__()
            self.llm = llm

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.llm(inputs_embeds=self.llm.get_input_embeddings()(ids), labels=ids).loss

    x = micro_batch(0, 0)
    model = llama(torch.float32)
    try:
        offload_model(model, device="cpu")
        with pytest.raises(RuntimeError, match=r"model\.embed_tokens \(Embedding\).*outside.*Call the model"):
            model.get_input_embeddings()(x)
        with pytest.raises(RuntimeError, match=r"model \(LlamaModel\).*outside.*Call the model"):
            model.model(input_ids=x)
        model(input_ids=x, labels=x).loss.backward()
    finally:
        tiered.offload.close()

    def train(offload: bool) -> list[torch.Tensor]:
        wrapped = WithEmbeds(llama(torch.float32))
        if offload:
            offload_model(wrapped, device="cpu")
        opt = TieredOptimizer(wrapped, nvme_path=str(tmp_path / str(offload)), lr=1e-2)
        try:
            for step in range(2):
                wrapped(micro_batch(step, 0)).backward()
                opt.step()
                opt.zero_grad()
            return [full(p) for p in wrapped.parameters()]
        finally:
            opt.close()
            tiered.offload.close()

    plain = run_bounded(lambda: train(False), RUN_TIMEOUT)
    off = run_bounded(lambda: train(True), RUN_TIMEOUT)
    assert all(torch.equal(a, b) for a, b in zip(plain, off, strict=True))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_layer_of_the_root_unit_recomputes_in_backward(reentrant):
    """A layer left in the root unit (``blocks=`` a subset) under activation checkpointing recomputes its forward in
    backward, after the model's forward has returned: its weights are gathered then, and the call goes on (the
    refusal of calls outside the forward, judged by where the call came from, refused it), bitwise as without
    offload."""
    import tiered.offload
    from tiered.offload import offload_model

    def grads(offload: bool) -> list[torch.Tensor]:
        model = llama(torch.float32)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        try:
            if offload:
                offload_model(model, device="cpu", blocks=[model.model.layers[0]])
            x = micro_batch(0, 0)
            model(input_ids=x, labels=x).loss.backward()
            return [full(p.grad) for p in model.parameters()]
        finally:
            tiered.offload.close()

    want = run_bounded(lambda: grads(False), RUN_TIMEOUT)
    got = run_bounded(lambda: grads(True), RUN_TIMEOUT)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_a_forward_refused_by_a_users_pre_hook_leaves_the_next_forward_working():
    """A user's input check, a pre-hook registered before offload_model, refuses one forward: torch still runs the
    forward hooks registered with ``always_call``, and a count of the forwards under way went below zero, so every
    later forward was refused as a call outside the model's forward."""
    import tiered.offload
    from tiered.offload import offload_model

    model = llama(torch.float32)

    def too_long(module, args, kwargs):
        if kwargs["input_ids"].shape[1] > SEQ:
            raise ValueError("sequence too long")

    model.model.register_forward_pre_hook(too_long, with_kwargs=True)
    try:
        offload_model(model, device="cpu")
        long = torch.zeros(2, SEQ + 1, dtype=torch.long)
        with pytest.raises(ValueError, match="too long"):
            model(input_ids=long, labels=long)
        x = micro_batch(0, 0)
        assert torch.isfinite(model(input_ids=x, labels=x).loss)
    finally:
        tiered.offload.close()


@pytest.mark.parametrize("kind", ["tiered", "torch"])
def test_an_optimizer_built_before_offload_model_is_refused_at_its_step(tmp_path, kind):
    """fully_shard makes new parameters: an optimizer built over the old ones saw no gradient and, silently,
    trained nothing. Its step now says so; one built after trains."""
    import tiered.offload
    from tiered import TieredOptimizer
    from tiered.offload import offload_model

    def make(model):
        if kind == "torch":
            return torch.optim.AdamW(model.parameters(), lr=1e-2)
        return TieredOptimizer(model, nvme_path=str(tmp_path), **KW)

    model = llama(torch.float32)
    early = make(model)
    try:
        offload_model(model, device="cpu")
        x = micro_batch(0, 0)
        model(input_ids=x, labels=x).loss.backward()
        with pytest.raises(RuntimeError, match="built over a model's parameters before offload_model"):
            early.step()
        late = make(model)
        before = {n: full(p).clone() for n, p in model.named_parameters()}
        late.step()
        assert all(not torch.equal(full(p), before[n]) for n, p in model.named_parameters())
        if kind == "tiered":
            late.close()
    finally:
        if kind == "tiered":
            early.close()
        tiered.offload.close()


def test_offload_model_lets_each_units_old_weights_go_before_it_shards_the_next(monkeypatch):
    """fully_shard moves a unit's weights to the device in place before it shards them to host memory, so the old
    parameters hold full copies there until they die. offload_model kept them all until its loop ended: on CUDA
    every block's weights at once (the 13.01B ran out of a 16 GB GPU inside offload_model). Each must be gone by
    the time the next unit is sharded (the same on CUDA: tests/gpu/test_offload_params_cuda.py)."""
    import weakref

    import torch.distributed.fsdp as fsdp

    import tiered.offload
    from tiered.offload import offload_model

    model = llama(torch.float32)
    units = list(model.model.layers)
    old = {id(u): [weakref.ref(p) for p in u.parameters()] for u in units}
    sharded, alive_at = [], []
    shard = fsdp.fully_shard

    def spy(unit, **kw):
        alive_at.append(sum(r() is not None for u in sharded for r in old[id(u)]))
        sharded.append(unit)
        return shard(unit, **kw)

    monkeypatch.setattr(fsdp, "fully_shard", spy)
    try:
        offload_model(model, device="cpu")
        assert len(sharded) == len(units) + 1  # the blocks, then the root
        assert alive_at == [0] * len(sharded)
    finally:
        tiered.offload.close()


class _Boom(Exception):
    pass


def _boom(*_):
    raise _Boom("out of memory, say")


def interrupted(nvme: str, *, offload: bool, where: str | None, then: str, no_sync: bool = False, device: str = "cpu",
                clip: float | None = 0.5, micro_batches: int = 2, failing: int = 0, **opt_kw) -> dict:  # fmt: skip
    """Three steps of ``micro_batches`` micro-batches; in the second step's micro-batch ``failing`` the ``where``
    ("backward": at the first layer's backward, the head's and the later layers' gradients made; "forward": at the
    second layer's forward; None: nowhere) raises part-way. ``then``: "skip" drops the batch
    (TieredOptimizer.zero_grad, and on to the next step), "model.zero_grad" the same through the model's, "keep"
    goes on to the next micro-batch, whose gradients add to what the failed backward made (as plain ``.grad``
    does), or to the step where it was the last. ``no_sync``: the offloaded model reduces the gradients in the
    last micro-batch of a step only (FSDP2's ``set_requires_gradient_sync``)."""
    import tiered.offload
    from tiered import TieredOptimizer

    model = llama(torch.float32)
    if offload:
        tiered.offload.offload_model(model, device=device)
    else:
        model.to(device)
    opt = TieredOptimizer(model, nvme_path=nvme, max_grad_norm=clip, **{**KW, **opt_kw})
    try:
        for step in range(3):
            for k in range(micro_batches):
                x = micro_batch(step, k).to(device)
                if offload and no_sync:
                    model.set_requires_gradient_sync(k == micro_batches - 1)
                if (step, k) == (1, failing):
                    if where is None:
                        model(input_ids=x, labels=x).loss.backward()
                    else:
                        layer = model.model.layers[0 if where == "backward" else 1]
                        hook = (layer.register_full_backward_pre_hook(_boom) if where == "backward"
                                else layer.register_forward_pre_hook(_boom))  # fmt: skip
                        with pytest.raises(_Boom):
                            model(input_ids=x, labels=x).loss.backward()
                        hook.remove()
                    if then == "skip":
                        opt.zero_grad()
                        break
                    if then == "model.zero_grad":
                        model.zero_grad()
                        break
                    continue
                model(input_ids=x, labels=x).loss.backward()
            else:
                opt.step()
                opt.zero_grad()
        return {n: digest(p) for n, p in model.named_parameters()}
    finally:
        opt.close()
        if offload:
            tiered.offload.close()


@pytest.mark.parametrize(
    "where, then", [("backward", "skip"), ("backward", "model.zero_grad"), ("backward", "keep"), ("forward", "skip")]
)
def test_a_pass_that_raised_part_way_is_dropped_or_kept_as_without_offload(tmp_path, caplog, where, then):
    """A forward or backward that raises part-way (out of memory) leaves FSDP2's bookkeeping of the pass undefined
    and the root's gradients on its gathered weights, where zero_grad does not reach them: offload/failed_pass.py
    puts it behind at zero_grad (dropping those gradients) or at the next forward (ending its backward, those
    gradients summed in for the next backward to add to), and says so once. Bitwise the run without offload
    either way."""
    plain = run_bounded(lambda: interrupted(str(tmp_path / "p"), offload=False, where=where, then=then), RUN_TIMEOUT)
    off = run_bounded(lambda: interrupted(str(tmp_path / "o"), offload=True, where=where, then=then), RUN_TIMEOUT)
    assert off == plain
    said = [r.getMessage() for r in caplog.records if "raised part-way" in r.getMessage()]
    assert len(said) == 1 and ("dropped" if then != "keep" else "kept") in said[0]


@pytest.mark.parametrize("where", ["backward", "forward"])
@pytest.mark.parametrize(
    "micro_batches, failing", [(3, 1), (2, 1), (3, 2)], ids=["then-the-next", "then-the-step", "last-of-three"]
)
def test_a_kept_pass_that_raised_after_the_first_micro_batch_is_bitwise_as_without_offload(
    tmp_path, caplog, where, micro_batches, failing
):
    """A pass that raised part-way in a later micro-batch, its gradients kept: plain ``.grad`` holds the earlier
    micro-batches' sum plus what the failed backward made, and the next backward adds to that sum, or the step
    takes it (a loop that catches an out-of-memory error in its last micro-batch and steps anyway). The offloaded
    model ends the failed backward where it stopped before the next forward or any optimizer's step: the
    gradients no reduction took yet (the root unit's: head, final norm) are reduced into the held sums then, in
    plain ``.grad``'s order. Bitwise the run without offload; said once, and where."""
    kw = dict(where=where, then="keep", micro_batches=micro_batches, failing=failing)
    plain = run_bounded(lambda: interrupted(str(tmp_path / "p"), offload=False, **kw), RUN_TIMEOUT)
    off = run_bounded(lambda: interrupted(str(tmp_path / "o"), offload=True, **kw), RUN_TIMEOUT)
    assert off == plain
    said = [r.getMessage() for r in caplog.records if "raised part-way" in r.getMessage()]
    assert len(said) == 1 and "kept" in said[0], said
    assert ("optimizer step" if failing == micro_batches - 1 else "next forward") in said[0]


def sgd_plain_and_offloaded(body) -> tuple[dict, dict]:
    """``body(model, opt, offloaded)`` on a tiny Llama with torch's SGD, not offloaded, then offloaded to the CPU: the
    weights' digests after each."""
    import tiered.offload

    def run(offload: bool) -> dict:
        model = llama(torch.float32)
        if offload:
            tiered.offload.offload_model(model, device="cpu")
        try:
            body(model, torch.optim.SGD(model.parameters(), lr=0.5), offload)
            return {n: digest(p) for n, p in model.named_parameters()}
        finally:
            if offload:
                tiered.offload.close()

    return run_bounded(lambda: run(False), RUN_TIMEOUT), run_bounded(lambda: run(True), RUN_TIMEOUT)


def backward_raising(model: torch.nn.Module, x: torch.Tensor) -> None:
    """A backward that raises part-way, in the first block (out of memory, say)."""
    hook = model.model.layers[0].register_full_backward_pre_hook(_boom)
    with pytest.raises(_Boom):
        model(input_ids=x, labels=x).loss.backward()
    hook.remove()


def test_a_torch_optimizer_steps_with_a_failed_backwards_gradients_as_without_offload():
    """Any optimizer's step (torch's SGD here) right after a backward that raised part-way takes the gradients that
    backward made, as plain ``.grad`` holds them, the root unit's not yet reduced included."""

    def body(model, opt, offloaded) -> None:
        x = micro_batch(0, 0)
        model(input_ids=x, labels=x).loss.backward()
        backward_raising(model, micro_batch(0, 1))
        opt.step()
        opt.zero_grad()

    plain, off = sgd_plain_and_offloaded(body)
    assert off == plain


def test_a_failed_pass_whose_end_raised_is_refused_until_zero_grad_then_trains_as_without_offload(monkeypatch):
    """The end of a failed backward (at the next step or forward) that raises part-way itself (out of memory in its
    reduce) leaves sums taken and never handed back: a retry summed without them (the root unit's earlier
    micro-batches' gradients lost, silently). Every step or forward over the model is refused until zero_grad
    skips the batch; the run then goes on as the plain run that skipped it."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    def body(model, opt, offloaded) -> None:
        x = micro_batch(0, 0)
        model(input_ids=x, labels=x).loss.backward()
        backward_raising(model, micro_batch(0, 1))
        if offloaded:
            real, calls = FSDPParamGroup.post_backward, []

            def oom_at_the_second(self, *args, **kw):
                calls.append(1)
                if len(calls) == 2:
                    raise RuntimeError("out of memory, say")
                return real(self, *args, **kw)

            with monkeypatch.context() as m:
                m.setattr(FSDPParamGroup, "post_backward", oom_at_the_second)
                with pytest.raises(RuntimeError, match="out of memory, say"):
                    opt.step()
            for again in (opt.step, lambda: model(input_ids=x)):
                with pytest.raises(RuntimeError, match="could not be ended.*zero_grad"):
                    again()
        model.zero_grad()  # the batch skipped (torch's SGD.zero_grad knows nothing of the model's failed pass)
        for k in (2, 3):
            x = micro_batch(0, k)
            model(input_ids=x, labels=x).loss.backward()
        opt.step()

    plain, off = sgd_plain_and_offloaded(body)
    assert off == plain


@pytest.mark.parametrize("where", [None, "backward"], ids=["healthy", "raised"])
@pytest.mark.parametrize("then", ["keep", "skip", "model.zero_grad"])
def test_no_sync_accumulation_is_no_failed_pass_and_trains_as_without_offload(tmp_path, caplog, where, then):
    """FSDP2's no-sync accumulation (``set_requires_gradient_sync(False)`` on all micro-batches but the last) leaves
    the gradients on the gathered weights after a backward that ended well, on purpose: no failed pass is said
    (nor FSDP2's state reset), a zero_grad drops them as it drops plain ``.grad``, and the run is bitwise the one
    without offload. A pass that raised under no-sync is said once, as without it."""
    plain = run_bounded(lambda: interrupted(str(tmp_path / "p"), offload=False, where=where, then=then), RUN_TIMEOUT)
    off = run_bounded(lambda: interrupted(str(tmp_path / "o"), offload=True, where=where, then=then, no_sync=True),
                      RUN_TIMEOUT)  # fmt: skip
    assert off == plain
    said = [r.getMessage() for r in caplog.records if "raised part-way" in r.getMessage()]
    assert len(said) == (0 if where is None else 1), said


def test_a_failed_pass_is_put_behind_on_a_torch_without_reset_iter_state(tmp_path, monkeypatch):
    """torch before 2.14 has no FSDPModule.reset_iter_state: the fields it resets are reset one by one."""
    from torch.distributed.fsdp import FSDPModule

    if hasattr(FSDPModule, "reset_iter_state"):
        monkeypatch.delattr(FSDPModule, "reset_iter_state")
    plain = run_bounded(lambda: interrupted(str(tmp_path / "p"), offload=False, where="backward", then="skip"),
                        RUN_TIMEOUT)  # fmt: skip
    off = run_bounded(lambda: interrupted(str(tmp_path / "o"), offload=True, where="backward", then="skip"),
                      RUN_TIMEOUT)  # fmt: skip
    assert off == plain


@pytest.mark.parametrize("write", ["load_state_dict", "in place"])
def test_a_write_between_steps_is_kept_by_split_masters_as_without_offload(tmp_path, write):
    """A write into the offloaded model's weights between steps (a load_state_dict, an in-place write under no_grad:
    ops on its DTensors, which move their own version counters, not their local tensors'), with split masters:
    the masters become the written weights, and the run is bitwise the plain run's with whole fp32 masters."""
    plain = run(tmp_path, "plain", offload=False, write=write, split_masters=False)
    off = run(tmp_path, "off", offload=True, write=write, split_masters=True)
    assert plain["masters_written"] and off["masters_written"]
    assert off["losses"] == plain["losses"]
    assert_bitwise(off, plain)


def test_a_resume_in_a_new_process_is_bitwise_the_straight_run(tmp_path):
    straight = run(tmp_path, "straight", offload=False, steps=(0, 4))
    ckpt = tmp_path / "ckpt"
    child(tmp_path, "first", offload=True, steps=[0, 2], save=str(ckpt))
    resumed = child(tmp_path, "second", offload=True, steps=[2, 4], load=str(ckpt))
    assert resumed["losses"] == straight["losses"][4:]
    assert_bitwise(resumed, straight)


@pytest.mark.parametrize(
    "first, then", [(True, False), (False, True)], ids=["offloaded-then-plain", "plain-then-offloaded"]
)
def test_state_dicts_resume_with_or_without_offload_bitwise(tmp_path, first, then):
    """A framework's checkpoint (the model's and the optimizer's state dicts, as HF Trainer saves them) from an
    offloaded run resumes without offload and the other way round: with ``enabled="auto"`` whether a model is
    offloaded depends on the machine's GPU. The offloaded optimizer's state holds one-rank DTensors."""
    straight = run(tmp_path, "straight", offload=False, steps=(0, 4))
    dicts = str(tmp_path / "dicts.pt")
    run(tmp_path, "first", offload=first, steps=(0, 2), save_dicts=dicts)
    resumed = run(tmp_path, "then", offload=then, steps=(2, 4), load_dicts=dicts)
    assert resumed["losses"] == straight["losses"][4:]
    assert_bitwise(resumed, straight)


def test_a_state_sharded_over_ranks_is_refused_by_an_optimizer_over_plain_parameters(tmp_path, monkeypatch):
    import tiered.optim.shards as shards
    from tiered import TieredOptimizer

    class TwoRankShard:  # what a DTensor of a two-rank mesh answers (two ranks need two processes)
        device_mesh = type("Mesh", (), {"size": lambda self: 2})()

    monkeypatch.setattr(shards, "is_sharded", lambda t: isinstance(t, TwoRankShard))
    model = llama(torch.float32)
    with TieredOptimizer(model, nvme_path=str(tmp_path), **KW) as opt:
        x = micro_batch(0, 0)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        sd = opt.state_dict()
        sd["state"][0]["exp_avg"] = TwoRankShard()
        with pytest.raises(ValueError, match=r"'exp_avg' is sharded over 2 ranks .*\(save_checkpoint"):
            opt.load_state_dict(sd)


def _two_ranks(rank: int, world: int, nvme: str, offload: bool, on_device: bool = False, room: bool = False,
               infer: bool = False) -> dict:  # fmt: skip
    """Under the user's own process group of two ranks: offload_model shards over it, makes none; two
    micro-batches a step, so the offloaded run's sums (offload/accumulation.py) are of sharded gradients, made on
    the worker or (``on_device``) in FSDP2's reduced shards as on a GPU. ``room``: keep_for_backward="room",
    rank 0 with room for the last block's weights, rank 1 for all (so, kept alone, rank 1 would not gather the
    blocks rank 0 gathers for backward, and the two would wait on each other). ``infer``: an evaluation under
    inference_mode before the first step and before each step (FSDP2 alone fails the training forward after the
    first: its unsharded weights made as inference tensors)."""
    from torch.distributed.fsdp import fully_shard

    import tiered.offload.accumulation as acc
    from tiered import TieredOptimizer
    from tiered.offload import offload_model
    from tiered.offload.kept_weights import KeptWeights

    acc.SUM_ON_DEVICE = on_device or None
    if room:
        KeptWeights.room = lambda self: self.sizes[-1] if rank == 0 else 1 << 62  # type: ignore[method-assign]

    model = llama(torch.float32)
    if offload:
        offload_model(model, device="cpu", keep_for_backward="room" if room else "auto")
        assert not model.tiered_offload.made_process_group and model.tiered_offload.world_size == 2
    else:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    evaluations = []
    with TieredOptimizer(model, nvme_path=f"{nvme}/{int(offload)}", max_grad_norm=0.5, **KW) as opt:
        for step in range(2):
            if infer:
                with torch.inference_mode():
                    x = micro_batch(step, 9)
                    evaluations.append(model(input_ids=x, labels=x).loss.item())
            for k in range(2):
                x = micro_batch(step, 2 * rank + k)
                model(input_ids=x, labels=x).loss.backward()
            if offload and on_device:
                sums = model.tiered_accumulation.stats()
                assert sums["bytes_summed_on_device"] == sums["bytes_summed"] > 0
            opt.step()
            opt.zero_grad()
    if room:  # sized after two backwards (the first step's), the least of the two ranks' counts
        assert model.tiered_kept_weights.count == 1
    return {n: digest(p) for n, p in model.named_parameters()} | ({"evaluations": evaluations} if infer else {})


def test_under_a_larger_world_it_shards_over_the_users_group(tmp_path):
    from distributed_common import run_ranks

    off = run_ranks(_two_ranks, 2, str(tmp_path), True)
    ref = run_ranks(_two_ranks, 2, str(tmp_path), False)
    assert off[0] == off[1] and off == ref  # every rank the same full weights, those of FSDP2 without offload
    on_device = run_ranks(_two_ranks, 2, str(tmp_path / "on_device"), True, True)
    assert on_device == ref  # the shards' sums made in FSDP2's reduced shards, as on a GPU
    room = run_ranks(_two_ranks, 2, str(tmp_path / "room"), True, False, True)
    assert room == ref  # the last block kept on both ranks, as the rank with less room allows
    infer = run_ranks(_two_ranks, 2, str(tmp_path / "infer"), True, False, False, True)
    assert [{k: v for k, v in r.items() if k != "evaluations"} for r in infer] == ref  # evaluations change nothing
    assert infer[0]["evaluations"] == infer[1]["evaluations"]  # each over the same weights


def _two_ranks_failed(rank: int, world: int, nvme: str, offload: bool, no_sync: bool, failing: int) -> dict:
    """Two ranks, three micro-batches a step; in the second step's micro-batch ``failing`` the backward raises on
    both ranks at the first layer's, its gradients kept. Without offload (the reference) FSDP2's own end of
    backward is run on the failed pass at once (``keep_failed_pass`` with the settings it ran with)."""
    from torch.distributed.fsdp import fully_shard

    from tiered import TieredOptimizer
    from tiered.offload import offload_model
    from tiered.offload.failed_pass import keep_failed_pass, settings

    model = llama(torch.float32)
    if offload:
        offload_model(model, device="cpu")
    else:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    with TieredOptimizer(model, nvme_path=f"{nvme}/{int(offload)}", max_grad_norm=0.5, **KW) as opt:
        for step in range(3):
            for k in range(3):
                if no_sync:
                    model.set_requires_gradient_sync(k == 2)
                x = micro_batch(step, 3 * rank + k)
                if (step, k) != (1, failing):
                    model(input_ids=x, labels=x).loss.backward()
                    continue
                hook = model.model.layers[0].register_full_backward_pre_hook(_boom)
                with pytest.raises(_Boom):
                    model(input_ids=x, labels=x).loss.backward()
                hook.remove()
                if not offload:
                    assert keep_failed_pass(model, settings(model))
            opt.step()
            opt.zero_grad()
    return {n: digest(p) for n, p in model.named_parameters()}


@pytest.mark.parametrize("no_sync, failing", [(True, 1), (False, 2)], ids=["no-sync-then-the-next", "then-the-step"])
def test_a_kept_failed_pass_over_two_ranks_is_ended_as_it_ran(tmp_path, no_sync, failing):
    """Over two ranks the reduction is an average, so when a failed pass's gradients are reduced shows in the bits:
    the offloaded model ends a failed backward with the settings it ran with, not those the loop set for the next
    micro-batch since (no-sync: the next forward's ``set_requires_gradient_sync(True)`` would reduce them apart
    from the last micro-batch's), and before the step where the pass was the last. Bitwise FSDP2 without offload
    whose failed backward was ended at once; every rank the same."""
    from distributed_common import run_ranks

    off = run_ranks(_two_ranks_failed, 2, str(tmp_path), True, no_sync, failing)
    ref = run_ranks(_two_ranks_failed, 2, str(tmp_path), False, no_sync, failing)
    assert off[0] == off[1] and off == ref


def child(tmp_path: Path, name: str, **kw) -> dict:
    nvme = tmp_path / name
    nvme.mkdir()
    out = tmp_path / f"{name}.json"
    args = json.dumps({"nvme": str(nvme), "out": str(out), **kw})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS_ROOT, os.environ.get("PYTHONPATH", "")])}  # helpers
    proc = subprocess.run([sys.executable, __file__, args], capture_output=True, text=True, timeout=RUN_TIMEOUT,
                          env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


BIG_MODEL = Path(__file__).resolve().parents[3] / "examples" / "big_model.py"
TOY = "--device cpu --hidden 64 --layers 2 --heads 4 --inter 128 --vocab 256 --seq 32 --steps 4 --accumulate 2".split()


def test_big_model_example_trains_offloaded_on_the_cpu_stand_in(tmp_path):
    """The example's offloaded run on the CPU stand-in, with the weights streamed again for backward
    (``--keep-for-backward off``, what ``auto`` gives on the CPU) and kept from forward to backward (``on``): the
    same losses either way."""
    losses = {}
    for keep in ("off", "on"):
        out = tmp_path / f"run-{keep}.json"
        cmd = [sys.executable, str(BIG_MODEL), *TOY, "--offload", "on", "--nvme-path", str(tmp_path / f"state-{keep}"),
               "--host-budget", "1MiB", "--chunk-bytes", "64KiB", "--lr", "1e-3", "--json", str(out),
               "--keep-for-backward", keep]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "LlamaDecoderLayer blocks streamed to cpu" in proc.stderr
        assert ("(kept from forward to backward)" in proc.stdout) is (keep == "on")
        res = json.loads(out.read_text())
        assert res["offload"] and res["gpu_budget"] == 0 and res["state"]["split_masters"]
        assert res["state"]["nvme"]["bytes_read"] > 0  # part of the state streams through the disk
        assert res["link"] is None and "link" not in proc.stdout  # no PCIe on the stand-in to hold the bytes against
        losses[keep] = res["losses"]
        assert len(losses[keep]) == 4 and losses[keep][-1] < losses[keep][0], losses
    assert losses["on"] == losses["off"]


@pytest.mark.parametrize("flag", [["--host-budget", "12XB"], ["--chunk-bytes", "-1"]])
def test_big_model_example_reports_a_bad_size_in_one_line(tmp_path, flag):
    cmd = [sys.executable, str(BIG_MODEL), *TOY, "--nvme-path", str(tmp_path / "state"), *flag]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("big_model.py: error:"), proc.stderr


if __name__ == "__main__":  # a child of the resume test: train, write the result as JSON
    a = json.loads(sys.argv[1])
    nvme, out = a.pop("nvme"), a.pop("out")
    a["steps"] = tuple(a["steps"])
    Path(out).write_text(json.dumps(train(nvme, **a)))


def test_big_model_example_draws_the_host_init_on_all_cores_the_same_for_any_thread_count():
    """The model made on the host for offloading skips torch's and transformers' one-core init and draws
    normal(0, initializer_range) on every core, each piece from its own seeded generator."""
    import argparse
    import importlib.util
    from concurrent import futures

    spec = importlib.util.spec_from_file_location("big_model_example", BIG_MODEL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = argparse.Namespace(vocab=512, hidden=256, inter=512, layers=2, heads=4, kv_heads=None, seq=64, seed=3,
                              checkpointing=False)  # fmt: skip
    a = mod.build_model(args, torch.device("cpu"))
    real = futures.ThreadPoolExecutor
    try:  # one thread instead of all the cores: the same weights
        mod.ThreadPoolExecutor = lambda n: real(1)
        b = mod.build_model(args, torch.device("cpu"))
    finally:
        mod.ThreadPoolExecutor = real
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
        if p.dim() >= 2:
            assert abs(p.float().std().item() - a.config.initializer_range) < 2e-3, name
        else:  # the norms' weights, as constructed
            assert torch.equal(p, torch.ones_like(p)), name
