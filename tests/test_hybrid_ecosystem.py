"""Hybrid models (Gated DeltaNet layers beside gated full attention; and LFM2's short convolutions, OLMo hybrid's Gated
DeltaNet, Kimi Linear's KDA beside NoPE latent attention) in the ecosystem, each client beside transformers' own class
(`Qwen3_5ForCausalLM`, `Qwen3NextForCausalLM`, `Lfm2ForCausalLM`, ...) with the same weights (converted by
`modular_decoder.conversion`): packed documents (each computed as alone: the linear layers restart their state at
every document), `Trainer` on padded and on packed batches, gradient checkpointing, PEFT LoRA on the linear
layers' projections (default targets; an adapter moving between transformers' class and ours) and the compiled
decode step."""

from __future__ import annotations

import pytest
import torch
from conversion_cases import CASES, converted_pair, lora_round_trip, perturbed, save_published, skip_without_class
from decoding import assert_compiled_decoding_matches, recording_backend, right_padded
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, Trainer, TrainingArguments

from modular_decoder import ModularDecoderForCausalLM
from modular_decoder.conversion import convert
from modular_decoder.hybrid_cache import HybridLayer
from modular_decoder.recurrent_cache import RecurrentLayer

pytestmark = pytest.mark.usefixtures("one_thread")

# Documents of 70 (crossing a 64-token chunk of the delta rule), 3, 6 and 1 tokens (shorter than the conv window)
DOCUMENTS = [[(7 * i + 3) % 90 + 1 for i in range(70)], [7, 14, 28], [11, 22, 33, 44, 55, 66], [5]]
LINEAR_TARGETS = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
ATTENTION_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next", "bamba", "nemotron_h", "falcon_h1"])
def pair(request, tmp_path_factory):
    """(transformers' model, ours converted from its checkpoint, the folders), fp32, eval."""
    return _pair(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    return _pair("qwen3_5_text", tmp_path_factory)


def _pair(case: str, tmp_path_factory):
    skip_without_class(case)
    return converted_pair(case, tmp_path_factory.mktemp(case))


def _packed(documents=DOCUMENTS):
    return DataCollatorWithFlattening(return_position_ids=True)([{"input_ids": d} for d in documents])


# --- packed documents ------------------------------------------------------------------------------


def test_packed_documents_equal_each_document_alone_in_transformers_class(pair):
    """One row of packed documents (as `DataCollatorWithFlattening` packs them): each document's logits equal
    transformers' class on that document alone."""
    theirs, ours, _ = pair
    batch = _packed()
    with torch.no_grad():
        packed = ours(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        start = 0
        for document in DOCUMENTS:
            alone = theirs(torch.tensor([document])).logits[0]
            torch.testing.assert_close(packed[start:start + len(document)], alone, rtol=1e-5, atol=1e-5)
            start += len(document)


def test_packed_rows_restart_at_row_starts_and_documents(pair):
    """Two rows, each holding two documents: each document computes what it computes alone (a row's start starts
    a document too), and a cache filled by the packed forward holds each row's last document's state."""
    _, ours, _ = pair
    rows = [(DOCUMENTS[1], DOCUMENTS[2][:4]), (DOCUMENTS[2][:2], DOCUMENTS[0][:5])]
    ids = torch.tensor([a + b for a, b in rows])
    positions = torch.tensor([list(range(len(a))) + list(range(len(b))) for a, b in rows])
    with torch.no_grad():
        output = ours(input_ids=ids, position_ids=positions, use_cache=True)
        for row, (a, b) in enumerate(rows):
            for offset, document in ((0, a), (len(a), b)):
                alone = ours(torch.tensor([document])).logits[0]
                torch.testing.assert_close(output.logits[row, offset:offset + len(document)], alone,
                                           rtol=1e-5, atol=1e-5)
        last = [ours(torch.tensor([b]), use_cache=True).cache for _, b in rows]
    for index, layer in enumerate(output.cache.layers):
        if isinstance(layer, (RecurrentLayer, HybridLayer)):
            layer = layer.recurrent if isinstance(layer, HybridLayer) else layer
            for row in range(len(rows)):
                alone = last[row].layers[index]
                alone = alone.recurrent if isinstance(alone, HybridLayer) else alone
                torch.testing.assert_close(layer.conv_state[row], alone.conv_state[0], rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(layer.recurrent_state[row], alone.recurrent_state[0], rtol=1e-5, atol=1e-6)


def test_packed_documents_call_the_convolution_module(qwen3_5):
    """The document-by-document convolution calls the module (one call per forward), so a hook on it runs and
    each document still computes as alone under it."""
    _, ours, _ = qwen3_5
    conv = ours.model.layers[0].linear_attn.conv1d
    calls = []

    def hook(module, inputs, output):
        calls.append(inputs[0].shape)
        return output * 1.5

    handle = conv.register_forward_hook(hook)
    try:
        batch = _packed(DOCUMENTS[1:3])
        with torch.no_grad():
            packed = ours(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
            assert len(calls) == 1
            alone = ours(torch.tensor([DOCUMENTS[2]])).logits[0]
    finally:
        handle.remove()
    torch.testing.assert_close(packed[len(DOCUMENTS[1]):], alone, rtol=1e-5, atol=1e-5)


# --- training --------------------------------------------------------------------------------------


def _grads(model, **inputs):
    model.zero_grad()
    model(**inputs).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_and_packing_give_the_same_gradients(pair):
    """Gradient checkpointing gives the plain gradients; a packed row gives the gradients of the same documents
    padded one per row (the same targets: `DataCollatorWithFlattening` masks each document's first label)."""
    _, ours, _ = pair
    model = ours.train()
    try:
        padded = right_padded([{"input_ids": d} for d in DOCUMENTS[:3]])
        plain = _grads(model, **padded)
        batch = _packed(DOCUMENTS[:3])
        packed = _grads(model, input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"])
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        checkpointed = _grads(model, **padded)
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
    assert plain.keys() == checkpointed.keys() == packed.keys()
    assert any(".linear_attn." in name for name in plain)
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(packed[name], plain[name], rtol=1e-4, atol=1e-6, msg=name)


def _train(model, collator, tmp_path, **arguments) -> list[float]:
    dataset = [{"input_ids": [(s * 5 + i) % 90 + 1 for i in range(6 + s % 5)]} for s in range(12)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3,
                             use_cpu=True, report_to=[], logging_steps=1, save_strategy="no",
                             remove_unused_columns=False, **arguments)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("case", ["qwen3_5_text", "bamba", "falcon_h1", "lfm2", "olmo_hybrid", "kimi_linear"])
def test_trainer_padded_and_packed_beside_transformers(case, tmp_path):
    """`Trainer` from the same weights and data: ours on padded batches, and on packed batches with gradient
    checkpointing, gives the loss curve of transformers' class (Qwen3.5, Bamba, Falcon-H1, LFM2, OLMo hybrid, Kimi
    Linear) on padded batches."""
    skip_without_class(case)
    config = CASES[case][1]()
    config.architectures = None
    torch.manual_seed(0)
    save_published(perturbed(AutoModelForCausalLM.from_config(config)), tmp_path / "theirs")
    convert(tmp_path / "theirs", tmp_path / "ours", progress=False)
    theirs = _train(AutoModelForCausalLM.from_pretrained(tmp_path / "theirs"), right_padded, tmp_path / "a")
    padded = _train(ModularDecoderForCausalLM.from_pretrained(tmp_path / "ours"), right_padded, tmp_path / "b")
    packed = _train(ModularDecoderForCausalLM.from_pretrained(tmp_path / "ours"),
                    DataCollatorWithFlattening(return_position_ids=True), tmp_path / "c", gradient_checkpointing=True)
    assert len(theirs) == 3
    torch.testing.assert_close(torch.tensor(padded), torch.tensor(theirs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(packed), torch.tensor(theirs), rtol=1e-5, atol=1e-5)


# --- PEFT ------------------------------------------------------------------------------------------


def _adapted(peft_model) -> set[str]:
    return {name.rsplit(".", 2)[-2] for name, _ in peft_model.named_modules() if name.endswith(".base_layer")}


# The modules `LoraConfig()` adapts (PEFT's Llama default, q_proj and v_proj, in this family's names) on each kind
LORA_DEFAULTS = {"qwen3_5_text": {"q_proj", "v_proj", "in_proj_qkv"}, "lfm2": {"q_proj", "v_proj", "in_proj"},
                 "olmo_hybrid": {"q_proj", "v_proj", "in_proj_qkv"},
                 "kimi_linear": {"q_proj", "v_proj", "kv_b_proj"}}  # KDA's q/v_proj, latent attention's q/kv_b_proj


@pytest.mark.parametrize("case", sorted(LORA_DEFAULTS))
def test_lora_defaults_adapt_the_linear_layers(case, tmp_path_factory):
    """`LoraConfig()` with no targets: PEFT's default for Llama (q_proj, v_proj), which on a hybrid also adapts the
    linear layers' projection of their queries and values (`in_proj_qkv`, the short convolution's `in_proj`, KDA's
    own `q_proj` / `v_proj`; `peft_targets.py`); one step trains them and the adapted model's cached decoding gives
    its uncached logits."""
    from peft import LoraConfig, get_peft_model

    _, _, path = _pair(case, tmp_path_factory)
    model = get_peft_model(ModularDecoderForCausalLM.from_pretrained(path / "ours"),
                           LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False))
    assert _adapted(model) == LORA_DEFAULTS[case]
    assert any(".linear_attn." in name for name, _ in model.named_modules() if name.endswith(".base_layer"))
    ids = torch.tensor([DOCUMENTS[2] + DOCUMENTS[1]])
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
        prefix = model(input_ids=ids[:, :5], use_cache=True)
        steps, cache = [prefix.logits], prefix.cache
        for t in range(5, ids.shape[1]):
            steps.append(model(input_ids=ids[:, t:t + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, rtol=1e-5, atol=1e-5)


def test_lora_adapter_moves_between_transformers_class_and_ours(qwen3_5, tmp_path):
    """A LoRA adapter on every projection of both layer kinds, made on transformers' Qwen3.5 (the module names are
    the same), loads onto ours with its logits; trained a step on ours, it loads back onto theirs with ours; and
    packed documents compute as alone under it. (PEFT adapts no depthwise `conv1d` at its default rank, on either
    side: rank must divide its groups.)"""
    _, _, path = qwen3_5
    ids = torch.tensor([DOCUMENTS[2] + DOCUMENTS[1]])
    ours, _ = lora_round_trip(path, LINEAR_TARGETS + ATTENTION_TARGETS, ids, tmp_path)
    batch = _packed([DOCUMENTS[2], DOCUMENTS[1]])
    with torch.no_grad():
        logits = ours(ids).logits
        packed = ours(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        alone = ours(torch.tensor([DOCUMENTS[1]])).logits
    torch.testing.assert_close(packed[:, len(DOCUMENTS[2]):], alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(packed[:, len(DOCUMENTS[2]):], logits[:, len(DOCUMENTS[2]):], atol=1e-3)


# --- compiled decoding ---------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["qwen3_5_text", "falcon_h1", "lfm2", "kimi_linear"])
def compiled_case(request, tmp_path_factory):  # (Falcon-H1: Mamba-2 in hybrid layers; LFM2, Kimi Linear: the
    return _pair(request.param, tmp_path_factory)  # short convolution and KDA beside NoPE latent attention)


def test_compiled_decode_step_gives_eager_and_transformers_tokens(compiled_case, two_threads):
    """`generate(**compiled_decoding())` (a static cache, the decode step compiled with fullgraph=True) on a hybrid of
    each recurrent kind: the step compiles, and the greedy tokens equal eager decoding and transformers' class
    through its own cache."""
    theirs, ours, _ = compiled_case
    assert_compiled_decoding_matches(ours, theirs, torch.tensor([DOCUMENTS[2]]))
