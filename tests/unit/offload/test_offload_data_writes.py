"""``param.data = tensor`` on an offloaded model's parameters, on the CPU stand-in.

FSDP2's parameter is a DTensor: a wrapper around its local tensor, the host shard FSDP2 copies up and the optimizer
updates. ``p.data = t`` (torch's ``set_data``) swaps the wrapper's own storage and leaves that local tensor alone:
training went on with the old weights, silently, where the model without offload (and a TieredOptimizer over it)
keeps the write. The write is now copied into the shard at the model's next forward, any optimizer's step, a
``state_dict``/``load_state_dict`` or a conversion, bitwise the run without offload given the same write; one that
cannot be taken (no values of its own to copy: a DTensor; another shape or dtype; a shard over several ranks) is
refused there, by the parameter's name, with the way round, the parameter left as it was before the assignment.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import run_bounded
from test_offload_params import KW, RUN_TIMEOUT, full, llama, micro_batch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")

# Parameters of the root unit (embeddings, final norm) and of a block, written by the tests.
WRITTEN = ("model.embed_tokens.weight", "model.norm.weight", "model.layers.1.mlp.up_proj.weight")


def whole(p: torch.Tensor) -> torch.Tensor:
    """The parameter's values as a plain tensor of its dtype, a copy (what a user holds: a shadow, a backup)."""
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def written(name: str, p: torch.Tensor) -> torch.Tensor:
    """The plain tensor assigned to ``p``: new values of its shape and dtype."""
    if name.endswith("norm.weight"):
        return torch.full(p.shape, 0.3, dtype=p.dtype)
    return whole(p) * 0.5 + 0.01


def assign(model: torch.nn.Module) -> None:
    params = dict(model.named_parameters())
    for name in WRITTEN:
        params[name].data = written(name, params[name])


def train(nvme: str, *, offload: bool, dtype: str, when: str, write: Callable = assign, steps: int = 3) -> dict:
    """Three steps of two micro-batches, clipped, with ``write(model)`` at ``when``: ``"first"`` (after
    offload_model and the optimizer, before the first forward), ``"between"`` (between steps, before the second
    step's forward), ``"each step"`` (before the second's and the third's) or ``"before step"`` (between the second
    step's backward and its step). Returns the weights' bits and the losses."""
    import tiered.offload
    from tiered import TieredOptimizer

    model = llama(getattr(torch, dtype))
    if offload:
        tiered.offload.offload_model(model, device="cpu")
    opt = TieredOptimizer(model, nvme_path=nvme, max_grad_norm=0.5, **KW)
    losses = []
    try:
        if when == "first":
            write(model)
        for step in range(steps):
            if when == "between" and step == 1 or when == "each step" and step:
                write(model)
            for k in range(2):
                x = micro_batch(step, k)
                loss = model(input_ids=x, labels=x).loss / 2
                loss.backward()
                losses.append(loss.item())
            if when == "before step" and step == 1:
                write(model)
            opt.step()
            opt.zero_grad()
        weights = {n: full(p) for n, p in model.named_parameters()}
    finally:
        opt.close()
        if offload:
            tiered.offload.close()
    return {"weights": weights, "losses": losses}


def run(tmp_path: Path, name: str, **kw) -> dict:
    nvme = tmp_path / name
    nvme.mkdir()
    return run_bounded(lambda: train(str(nvme), **kw), timeout=RUN_TIMEOUT)


def assert_bitwise(off: dict, plain: dict) -> None:
    assert off["losses"] == plain["losses"]
    assert off["weights"].keys() == plain["weights"].keys()
    differ = [n for n in plain["weights"] if not torch.equal(off["weights"][n], plain["weights"][n])]
    assert not differ, f"weights differ in {differ}"


@pytest.mark.parametrize("when", ["first", "between", "before step"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_data_assignment_is_taken_bitwise_as_without_offload(tmp_path, dtype, when):
    """A plain tensor assigned through ``.data`` to a root parameter and a block's, before the first forward,
    between steps, or between backward and step: the next forward and the step use it, and the run is bitwise
    the run without offload given the same write."""
    plain = run(tmp_path, "plain", offload=False, dtype=dtype, when=when)
    off = run(tmp_path, "off", offload=True, dtype=dtype, when=when)
    assert_bitwise(off, plain)
    # The comparison can fail: without the write the weights are others.
    unwritten = run(tmp_path, "unwritten", offload=False, dtype=dtype, when=when, write=lambda model: None)
    assert not torch.equal(unwritten["weights"]["model.norm.weight"], plain["weights"]["model.norm.weight"])


def ema_swap(shadow: dict[str, torch.Tensor], losses: list[float], evaluate: Callable, alias: bool = False) -> Callable:
    """An evaluation on the EMA weights (under ``evaluate()``), swapped in and back out through ``.data`` with
    plain tensors; ``alias``: the training weights kept as ``backup = p.data`` (on an offloaded model a DTensor on
    the parameter's own local tensor, which the shadow is copied into)."""

    def write(model: torch.nn.Module) -> None:
        params = dict(model.named_parameters())
        backup = {n: p.data if alias else whole(p) for n, p in params.items()}
        for n, p in params.items():
            p.data = shadow[n]
        with evaluate():
            x = micro_batch(9, 0)
            losses.append(model(input_ids=x, labels=x).loss.item())
        for n, p in params.items():
            p.data = backup[n]

    return write


@pytest.mark.parametrize("alias", [False, True], ids=["backup copied", "backup = p.data"])
@pytest.mark.parametrize("evaluate", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_an_ema_swap_through_data_evaluates_the_shadow_and_trains_on_as_without_offload(tmp_path, evaluate, alias):
    shadow = {n: whole(p) * 0.9 for n, p in llama(torch.bfloat16).named_parameters()}
    evals: dict[bool, list[float]] = {False: [], True: []}
    runs = {}
    for offload in (False, True):
        swap = ema_swap(shadow, evals[offload], evaluate, alias)
        runs[offload] = run(tmp_path, str(offload), offload=offload, dtype="bfloat16", when="between", write=swap)
    assert_bitwise(runs[True], runs[False])
    assert len(evals[True]) == 1 and evals[True] == evals[False]
    trained = run(tmp_path, "no-eval", offload=True, dtype="bfloat16", when="between", write=lambda model: None)
    assert_bitwise(runs[True], trained)  # the swap back restored the training weights exactly


def ema_swaps(shadow: dict[str, torch.Tensor], losses: list[float], how: str) -> Callable:
    """Evaluations on averaged weights swapped in and out through ``.data``, the training weights kept as ``backup =
    p.data``, chained as users chain them: ``"twice"`` (two evaluations in a row, the swap back of the first not yet
    taken when the second's ``backup = p.data`` and swap begin), ``"two shadows"`` (one backup, the EMA then an SWA
    average evaluated in turn, then the swap back) or ``"backup kept"`` (the backups taken once, at the first call,
    and swapped back at each: across steps)."""
    kept: dict[str, torch.Tensor] = {}

    def evaluate(model: torch.nn.Module, k: int) -> None:
        with torch.no_grad():
            x = micro_batch(9, k)
            losses.append(model(input_ids=x, labels=x).loss.item())

    def swap_in(params: dict[str, torch.Tensor], scale: float) -> None:
        for n, p in params.items():
            p.data = shadow[n] * scale

    def swap_back(params: dict[str, torch.Tensor], backup: dict[str, torch.Tensor]) -> None:
        for n, p in params.items():
            p.data = backup[n]

    def write(model: torch.nn.Module) -> None:
        params = dict(model.named_parameters())
        if how == "backup kept":
            kept.update(kept or {n: p.data for n, p in params.items()})
            swap_in(params, 1.0)
            evaluate(model, 0)
            swap_back(params, kept)
        elif how == "twice":
            for k in range(2):
                backup = {n: p.data for n, p in params.items()}  # the second: the first swap back not taken yet
                swap_in(params, 1.0)
                evaluate(model, k)
                swap_back(params, backup)
        else:
            backup = {n: p.data for n, p in params.items()}
            for k, scale in enumerate((1.0, 0.5)):
                swap_in(params, scale)
                evaluate(model, k)
            swap_back(params, backup)

    return write


@pytest.mark.parametrize("how", ["twice", "two shadows", "backup kept"])
def test_ema_swaps_chained_through_data_restore_the_training_weights_as_without_offload(tmp_path, how):
    """Each ``p.data = backup`` brings back the weights ``backup = p.data`` was taken from, however the swaps are
    chained: the run (its evaluations too) is bitwise the run without offload, and the training weights are those
    of the run without evaluations."""
    shadow = {n: whole(p) * 0.9 for n, p in llama(torch.bfloat16).named_parameters()}
    evals: dict[bool, list[float]] = {False: [], True: []}
    runs = {}
    for offload in (False, True):
        swaps = ema_swaps(shadow, evals[offload], how)
        runs[offload] = run(tmp_path, str(offload), offload=offload, dtype="bfloat16", when="each step", write=swaps)
    assert_bitwise(runs[True], runs[False])
    assert len(evals[True]) == (2 if how == "backup kept" else 4) and evals[True] == evals[False]
    trained = run(tmp_path, "no-eval", offload=True, dtype="bfloat16", when="each step", write=lambda model: None)
    assert_bitwise(runs[True], trained)


def offloaded(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    import tiered.offload

    model = llama(dtype)
    tiered.offload.offload_model(model, device="cpu")
    return model


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=micro_batch(0, 0)).logits


def test_a_taken_write_lands_in_the_pinned_shard_and_leaves_the_wrapper_as_it_was():
    """The write is copied into the parameter's local tensor, in its slab (not a new tensor), and the wrapper is
    restored: no storage of its own (``data_ptr() == 0``), the shape and dtype of the parameter. A strided tensor is
    taken with its strides."""
    import tiered.offload

    model, plain = offloaded(), llama(torch.float32)
    try:
        p, q = model.model.norm.weight, plain.model.norm.weight
        local = p.to_local().data_ptr()
        p.data = torch.arange(64, dtype=torch.float32)[::2]
        q.data = torch.arange(0, 64, 2, dtype=torch.float32)
        assert p.data_ptr() != 0  # the detector: the wrapper got the tensor's storage
        assert torch.equal(logits(model), logits(plain))
        assert p.data_ptr() == 0 and p.shape == (32,) and p.dtype == torch.float32
        assert p.to_local().data_ptr() == local and torch.equal(p.to_local(), q)
        assert any(slab.holds(p.to_local()) for slab in model.tiered_slabs)
        p.data = torch.ones(32)
        with torch.inference_mode():  # an evaluation's: the wrapper made again is no inference tensor
            model(input_ids=micro_batch(0, 0))
        assert torch.equal(p.to_local(), torch.ones(32)) and not p.is_inference()
        shadow = p.detach().clone() * 3  # a DTensor: copied in place, the way round its refusal names
        with torch.no_grad():
            p.copy_(shadow)
        assert torch.equal(p.to_local(), torch.full((32,), 3.0)) and p.data_ptr() == 0
    finally:
        tiered.offload.close()


def test_state_dicts_and_conversions_see_an_assignment_as_without_offload():
    """``state_dict()`` after ``p.data = t`` holds ``t``; a ``load_state_dict`` after it wins over it; a cast after
    it casts ``t``, as without offload."""
    import tiered.offload

    name = "model.layers.0.self_attn.q_proj.weight"
    model, plain = offloaded(), llama(torch.float32)
    try:
        for m in (model, plain):
            before = {k: v.clone() for k, v in m.state_dict().items()}
            p = m.get_parameter(name)
            t = torch.full(p.shape, 0.25)
            p.data = t
            assert torch.equal(m.state_dict()[name], t)
            p.data = t * 2
            m.load_state_dict(before)
            assert torch.equal(m.state_dict()[name], before[name])
            p.data = t * 3
            m.to(torch.bfloat16)  # before the first forward: a cast offload_model lays out again
            assert torch.equal(full(m.get_parameter(name)), (t * 3).to(torch.bfloat16).float())
        assert torch.equal(logits(model), logits(plain))
    finally:
        tiered.offload.close()


def test_a_tensor_sharing_the_weights_reads_a_taken_assignment_and_a_clone_keeps_them():
    """The difference docs/offload.md names: ``model.state_dict()``'s tensors taken without a clone, and
    ``p.to_local()``, are views of the host shard, so once ``p.data = t`` is taken they read ``t``, where without
    offload (``p.detach()`` there) they keep the old tensor's values; the way round it names, a clone, keeps them,
    and loading it brings them back as without offload."""
    import tiered.offload

    name = WRITTEN[2]
    model, plain = offloaded(), llama(torch.float32)
    try:
        for m, offload in ((model, True), (plain, False)):
            p = m.get_parameter(name)
            old, t = whole(p), torch.full(p.shape, 0.25)
            sd = m.state_dict()
            cloned = {k: v.clone() for k, v in sd.items()}
            shared = p.to_local() if offload else p.detach()
            p.data = t
            logits(m)  # taken
            assert torch.equal(sd[name], t if offload else old) and torch.equal(shared, t if offload else old)
            m.load_state_dict(cloned)
            assert torch.equal(whole(p), old)
        assert torch.equal(logits(model), logits(plain))
    finally:
        tiered.offload.close()


def test_an_ema_swap_on_one_model_spanning_another_models_step_gets_its_weights_back():
    """Two offloaded models: an evaluation of B on its EMA weights (``backup = p.data``) that spans a step of A's
    optimizer. A's step is no step of B's: B's swap back restores B's training weights, as without offload."""
    import tiered.offload

    a, b = offloaded(), offloaded()
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    try:
        p = b.model.norm.weight
        trained, out = whole(p), logits(b)
        backup = p.data
        p.data = torch.full(p.shape, 0.5)
        assert not torch.equal(logits(b), out)  # evaluated on the shadow
        x = micro_batch(1, 0)
        a(input_ids=x, labels=x).loss.backward()
        opt_a.step()  # A trains meanwhile
        p.data = backup
        assert torch.equal(logits(b), out) and torch.equal(whole(p), trained)
    finally:
        tiered.offload.close()


def test_an_optimizers_saves_leave_another_models_assignment_to_that_model(tmp_path):
    """Two offloaded models: an assignment on B that cannot be taken is no business of A's TieredOptimizer, whose
    ``save_checkpoint`` and ``state_dict`` go on; B's own next read refuses it by name."""
    import tiered.offload
    from tiered import TieredOptimizer

    a, b = offloaded(), offloaded()
    opt_a = TieredOptimizer(a, nvme_path=str(tmp_path / "a"), **KW)
    try:
        p = b.model.norm.weight
        p.data = dtensor_shadow(p)
        opt_a.save_checkpoint(str(tmp_path / "ck"))
        opt_a.state_dict()
        with pytest.raises(RuntimeError, match=r"'model\.norm\.weight'.*no values of its own"):
            logits(b)
    finally:
        opt_a.close()
        tiered.offload.close()


def dtensor_shadow(p: torch.Tensor) -> torch.Tensor:
    return (p.detach().clone() * 3).data  # an EMA shadow made from the offloaded parameter: a DTensor


REFUSED = {  # what is assigned -> what the refusal says
    "a DTensor": (dtensor_shadow, r"no values of its own"),
    "another shape": (lambda p: torch.ones(33), r"shape \[33\].*\[32\]"),
    "another dtype": (lambda p: torch.ones(32, dtype=torch.float64), r"torch.float64.*torch.float32"),
}


@pytest.mark.parametrize("at", ["forward", "step", "state_dict"])
@pytest.mark.parametrize("what", list(REFUSED))
def test_an_assignment_that_cannot_be_taken_is_refused_by_name_and_the_model_left_as_it_was(tmp_path, what, at):
    import tiered.offload
    from tiered import TieredOptimizer

    make, says = REFUSED[what]
    model = offloaded()
    opt = TieredOptimizer(model, nvme_path=str(tmp_path), **KW)
    try:
        x = micro_batch(0, 0)
        model(input_ids=x, labels=x).loss.backward()
        p = model.model.norm.weight
        before, out = whole(p), logits(model)
        p.data = make(p)
        call = {"forward": lambda: logits(model), "step": opt.step, "state_dict": model.state_dict}[at]
        with pytest.raises(RuntimeError, match=rf"'model\.norm\.weight'.*{says}.*to_local\(\)\.copy_") as e:
            call()
        assert "nothing of it was taken" in str(e.value)
        assert p.data_ptr() == 0 and p.shape == (32,) and p.dtype == torch.float32  # the wrapper as it was
        assert torch.equal(whole(p), before) and torch.equal(logits(model), out)  # the weights too: usable
        with torch.no_grad():  # the way round the refusal names
            p.to_local().copy_(torch.full((32,), 0.5))
        assert not torch.equal(logits(model), out)
        opt.step()
    finally:
        opt.close()
        tiered.offload.close()


def _two_ranks_assign(rank: int, world: int) -> str:
    from tiered.offload import offload_model

    model = llama(torch.float32)
    offload_model(model, device="cpu")
    model.model.norm.weight.data = torch.ones(32)
    try:
        logits(model)
    except RuntimeError as e:
        return str(e)
    return "taken"


def test_an_assignment_over_two_ranks_is_refused_on_each(tmp_path):
    """Over two ranks each holds half of the parameter: a whole tensor assigned is refused, by name, on each rank,
    with the way round over ranks."""
    from distributed_common import run_ranks

    said = run_ranks(_two_ranks_assign, 2)
    for text in said:
        assert "'model.norm.weight'" in text and "over 2 ranks" in text and "distribute_tensor" in text, text


def test_an_in_place_write_of_a_plain_tensor_is_refused_loudly_and_the_ways_round_write_as_without_offload():
    """``p.copy_(t)``, ``p.add_(t)``, ``p.data.copy_(t)`` with a plain ``t`` raise torch's own error (the parameter
    is a DTensor), nothing written; the ways round docs/offload.md names (the local tensor, ``implicit_replication``)
    write what the model without offload writes."""
    from torch.distributed.tensor.experimental import implicit_replication

    import tiered.offload

    model, plain = offloaded(), llama(torch.float32)
    try:
        p, q = model.model.layers[0].mlp.up_proj.weight, plain.model.layers[0].mlp.up_proj.weight
        t = torch.randn(p.shape, generator=torch.Generator().manual_seed(1))
        before = whole(p)
        for write in (lambda w: w.copy_(t), lambda w: w.add_(t), lambda w: w.data.copy_(t)):
            with torch.no_grad(), pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
                write(p)
        assert torch.equal(whole(p), before)
        with torch.no_grad():
            p.to_local().copy_(t)
            with implicit_replication():
                p.add_(t)
                p.data.mul_(t)
            q.copy_(t)
            q.add_(t)
            q.data.mul_(t)
        assert torch.equal(whole(p), whole(q)) and torch.equal(logits(model), logits(plain))
    finally:
        tiered.offload.close()


def optimizer_after_assign(nvme: Path, *, offload: bool, dtype: str, then: str) -> list[torch.Tensor]:
    """One step, ``p.data = t`` on a block's parameter, then at once (no forward, no step) the optimizer's
    ``then``: ``save_checkpoint`` (read back into a fresh model), ``state_dict`` (its masters) or
    ``load_checkpoint`` of a checkpoint saved before the assignment (and a forward after it). Returns what each saw."""
    import tiered.offload
    from tiered import TieredOptimizer
    from tiered.checkpoint import load_checkpoint

    name = WRITTEN[2]
    model = llama(getattr(torch, dtype))
    if offload:
        tiered.offload.offload_model(model, device="cpu")
    opt = TieredOptimizer(model, nvme_path=str(nvme / "a"), **KW)
    try:
        x = micro_batch(0, 0)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        before = opt.save_checkpoint(str(nvme / "before"))
        p = model.get_parameter(name)
        p.data = written(name, p)
        if then == "state_dict":
            sd = opt.state_dict()["state"]
            return [full(sd[i].get("master", sd[i]["exp_avg"])) for i in sorted(sd)]
        if then == "load_checkpoint":
            opt.load_checkpoint(before)
            return [full(p), logits(model).float(), full(p)]
        saved = opt.save_checkpoint(str(nvme / "saved"))
    finally:
        opt.close()
        if offload:
            tiered.offload.close()
    fresh = llama(getattr(torch, dtype))
    with TieredOptimizer(fresh, nvme_path=str(nvme / "b"), **KW) as opt2:
        load_checkpoint(opt2, saved)
        return [full(q) for q in fresh.parameters()]


@pytest.mark.parametrize("then", ["save_checkpoint", "state_dict", "load_checkpoint"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_optimizer_sees_an_assignment_made_just_before_it_saves_or_loads(tmp_path, dtype, then):
    """``p.data = t`` then at once the optimizer's ``save_checkpoint`` or ``state_dict`` saves ``t`` (its masters
    too), and its ``load_checkpoint`` wins over ``t`` (not ``t`` copied over the loaded weights at the next
    forward): bitwise as without offload."""
    seen = {}
    for offload in (False, True):
        nvme = tmp_path / str(offload)
        nvme.mkdir()
        seen[offload] = run_bounded(
            lambda nvme=nvme, offload=offload: optimizer_after_assign(nvme, offload=offload, dtype=dtype, then=then),
            timeout=RUN_TIMEOUT,
        )
    assert len(seen[True]) == len(seen[False])
    differ = [i for i, (a, b) in enumerate(zip(seen[True], seen[False])) if not torch.equal(a, b)]
    assert not differ, f"{then} after p.data = t differs from the run without offload at {differ}"


def test_the_look_before_each_forward_walks_no_modules(monkeypatch):
    """The look at each forward goes over the units found at ``offload_model`` (and after a conversion), not over
    every module of the model again (a walk that cost more than the look itself on a model of hundreds of
    parameters); an assignment is still taken."""
    import tiered.offload

    model, plain = offloaded(), llama(torch.float32)
    try:
        walks = []
        real = torch.nn.Module.modules
        monkeypatch.setattr(torch.nn.Module, "modules", lambda self: walks.append(self) or real(self))
        for m in (model, plain):
            m.get_parameter(WRITTEN[2]).data = torch.full(plain.get_parameter(WRITTEN[2]).shape, 0.25)
        model.tiered_data_writes.take()
        assert walks == []
        monkeypatch.undo()
        assert torch.equal(logits(model), logits(plain))
    finally:
        tiered.offload.close()
