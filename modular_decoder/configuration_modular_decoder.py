"""The model's configuration: one config whose fields span the decoder-only design space.

Every field that changes the math is explicit, serialized in ``config.json`` and validated at
construction: a bad combination raises ``ValueError`` naming the field and the allowed values,
never a shape error deep inside ``forward``.
"""

from __future__ import annotations


# first: importing compat checks the transformers version, before anything below can fail on an older one
from .compat import (  # isort: skip
    convert_nested_rope_params, plan_additions, run_config_validators, standardize_nested_rope_params,
)

from transformers import PretrainedConfig  # noqa: E402

from .blocks import BlockFields, LayerNormPositionFields, mixing_layer_types, validate_block  # noqa: E402
from .chunked_attention import CHUNKED_ATTENTION  # noqa: E402
from .compressed_attention import COMPRESSED_LAYER_TYPES  # noqa: E402
from .gated_deltanet import GatedDeltaNetFields  # noqa: E402
from .kinds import (HYBRID, LINEAR_ATTENTION, require_bool, require_choice, require_int,  # noqa: E402
                    require_number, require_per_layer)
from .mamba2 import Mamba2Fields  # noqa: E402
from .moe import ExpertFormFields  # noqa: E402
from .mup import MupFields  # noqa: E402
from .norms import NORMS  # noqa: E402
from .peft_targets import PEFT_LORA_TARGET_MODULES, register_peft_defaults  # noqa: E402
from .positions import require_rope_dicts, transformers_rope_check  # noqa: E402
from .query_temperature import QueryTemperatureFields  # noqa: E402
from .registries import (ATTENTIONS, FEATURES, FIELD_MIXINS, LINEAR_ATTENTIONS, MLPS, POSITIONS,  # noqa: E402
                         RESIDUAL_STREAMS)
from .mla import LatentAttentionFields  # noqa: E402
from .short_conv import ShortConvFields  # noqa: E402

# The layers that attend (they read positions and masks); "linear_attention" layers keep a recurrent state instead.
# The compressed ones (DeepSeek-V4's CSA / HCA) are those of the attention kinds that build them (`shared_kv`).
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", CHUNKED_ATTENTION, *COMPRESSED_LAYER_TYPES)
LAYER_TYPES = (*ATTENTION_LAYER_TYPES, "linear_attention", HYBRID)
# Config fields that hold one entry per layer: a multi-token-prediction module is built from a config whose
# lists hold the last layer's entry once per module (`mtp.mtp_block_config`). A new per-layer field goes here.
PER_LAYER_FIELDS = ("layer_types", "mlp_layer_types", "no_rope_layers", "block_types", "layer_intermediate_sizes",
                    "activation_sparsity_pattern")
# `mtp_loss_scaling_factor` where unset and `num_mtp_layers` > 0: DeepSeek-V3's λ for the last 4.8T of its
# 14.8T training tokens (0.3 before; arXiv 2412.19437, §4.2)
MTP_LOSS_SCALING_FACTOR = 0.1
# The smallest window the sliding cache layers keep correctly: they hold the last `window - 1`
# tokens between steps, so a window of 1 would leave nothing to slice by.
MIN_SLIDING_WINDOW = 2


def _int(minimum: int, optional: bool = False):
    return lambda name, value: require_int(name, value, minimum=minimum, optional=optional)


def _number(optional: bool = False, **bounds):
    return lambda name, value: require_number(name, value, optional=optional, **bounds)


def _flag(name: str, value) -> None:
    require_bool(name, value)


def _token_ids(name: str, value) -> None:
    ids = value if isinstance(value, list) else [value]
    for token_id in ids:
        require_int(name, token_id, minimum=0, optional=not isinstance(value, list))


# The sizes everything else derives from: checked before any default is computed from them.
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings")
# The sizes whose `None` means "derive it" (4·d, H, d / H); the others are required.
DERIVED_SIZE_FIELDS = ("intermediate_size", "num_key_value_heads", "head_dim")
# Rules of the fields that do not pick a variant (those are checked by their registry entries, which
# own the fields only they read: see `registries.py`).
FIELD_RULES = {
    **{name: _int(1) for name in SIZE_FIELDS},
    "norm_eps": _number(above=0),
    "norm_bias": _flag,
    "norm_unit_offset": _flag,
    "final_norm": _flag,
    "attention_bias": _flag,
    "attention_output_bias": _flag,
    "attn_output_gate": _flag,  # its type under any attention kind (only standard attention may set it)
    "sliding_window": _int(MIN_SLIDING_WINDOW, optional=True),
    "attn_logit_softcapping": _number(optional=True, above=0),
    "attention_sinks": _flag,
    "final_logit_softcapping": _number(optional=True, above=0),
    "query_pre_attn_scalar": _number(optional=True, above=0),
    "attention_dropout": _number(at_least=0, below=1),
    "hidden_dropout": _number(at_least=0, below=1),
    "tie_word_embeddings": _flag,
    "embedding_multiplier": _number(above=0),
    "residual_multiplier": _number(above=0),
    "logits_scaling": _number(above=0),
    "embedding_norm": _flag,
    "lm_head_bias": _flag,
    "initializer_range": _number(at_least=0),
    "use_cache": _flag,
    "num_mtp_layers": _int(0),
    "mtp_loss_scaling_factor": _number(at_least=0),
    "mtp_draft_vocab_size": _int(0),
    "mtp_draft_tokens": _int(1, optional=True),
    "pad_token_id": _int(0, optional=True),
    "bos_token_id": _token_ids,
    "eos_token_id": _token_ids,
}


class ModularDecoderConfig(BlockFields, LayerNormPositionFields, ExpertFormFields, Mamba2Fields, MupFields,
                           QueryTemperatureFields, LatentAttentionFields, GatedDeltaNetFields, ShortConvFields,
                           *FIELD_MIXINS, PretrainedConfig):
    r"""Configuration of a modular decoder-only transformer.

    Args:
        vocab_size (`int`): Number of token ids; `input_ids` must lie in `[0, vocab_size)`.
        hidden_size (`int`): Residual stream width d.
        intermediate_size (`int`, *optional*): FFN inner width d_f. Defaults to 4·d.
        num_hidden_layers (`int`): Number of decoder blocks L.
        num_attention_heads (`int`): Query heads H.
        num_key_value_heads (`int`, *optional*): K/V heads H_kv: H for MHA, 1 for MQA, a divisor of H
            in between for GQA. Defaults to H.
        head_dim (`int`, *optional*): Per-head width d_h. Defaults to d / H (MLA: d_c + d_R, the one latent
            "head" each token caches, as vLLM sizes MLA's cache).
        max_position_embeddings (`int`): The longest sequence the model is configured for. A hard limit
            for learned positions (longer input raises), the pre-training length for RoPE scalings.
        norm_type (`str`): `"layernorm"` or `"rmsnorm"`.
        norm_eps (`float`): Epsilon inside every norm.
        norm_bias (`bool`): Whether LayerNorms carry a bias (ignored by RMSNorm).
        norm_unit_offset (`bool`): Scale by `1 + w` instead of `w` (Gemma's RMSNorm); the stored
            weight is then initialised at 0.
        norm_position (`str`): Where the block's norms sit. `"post"`: x = N(x + F(x)) (GPT-1);
            `"pre"`: x = x + F(N(x)) (GPT-2, Llama); `"sandwich"`: x = x + N'(F(N(x))) (Gemma 2/3);
            `"output"`: x = x + N(F(x)) (OLMo 2).
        final_norm (`bool`, *optional*): Whether a norm follows the last block. Defaults to `True`
            except for `norm_position="post"`, whose blocks already end in a norm.
        parallel_block (`bool`): x + Attn(N(x)) + FFN(N(x)) instead of the serial block (GPT-J,
            GPT-NeoX, Falcon, PaLM). Requires `norm_position="pre"`.
        parallel_norms (`str`): For parallel blocks, `"shared"` (one norm feeds both branches, GPT-J)
            or `"separate"` (one each, GPT-NeoX).
        mlp_type (`str`): `"dense"` (act(x W1) W2), `"gated"` (act(x W_gate) * (x W_up) W_down) or `"moe"`
            (a mixture of gated experts; the fields below up to `output_router_logits` apply to it only).
        hidden_act (`str`): Any `transformers.activations.ACT2FN` key. With `mlp_type="gated"`,
            sigmoid / relu / gelu / silu give GLU / ReGLU / GEGLU / SwiGLU.
        mlp_bias (`bool`): Biases on the FFN projections (with `"moe"`: every expert's gate/up and down products,
            `mlp.experts.gate_up_proj_bias` / `down_proj_bias`, as gpt-oss's; and the shared and dense MLPs').
        mlp_layer_types (`list[str]`, *optional*): With `"moe"`, `"sparse"` (experts) or `"dense"` (a gated
            MLP of `intermediate_size`) per layer, transformers' values. DeepSeek's `first_k_dense_replace=k`
            is k × `"dense"` then `"sparse"`; Qwen-MoE's `mlp_only_layers` are `"dense"`. Defaults to all
            `"sparse"`.
        num_experts (`int`, *optional*): Routed experts E per sparse layer (Mixtral `num_local_experts`,
            DeepSeek `n_routed_experts`). Required with `"moe"`.
        num_experts_per_tok (`int`, *optional*): Experts k each token is routed to. Required with `"moe"`.
        moe_intermediate_size (`int`, *optional*): Inner width of each routed expert. Defaults to
            `intermediate_size` (Mixtral, OLMoE).
        n_shared_experts (`int`): Always-on experts added to the routed ones (DeepSeek; Qwen2-MoE has 1).
        shared_expert_intermediate_size (`int`, *optional*): Inner width of each shared expert; they run
            as one gated MLP of `n_shared_experts` times this width. Defaults to `moe_intermediate_size`.
        shared_expert_gate (`bool`): Scale the shared experts' output by σ(x·w), a learned per-token
            gate (Qwen2-MoE).
        router_type (`str`): `"softmax_topk"` (softmax over all experts, keep the k largest: Mixtral, Qwen,
            OLMoE, DeepSeek-V2), `"sigmoid_topk"` (independent sigmoid scores, chosen on score + a
            load-balancing correction bias, weighted by the unbiased scores: DeepSeek-V3) or `"topk_softmax"`
            (keep the k largest logits, softmax over those k: gpt-oss; no groups, `norm_topk_prob` stays True) or
            `"topk_sigmoid"` (keep the k largest logits, a sigmoid of each: Llama 4; no groups).
        router_bias (`bool`): A learned bias on the router logits (`mlp.gate.bias`, gpt-oss).
        norm_topk_prob (`bool`): Renormalise the k kept weights to sum to 1 (Mixtral, Qwen3-MoE,
            DeepSeek-V3: yes; Qwen2-MoE, OLMoE, DeepSeek-V2: no).
        n_group (`int`): Group-limited routing: the experts form `n_group` equal groups (1: no groups).
        topk_group (`int`, *optional*): Tokens pick experts only from their `topk_group` best groups (a group
            scores its best expert under softmax, the sum of its two best under sigmoid). Defaults to
            `n_group`.
        routed_scaling_factor (`float`): Multiplies the routing weights (DeepSeek).
        router_aux_loss_coef (`float`, *optional*): Weight of the router kind's balance loss, added to the LM
            loss when router logits are returned: for `"softmax_topk"` Switch Transformer's load-balancing loss
            (the value transformers' MoE families compute), default 0.001 (transformers' Mixtral default); for
            `"sigmoid_topk"` DeepSeek-V3's complementary sequence-wise balance loss, whose α this is, default
            0.0001 (the paper's). Without experts it is 0.0 (no router, no loss), which is how trainers that
            weight it themselves (TRL) tell a model without one. DeepSeek-V3's auxiliary-loss-free balancing
            (the correction bias moved after each step) is opt-in: `router_losses.update_router_bias`.
        router_z_loss_coef (`float`): Weight of the router z-loss (ST-MoE: mean squared logsumexp of the
            router logits) added likewise; 0 disables it. Softmax routers only.
        output_router_logits (`bool`): Return every sparse layer's router logits (and add the router losses
            to a loss computed from `labels`) unless `forward(output_router_logits=...)` says otherwise.
        swiglu_limit (`float`, *optional*): Gives the experts gpt-oss's clamped SwiGLU, transformers' field:
            g = min(gate, limit), u = clamp(up, -limit, limit), out = (u + 1) · g·σ(α·g) (with
            `hidden_act="silu"`). `None`: act(gate) · up.
        swiglu_alpha (`float`, *optional*): α of that SwiGLU (transformers' field); defaults to gpt-oss's 1.702
            where `swiglu_limit` is set.
        position_embedding_type (`str`): `"learned"`, `"sinusoidal"` (added to the token embedding),
            `"rope"` (rotary on q and k), `"alibi"` (linear bias on the scores) or `"none"`.
        learned_position_offset (`int`): Rows of the learned table before position 0 (OPT uses 2).
        rope_parameters (`dict`, *optional*): transformers' RoPE dict (`rope_type` in default, linear,
            dynamic, yarn, longrope, llama3, ...; `rope_theta`; the type's own keys). May be nested per
            layer type (`{"full_attention": {...}, "sliding_attention": {...}}`) to give local layers
            their own base, as Gemma 3 does.
        partial_rotary_factor (`float`): Fraction of each head's width that is rotated (GPT-J, NeoX, Phi).
        rope_interleaved (`bool`): Rotate adjacent pairs (x0, x1), (x2, x3), ... (GPT-J) instead of the
            two halves (GPT-NeoX / Llama layout).
        no_rope_layers (`list[int]`, *optional*): Which layers rotate, transformers' SmolLM3 field and meaning:
            per layer 1 for a RoPE layer, 0 for a NoPE layer (no rotary on its queries and keys; SmolLM3 has one
            every fourth layer). `None`: every layer rotates. Standard attention only (MLA's rotary key is its
            only position signal).
        attention_type (`str`): `"standard"` (MHA / GQA / MQA through `num_key_value_heads`), `"mla"`, or
            `"dsa"` (DeepSeek Sparse Attention, DeepSeek-V3.2: MLA whose every query attends only to the
            `index_topk` keys a lightning indexer ranks highest; the `index_*` fields apply to it only).
        q_lora_rank (`int`, *optional*): MLA query bottleneck width; `None` projects queries directly.
        kv_lora_rank (`int`, *optional*): MLA joint KV latent width d_c.
        qk_nope_head_dim (`int`, *optional*): MLA per-head content (non-rotary) q/k width.
        qk_rope_head_dim (`int`, *optional*): MLA shared rotary key width d_R (with `position_embedding_type="none"`
            the decoupled key is kept and never rotated: Kimi Linear's NoPE latent attention).
        v_head_dim (`int`, *optional*): MLA per-head value width.
        kv_latent_norm (`bool`): Whether MLA's joint KV latent passes through an RMSNorm (`kv_a_layernorm`,
            as DeepSeek always does). `False` keeps the latent a linear function of the hidden state, which is
            what makes an exact conversion of standard attention to MLA possible (TransMLA,
            `modular_decoder.tools.reshape.mla_conversion`); DeepSeek's classes cannot express it.
        index_n_heads (`int`, *optional*): DSA indexer heads H_I (transformers' name; DeepSeek-V3.2: 64). Each
            head scores every key, ReLU(q_I·k_I / sqrt(D_I)), and the heads are summed with per-token weights
            (`weights_proj(x) / sqrt(H_I)`). Required with `"dsa"`.
        index_head_dim (`int`, *optional*): DSA indexer head width D_I (DeepSeek-V3.2: 128): the width of the one
            indexer key each token caches beside the latent (after a LayerNorm with bias, eps `norm_eps`), and of
            each indexer query (made from the query latent, so `q_lora_rank` is required). Its first
            `qk_rope_head_dim` features are rotated, in the halves layout whatever `rope_interleaved` says (as
            transformers' `DeepseekV32Indexer` does). Required with `"dsa"`.
        index_topk (`int`, *optional*): Keys k each query attends to under `"dsa"` (DeepSeek-V3.2: 2048): the k
            with the highest indexer score among those the mask lets it see; a query that sees at most k keys
            attends to all of them, as dense MLA does. Required with `"dsa"`.
        attention_bias (`bool`): Biases on the q, k and v projections.
        attention_output_bias (`bool`, *optional*): Bias on the output projection. Defaults to
            `attention_bias` (Qwen 2 sets q/k/v biases but none on the output).
        qk_norm (`str`): `"none"`, `"head"` (a norm over each head's d_h, Qwen 3 / Gemma 3), `"full"`
            (over the whole projected q and k, OLMo 2) or `"weightless"` (an RMS norm without weight of each rotated
            head, on the layers that rotate: Llama 4's L2 norm).
        attn_output_gate (`bool`): Gate the attention output per head and channel, o·σ(x W_g), before `o_proj`
            (Qwen3-Next / Qwen3.5's full layers). `q_proj` then projects to 2·H·d_h: each head's query, then its
            gate (transformers' layout). Standard attention only.
        sliding_window (`int`, *optional*): Window of the `"sliding_attention"` layers.
        layer_types (`list[str]`, *optional*): One of `"full_attention"` / `"sliding_attention"` /
            `"chunked_attention"` (`attention_chunk_size`) / `"linear_attention"` / `"hybrid"` per layer. Defaults to
            all sliding when `sliding_window` is set, else all full. A `"linear_attention"` layer mixes tokens through
            a recurrent state instead of attention (the kind `linear_attention_type` names; Qwen3-Next and Qwen3.5 have
            three for every full layer): it reads no positions, and its cache holds a fixed-size state per sequence. A
            `"hybrid"` layer runs full attention and the linear-attention kind side by side on the same normed input
            and adds their outputs (Falcon-H1; transformers' value); its cache holds K/V and a state.
        linear_attention_type (`str`): The linear-attention layers' kind: `"gated_deltanet"` (Gated DeltaNet,
            Qwen3-Next / Qwen3.5 / OLMo hybrid) or another kind of `registries.LINEAR_ATTENTIONS`, whose fields live
            beside it (`"kda"`: Kimi Delta Attention, Kimi Linear, Gated DeltaNet's fields; `"short_conv"`: LFM2's
            gated short convolution, `short_conv.ShortConvFields`; `"mamba2"`: `mamba2.Mamba2Fields`). The fields
            below up to `linear_conv_kernel_dim` are Gated DeltaNet's (and KDA's; `"short_conv"` reads the last) and
            apply only when `layer_types` has linear layers (left unset otherwise).
        linear_num_key_heads (`int`, *optional*): Query/key heads H_k of the linear layers. Defaults to H.
        linear_num_value_heads (`int`, *optional*): Value heads H_v, a multiple of H_k (each key head serves
            H_v / H_k of them). Defaults to H.
        linear_key_head_dim (`int`, *optional*): Query/key head width d_k. Defaults to d_h.
        linear_value_head_dim (`int`, *optional*): Value head width d_v (the state is d_k x d_v per value head).
            Defaults to d_h.
        linear_conv_kernel_dim (`int`, *optional*): Taps K of the short causal convolution (over q, k and v; over
            B ⊙ x with `"short_conv"`). Defaults to 4 (3 with `"short_conv"`).
        attn_logit_softcapping (`float`, *optional*): Scores become c·tanh(s/c) (Gemma 2).
        attention_sinks (`bool`): A learned logit per query head (`self_attn.sinks`) joins every softmax's
            denominator: probability mass that attends to nothing, so a head may attend to no key (gpt-oss).
            p_ij = exp(s_ij) / (exp(sink_h) + Σ_j' exp(s_ij')). Any attention kind; every backend but flash-attn 2,
            whose kernels take no sink.
        final_logit_softcapping (`float`, *optional*): Logits become c·tanh(z/c) (Gemma 2).
        query_pre_attn_scalar (`float`, *optional*): Scores are scaled by this value^-1/2 instead of
            d_h^-1/2 (Gemma 2/3).
        attention_dropout (`float`): Dropout on attention probabilities while training.
        hidden_dropout (`float`): Dropout on the embedding and on each sublayer output while training.
        tie_word_embeddings (`bool`): Share the output projection with the token embedding.
        embedding_multiplier (`float`): Token embeddings are multiplied by this (Gemma: sqrt(d)).
        residual_multiplier (`float`): Each sublayer's output is multiplied by this before it is added to
            the residual stream, x + m·F(...) (Granite's μP scaling).
        logits_scaling (`float`): The logits are divided by this (Granite), before any soft-capping.
        embedding_norm (`bool`): A norm right after the embedding (BLOOM).
        lm_head_bias (`bool`): Bias on the output projection (GPT-J, Phi).
        initializer_range (`float`): Standard deviation of the normal weight init.
        use_cache (`bool`): Whether forward returns a cache by default.
        num_mtp_layers (`int`): Multi-token-prediction modules (DeepSeek-V3's MTP, transformers' name; DeepSeek's
            `num_nextn_predict_layers`). Module k joins the RMS-normed last hidden state of depth k-1 (the model's
            own for k = 0) with the normed embedding of the token k+1 places ahead, projects them back to d
            (`eh_proj`), runs one block of the last layer's kinds and a norm, and predicts through the shared head
            the token k+2 places ahead. They add a training loss (`mtp_loss_scaling_factor`) and draft tokens for
            `generate(use_mtp=True)`; the main forward never runs them. 0: none.
        mtp_loss_scaling_factor (`float`, *optional*): Weight λ of the MTP loss, the mean over modules of their
            cross-entropies, added to the LM loss when `labels` are given (transformers' name). Defaults to 0.1
            (DeepSeek-V3's final λ) with MTP modules, 0.0 without (then it must stay 0).
        mtp_draft_vocab_size (`int`): Drafting only (FR-Spec, arXiv 2502.14856): the MTP modules draft among this
            many token ids, the first of the buffer `mtp.draft_vocab` (ranked most frequent first; set it with
            `modular_decoder.draft_vocab.set_draft_vocab` or `reshape --add-mtp K --draft-vocab N`), computing the
            shared head over those rows only. The model still verifies every draft, so `generate` returns the same
            tokens. The main forward and its losses (`labels`) use the whole vocabulary; `reshape --add-mtp`'s
            self-distillation trains the modules over the draft vocabulary. 0: the whole vocabulary. Needs
            `num_mtp_layers`; at most `vocab_size`.
        mtp_draft_tokens (`int`, *optional*): Tokens `generate(use_mtp=True)` drafts per step by default
            (`generate(mtp_draft_tokens=K)` overrides it). K up to `num_mtp_layers` drafts with the first K modules;
            more, and the last module drafts the rest again on its own output and drafted token (as vLLM and SGLang
            do for DeepSeek-V3's single module). The tokens are those of decoding without drafts either way.
            Defaults to one per module (transformers' drafting); requires MTP modules.
    """

    model_type = "modular_decoder"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]  # the output field before transformers 5.24
    default_theta = 10_000.0
    # The keys of a `rope_parameters` dict nested by layer type. transformers takes them from
    # `layer_types` otherwise, and then neither fills in nor checks a table for a layer type no layer
    # has (a sliding table in an all-full config), which the config would still carry.
    _rope_type_labels = ATTENTION_LAYER_TYPES

    # sizes
    vocab_size: int = 32000
    hidden_size: int = 768
    intermediate_size: int | None = None
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    # norms
    norm_type: str = "rmsnorm"
    norm_eps: float = 1e-5
    norm_bias: bool = True
    norm_unit_offset: bool = False
    norm_position: str = "pre"
    final_norm: bool | None = None
    # block
    parallel_block: bool = False
    parallel_norms: str = "shared"
    # FFN
    mlp_type: str = "gated"
    hidden_act: str = "silu"
    mlp_bias: bool = False
    # mixture of experts (`mlp_type="moe"` only)
    mlp_layer_types: list[str] | None = None
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    n_shared_experts: int = 0
    shared_expert_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    router_type: str = "softmax_topk"
    router_bias: bool = False
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    router_aux_loss_coef: float | None = None
    router_z_loss_coef: float = 0.0
    output_router_logits: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None
    # positions
    position_embedding_type: str = "rope"
    learned_position_offset: int = 0
    rope_parameters: dict | None = None
    partial_rotary_factor: float = 1.0
    rope_interleaved: bool = False
    no_rope_layers: list[int] | None = None
    # attention
    attention_type: str = "standard"
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    kv_latent_norm: bool = True
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    index_topk: int | None = None
    attention_bias: bool = False
    attention_output_bias: bool | None = None
    qk_norm: str = "none"
    attn_output_gate: bool = False
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    # linear attention (the `"linear_attention"` layers of `layer_types` only)
    linear_attention_type: str = "gated_deltanet"
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_conv_kernel_dim: int | None = None
    attn_logit_softcapping: float | None = None
    attention_sinks: bool = False
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    # ends
    tie_word_embeddings: bool = True
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    embedding_norm: bool = False
    lm_head_bias: bool = False
    initializer_range: float = 0.02
    use_cache: bool = True
    # multi-token prediction
    num_mtp_layers: int = 0
    mtp_loss_scaling_factor: float | None = None
    mtp_draft_vocab_size: int = 0
    mtp_draft_tokens: int | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        for name in self.integer_fields():  # the type of each, named, before any other rule reads it
            require_int(name, getattr(self, name), optional=True)
        for name in SIZE_FIELDS:  # before the defaults below compute with them
            require_int(name, getattr(self, name), minimum=1, optional=name in DERIVED_SIZE_FIELDS)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and isinstance(self.attention_type, str) and self.attention_type in ATTENTIONS:
            self.head_dim = ATTENTIONS[self.attention_type].default_head_dim(self)
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"`hidden_size`={self.hidden_size} is not divisible by `num_attention_heads`="
                    f"{self.num_attention_heads}; set `head_dim` explicitly."
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.hidden_size
        if self.final_norm is None:
            self.final_norm = self.norm_position != "post"
        if self.attention_output_bias is None:
            self.attention_output_bias = self.attention_bias
        if self.layer_types is None:
            kind = "sliding_attention" if self.sliding_window is not None else "full_attention"
            self.layer_types = [kind] * self.num_hidden_layers
        elif isinstance(self.layer_types, (list, tuple)):
            self.layer_types = list(self.layer_types)
        else:
            raise ValueError(f"`layer_types` must be a list with one entry per layer, got {self.layer_types!r}.")
        for registry in (ATTENTIONS, LINEAR_ATTENTIONS, MLPS, POSITIONS, RESIDUAL_STREAMS, FEATURES):  # their defaults
            registry.complete(self)
        if self.mtp_loss_scaling_factor is None:
            self.mtp_loss_scaling_factor = MTP_LOSS_SCALING_FACTOR if self.num_mtp_layers else 0.0
        super().__post_init__(**kwargs)
        self.validate_contract()

    @classmethod
    def declared_fields(cls) -> dict[str, object]:
        """Every field this family declares, with its type annotation (not transformers' `PretrainedConfig`'s).

        The fields of this class, its subclasses and its field mixins (a mechanism's fields live in a
        `@dataclass(kw_only=True)` mixin in its own module, documented there). The whole MRO is read, so that a
        subclass keeps the checks."""
        declared = {}
        for klass in reversed(cls.__mro__):
            if klass not in PretrainedConfig.__mro__:
                declared.update(vars(klass).get("__annotations__", {}))
        return declared

    @classmethod
    def integer_fields(cls) -> list[str]:
        """The declared fields (`declared_fields`) typed `int` (or `int | None`).

        Kinds read them to derive others (MLA's `head_dim` from `kv_lora_rank`), so a string or a float must be
        refused under its own name first."""
        return [name for name, kind in cls.declared_fields().items()  # strings here, types in a subclass
                if kind in ("int", "int | None", int, int | None) and FIELD_RULES.get(name) is not _token_ids]

    # RoPE parameters only mean something for rotary positions (and MLA's decoupled rotary key):
    # other position types keep `rope_parameters=None` instead of a default dict nobody reads.
    def convert_rope_params_to_dict(self, **kwargs):
        if self.position_embedding_type != "rope":
            kwargs.pop("rope_scaling", None)
            kwargs.pop("rope_theta", None)
            self.rope_parameters = None
            return kwargs
        require_rope_dicts(kwargs.get("rope_scaling") or self.rope_parameters, ATTENTION_LAYER_TYPES)
        converted = convert_nested_rope_params(self, kwargs)
        return converted if converted is not None else super().convert_rope_params_to_dict(**kwargs)

    def standardize_rope_params(self) -> None:
        """transformers' own, except for a dict nested by layer type before 5.18 (`compat`)."""
        if not standardize_nested_rope_params(self):
            super().standardize_rope_params()

    def validate_rope(self) -> None:
        """transformers' RoPE validation, on the head the attention kind rotates
        (`positions.transformers_rope_check`); `save_pretrained` runs it through `validate()`."""
        if self.uses_rope:
            transformers_rope_check(self)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """transformers' `from_dict`, after dropping values earlier versions wrote into every config.json for
        fields the chosen kinds do not read (`Registry.forget_formerly_written`)."""
        config_dict = dict(config_dict)
        for registry in (ATTENTIONS, LINEAR_ATTENTIONS, MLPS, RESIDUAL_STREAMS):
            registry.forget_formerly_written(cls, config_dict)
        return super().from_dict(config_dict, **kwargs)

    def to_dict(self) -> dict:
        register_peft_defaults()  # see there: PEFT reads this dict to pick a config's default targets
        output = super().to_dict()
        model_entry = (output.get("auto_map") or {}).get("AutoModel")
        if isinstance(model_entry, str):
            # A folder that carries the model code loads this class through the modeling module, which
            # imports it: transformers copies remote code into a directory named by a hash of the loaded
            # file and the files it imports, so a config loaded from this module would live in a second
            # copy of every shared module, whose attention and MoE classes (built by the config's
            # registries) the model's `isinstance` checks and output recorders (router logits) miss.
            module = model_entry.rsplit(".", 1)[0]
            output["auto_map"] = {**output["auto_map"], "AutoConfig": f"{module}.{type(self).__name__}"}
        return output

    def validate(self) -> None:
        """The class validators transformers runs when saving, looked up on this class, so that the
        `validate_rope` above replaces the mixin's (which reads an MLA config's unused `head_dim`)."""
        run_config_validators(self, PretrainedConfig)

    @property
    def uses_rope(self) -> bool:
        return self.position_embedding_type == "rope"

    @property
    def attention_kind(self):
        """The registry entry of `attention_type` (`registries.ATTENTIONS`)."""
        return ATTENTIONS.of(self)

    @property
    def mlp_kind(self):
        """The registry entry of `mlp_type` (`registries.MLPS`)."""
        return MLPS.of(self)

    @property
    def linear_attention_kind(self):
        """The registry entry of `linear_attention_type` (`registries.LINEAR_ATTENTIONS`)."""
        return LINEAR_ATTENTIONS.of(self)

    def mixer_kind(self, layer_type: str):
        """The kind whose module mixes tokens in a layer of `layer_type`: the linear-attention kind for
        `"linear_attention"` layers, the attention kind for the others."""
        return self.linear_attention_kind if layer_type == LINEAR_ATTENTION else self.attention_kind

    @property
    def attention_layer_count(self) -> int:
        """Layers that attend (full or sliding, alone or in a hybrid layer), as opposed to linear-attention layers
        and layers without a token mixer (`block_types`)."""
        return sum(any(t != LINEAR_ATTENTION for t in types) for types in mixing_layer_types(self))

    @property
    def linear_attention_layer_count(self) -> int:
        """Layers that run a linear-attention mixer (alone or in a hybrid layer)."""
        return sum(LINEAR_ATTENTION in types for types in mixing_layer_types(self))

    # transformers reads its parallelism plans from the config instance; these are built from the kinds the
    # config chose, so every key names a module or parameter of the model it builds (a dense MLP has no
    # `gate_proj`, MLA no `k_proj`, only MoE layers have `experts`, a post-norm model may have no final norm).
    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """Tensor-parallel styles by module name (relative to the base model): the attention and
        feed-forward kinds' own entries for every layer."""
        per_layer = dict(self.attention_kind.tp_plan(self)) if self.attention_layer_count else {}
        if self.linear_attention_kind.in_use(self):
            per_layer.update(self.linear_attention_kind.tp_plan(self))
        per_layer.update(self.mlp_kind.tp_plan(self))
        plan = {f"layers.*.{name}": style for name, style in per_layer.items()}
        return {**plan, **self.__dict__.get("base_model_tp_plan", {})}

    @base_model_tp_plan.setter
    def base_model_tp_plan(self, value: dict[str, str]) -> None:
        # transformers 5.16-5.20 add entries to the plan from `__post_init__` (compat.py)
        self.__dict__["base_model_tp_plan"] = plan_additions(value, type(self).base_model_tp_plan.fget(self))

    @property
    def base_model_ep_plan(self) -> dict[str, str]:
        """Expert-parallel styles (empty unless the feed-forward kind has routed experts)."""
        return {f"layers.*.{name}": style for name, style in self.mlp_kind.ep_plan(self).items()}

    @property
    def base_model_fsdp_plan(self) -> dict[str, str]:
        """FSDP2 units: embeddings and each layer freed after use, the final norm kept (transformers' default
        names it `norm`)."""
        plan = {"embed_tokens": "free_full_weight", "layers.*": "free_full_weight"}
        if self.final_norm:
            plan["final_norm"] = "keep_full_weight"
        return plan

    @property
    def base_model_pp_plan(self) -> dict[str, tuple[list[str], list[str]]]:
        """Pipeline stages' inputs and outputs by module."""
        plan = {"embed_tokens": (["input_ids"], ["inputs_embeds"]),
                "layers": (["hidden_states", "attention_mask"], ["hidden_states"])}
        if self.final_norm:
            plan["final_norm"] = (["hidden_states"], ["hidden_states"])
        return plan

    @property
    def rope_head_dim(self) -> int:
        """The head width RoPE tables are built for (the attention kind decides: d_h, or MLA's d_R)."""
        return self.attention_kind.rope_head_dim(self)

    @property
    def rotary_dim(self) -> int:
        """Width of the rotated part of each q/k head (d_R for MLA)."""
        return self.attention_kind.rotary_dim(self)

    def rope_parameters_for(self, layer_type: str) -> dict | None:
        """The RoPE dict a layer of `layer_type` uses (nested dicts give each type its own)."""
        if not self.uses_rope:
            return None
        params = self.rope_parameters
        return params[layer_type] if self.rope_is_nested else params

    @property
    def rope_is_nested(self) -> bool:
        return bool(self.rope_parameters) and all(key in ATTENTION_LAYER_TYPES for key in self.rope_parameters)

    def validate_contract(self) -> None:
        """Check every field and their combinations; raises `ValueError` naming the field.

        General fields follow `FIELD_RULES`; each variant field is checked by its registry, whose
        chosen entry checks the fields it owns, and whose other entries' fields must keep their
        defaults (a setting nothing would read is refused, not ignored).
        """
        for name, rule in FIELD_RULES.items():
            rule(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"`num_attention_heads`={self.num_attention_heads} must be a multiple of "
                f"`num_key_value_heads`={self.num_key_value_heads} (MHA: equal, MQA: 1, GQA: a divisor)."
            )
        if self.pad_token_id is not None and self.pad_token_id >= self.vocab_size:
            raise ValueError(f"`pad_token_id`={self.pad_token_id} must lie in [0, vocab_size={self.vocab_size}).")
        require_choice("norm_type", self.norm_type, NORMS)
        validate_block(self)
        self._validate_layer_types()
        if not self.num_mtp_layers and self.mtp_loss_scaling_factor:
            raise ValueError(f"`mtp_loss_scaling_factor`={self.mtp_loss_scaling_factor} weighs the loss of MTP modules, "
                             "and `num_mtp_layers`=0: set `num_mtp_layers` or leave the factor at 0.")
        if self.mtp_draft_vocab_size and not self.num_mtp_layers:
            raise ValueError(f"`mtp_draft_vocab_size`={self.mtp_draft_vocab_size} restricts the drafts of MTP modules, "
                             "and `num_mtp_layers`=0: set `num_mtp_layers` or leave it at 0.")
        if self.mtp_draft_vocab_size > self.vocab_size:
            raise ValueError(f"`mtp_draft_vocab_size`={self.mtp_draft_vocab_size} must be at most "
                             f"`vocab_size`={self.vocab_size} (0: the whole vocabulary).")
        if not self.num_mtp_layers and self.mtp_draft_tokens is not None:
            raise ValueError(f"`mtp_draft_tokens`={self.mtp_draft_tokens} sets the tokens MTP modules draft per step, "
                             "and `num_mtp_layers`=0: set `num_mtp_layers` or leave it unset.")
        for registry in (ATTENTIONS, LINEAR_ATTENTIONS, POSITIONS, MLPS, RESIDUAL_STREAMS, FEATURES):
            registry.check(self)

    def _validate_layer_types(self) -> None:
        require_per_layer("layer_types", self.layer_types, self)
        for layer_type in self.layer_types:
            require_choice("layer_types[...]", layer_type, LAYER_TYPES)
        kind = ATTENTIONS.get(self.attention_type) if isinstance(self.attention_type, str) else None
        unbuilt = sorted({t for t in self.layer_types if t in ATTENTION_LAYER_TYPES} - set(kind.layer_types)) if kind else []
        if unbuilt:
            owners = [name for name, entry in ATTENTIONS.items() if set(unbuilt) <= set(entry.layer_types)]
            raise ValueError(f"`layer_types` has {unbuilt} layers, which `attention_type`={self.attention_type!r} "
                             f"does not build: use `attention_type` in {owners}.")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("`layer_types` has sliding layers but `sliding_window` is None.")
        if not self.attention_layer_count and self.position_embedding_type in ("rope", "alibi"):
            raise ValueError(
                f"`position_embedding_type`={self.position_embedding_type!r} acts on attention scores, and every "
                "layer of `layer_types` is 'linear_attention' (which reads no positions): use 'none', 'learned' or "
                "'sinusoidal'."
            )


__all__ = ["ModularDecoderConfig", "PEFT_LORA_TARGET_MODULES", "PER_LAYER_FIELDS", "register_peft_defaults"]
