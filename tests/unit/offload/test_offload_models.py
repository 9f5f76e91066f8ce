"""Model families beyond the decoder-only Llama of test_offload_params.py, offloaded on the CPU stand-in.

BERT-family masked-LM models list their embeddings in ``_no_split_modules`` and tie the word embedding to the
LM head, which lies outside every block: ``offload_model`` leaves such a block out (the root unit holds the tied
weight) and trains bitwise as without offload; blocks named that hold it are refused before anything is sharded.

Encoder-decoder models (T5, BART) are bitwise plain FSDP2 and agree with the model without FSDP2 to rounding only,
as docs/offload.md ("Exactness") says.

A peft LoRA model offloaded is merged and saved as without offload: the merged model, a submodule of the offloaded
one, has a state dict of plain tensors, as every module in it has.
"""

from __future__ import annotations

import logging
import tempfile

import pytest
import torch
from helpers import TIMEOUT, run_bounded

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")

RUN_TIMEOUT = 10 * TIMEOUT  # a whole run of a tiny model: only reached when something hangs
VOCAB, SEQ = 96, 16
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
            max_position_embeddings=SEQ + 2)  # fmt: skip  # RoBERTa's positions start after the padding index

# Each lists its embeddings class in _no_split_modules and ties its word embedding to the LM head (HF defaults).
MASKED_LM = {
    "BertForMaskedLM": "BertConfig",
    "BertForPreTraining": "BertConfig",
    "RobertaForMaskedLM": "RobertaConfig",
    "XLMRobertaForMaskedLM": "XLMRobertaConfig",
    "CamembertForMaskedLM": "CamembertConfig",
}


def masked_lm(name: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return getattr(transformers, name)(getattr(transformers, MASKED_LM[name])(**TINY)).train()


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(3, VOCAB, (2, SEQ), generator=g)  # clear of RoBERTa's padding index


def full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def train_masked_lm(name: str, offload: bool) -> dict[str, torch.Tensor]:
    """Two clipped steps of AdamW (TieredOptimizer) on ``name``; its weights after them."""
    import tiered.offload
    from tiered import TieredOptimizer

    model = masked_lm(name)
    if offload:
        tiered.offload.offload_model(model, device="cpu")
    opt = TieredOptimizer(model, nvme_path=tempfile.mkdtemp(prefix="tiered-test-"), lr=1e-2, max_grad_norm=0.5)
    try:
        for step in range(2):
            x = batch(step)
            labels = x if name != "BertForPreTraining" else {"labels": x, "next_sentence_label": torch.tensor([0, 1])}
            kw = {"labels": labels} if name != "BertForPreTraining" else labels
            model(input_ids=x, **kw).loss.backward()
            opt.step()
            opt.zero_grad()
        return {n: full(p) for n, p in model.named_parameters()}
    finally:
        opt.close()
        if offload:
            tiered.offload.close()


@pytest.mark.parametrize("name", list(MASKED_LM))
def test_a_block_tied_to_the_root_is_left_out_of_the_blocks(name, caplog):
    """Found from ``_no_split_modules``, the embeddings block holds the word embedding the LM head (root) shares:
    FSDP2 failed at the first forward ("shared with a parameter already managed by another FSDP group"). It is
    left out, said once by name, and its parameters join the root unit."""
    from tiered.offload import find_blocks

    model = masked_lm(name)
    with caplog.at_level(logging.INFO, logger="tiered"):
        blocks = find_blocks(model)
    assert {type(b).__name__ for b in blocks} == {name.split("For")[0] + "Layer"}
    assert len(blocks) == TINY["num_hidden_layers"]
    said = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(said) == 1 and "Embeddings" in said[0] and "word_embeddings.weight" in said[0], said


@pytest.mark.parametrize("name", ["BertForMaskedLM", "RobertaForMaskedLM", "BertForPreTraining"])
def test_a_masked_lm_offloaded_trains_bitwise_as_without_offload(name):
    plain = run_bounded(lambda: train_masked_lm(name, False), timeout=RUN_TIMEOUT)
    off = run_bounded(lambda: train_masked_lm(name, True), timeout=RUN_TIMEOUT)
    assert plain.keys() == off.keys()
    differ = [n for n in plain if not torch.equal(plain[n], off[n])]
    assert not differ, f"weights differ in {differ}"


def test_blocks_named_that_hold_a_tied_weight_are_refused_before_anything_is_sharded():
    """Named by the user, such a block is refused by name, and the model is left as it was: offloading it again
    with the blocks that work succeeds (it was already sharded, and refused as "already applied")."""
    import tiered.offload
    from tiered.offload import offload_model

    model = masked_lm("BertForMaskedLM")
    with pytest.raises(ValueError, match=r"BertEmbeddings.*bert\.embeddings\.word_embeddings\.weight.*"
                                         r"cls\.predictions\.decoder\.weight"):  # fmt: skip
        offload_model(model, device="cpu", blocks=["BertEmbeddings", "BertLayer"])
    assert not hasattr(model, "tiered_offload")
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())  # nothing sharded
    try:
        offload_model(model, device="cpu", blocks="BertLayer")
        assert model.tiered_offload.offloaded and model.tiered_offload.blocks == TINY["num_hidden_layers"]
        x = batch(0)
        run_bounded(lambda: model(input_ids=x, labels=x).loss.backward(), timeout=RUN_TIMEOUT)
    finally:
        tiered.offload.close()


def test_blocks_found_that_share_a_parameter_are_left_out_and_none_left_is_refused():
    """Two found blocks sharing a parameter both go to the root unit (leaving one out would leave it shared
    between the other and the root); where that leaves no block, the message says to name them."""
    from torch import nn

    from tiered.offload import find_blocks

    shared = nn.Linear(2, 2)
    layers = nn.ModuleList([nn.Sequential(shared), nn.Sequential(shared, nn.Linear(2, 2)), nn.Linear(2, 2)])
    assert find_blocks(nn.Sequential(layers)) == [layers[2]]
    with pytest.raises(ValueError, match="share a parameter"):
        find_blocks(nn.Sequential(layers), list(layers))  # named: refused, as ever
    with pytest.raises(ValueError, match="blocks="):
        find_blocks(nn.Sequential(nn.ModuleList([nn.Sequential(shared), nn.Sequential(shared)])))
    # A block whose parameter the model also holds outside it (a head tied to it), among found blocks:
    head = nn.Linear(2, 2)
    model = nn.Sequential(nn.ModuleList([nn.Sequential(nn.Linear(2, 2)), nn.Sequential(head)]), head)
    assert find_blocks(model) == [model[0][0]]
    with pytest.raises(ValueError, match=r"'0\.1\.0\.weight'.*'1\.weight'"):
        find_blocks(model, list(model[0]))


def encoder_decoder(name: str) -> torch.nn.Module:
    import transformers as T

    torch.manual_seed(0)
    if name == "t5":
        config = T.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                            num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
        return T.T5ForConditionalGeneration(config).train()
    config = T.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                          decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                          max_position_embeddings=SEQ + 2, dropout=0.0, attention_dropout=0.0,
                          activation_dropout=0.0)  # fmt: skip
    return T.BartForConditionalGeneration(config).train()


def train_encoder_decoder(name: str, how: str) -> dict[str, dict[str, torch.Tensor]]:
    """Two steps of ``name`` (``how``: ``"plain"``, the model as built; ``"fsdp2"``, plain ``fully_shard`` on the
    blocks offload_model finds and the root; ``"offload"``), under the one-rank group the caller made: the first
    backward's gradients and the weights after the steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tiered import TieredOptimizer
    from tiered.offload import find_blocks, offload_model

    model = encoder_decoder(name)
    if how == "fsdp2":
        mesh = init_device_mesh("cpu", (1,))
        for block in find_blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif how == "offload":
        offload_model(model, device="cpu")
    grads = {}
    with TieredOptimizer(model, nvme_path=tempfile.mkdtemp(prefix="tiered-test-"), lr=1e-2) as opt:
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randint(3, VOCAB, (2, SEQ), generator=g), torch.randint(3, VOCAB, (2, SEQ // 2), generator=g)
            model(input_ids=x, labels=y).loss.backward()
            grads = grads or {n: full(p.grad) for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
        return {"grads": grads, "weights": {n: full(p) for n, p in model.named_parameters()}}


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_an_encoder_decoder_offloaded_is_bitwise_plain_fsdp2_and_the_model_to_rounding(name):
    """What docs/offload.md ("Exactness") promises for encoder-decoder models: the encoder's output feeds every
    decoder block's cross-attention, and FSDP2's hooks on each block's inputs (its own, no tiered code) sum that
    output's gradient in another order than autograd without them. So the offloaded run is bitwise plain
    ``fully_shard`` on the same blocks, gradients and weights, and the model without FSDP2 to rounding only."""
    import torch.distributed as dist

    folder = tempfile.mkdtemp(prefix="tiered-test-pg-")
    dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store", 1), rank=0, world_size=1)
    try:
        runs = {how: run_bounded(lambda how=how: train_encoder_decoder(name, how), timeout=RUN_TIMEOUT)
                for how in ("plain", "fsdp2", "offload")}  # fmt: skip
    finally:
        dist.destroy_process_group()
    for kind in ("grads", "weights"):
        fsdp2, off, plain = (runs[how][kind] for how in ("fsdp2", "offload", "plain"))
        assert off.keys() == fsdp2.keys() == plain.keys()
        differ = [n for n in off if not torch.equal(off[n], fsdp2[n])]
        assert not differ, f"{kind} differ from plain FSDP2's in {differ}"
        for n in off:
            torch.testing.assert_close(off[n], plain[n], msg=lambda m, where=f"{kind} {n}": f"{where}: {m}")


def train_peft_lora(offload: bool, out) -> set[type]:
    """Two steps of a peft LoRA on a bf16 Llama, then peft's usual export: the adapters merged into the model it
    wraps, which is saved on its own to ``out``. Returns the types in the state dicts of the modules inside the
    offloaded model that users take out (``get_base_model()``, a block, a LoRA layer, the merged model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    import tiered.offload
    from tiered import TieredOptimizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         use_cache=False)  # fmt: skip
    model = get_peft_model(LlamaForCausalLM(config).to(torch.bfloat16),
                           LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))  # fmt: skip
    if offload:
        tiered.offload.offload_model(model, device="cpu")
    opt = TieredOptimizer(model.parameters(), nvme_path=tempfile.mkdtemp(prefix="tiered-test-"), lr=1e-2)
    try:
        for step in range(2):
            x = batch(step)
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
        block = model.get_base_model().model.layers[0]
        block.load_state_dict(block.state_dict())  # its own plain tensors load back into the shards
        taken = [model.get_base_model(), block, block.self_attn.q_proj]
        types = {type(v) for m in taken for v in m.state_dict().values()}
        merged = model.merge_and_unload()
        types |= {type(v) for v in merged.state_dict().values()}
        merged.save_pretrained(out)
        return types
    finally:
        opt.close()
        if offload:
            tiered.offload.close()


def test_a_peft_lora_offloaded_merges_and_saves_as_without_offload(tmp_path):
    """``model.merge_and_unload().save_pretrained(dir)``, peft's usual last step, on an offloaded ``PeftModel``: the
    merged model is the one it wraps, a submodule of the offloaded model, whose own ``state_dict()`` held
    DTensors (the plain-tensor hooks sat on the offloaded root alone), which safetensors cannot save ("invalid
    python storage"). Every module's state dict holds plain tensors now, and the files load back with
    ``from_pretrained`` as the merged weights of the run without offload, bit for bit."""
    pytest.importorskip("peft")
    from transformers import LlamaForCausalLM

    for offload in (False, True):
        types = run_bounded(lambda o=offload: train_peft_lora(o, tmp_path / str(o)), timeout=RUN_TIMEOUT)
        assert types == {torch.Tensor}, (offload, types)
    plain, offloaded = (LlamaForCausalLM.from_pretrained(tmp_path / str(o), torch_dtype=torch.bfloat16).state_dict()
                        for o in (False, True))  # fmt: skip
    assert plain.keys() == offloaded.keys() and not any("lora" in k for k in plain)
    differ = [k for k in plain if not torch.equal(plain[k], offloaded[k])]
    assert not differ, differ


class _FF(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, 2 * d), torch.nn.GELU(),
                                       torch.nn.Linear(2 * d, d))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class _Attn(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return self.attn(h, h, h, need_weights=False)[0]


class _Nested(torch.nn.Module):
    """Built as vit-pytorch and x-transformers build theirs: a ModuleList of ModuleLists ([attention, feed-forward]),
    no ``_no_split_modules``."""

    def __init__(self, d: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, d)
        self.layers = torch.nn.ModuleList([torch.nn.ModuleList([_Attn(d), _FF(d)]) for _ in range(depth)])
        self.head = torch.nn.Linear(d, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for attn, ff in self.layers:
            x = attn(x) + x
            x = ff(x) + x
        return torch.nn.functional.cross_entropy(self.head(x.mean(1)), y)


def train_nested(offload: bool) -> list[torch.Tensor]:
    import tiered.offload
    from tiered import TieredOptimizer

    torch.manual_seed(0)
    model = _Nested()
    if offload:
        tiered.offload.offload_model(model, device="cpu")
        assert model.tiered_offload.blocks == 6
    opt = TieredOptimizer(model, nvme_path=tempfile.mkdtemp(prefix="tiered-test-"), lr=1e-2)
    try:
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            model(torch.randn(2, 5, 8, generator=g), torch.randint(0, 3, (2,), generator=g)).backward()
            opt.step()
            opt.zero_grad()
        return [full(p) for p in model.parameters()]
    finally:
        opt.close()
        if offload:
            tiered.offload.close()


def test_containers_without_forward_are_looked_into_for_blocks():
    """The largest ModuleList's children were the blocks even where they are ModuleLists, which FSDP2 refuses
    ("does not support containers that do not implement forward", after the process group was made): their
    children are the blocks, and the run is bitwise the one without offload. A container named is refused by
    name, before anything is sharded or a process group made."""
    import torch.distributed as dist

    from tiered.offload import find_blocks, offload_model

    model = _Nested()
    assert find_blocks(model) == [m for pair in model.layers for m in pair]
    plain = run_bounded(lambda: train_nested(False), timeout=RUN_TIMEOUT)
    off = run_bounded(lambda: train_nested(True), timeout=RUN_TIMEOUT)
    assert all(torch.equal(a, b) for a, b in zip(plain, off, strict=True))
    for blocks in ([model.layers[0], model.layers[1]], "ModuleList"):
        with pytest.raises(ValueError, match=r"ModuleList.*no forward.*blocks="):
            offload_model(model, device="cpu", blocks=blocks)
        assert not dist.is_initialized() and not hasattr(model, "tiered_offload")
        assert all(type(p) is torch.nn.Parameter for p in model.parameters())  # nothing sharded


def test_a_model_with_a_scalar_parameter_is_refused_before_anything_is_sharded():
    """CLIP's ``logit_scale`` (BLIP's ``temp``, ALIGN's ``temperature``) is a 0-dim parameter, which FSDP2 cannot
    shard: it refused it only at the root unit, with the layers already sharded and the process group made, the
    model left half converted. It is refused by name first: nothing sharded, no group made, and the model trains
    as it was."""
    import torch.distributed as dist
    from transformers import CLIPConfig, CLIPModel

    from tiered.offload import offload_model

    torch.manual_seed(0)
    layers = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    cfg = CLIPConfig(text_config=dict(vocab_size=VOCAB, max_position_embeddings=SEQ, **layers),
                     vision_config=dict(image_size=16, patch_size=4, **layers), projection_dim=16)  # fmt: skip
    model = CLIPModel(cfg).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"'logit_scale'.*0-dim.*FSDP2"):
        offload_model(model, device="cpu")
    assert not dist.is_initialized() and not hasattr(model, "tiered_offload")
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())  # nothing sharded
    assert not [m for m in model.modules() if type(m).__name__.startswith("FSDP")]
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    g = torch.Generator().manual_seed(0)
    ids, pixels = torch.randint(0, VOCAB, (3, SEQ), generator=g), torch.randn(3, 3, 16, 16, generator=g)
    model(input_ids=ids, pixel_values=pixels, return_loss=True).loss.backward()
    assert model.logit_scale.grad is not None
