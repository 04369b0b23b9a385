"""The modular decoder: embeddings, a stack of configurable blocks, and a language-model head."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

# first: importing compat checks the transformers version (a saved folder loads its config through this module)
from .compat import (  # isort: skip
    accepts_past_key_values, attn_implementation, cache_of, create_masks_for_generate, drafted_tokens_per_step,
    drafting_generation_config, drafts_grow, generate_cache_kwarg, slice_logits_to_keep, static_cache_length,
    with_cache, with_old_cache_name,
)

import torch  # noqa: E402
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .alibi_kernels import takes_alibi_slopes
from .attention_layer import AttentionLayer
from .backend_features import BOTTOM_RIGHT_CAUSAL, canonical_backend, check_backend, default_backend
from .blocks import BLOCKS, DecoderBlock, block_class
from .cache import ModularDecoderCache
from .checkpoint_checks import check_checkpoint
from .chunked_attention import CHUNKED_ATTENTION, CHUNKED_ATTENTION_FEATURE
from .compressed_attention import COMPRESSED_LAYER_TYPES
from .compressed_cache import refuse_rollback_decoding
from .configuration_modular_decoder import ModularDecoderConfig
from .experts import experts_kernels_available
from .gated_deltanet import GatedRMSNorm
from .input_checks import check_generate_inputs, check_inputs, check_token_ids, generating
from .kinds import LINEAR_ATTENTION, attention_layer_type, mixer_layer_types
from .kept_positions import keep_last, kept_positions_from
from .kv_assistant import check_kv_assistant, drafter_kv, kv_assistant_drafter, reads_model_kv
from .kv_sharing import drafter_kv_layers, kv_sources
from .mamba2 import GroupedGatedRMSNorm
from .moe import init_moe_weights
from .mtp import MultiTokenPredictor, default_draft_vocab
from .mtp_generation import (MtpCandidateGenerator, check_draft_tokens, check_static_drafting, check_use_mtp,
                             drafting_options, drafting_refusal, options_of, static_cache_room)
from .norms import LayerNorm, RMSNorm, build_norm
from .packed_documents import PackedDocuments, packed_documents
from .per_layer_embeddings import PER_LAYER_EMBEDDINGS, PerLayerEmbeddings
from .positions import (ABSOLUTE_POSITIONS, AlibiBias, LearnedPositions, RotaryEmbedding, attending_layer_types,
                        keys_rotated_before_the_switch, rotary_layers)
from .recurrent_mixer import RecurrentMixer
from .registries import RESIDUAL_STREAMS
from .routers import TopKRouter, router_losses
from .split_products import project

def linear_attention_mask(config, inputs_embeds, attention_mask, position_ids=None, **cache_kwarg) -> torch.Tensor | None:
    """The padding mask a linear-attention layer multiplies its input by (`None`: nothing to remove).

    The columns of a 2-D `attention_mask` that hold the new tokens (which the layer multiplies its input by, so
    padding writes nothing into its state), or `None` where there is no padding to remove: no 2-D mask, or a
    one-token step (a generated token is never padding). Unlike transformers' `create_recurrent_attention_mask`, it
    reads no values (no host sync) and finds the new tokens' columns by the cache's count, so a mask padded to a
    static cache's length works too."""
    seq = inputs_embeds.shape[1]
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 or seq == 1:
        return None
    cache = next(iter(cache_kwarg.values()), None)
    return new_token_columns(attention_mask, _tokens_before(cache), seq).to(inputs_embeds.dtype)


# (a compressed layer attends to a window, then to its entries, which it masks itself: `compressed_attention.py`)
MASK_BUILDERS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask,
                 **dict.fromkeys(COMPRESSED_LAYER_TYPES, create_sliding_window_causal_mask),
                 CHUNKED_ATTENTION: CHUNKED_ATTENTION_FEATURE.mask_builder, LINEAR_ATTENTION: linear_attention_mask}


class ModularDecoderPreTrainedModel(PreTrainedModel):
    config_class = ModularDecoderConfig
    config: ModularDecoderConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = [cls.__name__ for cls in BLOCKS.values()]
    _skip_keys_device_placement = ["cache", "past_key_values"]  # the name transformers < 5.24 passes
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    # Attention weights are what each block's `self_attn` returns second, whatever kind built it;
    # router logits what each sparse layer's router returns first (recorded only with routed experts)
    _can_record_outputs = {
        "hidden_states": DecoderBlock,
        "attentions": OutputRecorder(None, index=1, class_name="self_attn"),
        "router_logits": OutputRecorder(TopKRouter, index=0),
    }

    def __init__(self, config: ModularDecoderConfig, *inputs, **kwargs):
        super().__init__(config, *inputs, **kwargs)
        # read by `from_pretrained` in half precision (e.g. DeepSeek-V3's sigmoid routers stay fp32)
        self._keep_in_fp32_modules_strict = [*config.mlp_kind.fp32_parameters(config),
                                             *RESIDUAL_STREAMS.of(config).fp32_modules(config)]
        self._keep_in_fp32_modules = list(config.attention_kind.fp32_modules(config))  # under fp16 only

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        """Whether `experts_implementation=` (and transformers' experts kernels) apply: transformers
        guesses it by searching the modeling file for its decorator, but the experts module lives in
        experts.py, decorated there whenever this transformers has the kernels. With it, transformers'
        default is its own ("grouped_mm"); "eager" selects `experts.Experts.forward`. (A hook of
        transformers' `PreTrainedModel`, as is the next: see compat.py.)"""
        return experts_kernels_available()

    def _check_and_adjust_attn_implementation(self, attn_implementation, is_init_check=False, **kwargs):
        """Default to SDPA only where it can honour the contract; refuse a backend that cannot."""
        if attn_implementation is None:
            attn_implementation = default_backend(self.config)
        check_backend(self.config, attn_implementation)  # the contract first, whether or not a kernel is installed
        chosen = super()._check_and_adjust_attn_implementation(attn_implementation, is_init_check, **kwargs)
        check_backend(self.config, chosen)
        return chosen

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save weights, config and the code files, so the folder loads where this package is not installed.

        `auto_map` names all three Auto classes, so the folder loads with `trust_remote_code=True` (the config
        class through this module too: `ModularDecoderConfig.to_dict` says why)."""
        module = "modeling_modular_decoder"
        self.config.auto_map = {
            "AutoConfig": f"{module}.ModularDecoderConfig",
            "AutoModel": f"{module}.ModularDecoderModel",
            "AutoModelForCausalLM": f"{module}.ModularDecoderForCausalLM",
        }
        return super().save_pretrained(save_directory, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, *args, strict: bool = True, **kwargs):
        """transformers' `from_pretrained`, after a check of the checkpoint against its config.

        With `strict=True` (the default) a checkpoint that would load silently wrong raises a `ValueError`
        naming the tensors, before the model is built (`checkpoint_checks.check_checkpoint` reads only the
        safetensors headers): mis-shaped tensors, or a part it holds (the base model, the head) that does not
        match the config. What transformers loads by design loads here too and is reported as it reports it
        (`output_loading_info=True`, its load report): a base model's checkpoint in `ForCausalLM` gets a
        fresh `lm_head`. `strict=False` loads a partial or different checkpoint as transformers does.
        """
        if "decode_layout" in kwargs:  # transformers would store an unknown keyword in the config
            raise ValueError(
                "`decode_layout` was removed: parameters are always stored as saved; the few-row products "
                "that made decoding fast are computation only (`MODULAR_DECODER_SPLIT_PRODUCTS=0` turns them off)."
            )
        if strict:
            check_checkpoint(cls, args[0] if args else kwargs.get("pretrained_model_name_or_path"), kwargs)
        return super().from_pretrained(*args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if init_moe_weights(module, std, init):
            return
        if isinstance(module, (RMSNorm, LayerNorm)):
            # `1 + w` norms start at w = 0 so that they start as the identity scale
            init.zeros_(module.weight) if module.unit_offset else init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, RotaryEmbedding):
            fresh = RotaryEmbedding(self.config)
            for name, buffer in fresh.named_buffers():
                init.copy_(getattr(module, name), buffer)
        elif isinstance(module, AlibiBias):
            init.copy_(module.slopes, AlibiBias(self.config).slopes)
        elif isinstance(module, AttentionLayer) and module.sinks is not None:
            init.normal_(module.sinks, mean=0.0, std=std)  # as transformers' gpt-oss
        elif isinstance(module, RecurrentMixer):  # a recurrent mixer's own parameters (its kind's rule)
            module.init_scan_parameters(init)
        elif isinstance(module, (GatedRMSNorm, GroupedGatedRMSNorm)):
            init.ones_(module.weight)
        elif isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d)):
            init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, MultiTokenPredictor) and module.draft_vocab is not None:  # no ranking saved
            init.copy_(module.draft_vocab, default_draft_vocab(module.draft_vocab.numel()))
        elif hasattr(module, "inv_freq"):  # sinusoidal table
            fresh = ABSOLUTE_POSITIONS["sinusoidal"](self.config)
            init.copy_(module.inv_freq, fresh.inv_freq)
        if hasattr(module, "init_own_weights"):  # a mechanism's own tensors (a layer scalar, AltUp's coefficients,
            # hyper-connections, compressors' position biases)
            module.init_own_weights(init, std)


@dataclass
class ModularDecoderModelOutput(MoeModelOutputWithPast):
    """The base model's output: transformers' MoE output, and the keys and values a drafter reads.

    `shared_kv_states` (with `return_shared_kv_states=True`, which transformers' assisted decoding passes for its
    Gemma 4 assistant; else `None`): per attention type, the (keys, values) (B, H_kv, T_kv, D) that the last layer of
    that type computing its own attended to in this forward, as transformers' Gemma 4 returns them
    (`kv_assistant.py`)."""

    shared_kv_states: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None


class ModularDecoderModel(ModularDecoderPreTrainedModel):
    """Embeddings (+ absolute positions, multiplier, optional norm), the blocks, the final norm."""

    def __init__(self, config: ModularDecoderConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        position_cls = ABSOLUTE_POSITIONS.get(config.position_embedding_type)
        self.embed_positions = position_cls(config) if position_cls is not None else None
        self.embed_norm = build_norm(config) if config.embedding_norm else None
        self.embed_dropout = nn.Dropout(config.hidden_dropout)
        self.rotary_emb = RotaryEmbedding(config) if config.uses_rope else None
        self.alibi = AlibiBias(config) if config.position_embedding_type == "alibi" else None
        # the stream(s) the layers join their outputs to, made from the embedded input (`residual_streams.py`)
        self.residual_stream = RESIDUAL_STREAMS.of(config).model_module(config)
        self.per_layer_embeddings = PerLayerEmbeddings(config) if PER_LAYER_EMBEDDINGS.in_use(config) else None
        self.layers = nn.ModuleList(block_class(config, i)(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = build_norm(config) if config.final_norm else None
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed_tokens = value

    @accepts_past_key_values
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> ModularDecoderModelOutput:
        """Embeds, runs every block with the masks / positions of its layer type, and norms. With an integer
        `logits_to_keep`, the layers that cache nothing run on the positions kept only (`kept_positions.py`).

        `position_ids` default to counting the real tokens of a 2-D `attention_mask` (so left
        padding does not shift positions), else to the cache length onwards. Packed documents
        are expressed by `position_ids` restarting at 0 with no `attention_mask`: attention layers
        mask across them, linear-attention layers restart their state at each (`packed_documents.py`).

        Serving: vLLM's Transformers backend calls this forward with its requests packed in one row,
        positions in `position_ids` and no cache; `**kwargs` reach every attention call, where it
        puts its own kernel and paged cache (docs/serving.md).
        """
        self._check_inputs(input_ids, attention_mask, inputs_embeds, cache)
        packed_positions = self._packed_document_positions(position_ids, cache)
        use_cache = self._use_cache(use_cache)
        if inputs_embeds is None:
            inputs_embeds = self._embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = ModularDecoderCache(self.config)
        past_seen = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = self._default_position_ids(inputs_embeds, attention_mask, past_seen)

        hidden = self._embed(inputs_embeds, position_ids)
        # `return_shared_kv_states`: hand a drafter the keys and values it reads (transformers' name; kv_assistant.py)
        hand_over = kwargs.pop("return_shared_kv_states", False)
        layer_inputs = self._layer_inputs(input_ids, hidden, hand_over)
        masks = self._masks(inputs_embeds, attention_mask, packed_positions, cache, past_seen)
        rotary = self._rotary_tables(hidden, position_ids)
        layer_kwargs = self._alibi_kwargs(hidden, cache)
        if (documents := self._linear_documents(packed_positions, attention_mask, inputs_embeds)) is not None:
            layer_kwargs[LINEAR_ATTENTION] = {"documents": documents}
        hidden = self.residual_stream(hidden)  # the stream(s) the layers join (`residual_streams.py`)
        cut_from = kept_positions_from(self, logits_to_keep, inputs_embeds.shape[1], masks, cache, kwargs)

        layer_types = self.config.layer_types
        by_type = layer_type_kwargs(layer_types, masks, layer_kwargs)
        # the first `num_hidden_layers` as transformers' models run them: its assistant early exit drafts with
        # the model itself after lowering that number
        for layer_idx, block in enumerate(self.layers[: self.config.num_hidden_layers]):
            if layer_idx == cut_from:
                hidden, masks, rotary, position_ids, input_ids, layer_inputs = keep_last(
                    logits_to_keep, RESIDUAL_STREAMS.of(self.config).position_dim, hidden, masks, rotary,
                    position_ids, input_ids, layer_inputs)
                by_type = layer_type_kwargs(layer_types, masks, layer_kwargs)  # (the masks of the kept positions)
            hidden = block(
                hidden,
                position_embeddings=rotary[layer_idx],
                position_ids=position_ids,
                input_ids=input_ids,
                cache=cache,
                **by_type[layer_types[layer_idx]],
                **layer_inputs[layer_idx],
                **kwargs,
            )
        hidden = self.residual_stream(hidden, leaving=True)
        if self.final_norm is not None:
            hidden = self.final_norm(hidden)
        return ModularDecoderModelOutput(last_hidden_state=hidden, **with_cache(cache if use_cache else None),
                                         shared_kv_states=drafter_kv(self.config, layer_inputs, hand_over))

    def _layer_inputs(self, input_ids, hidden: torch.Tensor, hand_over: bool = False) -> list[dict]:
        """What each layer takes beside the stream: its per-layer embedding (`per_layer_input`), and for layers that
        share keys and values, or hand them to a drafter (`hand_over`), this forward's dict of them (`shared_kv`,
        `kv_sharing.py`)."""
        inputs = [{} for _ in range(self.config.num_hidden_layers)]
        if self.per_layer_embeddings is not None:
            for layer_input, embedding in zip(inputs, self.per_layer_embeddings(input_ids, hidden).unbind(2)):
                layer_input["per_layer_input"] = embedding
        if not self.config.num_kv_shared_layers and not hand_over:  # (no layer reads another's: the common case)
            return inputs
        sources = kv_sources(self.config)
        sharing = set(sources) | {i for i, source in enumerate(sources) if source is not None}
        if hand_over:
            sharing |= set(drafter_kv_layers(self.config).values())
        shared = {}
        for layer_idx in sharing - {None}:
            inputs[layer_idx]["shared_kv"] = shared
        return inputs

    def _check_inputs(self, input_ids, attention_mask, inputs_embeds, cache) -> None:
        """Exactly one of ids or embeddings, and each input what it claims (`input_checks.check_inputs`)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` or `inputs_embeds`.")
        check_inputs(self.config, input_ids, attention_mask, inputs_embeds, cache)

    @staticmethod
    def _packed_document_positions(position_ids, cache) -> torch.Tensor | None:
        """The packed-document policy: documents packed in one row are told by `position_ids` restarting
        at 0 (no `attention_mask`), looked for (one host read, in transformers' mask builders) only in
        positions a caller gave without a cache, as transformers' models look for them; generate always
        passes a cache."""
        return position_ids if cache is None else None

    def _linear_documents(self, packed_positions, attention_mask, inputs_embeds) -> PackedDocuments | None:
        """The packed documents a linear-attention layer restarts its state at, where the packed-document policy
        looks for documents (positions given, no mask, no cache) and there are linear layers: one more host read,
        in that case only (`packed_documents.packed_documents`)."""
        if packed_positions is None or attention_mask is not None:
            return None
        if not self.config.linear_attention_kind.in_use(self.config):
            return None
        return packed_documents(packed_positions, inputs_embeds.shape[0])

    def _use_cache(self, use_cache: bool | None) -> bool:
        """The caller's `use_cache`, else the config's; never while training with gradient checkpointing."""
        if self.gradient_checkpointing and self.training:
            return False
        return use_cache if use_cache is not None else self.config.use_cache

    def _masks(self, inputs_embeds, attention_mask, packed_positions, cache, past_seen) -> dict:
        """The attention mask of each layer type, from transformers' mask builders (`MASK_BUILDERS`).

        generate() pre-builds them for a static cache (a dict, used as given). The cache the builders see,
        and the mask beside a static cache, come from `_mask_cache` and `_static_cache_mask`.
        """
        if isinstance(attention_mask, dict):
            return attention_mask
        mask_cache = self._mask_cache(cache, past_seen)
        if attention_mask is None:
            attention_mask = self._static_cache_mask(inputs_embeds, mask_cache, past_seen)
        layer_types = {t for layer_type in set(self.config.layer_types) for t in mixer_layer_types(layer_type)}
        # one mask per builder: layer types that share one (a window on compressed layers too) share its mask
        built = {builder: builder(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                  position_ids=packed_positions, **with_cache(mask_cache))
                 for builder in {MASK_BUILDERS[layer_type] for layer_type in layer_types}}
        return {layer_type: built[MASK_BUILDERS[layer_type]] for layer_type in layer_types}

    @staticmethod
    def _mask_cache(cache, past_seen) -> Cache | None:
        """The cache the mask builders size the masks by: a static cache always; a dynamic cache only once it
        holds tokens (an empty one sizes the masks as no cache would, so that transformers then looks for
        packed documents). The static cache is tested first: its length is a tensor, which export cannot
        branch on."""
        return cache if cache is not None and (cache.is_compileable or past_seen) else None

    def _static_cache_mask(self, inputs_embeds, mask_cache, past_seen) -> torch.Tensor | None:
        """The mask to build from when the caller gave none: over a static cache, `_filled_slots_mask`."""
        if mask_cache is None or not mask_cache.is_compileable:
            return None
        return self._filled_slots_mask(inputs_embeds, past_seen)

    def _filled_slots_mask(self, inputs_embeds: torch.Tensor, past_seen: int) -> torch.Tensor | None:
        """A (B, seen + new) all-ones mask for the flash backends over a static cache: with no mask,
        they would attend to the cache's empty slots (their causal mask ends at the last slot).
        transformers' own models share this gap; the other backends mask by position already."""
        if canonical_backend(attn_implementation(self.config)) not in BOTTOM_RIGHT_CAUSAL:
            return None
        batch, seq = inputs_embeds.shape[:2]
        return torch.ones(batch, past_seen + seq, dtype=torch.long, device=inputs_embeds.device)

    def _embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings; an id outside the vocabulary raises a `ValueError` naming it."""
        return _checked_lookup(self.embed_tokens, input_ids, self._check_token_ids)

    def _check_token_ids(self, input_ids: torch.Tensor) -> None:
        check_token_ids(self.config, input_ids)

    def _check_positions(self, position_ids: torch.Tensor) -> None:
        longest = int(position_ids.max())
        if longest >= self.config.max_position_embeddings:
            raise ValueError(
                f"Position {longest} is beyond the {self.config.max_position_embeddings} learned positions "
                "(`max_position_embeddings`); shorten the input."
            )

    def _default_position_ids(self, inputs_embeds, attention_mask, past_seen: int | torch.Tensor) -> torch.Tensor:
        """Positions count real tokens only, so a left-padded row gets the positions it gets alone.

        A 2-D mask's column j is token j (slot j of a static cache, whose mask may be padded with zeros to
        the cache's length): the new tokens are columns `past_seen` onwards, not the mask's last ones."""
        seq = inputs_embeds.shape[1]
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            return new_token_columns(positions, past_seen, seq)
        return (torch.arange(seq, device=inputs_embeds.device) + past_seen).unsqueeze(0)

    def _embed(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        hidden = inputs_embeds
        if self.config.embedding_multiplier != 1.0:
            # Gemma rounds the multiplier to the activation dtype first
            hidden = hidden * torch.tensor(self.config.embedding_multiplier, dtype=hidden.dtype)
        if isinstance(self.embed_positions, LearnedPositions):
            hidden = hidden + _checked_lookup(self.embed_positions, position_ids, self._check_positions).to(hidden.dtype)
        elif self.embed_positions is not None:
            hidden = hidden + self.embed_positions(position_ids).to(hidden.dtype)
        if self.embed_norm is not None:
            hidden = self.embed_norm(hidden)
        return self.embed_dropout(hidden) if self.training else hidden  # (eval dropout is the identity: skip the call)

    def _rotary_tables(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> list:
        """The rotary (cos, sin) of each layer, its layer type's (`None` without rotary positions, and on the
        NoPE layers of `no_rope_layers`)."""
        if self.rotary_emb is None:
            return [None] * self.config.num_hidden_layers
        layer_types = self.config.layer_types
        tables = self.rotary_emb.tables(hidden, position_ids, layer_types)
        of_type = {t: tables.get(attention_layer_type(t)) for t in set(layer_types)}  # none for linear attention
        return [of_type[layer_type] if rotates else None
                for layer_type, rotates in zip(layer_types, rotary_layers(self.config))]

    def _alibi_kwargs(self, hidden: torch.Tensor, cache) -> dict:
        """ALiBi per layer type: the slopes for backends that take them (flex, flash), else the
        (1, H, T_q, T_k) `position_bias` over the keys each layer will see (eager, sdpa); none without ALiBi."""
        if self.alibi is None:
            return {}
        attending = attending_layer_types(self.config.layer_types)
        if takes_alibi_slopes(attn_implementation(self.config)):
            return {layer_type: {"alibi_slopes": self.alibi.slopes} for layer_type in attending}
        seq = hidden.shape[1]
        kwargs = {}
        for layer_type in attending:
            layer_idx = next(i for i, t in enumerate(self.config.layer_types) if attention_layer_type(t) == layer_type)
            kv_length = cache.get_mask_sizes(seq, layer_idx)[0] if cache is not None else seq
            kwargs[layer_type] = {"position_bias": self.alibi(seq, kv_length, hidden.dtype)}
        return kwargs


def layer_masks(masks: dict, layer_type: str):
    """The mask a layer of `layer_type` takes from the masks by layer type: its own, or for a layer of several mixers
    (`kinds.HYBRID`) one per mixer, keyed by the mixer's layer type."""
    types = mixer_layer_types(layer_type)
    return masks[layer_type] if len(types) == 1 else {t: masks[t] for t in types}


def layer_kwargs_of(kwargs_by_type: dict, layer_type: str) -> dict:
    """The extra keyword arguments of a layer of `layer_type`: those of each of its mixers' layer types."""
    return {key: value for t in mixer_layer_types(layer_type) for key, value in kwargs_by_type.get(t, {}).items()}


def layer_type_kwargs(layer_types: list[str], masks: dict, kwargs_by_type: dict) -> dict[str, dict]:
    """{layer type: its mask and extra keyword arguments}, gathered once per type rather than once per layer."""
    return {layer_type: dict(attention_mask=layer_masks(masks, layer_type),
                             **layer_kwargs_of(kwargs_by_type, layer_type)) for layer_type in set(layer_types)}


def new_token_columns(mask: torch.Tensor, past_seen: int | torch.Tensor, seq: int) -> torch.Tensor:
    """Columns `past_seen .. past_seen + seq` of a (B, L) tensor laid out like a 2-D attention mask: those of
    the new tokens (a static cache counts `past_seen` on the device, so it is indexed, never read)."""
    if isinstance(past_seen, int):
        return mask[:, past_seen : past_seen + seq]
    return mask[:, torch.arange(seq, device=mask.device) + past_seen.to(mask.device)]


def _tokens_before(cache) -> int | torch.Tensor:
    """How many tokens `cache` holds before this forward: a static cache counts on the device, in a tensor
    the forward advances in place, so a copy of it (never read on the host)."""
    past = cache.get_seq_length() if isinstance(cache, Cache) else 0
    return past.clone() if isinstance(past, torch.Tensor) else past


def _checked_lookup(lookup: nn.Module, ids: torch.Tensor, check) -> torch.Tensor:
    """`lookup(ids)` for an embedding table, with `check(ids)` turning an out-of-range id into a
    `ValueError` that names the limit.

    The range is read only on the table's own bounds error, which a CPU lookup raises: no extra pass
    or host read per step. On an accelerator a bad id is a device-side assert instead; reading the
    range first would cost a device sync per forward (the sync rule in `input_checks.py`), so there the
    ids of `generate`'s prompt are checked on entry and a direct `forward` behaves as transformers' models.
    """
    try:
        return lookup(ids)
    except IndexError:
        check(ids)
        raise


@dataclass
class ModularDecoderCausalLMOutput(MoeCausalLMOutputWithPast):
    """The causal-LM output: logits, loss, cache, and the router and MTP losses.

    transformers' MoE causal-LM output (`aux_loss`, `router_logits` beside the usual fields), plus `z_loss`: the
    router z-loss, returned with the router logits, and `mtp_loss`: the multi-token-prediction modules' loss,
    returned with `labels`.

    `aux_loss` (the router kind's balance loss: Switch's for softmax routers, DeepSeek-V3's sequence-wise
    one for sigmoid routers), `z_loss` (softmax routers only) and `mtp_loss` (the mean of the MTP modules'
    cross-entropies) are the unweighted losses; `loss` (with `labels`) already holds
    `router_aux_loss_coef · aux_loss + router_z_loss_coef · z_loss + mtp_loss_scaling_factor · mtp_loss`.
    `shared_kv_states`: the base model's (`ModularDecoderModelOutput`), for a drafter that reads them.
    """

    z_loss: torch.Tensor | None = None
    mtp_loss: torch.Tensor | None = None
    shared_kv_states: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None


class ModularDecoderForCausalLM(ModularDecoderPreTrainedModel, GenerationMixin):
    """The decoder with a language-model head; loss shifts labels and skips `-100`, plus the router
    losses when router logits are returned."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    # the masks generate() builds for a static cache (a hook of transformers' `GenerationMixin`: see compat.py)
    create_masks_for_generate = staticmethod(create_masks_for_generate)

    def __init__(self, config: ModularDecoderConfig):
        super().__init__(config)
        self.model = ModularDecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)
        # beside the base model: they read its output and the head, and only the loss and drafting run them
        self.mtp = MultiTokenPredictor(config) if config.num_mtp_layers else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value

    @accepts_past_key_values
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_router_logits: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> ModularDecoderCausalLMOutput:
        """Logits (soft-capped if configured) and, with `labels`, the next-token loss: labels are
        shifted inside, `-100` is ignored. `logits_to_keep=k` projects only the last k positions.

        With `output_router_logits` (default: the config's), every sparse layer's router logits are
        returned with the router kind's balance loss `aux_loss` and the `z_loss` over the real tokens of a 2-D
        `attention_mask`; with `labels`, their coefficient-weighted sum is added to `loss`, as
        transformers' MoE families add theirs. A model without routers records none (an empty
        `router_logits`, no router losses), as the outputs the class declares recordable allow.

        With `labels` and MTP modules (`num_mtp_layers`), their loss `mtp_loss` over this forward's tokens is
        returned and added to `loss` with its weight `mtp_loss_scaling_factor` (`mtp.MultiTokenPredictor.loss`).
        """
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        # where the new tokens start in a 2-D mask, for the router losses
        past_seen = _tokens_before(cache) if output_router_logits else 0
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=output_router_logits,
            # (the model runs its last layers on these positions only where none of the others is read)
            logits_to_keep=0 if labels is not None else logits_to_keep,
            **kwargs,
        )
        logits = self._logits(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
        loss = aux_loss = z_loss = mtp_loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
            if self.mtp is not None:
                mtp_loss = self.mtp.training_loss(self, outputs.last_hidden_state, input_ids, inputs_embeds,
                                                  attention_mask, position_ids, labels, **kwargs)
                loss = loss + self.config.mtp_loss_scaling_factor * mtp_loss.to(loss.device)
        if output_router_logits and outputs.router_logits:  # a model without routers records none
            router_loss, aux_loss, z_loss = self._router_losses(outputs, attention_mask, past_seen)
            if loss is not None:
                loss = loss + router_loss.to(loss.device)
        return ModularDecoderCausalLMOutput(
            loss=loss,
            aux_loss=aux_loss,
            logits=logits,
            **with_cache(cache_of(outputs)),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
            z_loss=z_loss,
            mtp_loss=mtp_loss,
            shared_kv_states=outputs.shared_kv_states,
        )

    # computed once: generate reads it at every step of a model registered for the Auto classes (transformers'
    # `is_remote_code`, which this family is), and building it from the decorated function costs more than the rest
    # of that step's input preparation
    forward.__signature__ = inspect.signature(forward)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head: `lm_head(hidden) / logits_scaling`, soft-capped to (-cap, cap) by `cap * tanh(x / cap)`."""
        return self._finish_logits(project(self.lm_head, hidden))

    def _finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """What `_logits` does after `lm_head`: `logits_scaling`, then `final_logit_softcapping`."""
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        return logits

    def _mtp_block_kwargs(self, depth: int, token_embeds, position_ids, attention_mask, cache, packed: bool) -> dict:
        """What MTP block `depth` takes beside its input (all are of the last layer's type): that type's mask and
        rotary table (or ALiBi bias), over its layer of the modules' own `cache` while drafting, none while
        training."""
        config, layer_type = self.mtp.block_config, self.mtp.layer_type
        attends = layer_type != LINEAR_ATTENTION
        mask_cache = cache if cache is not None and cache.get_seq_length(depth) else None  # empty: as none
        mask = MASK_BUILDERS[layer_type](config=config, inputs_embeds=token_embeds, attention_mask=attention_mask,
                                         position_ids=position_ids if packed else None,
                                         **({"layer_idx": depth} if attends else {}), **with_cache(mask_cache))
        kwargs = {"attention_mask": mask, "position_ids": position_ids, "cache": cache}
        if not attends and packed and attention_mask is None:  # a recurrent state restarts at each packed document
            kwargs["documents"] = packed_documents(position_ids, token_embeds.shape[0])
        if self.model.rotary_emb is not None and rotary_layers(config)[depth]:  # (not on a NoPE layer)
            tables = self.model.rotary_emb.tables(token_embeds, position_ids, [layer_type])
            kwargs["position_embeddings"] = tables.get(layer_type)  # none for a linear-attention layer
        if self.model.alibi is not None and attends:
            if takes_alibi_slopes(attn_implementation(self.config)):
                kwargs["alibi_slopes"] = self.model.alibi.slopes
            else:
                seq = token_embeds.shape[1]
                kv_length = cache.get_mask_sizes(seq, depth)[0] if cache is not None else seq
                kwargs["position_bias"] = self.model.alibi(seq, kv_length, token_embeds.dtype)
        return kwargs

    def _router_losses(self, outputs, attention_mask, past_seen: int | torch.Tensor):
        """(weighted sum, aux_loss, z_loss) of the router logits, over the new tokens' real positions: padding
        is left out through a 2-D mask, whose new tokens are its columns from `past_seen` (a static cache's
        mask may be padded past them; generate's pre-built per-layer masks carry none)."""
        mask = attention_mask if torch.is_tensor(attention_mask) and attention_mask.dim() == 2 else None
        seq = outputs.last_hidden_state.shape[1]
        if mask is not None:
            mask = new_token_columns(mask, past_seen, seq)
        return router_losses(outputs.router_logits, self.config, mask, outputs.last_hidden_state.shape[0])

    def generate(self, inputs: torch.Tensor | None = None, *args, **kwargs):
        """transformers' `generate`, the prompt checked first; `use_mtp=True` drafts with the model's MTP modules.

        The prompt (`input_ids`, `attention_mask`, `inputs_embeds`) is
        checked first: an empty or 1-D prompt or a mask that does not fit it raises a `ValueError`.
        The steps then skip re-reading the mask's values (generate only appends ones to it). A cache
        passed as `cache=` is used on every transformers release (before 5.24 generate calls it
        `past_key_values`). Decoding that drafts and crops the cache (`assistant_model`, `prompt_lookup_num_tokens`,
        `assistant_early_exit`, `use_mtp`) works beside linear-attention layers too: their cache records the states
        of the drafted tokens and rolls back to the last accepted one (`recurrent_cache.py`). `use_mtp=True`
        drafts with the model's MTP modules (`mtp_generation.py`), `mtp_draft_tokens=K` tokens per step (default
        `config.mtp_draft_tokens`, else one per module); a model without them raises a `ValueError`."""
        kwargs = generate_cache_kwarg(kwargs)
        use_mtp = kwargs.get("use_mtp") or getattr(kwargs.get("generation_config"), "use_mtp", None)
        options = options_of(kwargs, (kwargs.get("generation_config"), self.generation_config))
        check_use_mtp(self.config, use_mtp)
        check_kv_assistant(self.config, kwargs.get("assistant_model"))
        check_draft_tokens(self.config, use_mtp, options.draft_tokens)
        if use_mtp and (refusal := drafting_refusal(self.config)) is not None:
            raise ValueError(refusal)
        if (rollback_error := self.config.attention_kind.rollback_error(self.config)) is not None:
            refuse_rollback_decoding(kwargs, self.generation_config, rollback_error)  # compressed entries: no crop
        check_generate_inputs(
            self.config,
            input_ids=inputs if inputs is not None else kwargs.get("input_ids"),
            attention_mask=kwargs.get("attention_mask"),
            inputs_embeds=kwargs.get("inputs_embeds"),
        )
        with generating(), drafting_options(options):
            return super().generate(inputs, *args, **kwargs)

    def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
        """transformers' own, except at the step where LongRoPE switches to its long factors: the cache (keys
        rotated with the short ones) is dropped and the whole text runs again, as transformers' Phi-3 does
        (`positions.keys_rotated_before_the_switch`)."""
        name = "cache" if "cache" in kwargs else "past_key_values"  # (the name transformers < 5.24 passes)
        if keys_rotated_before_the_switch(self.config, input_ids.shape[1], kwargs.get(name)):
            kwargs.update({name: None, "next_sequence_length": None} if "next_sequence_length" in kwargs
                          else {name: None})
        inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        return with_old_cache_name(self, inputs)  # where PEFT's prompt learning replaced this method on the model

    # generate() reads this method's parameters (whether it forwards `inputs_embeds`, which model kwargs it uses)
    prepare_inputs_for_generation.__signature__ = inspect.signature(GenerationMixin.prepare_inputs_for_generation)

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, *args, **kwargs):
        """With `use_mtp`, the candidate generator that drafts with this model's own MTP modules; with transformers'
        Gemma 4 assistant, transformers' drafter for it, reading this model's keys and values (`kv_assistant.py`);
        otherwise transformers' choice (a hook of transformers' `GenerationMixin`: see compat.py). The cache is told
        how many tokens a step drafts, which its linear-attention layers record to roll back (transformers 5.16-5.24
        tell it nothing)."""
        transformers_first = generation_config.assistant_early_exit is not None \
            or generation_config.prompt_lookup_num_tokens is not None
        if generation_config.use_mtp and not transformers_first:
            generator = MtpCandidateGenerator(self, generation_config, model_kwargs, logits_processor)
        elif reads_model_kv(assistant_model) and not transformers_first:
            generator = kv_assistant_drafter(self, assistant_model, generation_config, input_ids, inputs_tensor,
                                             logits_processor, model_kwargs)
        else:
            generator = super()._get_candidate_generator(generation_config, input_ids, inputs_tensor,
                                                         logits_processor, model_kwargs, assistant_model, *args,
                                                         **kwargs)
        if isinstance(cache := cache_of(model_kwargs), ModularDecoderCache):
            drafts = drafted_tokens_per_step(generator)
            if drafts_grow(generator):  # at most the tokens left to generate
                drafts = max(drafts or 0, generation_config.max_length - input_ids.shape[1])
            cache.activate_past_recording(drafts)
        return generator

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs: dict, generation_mode, batch_size: int, max_cache_length: int
    ):
        """generate() builds this family's own cache unless the user passed one or asked for another
        (a hook of transformers' `GenerationMixin`: see compat.py)."""
        drafting_generation_config(generation_config)
        implementation = generation_config.cache_implementation
        drafting = generation_mode == "assisted_generation"
        if drafting:  # a step writes its drafts into the cache before verifying them
            max_cache_length += static_cache_room(generation_config, self.config)
        if cache_of(model_kwargs) is not None or generation_config.use_cache is False:
            if drafting and cache_of(model_kwargs) is not None:
                check_static_drafting(cache_of(model_kwargs), max_cache_length)
            return super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
            )
        if implementation is None or implementation == "dynamic":
            cache = ModularDecoderCache(self.config)
        elif implementation == "static":
            # As transformers' models do: never shorter than an earlier call's static cache, so a
            # compiled decode step sees the same shapes (no recompilation) call after call.
            max_cache_length = static_cache_length(self, max(max_cache_length, generation_config.max_cache_len or 0))
            cache = ModularDecoderCache(self.config, "static", max_cache_len=max_cache_length)
        elif implementation == "quantized" and (generation_config.cache_config or {}).get("backend", "int8") == "int8":
            # This family's int8 K/V (`cache_config={"backend": "int8"}`, the default here); other
            # backends go to transformers' QuantizedCache.
            cache = ModularDecoderCache(self.config, "int8")
        else:
            return super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
            )
        if drafting:
            check_static_drafting(cache, max_cache_length)
        if generation_config.is_assistant:
            # A draft model's cache is cropped after each verification (of at most its `num_assistant_tokens`
            # drafts), also past a sliding window or a recurrent state
            cache.activate_past_recording(generation_config.num_assistant_tokens)
        model_kwargs.update(with_cache(cache))


__all__ = ["ModularDecoderPreTrainedModel", "ModularDecoderModel", "ModularDecoderForCausalLM",
           "ModularDecoderCausalLMOutput", "ModularDecoderModelOutput"]
