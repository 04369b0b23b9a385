"""PEFT on the family: LoRA / DoRA with Llama-style `target_modules` on every preset, training,
save -> reload on a fresh base, merge; prefix tuning against transformers' Llama."""

from __future__ import annotations

import pytest
import torch
from peft import (CPTConfig, LoraConfig, PeftModel, PrefixTuningConfig, PromptEncoderConfig, PromptTuningConfig,
                  get_peft_model)
from transformers import LlamaConfig, LlamaForCausalLM

from modular_decoder import PRESETS, ModularDecoderForCausalLM, preset_config
from modular_decoder.compat import CACHE_NAME

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _counting_batch(batch: int = 8, length: int = 24, vocab: int = 128, seed: int = 0) -> torch.Tensor:
    """Rows that count up from a random start: learnable, unlike random tokens."""
    starts = torch.randint(0, vocab, (batch, 1), generator=torch.Generator().manual_seed(seed))
    return (starts + torch.arange(length)) % vocab


def _perturb_adapter(model) -> None:
    """LoRA's B starts at zero, which would make every comparison below trivially equal."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.05)


def test_lora_finetune_halves_loss():
    # A random base at the default init (std 0.02) has a frozen head whose logits span ~1 nat at
    # most, so no adapter can halve the loss; std 0.1 stands in for a trained base's larger norms.
    model = ModularDecoderForCausalLM(preset_config("llama", tiny=True, initializer_range=0.1))
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    assert all(("lora_" in n) == p.requires_grad for n, p in peft_model.named_parameters())
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    batch = _counting_batch()
    losses = []
    for _ in range(30):
        loss = peft_model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 2, losses


# LoRA on every preset; DoRA (slower: a weight norm per layer) on one dense and two gated layouts.
CASES = [(name, False) for name in sorted(PRESETS)] + [(name, True) for name in ("gpt2", "llama", "gemma3")]


@pytest.mark.parametrize(("preset", "use_dora"), CASES, ids=[f"{p}-{'dora' if d else 'lora'}" for p, d in CASES])
def test_adapter_save_reload_merge(preset, use_dora, tmp_path):
    config = preset_config(preset, tiny=True)
    base = ModularDecoderForCausalLM(config).eval()
    base.save_pretrained(tmp_path / "base")
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, use_dora=use_dora))
    wrapped = {name.rsplit(".", 1)[-1] for name, module in peft_model.named_modules() if hasattr(module, "lora_A")}
    if config.attention_type in ("mla", "dsa"):  # DeepSeek's own projection names, of which TARGETS holds these
        expected = {"o_proj"} | ({"q_proj"} if config.q_lora_rank is None else set())
        if config.linear_attention_type == "kda" and "linear_attention" in config.layer_types:  # Kimi Linear
            expected |= {"q_proj", "k_proj", "v_proj"}  # KDA's own projections, beside the latent attention
    elif config.attention_type == "shared_kv":  # DeepSeek-V4's own names (kv_proj, o_b_proj): none of TARGETS'
        expected = set()
    else:
        expected = {"q_proj", "k_proj", "v_proj", "o_proj"}
    if config.mlp_type == "dense":
        expected |= {"up_proj", "down_proj"}
    # gated MLPs, and with experts the dense layers' MLPs and the shared experts (the routed experts
    # are 3-D parameters, reached through `target_parameters`: see the test below)
    elif config.mlp_type == "gated" or "dense" in config.mlp_layer_types or config.n_shared_experts:
        expected |= {"gate_proj", "up_proj", "down_proj"}
    assert wrapped == expected
    _perturb_adapter(peft_model)
    peft_model.eval()
    ids = _counting_batch(2, 12)
    with torch.no_grad():
        plain = ModularDecoderForCausalLM.from_pretrained(tmp_path / "base").eval()(ids).logits
        adapted = peft_model(input_ids=ids).logits
    assert (adapted - plain).abs().max() > 1e-3  # the adapter does something

    peft_model.save_pretrained(tmp_path / "adapter")
    fresh = ModularDecoderForCausalLM.from_pretrained(tmp_path / "base").eval()
    reloaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, adapted, rtol=0, atol=0)
        merged = reloaded.merge_and_unload()
        assert isinstance(merged, ModularDecoderForCausalLM)
        assert not any("lora_" in n for n, _ in merged.named_parameters())
        torch.testing.assert_close(merged(ids).logits, adapted, rtol=1e-5, atol=1e-5)

    # The same through the default CPU load (decode layout: fused q/k/v and gate/up): the adapter
    # wraps fused members, merging writes into (or replaces) the fused buffer's views
    laid_out = PeftModel.from_pretrained(ModularDecoderForCausalLM.from_pretrained(tmp_path / "base"),
                                         tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(laid_out(input_ids=ids).logits, adapted, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(laid_out.merge_and_unload()(ids).logits, adapted, rtol=1e-5, atol=1e-5)


# The router weight and the stacked experts are not Linear modules: PEFT adapts them as parameters
# (a ParamWrapper parametrizes W + ΔW during the owner's forward; rank r per expert).
EXPERT_PARAMETERS = ["mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.mark.parametrize("preset", ["mixtral", "deepseek_v3", "gpt_oss"])  # gpt-oss: biased router and experts
def test_lora_on_router_and_experts_trains_saves_reloads_and_merges(preset, tmp_path):
    config = preset_config(preset, tiny=True, initializer_range=0.1)
    base = ModularDecoderForCausalLM(config).eval()
    base.save_pretrained(tmp_path / "base")
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["o_proj"], target_parameters=EXPERT_PARAMETERS)
    peft_model = get_peft_model(base, lora)
    adapted_params = {name for name, p in peft_model.named_parameters() if p.requires_grad}
    assert adapted_params and all("lora_" in name for name in adapted_params)
    sparse = [i for i, kind in enumerate(config.mlp_layer_types) if kind == "sparse"]
    for part in ("gate", "experts"):  # every sparse layer's router and experts carry an adapter
        assert all(any(f"layers.{i}.mlp.{part}." in name for name in adapted_params) for i in sparse)

    # train: the loss falls, and the frozen base does not move
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    batch = _counting_batch(4, 16)
    frozen = {k: v.clone() for k, v in base.state_dict().items() if "lora_" not in k and "base_layer" not in k}
    peft_model.train()
    losses = []
    for _ in range(8):
        loss = peft_model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    assert all(torch.equal(frozen[k], v) for k, v in base.state_dict().items() if k in frozen)

    peft_model.eval()
    ids = _counting_batch(2, 12, seed=3)
    with torch.no_grad():
        adapted = peft_model(input_ids=ids).logits
        plain = ModularDecoderForCausalLM.from_pretrained(tmp_path / "base").eval()(ids).logits
        assert (adapted - plain).abs().max() > 1e-3
        peft_model.save_pretrained(tmp_path / "adapter")
        fresh = ModularDecoderForCausalLM.from_pretrained(tmp_path / "base").eval()
        reloaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
        torch.testing.assert_close(reloaded(input_ids=ids).logits, adapted, rtol=1e-5, atol=1e-5)
        merged = reloaded.merge_and_unload()
        torch.testing.assert_close(merged(ids).logits, adapted, rtol=1e-5, atol=1e-5)
    assert isinstance(merged, ModularDecoderForCausalLM)
    assert not any("lora_" in name or "base_layer" in name for name, _ in merged.named_parameters())
    experts = merged.model.layers[sparse[0]].mlp.experts
    assert type(experts.gate_up_proj) is torch.nn.Parameter and experts.gate_up_proj.is_contiguous()
    assert set(merged.state_dict()) == set(ModularDecoderForCausalLM(config).state_dict())  # the plain names


MLA_TARGETS = TARGETS + ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"]  # DeepSeek's names


def test_lora_on_mla_low_rank_projections(tmp_path):
    config = preset_config("llama", tiny=True, attention_type="mla", q_lora_rank=32, kv_lora_rank=16,
                           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    base = ModularDecoderForCausalLM(config).eval()
    base.save_pretrained(tmp_path / "base")
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=MLA_TARGETS)).eval()
    wrapped = {name.rsplit(".", 1)[-1] for name, module in peft_model.named_modules() if hasattr(module, "lora_A")}
    assert wrapped == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj"}
    _perturb_adapter(peft_model)
    ids = _counting_batch(2, 12)
    with torch.no_grad():
        adapted = peft_model(input_ids=ids).logits
        peft_model.save_pretrained(tmp_path / "adapter")
        fresh = ModularDecoderForCausalLM.from_pretrained(tmp_path / "base").eval()
        assert (fresh(ids).logits - adapted).abs().max() > 1e-3
        reloaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
        torch.testing.assert_close(reloaded(input_ids=ids).logits, adapted, rtol=0, atol=0)
        torch.testing.assert_close(reloaded.merge_and_unload()(ids).logits, adapted, rtol=1e-5, atol=1e-5)


def _llama_twin(model: ModularDecoderForCausalLM) -> LlamaForCausalLM:
    """transformers' Llama with the same weights as a tiny `llama` preset model."""
    c = model.config
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.norm_eps, tie_word_embeddings=c.tie_word_embeddings, rope_parameters=c.rope_parameters,
    ))
    renames = {"pre_attn_norm": "input_layernorm", "pre_mlp_norm": "post_attention_layernorm", "final_norm": "norm"}
    state = {}
    for key, value in model.state_dict().items():
        for ours, theirs in renames.items():
            key = key.replace(ours, theirs)
        state[key] = value
    llama.load_state_dict(state, strict=True)
    return llama.eval()


def test_prefix_tuning_matches_llama():
    """PEFT prefix tuning hands the prefix in as `past_key_values`; the forwards accept it through
    `deprecate_kwarg` and must attend to it exactly as Llama does."""
    model = ModularDecoderForCausalLM(preset_config("llama", tiny=True)).eval()
    llama = _llama_twin(model)
    ids = _counting_batch(2, 10)
    prefix = PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    ours, theirs = get_peft_model(model, prefix), get_peft_model(llama, prefix)
    theirs.prompt_encoder.load_state_dict(ours.prompt_encoder.state_dict())
    with torch.no_grad():
        for mask in (None, torch.ones_like(ids)):
            got = ours(input_ids=ids, attention_mask=mask).logits
            torch.testing.assert_close(got, theirs(input_ids=ids, attention_mask=mask).logits)
            assert (got - model(ids).logits).abs().max() > 1e-2  # the prefix is attended to


PROMPT_LEARNING = {
    "prompt_tuning": lambda: PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    "p_tuning": lambda: PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, encoder_hidden_size=16),
    "cpt": lambda: CPTConfig(task_type="CAUSAL_LM", cpt_token_ids=[5, 6, 7, 8], cpt_mask=[1, 1, 1, 1],
                             cpt_tokens_type_mask=[1, 2, 2, 3]),
    "prefix_tuning": lambda: PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
}


def _greedy_through(adapted, ids: torch.Tensor, mask: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy tokens recomputed token by token through the adapted model's forward, without a cache (PEFT adds its
    virtual tokens, or prefix, to each whole text)."""
    with torch.no_grad():
        for _ in range(steps):
            logits = adapted(input_ids=ids, attention_mask=mask).logits[:, -1]
            ids = torch.cat((ids, logits.argmax(-1, keepdim=True)), dim=1)
            mask = torch.cat((mask, torch.ones_like(mask[:, :1])), dim=1)
    return ids


@pytest.mark.parametrize("method", list(PROMPT_LEARNING))
def test_prompt_learning_generates_as_its_uncached_forward(method):
    """Prompt tuning, P-tuning, CPT and prefix tuning in `generate`: the virtual tokens (or the prefix) once, before
    the text, as PEFT's forward reads them: the greedy tokens of the adapted model's forward recomputed without a
    cache, which transformers' Llama with the same weights gives too (its forward, and its `generate` on
    transformers before 5.24, where PEFT finds generate's cache under `past_key_values`). On 5.24 onwards PEFT
    does not find it there: Llama's `generate` adds the virtual tokens again at every step, and drops a prefix."""
    model = ModularDecoderForCausalLM(preset_config("llama", tiny=True)).eval()
    llama = _llama_twin(model)
    torch.manual_seed(0)
    ours, theirs = get_peft_model(model, PROMPT_LEARNING[method]()), get_peft_model(llama, PROMPT_LEARNING[method]())
    with torch.no_grad():
        for param in ours.prompt_encoder.parameters():
            param.mul_(20 if method == "prefix_tuning" else 1)  # a prefix strong enough to change the tokens
    theirs.prompt_encoder.load_state_dict(ours.prompt_encoder.state_dict())
    ids = _counting_batch(2, 6)
    padded = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    for prompt, mask in ((ids, torch.ones_like(ids)), (padded, (padded != 0).long())):
        expected = _greedy_through(ours, prompt, mask, 6)
        with torch.no_grad():
            got = ours.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert torch.equal(got, expected), method
    # transformers' Llama: its uncached forward gives the same tokens (unpadded: without position ids, which PEFT
    # drops, Llama counts padding as positions)
    assert torch.equal(_greedy_through(theirs, ids, torch.ones_like(ids), 6),
                       _greedy_through(ours, ids, torch.ones_like(ids), 6))
    with torch.no_grad():
        base = model.generate(ids, max_new_tokens=6, do_sample=False)
        llama_generate = theirs.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                         do_sample=False)
    assert not torch.equal(_greedy_through(ours, ids, torch.ones_like(ids), 6), base)  # the adapter changes them
    if CACHE_NAME != "cache":
        assert torch.equal(llama_generate, _greedy_through(ours, ids, torch.ones_like(ids), 6))
    elif method == "prefix_tuning":
        assert torch.equal(llama_generate, base)  # transformers' Llama drops the prefix (when this fails: fixed)


def test_prefix_tuning_on_mla_is_refused_at_the_first_forward():
    """PEFT's prefix is per-head keys and values; MLA's cache holds one latent per token. transformers' DeepseekV3
    and ours both failed inside `cache.update` with a tensor-size error; ours refuses in one line naming MLA and
    what to use instead."""
    model = ModularDecoderForCausalLM(preset_config("deepseek_v3", tiny=True)).eval()
    adapted = get_peft_model(model, PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    for run in (lambda ids: adapted(input_ids=ids), lambda ids: adapted.generate(input_ids=ids, max_new_tokens=2)):
        with torch.no_grad(), pytest.raises(ValueError) as error:
            run(_counting_batch(1, 6))
        message = str(error.value)
        assert "\n" not in message and message.startswith("MLA (`attention_type='mla'`) cannot attend to per-head keys")
        assert "`PromptTuningConfig`" in message and "LoRA" in message


def _greedy_without_cache(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=ids, use_cache=False).logits[:, -1]
            ids = torch.cat((ids, logits.argmax(-1, keepdim=True)), dim=1)
    return ids


def test_activated_lora_on_mla_generates_as_its_uncached_forward():
    """aLoRA (LoRA active from an invocation token on) on MLA's per-token projections, `kv_a_proj_with_mqa`
    whose output the latent cache holds among them: greedy tokens through the cache equal a loop over the
    uncached forward of the same adapted model, on a batch (whose cached latents are a strided slice of the
    growing cache: `expand_kv` hands `kv_b_proj` a contiguous input, which a wrapped layer may `view`)."""
    torch.manual_seed(0)
    model = ModularDecoderForCausalLM(preset_config("deepseek_v3", tiny=True)).eval()
    config = LoraConfig(task_type="CAUSAL_LM", r=4, alora_invocation_tokens=[7], init_lora_weights=False,
                        target_modules=["q_b_proj", "kv_a_proj_with_mqa", "o_proj"])
    adapted = get_peft_model(model, config).eval()
    ids = torch.tensor([[3, 7, 5, 9, 2], [4, 4, 7, 8, 6]])
    with torch.no_grad():
        generated = adapted.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                     do_sample=False)
        assert not torch.equal(adapted(input_ids=ids).logits, model(ids).logits)  # the adapter is active
    assert torch.equal(generated, _greedy_without_cache(adapted, ids, 4))


def test_activated_lora_on_kv_b_proj_trains_and_refuses_a_cache_in_one_line():
    """aLoRA on `kv_b_proj` (MLA's default LoRA targets include it) adapts the last tokens of each call; the latent
    cache re-expands every cached token through it at each step, so a cached step would answer otherwise than the
    uncached forward (measured: greedy tokens diverged at the second new token). Without a cache it trains; a step
    against cached tokens is refused, naming the alternatives."""
    torch.manual_seed(0)
    model = ModularDecoderForCausalLM(preset_config("deepseek_v3", tiny=True)).eval()
    adapted = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=4, alora_invocation_tokens=[7],
                                               init_lora_weights=False))
    ids = torch.tensor([[3, 7, 5, 9, 2], [4, 4, 7, 8, 6]])
    adapted.train()
    adapted(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in adapted.named_parameters() if "kv_b_proj.lora" in n)
    adapted.eval()
    with torch.no_grad(), pytest.raises(ValueError) as error:
        adapted.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
    message = str(error.value)
    assert "\n" not in message and "`kv_b_proj`" in message and "`kv_a_proj_with_mqa`" in message
