"""What the framework tests (tests/test_frameworks_*.py) share: a tiny Llama built from a config, random
token data made in the test, the two optimizers of each pair and the comparison of their final weights.

Every test trains the same thing twice from the same seed, once with ``torch.optim.AdamW`` and once with
``TieredOptimizer``, inside a real framework, and asserts that the weights agree to float rounding. Nothing
is downloaded: the model comes from a config, the data from a seeded generator, and the hub is offline.
"""

from __future__ import annotations

import os

# Before transformers (or anything that imports huggingface_hub) reads them: no network at test time.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import torch  # noqa: E402
from torch import nn  # noqa: E402

from tiered import TieredOptimizer  # noqa: E402

LR = 1e-2
WEIGHT_DECAY = 0.01
SEQ = 16
BATCH = 4
# The tiny Llama's AdamW state is 338 KiB; 64 KiB chunks cut it into 6. A host budget below the state's size
# makes part of it live on NVMe, whatever the placement policy (assert_used_disk checks that it did).
HOST_BUDGET = "256KiB"
CHUNK_BYTES = "64KiB"
# The reference is torch's fused AdamW kernel, the arithmetic TieredOptimizer performs, so that a mismatch
# points at the framework integration rather than at two kernels' rounding. Where it cannot be (loss scaling,
# see test_frameworks_accelerate.py), the reference is the default foreach kernel: 20 steps of the two
# kernels differ by up to 2.4e-7 here, hence the looser tolerance.
RTOL, ATOL = 1e-6, 1e-7
FOREACH_RTOL, FOREACH_ATOL = 1e-5, 1e-6
KINDS = ("adamw", "tiered")


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )


def tiny_llama(seed: int = 0) -> nn.Module:
    """A 2-layer Llama (28,832 parameters, untied head), the same weights for the same seed."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config())


def tokens(n: int, seq: int = SEQ, seed: int = 1) -> torch.Tensor:
    """``n`` random token sequences, [n, seq] int64."""
    return torch.randint(0, 128, (n, seq), generator=torch.Generator().manual_seed(seed))


class TokenDataset(torch.utils.data.Dataset):
    """Causal-LM samples as the HF Trainer's default collator wants them: input_ids and labels."""

    def __init__(self, n: int, seq: int = SEQ, seed: int = 1):
        self.x = tokens(n, seq, seed)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def optimizer_kwargs(kind: str, nvme_path, lr: float = LR, fused: bool = True) -> tuple[type, dict]:
    """(class, kwargs) of one side of a pair, as HF's ``optimizer_cls_and_kwargs`` takes them. ``fused``:
    which torch kernel the AdamW side runs."""
    if kind == "adamw":
        return torch.optim.AdamW, dict(lr=lr, weight_decay=WEIGHT_DECAY, fused=fused)
    if kind == "tiered":
        return TieredOptimizer, dict(
            nvme_path=nvme_path, lr=lr, weight_decay=WEIGHT_DECAY, host_budget=HOST_BUDGET, chunk_bytes=CHUNK_BYTES
        )
    raise ValueError(kind)


def make_optimizer(kind: str, model: nn.Module, nvme_path, lr: float = LR, fused: bool = True) -> torch.optim.Optimizer:
    """``torch.optim.AdamW(model.parameters(), ...)`` or ``TieredOptimizer(model, nvme_path=..., ...)``."""
    cls, kw = optimizer_kwargs(kind, nvme_path, lr, fused)
    return cls(model.parameters() if kind == "adamw" else model, **kw)


def unwrap(opt):
    """The user's optimizer inside a framework's wrapper (accelerate's AcceleratedOptimizer keeps it in
    ``.optimizer``, Lightning's LightningOptimizer in ``._optimizer``)."""
    for _ in range(4):
        if type(opt) in (TieredOptimizer, torch.optim.AdamW):  # not isinstance: LightningOptimizer fakes it
            return opt
        opt = getattr(opt, "optimizer", None) or getattr(opt, "_optimizer", None) or opt
    return opt


def close(opt) -> None:
    """Close a TieredOptimizer (what the end of a process does); nothing for AdamW."""
    opt = unwrap(opt)
    if isinstance(opt, TieredOptimizer):
        opt.close()


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_weights(
    expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], what: str = "", rtol=RTOL, atol=ATOL
):
    """Every parameter equal to float rounding; the message names the parameter and the comparison."""
    assert expected.keys() == actual.keys()
    for name, e in expected.items():
        torch.testing.assert_close(
            actual[name], e, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{what}: parameter {name}: {m}"
        )


def assert_trained(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    """Guard against a vacuous comparison: training moved every parameter."""
    for name, b in before.items():
        assert not torch.equal(b, after[name]), f"{name} did not change during training"


def step_count(opt) -> int:
    """The AdamW step count of the first parameter, from the torch-layout state dict."""
    return int(float(opt.state_dict()["state"][0]["step"]))


def assert_used_disk(opt) -> None:
    """The pair tested what it claims: part of the state went through the NVMe tier."""
    opt = unwrap(opt)
    assert isinstance(opt, TieredOptimizer), type(opt)
    total = opt.stats()["total"]
    assert total["nvme_read_bytes"] > 0, f"no state was read from NVMe: {total}"


def sized_llama(seed: int = 0, *, hidden: int = 512, layers: int = 4, vocab: int = 8192) -> nn.Module:
    """A Llama of ``hidden`` x ``layers`` (fp32, untied head) for tests that need the state large: the
    defaults make 21.0M parameters, 168 MiB of AdamW moments. The same weights for the same seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=64)  # fmt: skip
    return LlamaForCausalLM(config)


class LoadOntoGPU(Exception):
    """What ``spy_loads`` raises in place of a load onto a GPU, which this machine may not have."""


def spy_loads(monkeypatch) -> list[tuple[str, object, object]]:
    """``torch.load`` spied: each call's file name, ``map_location`` and ``mmap`` go to the list returned (as a
    framework resuming on rank 0 of several GPUs calls it); a load onto a GPU raises ``LoadOntoGPU``."""
    loads: list[tuple[str, object, object]] = []
    real_load = torch.load

    def spy(f, *args, **kwargs):
        loads.append((os.path.basename(str(f)), kwargs.get("map_location"), kwargs.get("mmap")))
        if str(kwargs.get("map_location")).startswith("cuda"):
            raise LoadOntoGPU
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    return loads
