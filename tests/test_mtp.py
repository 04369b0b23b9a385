"""Multi-token prediction as configuration: the modules (named as transformers' `MtpLayer`, built from the family's
own block kinds), their training loss against an independent formulation, PEFT and Trainer reaching them, the
parameter formula, save / reload; the fields' rules."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainingArguments

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM, preset_config
from modular_decoder.contract import parameter_count
from modular_decoder.mtp import MultiTokenPredictor
from mtp_cases import drafted_steps, reference_drafts
from strategies import MAX_SEQ
from test_properties import _budget, model_cases
from test_properties import _model as _scrambled

V = 64


def tiny(num_mtp_layers: int = 1, **overrides) -> ModularDecoderConfig:
    fields = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=48, max_position_embeddings=64, num_mtp_layers=num_mtp_layers)
    return ModularDecoderConfig(**{**fields, **overrides})


def model_of(config, seed: int = 0) -> ModularDecoderForCausalLM:
    torch.manual_seed(seed)
    return ModularDecoderForCausalLM(config).eval()


def test_fields_defaults_and_refusals():
    assert tiny(0).num_mtp_layers == 0 and tiny(0).mtp_loss_scaling_factor == 0.0
    assert tiny(2).mtp_loss_scaling_factor == 0.1
    assert tiny(2, mtp_loss_scaling_factor=0.3).mtp_loss_scaling_factor == 0.3
    with pytest.raises(ValueError, match="mtp_loss_scaling_factor"):
        tiny(0, mtp_loss_scaling_factor=0.3)
    with pytest.raises(ValueError, match="mtp_loss_scaling_factor"):
        tiny(1, mtp_loss_scaling_factor=-1.0)
    with pytest.raises(ValueError, match="num_mtp_layers"):
        tiny(-1)
    with pytest.raises(ValueError, match="num_mtp_layers"):
        tiny("1")


@pytest.mark.parametrize("preset", ["llama", "deepseek_v3", "gemma3", "gpt2"])
def test_modules_are_the_last_layers_kinds_named_as_transformers(preset):
    config = preset_config(preset, tiny=True, num_mtp_layers=2)
    model = ModularDecoderForCausalLM(config)
    last = model.model.layers[-1]
    for k, layer in enumerate(model.mtp.layers):
        assert type(layer.mtp_block) is type(last) and layer.mtp_block.self_attn.layer_idx == k
        assert type(layer.mtp_block.self_attn) is type(last.self_attn)
        assert type(layer.mtp_block.mlp) is type(last.mlp)
    names = {n for n, _ in model.named_parameters() if n.startswith("mtp.layers.0.")}
    assert {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
            "mtp.layers.0.post_norm.weight"} <= names
    assert all(n.startswith(("mtp.layers.0.enorm", "mtp.layers.0.hnorm", "mtp.layers.0.eh_proj",
                             "mtp.layers.0.post_norm", "mtp.layers.0.mtp_block.")) for n in names)
    counts = parameter_count(config)
    assert counts["total"] == model.num_parameters()
    assert counts["active"] == parameter_count(preset_config(preset, tiny=True))["active"]
    assert ModularDecoderForCausalLM(preset_config(preset, tiny=True)).mtp is None


def _reference_mtp_loss(model, ids):
    """The MTP loss written another way (`_module_losses`): module k runs only on the positions that have a token
    k+1 places ahead and a label k+2 places ahead (sequences trimmed, not padded); the mean over modules."""
    return torch.stack(_module_losses(model, ids)).mean()


@pytest.mark.parametrize("num_mtp_layers", [1, 2])
def test_training_loss_adds_the_weighted_mtp_loss(num_mtp_layers):
    model = model_of(tiny(num_mtp_layers, mtp_loss_scaling_factor=0.3))
    ids = torch.randint(0, V, (3, 12), generator=torch.Generator().manual_seed(1))
    out = model(input_ids=ids, labels=ids)
    plain = ModularDecoderForCausalLM.loss_function.fget(model)(logits=out.logits, labels=ids, vocab_size=V)
    torch.testing.assert_close(out.mtp_loss, _reference_mtp_loss(model, ids), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loss, plain + 0.3 * out.mtp_loss, rtol=1e-6, atol=1e-6)
    assert model(input_ids=ids).mtp_loss is None  # no labels, no modules run
    out.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.mtp.parameters())


def test_training_loss_through_inputs_embeds_and_padding():
    model = model_of(tiny(2))
    ids = torch.randint(1, V, (1, 10), generator=torch.Generator().manual_seed(2))
    alone = model(input_ids=ids, labels=ids).mtp_loss
    embeds = model(inputs_embeds=model.model.embed_tokens(ids), labels=ids).mtp_loss
    torch.testing.assert_close(embeds, alone, rtol=1e-6, atol=1e-6)
    # left padding: the padded row scores the same positions with the same inputs
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], dim=1)
    labels = padded.masked_fill(mask == 0, -100)
    torch.testing.assert_close(model(input_ids=padded, attention_mask=mask, labels=labels).mtp_loss, alone,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer_types", [None, ["full_attention", "linear_attention"]], ids=["attention", "linear"])
def test_packed_documents_train_each_module_within_its_document(layer_types):
    """Documents packed in one row (positions restarting, no mask): the modules' loss is the token-weighted mean of
    each document's own, nothing scored across a boundary (nor carried across one: a linear-attention block's state
    restarts at each document, as the model's layers' do)."""
    # scrambled: weights large enough that a state carried across the boundary shows in the loss
    model = _scrambled(tiny(2, **({"layer_types": layer_types} if layer_types else {})), 0)
    docs = [torch.randint(0, V, (1, n), generator=torch.Generator().manual_seed(n)) for n in (7, 9)]
    packed = torch.cat(docs, dim=1)
    positions = torch.cat([torch.arange(d.shape[1]) for d in docs]).unsqueeze(0)
    with torch.no_grad():
        out = model(input_ids=packed, position_ids=positions, labels=packed).mtp_loss
        # each module k scores n - k - 2 positions of a document of n tokens
        per_doc = [(model(input_ids=d, labels=d).mtp_loss, d.shape[1]) for d in docs]
    depth_counts = [[n - k - 2 for k in range(2)] for _, n in per_doc]
    # per module: token-weighted over documents; the modules' losses are then averaged
    separate = [[_module_losses(model, d)[k] for k in range(2)] for d in docs]
    expected = sum(sum(separate[i][k] * depth_counts[i][k] for i in range(2)) / sum(c[k] for c in depth_counts)
                   for k in range(2)) / 2
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert all(torch.isfinite(loss) for loss, _ in per_doc)


def _module_losses(model, ids) -> list[torch.Tensor]:
    losses = []
    hidden = model.model(input_ids=ids).last_hidden_state
    embeds = model.model.embed_tokens(ids)
    for depth, layer in enumerate(model.mtp.layers):
        ahead = depth + 1
        length = ids.shape[1] - ahead
        positions = torch.arange(ahead, ahead + length).unsqueeze(0)
        hidden = hidden[:, :length]
        hidden = layer(embeds[:, ahead:], hidden,
                       **model._mtp_block_kwargs(depth, embeds[:, ahead:], positions, None, None, False))
        logits = model._logits(hidden)[:, : length - 1]
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, ahead + 1:].flatten()))
    return losses


def test_peft_lora_reaches_the_modules_and_trains_them():
    model = model_of(tiny(1, initializer_range=0.1))
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "eh_proj"]))
    wrapped = {name for name, module in peft_model.named_modules() if hasattr(module, "lora_A")}
    assert any(".mtp.layers.0.mtp_block.self_attn.q_proj" in name for name in wrapped)
    assert any(".mtp.layers.0.eh_proj" in name for name in wrapped)
    ids = torch.randint(0, V, (4, 12), generator=torch.Generator().manual_seed(3))
    out = peft_model(input_ids=ids, labels=ids)
    assert out.mtp_loss is not None
    out.loss.backward()
    grads = {n: p.grad for n, p in peft_model.named_parameters() if "lora_B" in n and ".mtp." in n}
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())


def test_trainer_trains_the_modules_and_saves_them(tmp_path):
    model = ModularDecoderForCausalLM(tiny(1))
    before = {n: p.detach().clone() for n, p in model.mtp.named_parameters()}
    starts = torch.randint(0, V, (16,), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": ((s + torch.arange(12)) % V).tolist(), "labels": ((s + torch.arange(12)) % V).tolist()}
            for s in starts]
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4,
                             learning_rate=1e-3, use_cpu=True, report_to=[], save_strategy="no")
    Trainer(model=model, args=args, train_dataset=data).train()
    assert all(not torch.equal(p, before[n]) for n, p in model.mtp.named_parameters())
    model.save_pretrained(tmp_path / "saved")
    again = ModularDecoderForCausalLM.from_pretrained(tmp_path / "saved")
    assert again.config.num_mtp_layers == 1
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_mtp_block_config_is_the_last_layers():
    config = tiny(2, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    block_config = MultiTokenPredictor(config).block_config
    assert block_config.layer_types == ["full_attention"] * 2 and block_config.num_hidden_layers == 2
    assert config.layer_types == ["sliding_attention", "full_attention"]  # the model's own is untouched


# ---------------------------------------------------------------------------------------------
# drafting over the whole config space


@given(case=model_cases(min_length=3))
@_budget(0.1)  # two generate calls per example
def test_every_draft_equals_the_modules_without_a_cache_and_tokens_stay_greedy(case):
    """Across drawn configs with MTP modules (windows, MLA, DSA, ALiBi, sinks, NoPE, MoE, every norm placement, ...):
    each step's drafts (one per module, or the drawn `mtp_draft_tokens`, past the modules the last one again) are what
    the modules compute from the verified text without a cache, and the tokens are plain greedy decoding's."""
    config, seed, ids = case
    # no EOS: every step drafts (a drawn EOS may end decoding at its first token)
    try:
        config = ModularDecoderConfig(**{**config.to_dict(), "num_mtp_layers": config.num_mtp_layers or 1,
                                         "eos_token_id": None})
    except ValueError:  # a topology MTP modules do not join (AltUp, per-layer embeddings: refused by name there)
        assume(False)
    assume(config.attention_kind.rollback_error(config) is None)  # (DeepSeek-V4's compressed cache: MTP refused)
    model = _scrambled(config, seed)
    new_tokens = 4
    # within MAX_SEQ with the last step's drafts: past it a drawn length-dependent RoPE (dynamic, longrope) changes
    # its tables with the length of the call, which no cache follows (see strategies.MAX_SEQ)
    prompt = ids[:1, : MAX_SEQ - new_tokens - (config.mtp_draft_tokens or config.num_mtp_layers)]
    # every prompt token is text (generate would take a token equal to the pad id for padding)
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, attention_mask=torch.ones_like(prompt),
                  pad_token_id=0)
    drafted, steps, _ = drafted_steps(model, prompt, **kwargs)
    assert torch.equal(drafted, model.generate(prompt, **kwargs))
    assert steps
    for input_ids, draft, logits in steps:
        expected = reference_drafts(model, input_ids, draft)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        assert torch.equal(draft, expected.argmax(-1))


@pytest.mark.parametrize("drafting", [{"prompt_lookup_num_tokens": 3}, {"assistant_early_exit": 1}],
                         ids=["prompt-lookup", "early-exit"])
def test_transformers_other_drafters_give_plain_greedy_tokens(drafting):
    """Prompt lookup and assistant early exit (transformers lowers `num_hidden_layers` while the model drafts with
    its first layers) beside MTP: the tokens of plain greedy decoding."""
    model = model_of(tiny(0, num_hidden_layers=3))
    prompt = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    kwargs = dict(max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompt), pad_token_id=0)
    drafted = model.generate(prompt, **drafting, **kwargs)
    assert torch.equal(drafted, model.generate(prompt, **kwargs))
    assert model.config.num_hidden_layers == 3  # restored after drafting
