"""Every PEFT method that has default targets for Llama has them for this family (`peft_targets.py`): its config
with no `target_modules` (`IA3Config()`, `VeraConfig()`, `OFTConfig()`, ...) on a tiny model of each attention
kind, beside transformers' `LlamaForCausalLM` with the same config. Where the method works on Llama it works on
ours: the translated modules adapted, the same output as the base model at init where Llama's is, a backward
pass reaching the adapter. (PEFT's own `tests/test_decoder_models.py` is the full check; it runs outside this
suite, docs/using.md.)"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from modular_decoder import PRESETS, ModularDecoderForCausalLM, preset_config
from modular_decoder.peft_targets import LLAMA_TO_OURS, MODEL_TYPE, peft_target_tables, translated
from modular_decoder.registries import ATTENTIONS, LINEAR_ATTENTIONS

peft = pytest.importorskip("peft")
from peft import get_peft_model  # noqa: E402
from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# Tiny models: sizes some methods' defaults do not fit (they fail on Llama just the same), set per method
SMALL = {"C3A": dict(block_size=8), "MISS": dict(r=8), "SHIRA": dict(r=4), "PSOFT": dict(r=4),
         "ROAD": dict(group_size=8), "VBLORA": dict(vector_length=8), "FOURIERFT": dict(n_frequency=16),
         "WAVEFT": dict(n_frequency=16), "ADALORA": dict(total_step=10)}
# a tiny preset of each attention kind: these where named, else the first preset of that kind
PREFERRED = {"standard": "llama", "mla": "deepseek_v3"}


def kind_preset(kind: str) -> str | None:
    if kind in PREFERRED:
        return PREFERRED[kind]
    return next((name for name in sorted(PRESETS) if preset_config(name, tiny=True).attention_type == kind), None)


def linear_kind_preset(kind: str) -> str | None:
    """The first preset whose `layer_types` hold linear-attention layers of this kind (beside full attention)."""
    return next((name for name in sorted(PRESETS) if (config := preset_config(name, tiny=True)).linear_attention_type
                 == kind and "linear_attention" in config.layer_types), None)


KIND_PRESETS = {kind: kind_preset(kind) for kind in sorted(ATTENTIONS)}
KIND_PRESETS.update({f"linear_attention:{kind}": linear_kind_preset(kind) for kind in sorted(LINEAR_ATTENTIONS)})
# the residual topologies: chunked / NoPE layers and input-scaled experts; shared K/V and per-layer embeddings;
# AltUp's streams and LAUREL
KIND_PRESETS.update({f"topology:{name}": name for name in ("llama4", "gemma4", "gemma3n")})
# Methods whose default config fails on the family's own transformers class too: ShadowPEFT's one-layer copy of the
# backbone keeps `num_kv_shared_layers`, which Gemma4ForCausalLM / Gemma3nForCausalLM refuse as ours do
FAILS_ON_THE_FAMILY_CLASS = {("SHADOW", "topology:gemma4"), ("SHADOW", "topology:gemma3n")}


def methods() -> list[str]:
    """Every PEFT method that adapts modules (not prompt learning), by `PeftType` name: those with Llama defaults
    work on Llama with their default config; the others fail there too and are skipped."""
    from peft.config import PromptLearningConfig

    return sorted(peft_type.value for peft_type, config in PEFT_TYPE_TO_CONFIG_MAPPING.items()
                  if not issubclass(config, PromptLearningConfig))


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval()


# Some methods run the model on `inputs_embeds` (SHADOW); DeepSeek-V4's hash routing needs the ids (as transformers'
# class does), so its preset is tried here without it: the adapters are the attention's and experts' all the same
WITHOUT_IDS = {"shared_kv": dict(num_hash_layers=0)}
# Methods that read the decoder layers' hidden states as (B, T, d)
READS_ONE_STREAM = ("SHADOW",)


def _ours(kind: str) -> ModularDecoderForCausalLM:
    torch.manual_seed(0)
    return ModularDecoderForCausalLM(preset_config(KIND_PRESETS[kind], tiny=True, **WITHOUT_IDS.get(kind, {}))).eval()


def _adapted(peft_model) -> set[str]:
    """The leaf names of the modules PEFT wrapped (its layers hold the original as `base_layer`)."""
    return {name.rsplit(".", 2)[-2] for name, _ in peft_model.named_modules() if name.endswith(".base_layer")}


def _run(model, method: str):
    """(PEFT model, base logits, adapted logits at init), after one backward pass; or the exception."""
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(ids).logits
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config_class = PEFT_TYPE_TO_CONFIG_MAPPING[peft.PeftType(method)]
            adapted = get_peft_model(model, config_class(task_type="CAUSAL_LM", **SMALL.get(method, {})))
            with torch.no_grad():
                at_init = adapted(input_ids=ids).logits
            adapted.train()
            adapted(input_ids=ids, labels=ids).loss.backward()
    except Exception as error:  # noqa: BLE001 -- compared with what Llama raises
        return error
    assert any(p.grad is not None for p in adapted.parameters() if p.requires_grad), method
    return adapted, base, at_init


def test_every_attention_kind_has_a_tiny_preset():  # linear-attention kinds too, in a hybrid preset
    assert all(KIND_PRESETS.values()), f"an attention kind without a preset to test PEFT on: {KIND_PRESETS}"


def test_every_llama_table_has_our_entry_in_our_names():
    model = _ours("standard")
    model.config.to_dict()  # what PEFT reads before its look-up: registers the entries
    tables = peft_target_tables()
    for name in ("LORA_TARGET", "IA3_TARGET", "IA3_FEEDFORWARD", "LNTUNING_TARGET", "ADALORA_TARGET", "VERA_TARGET"):
        assert f"TRANSFORMERS_MODELS_TO_{name}_MODULES_MAPPING" in tables  # tables of every release from 0.15
    for name, table in tables.items():
        assert table[MODEL_TYPE] == translated(table["llama"]), name
        assert set(table["llama"]) <= set(LLAMA_TO_OURS), f"{name}: a Llama target this family does not translate"


def test_peft_reads_its_defaults_where_peft_targets_writes_them(monkeypatch):
    """PEFT offers no public way to give a custom `model_type` default targets: each method reads them from its
    module-level table in `peft.utils.constants` by `model.config.to_dict()["model_type"]`, the config asked right
    before the look-up. This fails when PEFT moves any of that (docs/contract.md)."""
    import inspect

    from peft.tuners.lora import LoraModel
    from peft.tuners.tuners_utils import BaseTuner

    model = _ours("standard")
    tables = peft_target_tables()
    lora = tables["TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING"]
    assert LoraModel.target_module_mapping is lora  # the method reads the table in place
    assert 'target_module_mapping.get(model_config["model_type"])' in inspect.getsource(
        LoraModel._prepare_adapter_config)
    monkeypatch.delitem(lora, MODEL_TYPE)
    assert BaseTuner.get_model_config(model)["model_type"] == MODEL_TYPE  # PEFT's read of the config...
    assert lora[MODEL_TYPE] == translated(lora["llama"])  # ...registers the entry before the look-up
    for tuner in {config for config in PEFT_TYPE_TO_TUNER_MAPPING.values()}:
        mapping = getattr(tuner, "target_module_mapping", None)
        if isinstance(mapping, dict) and mapping.get("llama"):  # every method with Llama defaults reads a table
            assert any(mapping is table for table in tables.values()), tuner.__name__


@pytest.mark.parametrize("kind", sorted(KIND_PRESETS))
@pytest.mark.parametrize("method", methods())
def test_each_method_s_default_config_works_where_it_works_on_llama(method, kind):
    reference = _run(_llama(), method)
    if isinstance(reference, Exception):
        pytest.skip(f"{method}'s default config fails on transformers' Llama too: {reference}")
    if method in READS_ONE_STREAM and preset_config(KIND_PRESETS[kind], tiny=True).residual_stream != "single":
        pytest.skip(f"{method} reads each layer's output as one stream; hyper-connections' layers hold several "
                    "(as transformers' DeepSeek-V4's do)")
    result = _run(_ours(kind), method)
    if (method, kind) in FAILS_ON_THE_FAMILY_CLASS:
        assert isinstance(result, Exception)
        pytest.skip(f"{method}'s default config fails on the family's own transformers class too")
    assert not isinstance(result, Exception), f"{method} works on Llama, not on ours ({kind}): {result!r}"
    (llama_model, llama_base, llama_init), (ours_model, ours_base, ours_init) = reference, result
    config = ours_model.peft_config["default"]
    adapted = _adapted(ours_model)
    assert adapted and _adapted(llama_model)
    named = set(config.target_modules) if isinstance(config.target_modules, (list, set, tuple)) else set()
    assert named & _module_names(ours_model) <= adapted  # every default target this model has is adapted
    if torch.allclose(llama_init, llama_base, atol=1e-6):  # an identity at init on Llama is one here too
        torch.testing.assert_close(ours_init, ours_base, rtol=0, atol=1e-5)


def _module_names(peft_model) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, module in peft_model.named_modules()
            if not name.endswith(".base_layer") and name.rsplit(".", 1)[-1] in set().union(*LLAMA_TO_OURS.values())}
