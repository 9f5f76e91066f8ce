"""`tiered-bench plan --config`: a model's parameters and offloaded window counted from its config.json, against
the modules transformers builds from the same config (on the meta device: nothing allocated, nothing downloaded)."""

from __future__ import annotations

import json

import pytest
import torch

from tiered import cli
from tiered.bench.model_shape import FAMILIES, read_config, shape_from_config

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=300)  # fmt: skip
CASES = [
    ("LlamaConfig", {}),
    ("LlamaConfig", dict(attention_bias=True, mlp_bias=True)),
    ("LlamaConfig", dict(tie_word_embeddings=True, head_dim=32)),
    ("MistralConfig", {}),
    ("MistralConfig", dict(mlp_bias=True)),  # read by Llama only: the other classes' MLPs have no biases
    ("Qwen2Config", {}),
    ("Qwen3Config", dict(head_dim=16)),
    ("Qwen3Config", dict(head_dim=16, attention_bias=True)),
    ("MixtralConfig", dict(num_local_experts=4)),
    ("MixtralConfig", dict(num_local_experts=4, mlp_bias=True)),
    ("GemmaConfig", dict(head_dim=16)),
    ("GemmaConfig", dict(head_dim=16, tie_word_embeddings=False)),
]


def built(name: str, extra: dict) -> tuple[dict, torch.nn.Module]:
    cfg = getattr(transformers, name)(**{**SMALL, **extra})
    with torch.device("meta"):
        return json.loads(cfg.to_json_string()), transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("name, extra", CASES, ids=[f"{n}-{'-'.join(e) or 'defaults'}" for n, e in CASES])
def test_the_counts_are_the_modules_transformers_builds(name, extra):
    cfg, model = built(name, extra)
    shape = shape_from_config(cfg)
    layers = model.model.layers
    assert shape.layers == len(layers)
    assert {sum(p.numel() for p in layer.parameters()) for layer in layers} == {shape.layer_params}
    assert shape.params == sum(p.numel() for p in model.parameters())  # tied weights counted once
    root = shape.params - shape.layers * shape.layer_params
    assert shape.root_params == root
    # The window: two layers' bf16 weights and one layer's gradients, the root unit's weights and gradients.
    assert shape.offload_window == 2 * (3 * shape.layer_params + 2 * root)


@pytest.mark.parametrize("name", ["LlamaConfig", "MistralConfig", "Qwen3Config", "GemmaConfig"])
def test_a_config_without_head_dim_takes_its_classs_default(name):
    # Qwen3's and Gemma's classes default to 128 and 256, not hidden_size / heads (16 here): a trimmed or
    # hand-written config.json without head_dim was counted as the smaller model.
    cfg, model = built(name, {})
    cfg.pop("head_dim", None)
    assert shape_from_config(cfg).params == sum(p.numel() for p in model.parameters())


KINDS = sorted(FAMILIES)


def from_raw(raw: dict) -> int:
    """The parameters of the model transformers builds from a config.json's dict as it stands, keys left out and
    all (``built`` goes through the class, whose JSON carries every default)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**raw))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("flags", [{}, dict(mlp_bias=True), dict(attention_bias=True)], ids=["bare", "mlp", "attn"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_config_that_leaves_out_the_class_defaults_counts_as_transformers_builds(kind, flags):
    # Without num_key_value_heads, Mistral and Mixtral take 8, Qwen2 and Qwen3 32, Gemma 16, not the config's
    # heads (a Mistral 7B was counted 11 % larger). mlp_bias puts biases on Llama's MLP only; the others ignore it.
    raw = dict(model_type=kind, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
               vocab_size=300, **flags)  # fmt: skip
    if FAMILIES[kind].experts:
        raw["num_local_experts"] = 4
    assert shape_from_config(raw).params == from_raw(raw)


@pytest.mark.parametrize("kind", KINDS)
def test_each_familys_defaults_are_its_config_classs(kind):
    """The table stands in for transformers' config classes where transformers is not installed: it must say
    what they say."""
    fam, heads = FAMILIES[kind], 4
    cfg = transformers.AutoConfig.for_model(kind, hidden_size=64, num_attention_heads=heads)
    assert cfg.tie_word_embeddings == fam.tied
    assert cfg.num_key_value_heads == (fam.kv_heads or heads)
    assert (getattr(cfg, "head_dim", None) or 64 // heads) == (fam.head_dim or 64 // heads)


@pytest.mark.parametrize("kind", KINDS)
def test_num_key_value_heads_given_as_null_are_the_heads(kind):
    raw = dict(model_type=kind, **SMALL, num_local_experts=4)
    given = shape_from_config({**raw, "num_key_value_heads": raw["num_attention_heads"]}).params
    raw["num_key_value_heads"] = None
    assert shape_from_config(raw).params == given
    try:
        real = from_raw(raw)
    except Exception as e:  # transformers 5 refuses the null for Mistral, Mixtral and Gemma (4 took the heads)
        assert "num_key_value_heads" in str(e)
    else:
        assert real == given


def test_every_family_is_checked():
    assert {getattr(transformers, n)().model_type for n, _ in CASES} == set(FAMILIES)


def test_a_10b_llama_and_llama_3_8b_windows_are_the_docs():
    t10 = dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=48,
               num_attention_heads=32, vocab_size=32000)  # fmt: skip
    l3 = dict(t10, intermediate_size=14336, num_hidden_layers=32, num_key_value_heads=8, vocab_size=128256)
    assert round(shape_from_config(t10).offload_window / 1e9, 1) == 2.3
    assert round(shape_from_config(l3).params / 1e9, 2) == 8.03
    assert round(shape_from_config(l3).offload_window / 1e9, 1) == 5.5


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"model_type": "gpt2", "n_embd": 768}, "this one is 'gpt2'"),
        ({"model_type": "llava", "text_config": {}}, "under 'text_config'"),
        ({"model_type": "llama", "hidden_size": 64}, "lacks a whole number >= 1 for intermediate_size"),
        ({**SMALL, "model_type": "mixtral"}, "num_local_experts"),
        ({**SMALL, "model_type": "llama", "vocab_size": True}, "vocab_size"),
        ({**SMALL, "model_type": "llama", "num_key_value_heads": "8"}, "whole number >= 1 for num_key_value_heads"),
        ({**SMALL, "model_type": "llama", "num_key_value_heads": 0}, "whole number >= 1 for num_key_value_heads"),
        ({**SMALL, "model_type": "qwen3", "head_dim": -5}, "whole number >= 1 for head_dim"),
        ({**SMALL, "model_type": "mixtral", "num_local_experts": 0}, "whole number >= 1 for num_local_experts"),
        ({**SMALL, "model_type": ["llama"]}, "this one is ['llama']"),
        ({**SMALL, "model_type": "llama", "tie_word_embeddings": "false"}, "tie_word_embeddings must be true or"),
    ],
)
def test_what_it_cannot_count_is_refused_by_name(cfg, message):
    with pytest.raises(ValueError) as e:
        shape_from_config(cfg)
    assert message in str(e.value)


def test_the_cli_takes_a_config_file_or_its_folder(tmp_path, capsys):
    llama_3_8b = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8)  # fmt: skip
    cfg, _ = built("LlamaConfig", llama_3_8b)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    box = "--gpu 24GB --ram 64GiB --disk 1TB".split()
    assert cli.main(["plan", "--config", str(tmp_path), *box]) == 0
    out = capsys.readouterr().out
    assert "model: llama from its config, 8.03B parameters (32 layers of 218.1M, embeddings and head 1.05B)" in out
    assert "offloaded, a window of 5.5 GB" in out and "8.03B parameters:" in out
    assert cli.main(["plan", "--config", str(tmp_path / "config.json"), "--json", *box]) == 0
    doc = json.loads(capsys.readouterr().out)
    shape = read_config(tmp_path)
    assert doc["params"] == shape.params and doc["assumptions"]["offload_window"] == shape.offload_window
    assert doc["model"]["layer_params"] == shape.layer_params
    # The window given overrides the config's; the count stays the config's.
    assert cli.main(["plan", "--config", str(tmp_path), "--offload-window", "1GiB", "--json", *box]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["params"], doc["assumptions"]["offload_window"]) == (shape.params, 1 << 30)


def test_the_window_counted_moves_the_offloaded_limit(tmp_path, capsys):
    """What the config is for: Llama 3 8B's 128K vocabulary makes its window larger than the 4 GiB assumed, a 1B
    Llama's smaller. On a 10 GB card the assumed window leaves an offloaded model room; Llama 3 8B's does not."""

    def offloaded(*args: str) -> dict:
        assert cli.main(["plan", *args, "--gpu", "10GB", "--ram", "256GiB", "--disk", "4TB", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        return next(o for o in doc["options"] if o["key"] == "tiered-offload")

    def config(name: str, **cfg) -> str:
        path = tmp_path / name
        path.write_text(json.dumps(dict(model_type="llama", num_attention_heads=32, **cfg)))
        return str(path)

    l3 = config("l3.json", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_key_value_heads=8,
                vocab_size=128256)  # fmt: skip
    small = config("1b.json", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_key_value_heads=4,
                   vocab_size=32000)  # fmt: skip
    assert read_config(l3).offload_window > 4 << 30 > read_config(small).offload_window
    by_default, by_l3, by_small = offloaded(), offloaded("--config", l3), offloaded("--config", small)
    # Only models whose whole weights and gradients (4 B/param) are smaller than that window fit (the window's cap).
    assert 4 * by_l3["largest_params"] < read_config(l3).offload_window and by_l3["bound_by"] == "GPU memory"
    assert not by_l3["fit"]["fits"]
    assert by_default["largest_params"] == by_small["largest_params"] > 10**10  # RAM-bound, not GPU-bound
    assert by_small["fit"]["fits"] and by_small["fit"]["gpu_bytes"] < 10**10 < by_l3["fit"]["gpu_bytes"]


def test_cli_errors_are_one_line(tmp_path, capsys):
    box = "--gpu 24GB --ram 64GiB --disk 1TB".split()
    assert cli.main(["plan", "--config", str(tmp_path), *box]) == 2
    assert f"cannot read {tmp_path / 'config.json'}" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{not json")
    assert cli.main(["plan", "--config", str(tmp_path), *box]) == 2
    assert "not JSON" in capsys.readouterr().err
    (tmp_path / "config.json").write_bytes(b'{"model_type": "llama\xff"}')
    assert cli.main(["plan", "--config", str(tmp_path), *box]) == 2
    assert "is not UTF-8 text" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--config", str(tmp_path), "--params", "8B", *box])
    assert e.value.code == 2 and "not allowed with argument --config" in capsys.readouterr().err
