"""A decoder's size from its Hugging Face ``config.json``, for ``tiered-bench plan --config``.

The plan needs two figures of a model: its parameter count, and, with the parameters offloaded
(tiered.offload_model), the GPU bytes of the blocks FSDP2 holds whole at once, the "window": the running
decoder layer and the next one prefetched, one layer's gradients, and the root unit (embeddings, final norm,
head) with its gradients, all bf16. A 10B Llama with a 32K vocabulary holds 2.3 GB; Llama 3 8B, whose 128K
vocabulary makes its embeddings and head 1.05B parameters, 5.5 GB. A constant cannot be right for both, so
where the user has the model's config the plan counts them from it.

Counted exactly, as transformers builds the model (tests/tools/test_model_shape.py checks each family against
the module transformers instantiates, and each ``_Family`` default against its config class): the families in
``FAMILIES``. Others are refused by name rather than guessed at. Nothing here imports torch or transformers: the
plan runs where neither is installed, so the class defaults a config.json may leave out are a table here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["FAMILIES", "ModelShape", "read_config", "shape_from_config"]


@dataclass(frozen=True)
class _Family:
    tied: bool  # the class's tie_word_embeddings default, where config.json leaves it out
    qkv_bias: bool | None  # biases on q, k, v whatever the config says; None: ``attention_bias`` decides
    o_bias_with_attention_bias: bool  # ``attention_bias`` also puts one on the output projection
    qk_norm: bool  # a norm of head_dim on q and on k (Qwen3)
    experts: bool  # ``num_local_experts`` MLPs behind a router (Mixtral)
    head_dim: int | None = None  # the class's head_dim where config.json leaves it out; None: hidden / heads
    # The class's num_key_value_heads where config.json leaves it out: a fixed number, not the config's heads
    # (Qwen2's 32 holds for a 28-head config too). None: num_attention_heads.
    kv_heads: int | None = None
    mlp_bias: bool = False  # the config's ``mlp_bias`` puts biases on the MLP; the other classes ignore the key


FAMILIES: dict[str, _Family] = {
    "llama": _Family(False, None, True, False, False, mlp_bias=True),
    "mistral": _Family(False, False, False, False, False, kv_heads=8),
    "qwen2": _Family(False, True, False, False, False, kv_heads=32),
    "qwen3": _Family(False, None, True, True, False, head_dim=128, kv_heads=32),
    "mixtral": _Family(False, False, False, False, True, kv_heads=8),
    "gemma": _Family(True, None, True, False, False, head_dim=256, kv_heads=16),
}


@dataclass(frozen=True)
class ModelShape:
    """What the plan reads off a decoder: its layers, each layer's parameters, and the root unit's."""

    model_type: str
    layers: int
    layer_params: int  # one decoder layer: attention, MLP (every expert), norms
    root_params: int  # embeddings, the final norm, the head unless tied to the embeddings

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    @property
    def offload_window(self) -> int:
        """GPU bytes FSDP2 holds whole at once with the parameters offloaded: two layers' bf16 weights and one
        layer's gradients, the root's weights and gradients (docs/capacity.md)."""
        return 2 * (3 * self.layer_params + 2 * self.root_params)


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _get(cfg: dict[str, Any], key: str, default: Any = None) -> Any:
    v = cfg.get(key)
    return default if v is None else v


def shape_from_config(cfg: dict[str, Any]) -> ModelShape:
    """The shape of the decoder a config.json's dict describes; ValueError naming what is missing or unknown."""
    kind = cfg.get("model_type")
    if not isinstance(kind, str) or kind not in FAMILIES:
        sub = [k for k in ("text_config", "language_model") if isinstance(cfg.get(k), dict)]
        hint = f"; its decoder's config is under {sub[0]!r}: give that part as its own file" if sub else ""
        raise ValueError(
            f"the plan counts the model types {', '.join(FAMILIES)} from a config; this one is {kind!r}{hint}. "
            "Give --params and --offload-window instead"
        )
    fam = FAMILIES[kind]
    need = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
    optional = ["num_key_value_heads", "head_dim"] + (["num_local_experts"] if fam.experts else [])
    bad = [k for k in need if not _whole(cfg.get(k))] + [k for k in optional if cfg.get(k) is not None and not
                                                          _whole(cfg[k])]  # fmt: skip
    if fam.experts and cfg.get("num_local_experts") is None:
        bad.append("num_local_experts")
    if bad:
        raise ValueError(f"the {kind} config lacks a whole number >= 1 for {', '.join(bad)}")
    flags = [
        k for k in ("tie_word_embeddings", "attention_bias", "mlp_bias") if not isinstance(_get(cfg, k, False), bool)
    ]
    if flags:
        raise ValueError(f"the {kind} config's {', '.join(flags)} must be true or false (JSON booleans)")
    h, inter, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    # Left out, the class's default; present as null, the heads, as Llama's and Qwen's classes resolve it (and
    # Mistral's and Mixtral's did before transformers 5, which refuses the null for them and for Gemma).
    kv = cfg["num_key_value_heads"] if "num_key_value_heads" in cfg else fam.kv_heads
    kv = kv or heads
    hd = _get(cfg, "head_dim", fam.head_dim or h // heads)
    q, k = heads * hd, kv * hd
    bias = bool(_get(cfg, "attention_bias", False))
    qkv_bias = bias if fam.qkv_bias is None else fam.qkv_bias
    attn = h * (q + 2 * k) + q * h
    attn += (q + 2 * k) * qkv_bias + h * (bias and fam.o_bias_with_attention_bias)
    attn += 2 * hd * fam.qk_norm
    mlp = 3 * h * inter + (2 * inter + h) * (fam.mlp_bias and bool(_get(cfg, "mlp_bias", False)))
    if fam.experts:
        experts = cfg["num_local_experts"]
        mlp = experts * mlp + h * experts  # the router: one row of h weights an expert
    layer = attn + mlp + 2 * h  # and the two norms
    vocab = cfg["vocab_size"]
    tied = bool(_get(cfg, "tie_word_embeddings", fam.tied))
    root = vocab * h * (1 if tied else 2) + h
    return ModelShape(kind, cfg["num_hidden_layers"], layer, root)


def read_config(path: str | Path) -> ModelShape:
    """``shape_from_config`` of a config.json file, or of the config.json in the folder ``path`` names."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read {p} ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--config {path}: not JSON ({e})") from None
    except UnicodeDecodeError:
        raise ValueError(f"--config {path}: {p} is not UTF-8 text (a config.json is)") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--config {path}: a config.json holds one JSON object")
    return shape_from_config(cfg)
