"""The models the benchmarks and examples train: one builder each, so that every figure means one workload.

- `build_llama()`: the reference workload of bench/RESULTS.md, Llama-0.94B (transformers'
  `LlamaForCausalLM` from a config, random init, seed 0, bf16, one fixed batch of 8 x 1024 random tokens),
  the same model as DeepSpeed's `ds_anchor.py` anchor (bench/device_run.sh, stage `ds`). Every size is a
  keyword, so tests and CPU runs shrink it. Used by bench/llama_step.py, bench/llama_ab.py and
  `examples/train.py --llama`.
- `build_tiny()`: a small causal transformer over bytes, trained on random windows of a text (nothing to
  download), for CPU runs: examples/train.py and bench/moments_bf16.py.

Each returns a `Workload`: ``loss = w.loss(); loss.backward(); opt.step()``. Nothing here imports
transformers or touches CUDA until a builder runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

# The 0.94B reference configuration (940.6 M parameters): the builder's defaults.
LLAMA_LAYERS = 16
LLAMA_HIDDEN = 2048
LLAMA_VOCAB = 32000
LLAMA_SEQ = 1024
LLAMA_BATCH = 8
HEAD_DIM = 128
TINY_HEAD_DIM = 32  # TinyGPT's heads: one a 32 of its width


def heads_of(width: int, head_dim: int) -> int:
    """The builders' attention heads: one a ``head_dim`` of the width, at least one."""
    return max(1, width // head_dim)


def width_problem(width: int, *, llama: bool) -> str | None:
    """Why a builder cannot take this width, or None. Its heads must divide it, and a Llama's rotary
    embeddings need each head's width even. The layers would refuse it only as the model is built."""
    head_dim = HEAD_DIM if llama else TINY_HEAD_DIM
    heads = heads_of(width, head_dim)
    if width % heads or (llama and width // heads % 2):
        shape, under = ("heads of even width", "an even width") if llama else ("equal heads", "a width")
        return (f"{width} does not split into {heads} {shape} (one a {head_dim} of it): take a multiple of "
                f"{head_dim}, or {under} under {2 * head_dim}")  # fmt: skip
    return None


def llama_intermediate(hidden: int) -> int:
    """The MLP width: 5504 at hidden 2048, scaled with the hidden size."""
    return 5504 * hidden // 2048


@dataclass(frozen=True)
class Workload:
    """A model on its device and the loss of one training batch (a new forward pass each call)."""

    model: nn.Module
    loss: Callable[[], torch.Tensor]

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def build_llama(
    device: torch.device | str = "cuda",
    *,
    layers: int = LLAMA_LAYERS,
    hidden: int = LLAMA_HIDDEN,
    inter: int | None = None,
    vocab: int = LLAMA_VOCAB,
    seq: int = LLAMA_SEQ,
    batch: int = LLAMA_BATCH,
    seed: int | None = 0,
) -> Workload:
    """LlamaForCausalLM from a config (random init after `torch.manual_seed(seed)`), bf16, on `device`, with
    one fixed batch of `batch` x `seq` random tokens made on `device`. `inter` defaults to
    `llama_intermediate(hidden)`; one attention head per 128 of `hidden`. Needs transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    heads = heads_of(hidden, HEAD_DIM)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=llama_intermediate(hidden) if inter is None else inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq,
    )
    # Built on the CPU in fp32 (so the initial weights do not depend on the device), then cast and moved.
    # transformers types PreTrainedModel.to for a model (its wrapper's first argument), not a dtype
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).to(device)  # type: ignore[arg-type]
    x = torch.randint(0, vocab, (batch, seq), device=device)
    return Workload(model, lambda: model(input_ids=x, labels=x).loss)


def add_llama_arguments(p: argparse.ArgumentParser) -> None:
    """`--layers --hidden --inter --vocab --seq --batch`, defaulting to the reference configuration.

    After parsing, ``llama_kwargs(args)`` gives build_llama's keywords (with `inter` filled in)."""
    p.add_argument("--layers", type=int, default=LLAMA_LAYERS)
    p.add_argument("--hidden", type=int, default=LLAMA_HIDDEN)
    p.add_argument("--inter", type=int, default=None, help="default 5504 * hidden / 2048")
    p.add_argument("--vocab", type=int, default=LLAMA_VOCAB)
    p.add_argument("--seq", type=int, default=LLAMA_SEQ)
    p.add_argument("--batch", type=int, default=LLAMA_BATCH)


def llama_kwargs(args: argparse.Namespace) -> dict[str, int]:
    """build_llama's size keywords from flags added by `add_llama_arguments`; fills in `args.inter`."""
    if args.inter is None:
        args.inter = llama_intermediate(args.hidden)
    return {k: getattr(args, k) for k in ("layers", "hidden", "inter", "vocab", "seq", "batch")}


class TinyGPT(nn.Module):
    """A small causal transformer over bytes: big enough to stream state, small enough for 2 cores."""

    def __init__(self, dim: int, layers: int, seq: int, vocab: int = 256):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        block = nn.TransformerEncoderLayer(
            dim, heads_of(dim, TINY_HEAD_DIM), 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        return self.head(self.blocks(h, mask=self.mask, is_causal=True))


def build_tiny(
    device: torch.device | str = "cpu",
    *,
    dim: int = 128,
    layers: int = 4,
    seq: int = 64,
    batch: int = 16,
    corpus: bytes | None = None,
    seed: int | None = 0,
) -> Workload:
    """TinyGPT (after `torch.manual_seed(seed)`) and its next-byte loss on `batch` random windows of
    `corpus` (default: this file's source), drawn from torch's global generator at every call."""
    if seed is not None:
        torch.manual_seed(seed)
    data = corpus if corpus is not None else Path(__file__).read_bytes()
    if len(data) < seq + 2:
        raise ValueError(f"corpus of {len(data)} bytes is shorter than one window of seq + 2 = {seq + 2} bytes")
    text = torch.tensor(list(data), dtype=torch.long, device=device)
    model = TinyGPT(dim, layers, seq).to(device)

    def loss() -> torch.Tensor:
        i = torch.randint(0, len(text) - seq - 1, (batch, 1)) + torch.arange(seq + 1)
        w = text[i.to(device)]
        logits = model(w[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten())

    return Workload(model, loss)
