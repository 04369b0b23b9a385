"""Real ecosystem clients on a checkpoint loaded the default way (`AutoModelForCausalLM.from_pretrained(folder)`),
each run on transformers' own class and on ours with the same weights (converted by `modular_decoder.conversion`)
in the same test: a failure on both is the engine's limit, a failure or difference on ours alone is our defect.

Clients: accelerate `save_model`, safetensors `save_file`, full backward hooks, torchao int8 weight-only
(`quantize_`, `TorchAoConfig`), transformers tensor parallelism (standard attention, OLMo 2's full QK-norm, MLA
with experts, Mixtral's experts), FSDP2 (`fully_shard`, `DistributedConfig(fsdp_size=2)`) and DeepSpeed ZeRO-3 on
two gloo processes, transformers' ExecuTorch recipe (standard attention and MLA), `torch.compile(fullgraph=True)`,
PEFT's `LoraConfig()` defaults, TRL's `SFTTrainer` with LoRA and lm-eval's `HFLM`.

torchao and DeepSpeed are installed in their own folder (`scripts/setup.sh`: `.venv/isolated-clients`), which only
their worker processes put on the path: transformers imports torchao with every model class and accelerate imports
DeepSpeed on every save, both printing to stderr, which would change every other test's process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig, LlamaForCausalLM

import modular_decoder  # noqa: F401  (registers the Auto classes)
from modular_decoder import compiled_decoding
from modular_decoder.conversion import convert
from decoding import recording_backend
from tiny_tokenizer import tiny_tokenizer

TESTS = Path(__file__).parent
# torchao and DeepSpeed: see the module docstring
ISOLATED_CLIENTS = Path(sys.prefix) / "isolated-clients"
IDS = torch.tensor([[5, 6, 7, 8, 9, 10]])
SIDES = ("llama", "ours")


def _perturbed(model):
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny random Llama (GQA, untied, perturbed norms) saved by transformers, and the same weights converted to
    ours; both folders carry the tiny tokenizer."""
    root = tmp_path_factory.mktemp("eco")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=2, eos_token_id=3, pad_token_id=1)
    _perturbed(LlamaForCausalLM(config)).save_pretrained(root / "llama")
    tiny_tokenizer().save_pretrained(root / "llama")
    convert(root / "llama", root / "ours", progress=False)
    tiny_tokenizer().save_pretrained(root / "ours")
    return {"llama": root / "llama", "ours": root / "ours"}


def load(folders, side: str, **kwargs):
    """The default load path, for transformers' Llama and for ours alike."""
    return AutoModelForCausalLM.from_pretrained(folders[side], **kwargs).eval()


def _client_env() -> dict[str, str]:
    if not (ISOLATED_CLIENTS / "torchao").is_dir() or not (ISOLATED_CLIENTS / "deepspeed").is_dir():
        pytest.fail(f"torchao / DeepSpeed are not installed in {ISOLATED_CLIENTS}: run `bash scripts/setup.sh`.")
    path = [str(ISOLATED_CLIENTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "2"}


def test_both_sides_start_equal(folders):
    """The premise of every comparison below: the converted model is the same function."""
    llama, ours = load(folders, "llama"), load(folders, "ours")
    assert type(ours).__name__ == "ModularDecoderForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS).logits, llama(IDS).logits, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------- saving the weights


def test_accelerate_save_model_round_trip(folders, tmp_path):
    """Every tensor is written (none dropped as a presumed alias of another) and reloads equal."""
    from accelerate import Accelerator
    from safetensors.torch import load_file

    for side in SIDES:
        model = load(folders, side)
        state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        Accelerator(cpu=True).save_model(model, tmp_path / side)
        saved = {}
        for file in sorted((tmp_path / side).glob("*.safetensors")):
            saved.update(load_file(file))
        assert sorted(saved) == sorted(state), side
        assert all(torch.equal(saved[name], state[name]) for name in state), side
        fresh = load(folders, side)
        fresh.load_state_dict(saved, strict=True)
        with torch.no_grad():
            torch.testing.assert_close(fresh(IDS).logits, model(IDS).logits, rtol=0, atol=0)


def test_safetensors_save_file_of_the_state_dict(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    for side in SIDES:
        state = load(folders, side).state_dict()
        save_file(state, tmp_path / f"{side}.safetensors")
        loaded = load_file(tmp_path / f"{side}.safetensors")
        assert sorted(loaded) == sorted(state) and all(torch.equal(loaded[k], state[k]) for k in state), side


# ------------------------------------------------------------------------------------------------------ hooks


@pytest.mark.usefixtures("two_threads")
def test_full_backward_hooks_fire_with_the_same_gradients(folders):
    """Hooks registered after loading on q_proj, down_proj and lm_head fire in backward (train and eval mode)
    with the gradients Llama's see; forward hooks fire during a no-grad generate (the few-row path)."""
    seen, hook_calls = {}, {}
    for side in SIDES:
        for mode in ("train", "eval"):
            model = load(folders, side).train(mode == "train")
            layer = model.model.layers[0]
            fired = {}
            for name, module in {"q_proj": layer.self_attn.q_proj, "down_proj": layer.mlp.down_proj,
                                 "lm_head": model.lm_head}.items():
                module.register_full_backward_hook(
                    lambda mod, grad_in, grad_out, name=name: fired.__setitem__(name, grad_out[0].detach().clone()))
            model(IDS, labels=IDS).loss.backward()
            assert sorted(fired) == ["down_proj", "lm_head", "q_proj"], (side, mode, sorted(fired))
            seen[side, mode] = fired
        model = load(folders, side)
        calls = []
        model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda *args: calls.append("k_proj"))
        model.model.layers[1].mlp.up_proj.register_forward_pre_hook(lambda *args: calls.append("up_proj"))
        with torch.no_grad():
            model.generate(IDS, max_new_tokens=3, do_sample=False)
        hook_calls[side] = calls
        assert calls.count("k_proj") == calls.count("up_proj") >= 2, (side, calls)  # the prompt, then steps
    assert hook_calls["ours"] == hook_calls["llama"]
    for mode in ("train", "eval"):
        for name, grad in seen["llama", mode].items():
            torch.testing.assert_close(seen["ours", mode][name], grad, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------------- torchao


def test_torchao_int8_weight_only(folders):
    """`quantize_` after loading and `TorchAoConfig` at load: the weights become torchao's int8 tensors on both,
    and ours computes what Llama computes with them (forward, a one-token step, greedy tokens), two threads."""
    result = subprocess.run([sys.executable, str(TESTS / "eco_torchao_worker.py"), str(folders["llama"]),
                             str(folders["ours"])], capture_output=True, text=True, timeout=300, env=_client_env())
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["threads"] == 2
    assert not out["peft_imported"], "importing modular_decoder and loading a model imported PEFT"
    for way in ("quantize_", "TorchAoConfig"):
        llama, ours = out[f"llama/{way}"], out[f"ours/{way}"]
        assert llama["weight"] == ours["weight"] == "Int8Tensor"
        assert llama["head_weight"] == ours["head_weight"]  # transformers' TorchAoConfig leaves the head in fp32
        torch.testing.assert_close(torch.tensor(ours["logits"]), torch.tensor(llama["logits"]), rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.tensor(ours["step"]), torch.tensor(llama["step"]), rtol=0, atol=1e-5)
        assert ours["tokens"] == llama["tokens"], way
        # quantized, not ignored: int8 weights move the logits a little from fp32, as they move Llama's
        assert 0 < (torch.tensor(ours["logits"]) - torch.tensor(out["ours/fp32"])).abs().max() < 0.1


# -------------------------------------------------------------------------------- parallel engines, 2 processes


def _parallel_cases(root: Path) -> None:
    """transformers checkpoints of each case and ours converted from them (same weights)."""
    import transformers as tf
    from conversion_cases import CASES, COMMON, MLA

    builds = {
        "llama": CASES["llama"][1],
        "olmo2": CASES["olmo2"][1],  # qk_norm="full": q/k/v gather their output, o splits its input
        "mixtral": CASES["mixtral"][1],  # experts: transformers' packed_colwise / rowwise / moe_tp_experts
        # MLA (heads split across ranks) with a dense first layer, routed and shared experts; expert width 16
        # keeps the sharded experts within transformers' grouped_mm kernel (16-byte strides) for its own class
        "deepseek_v2": lambda: tf.DeepseekV2Config(**COMMON, **MLA, q_lora_rank=None, first_k_dense_replace=1,
                                                   n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                                   moe_intermediate_size=16),
    }
    for case, build in builds.items():
        config = build()
        config.architectures = None
        torch.manual_seed(0)
        _perturbed(AutoModelForCausalLM.from_config(config)).save_pretrained(root / case / "src")
        convert(root / case / "src", root / case / "ours", progress=False)


@pytest.mark.slow
def test_parallel_engines_on_two_processes(tmp_path):
    """Tensor parallelism (`tp_plan="auto"`) on a Llama, an OLMo 2 (full QK-norm), a DeepSeek-V2 (MLA + experts)
    and a Mixtral; FSDP2 (`fully_shard`, `DistributedConfig(fsdp_size=2)`) and DeepSpeed ZeRO-3 (wrapping a loaded
    model, and `zero.Init` at load) on the Llama: two gloo processes equal one (logits, every gradient, a one-token
    no-grad step, greedy tokens), for transformers' class and ours, and ours equals transformers' under each. The
    no-grad evaluation runs with two threads per process, so ours' reference runs the split products."""
    _parallel_cases(tmp_path)
    out = tmp_path / "results.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(TESTS / "eco_parallel_worker.py"), str(tmp_path), str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=_client_env())
    assert result.returncode == 0 and out.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads(out.read_text())
    results.pop("seconds")
    failed = {key: value for key, value in results.items() if value["error"]}
    assert not failed, json.dumps(failed, indent=1)[:4000]
    expected = {f"{case}/{side}/tp_plan_auto" for case in ("llama", "olmo2", "deepseek_v2", "mixtral")
                for side in ("src", "ours", "ours_vs_src")}
    expected |= {f"llama/{side}/{engine}" for side in ("src", "ours", "ours_vs_src")
                 for engine in ("fsdp_distributed_config", "fully_shard", "deepspeed_wrap", "deepspeed_zero_init")}
    assert set(results) == expected
    for key, value in results.items():
        if "/ours_vs_src/" in key:
            assert value["difference"] < 1e-5, (key, value)
        elif "deepspeed" in key:
            assert value["loss"] < 1e-6 and value["step"] < 1e-5, (key, value)
            assert value["partitioned"] is not False, (key, value)  # zero.Init: every parameter partitioned at load
        else:
            assert "DTensor" in value["parameter_types"], (key, value)
            assert max(value["logits"], value["grads"], value["step"]) < 1e-5 and value["generate"], (key, value)
        if "/ours/" in key:  # two threads: the one-process reference ran the split products the engine is held to
            assert value["reference_split"] > 0, (key, value)


# ---------------------------------------------------------------------------------------- ExecuTorch recipe


def _exported_steps(model, ids: torch.Tensor, strict: bool, new_tokens: int = 3, prepare=None):
    """transformers' ExecuTorch recipe: export a one-token step with its static cache, then run the prompt
    token by token through the exported program and decode greedily (the recipe's own `generate` feeds the
    first new token one position late in transformers 5.24, so the loop is written out)."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model.generation_config.cache_implementation = "static"
    recipe = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=16)
    if prepare is not None:
        prepare(recipe.model)
    program = recipe.export(input_ids=ids[:, :1], cache_position=torch.tensor([0]), strict=strict).module()
    tokens, logits = ids[0].tolist(), []
    for position in range(ids.shape[1] + new_tokens - 1):
        step = program(input_ids=torch.tensor([[tokens[position]]]), cache_position=torch.tensor([position]))
        logits.append(step[0, -1])
        if position >= ids.shape[1] - 1:
            tokens.append(int(step[0, -1].argmax()))
    return torch.stack(logits), tokens


def _check_against_eager(model, logits, tokens, ids):
    with torch.no_grad():
        eager = model(torch.tensor([tokens[:-1]])).logits[0]
    torch.testing.assert_close(logits, eager, rtol=0, atol=1e-5)
    expected = model.generate(ids, max_new_tokens=len(tokens) - ids.shape[1], do_sample=False,
                              cache_implementation="dynamic")
    assert tokens == expected[0].tolist()


def test_executorch_recipe_standard_attention(folders):
    """Exported (strict, the recipe's default): every step's logits equal the eager forward, greedy tokens equal
    `generate`, and ours equals Llama."""
    exported = {}
    for side in SIDES:
        model = load(folders, side)
        logits, tokens = _exported_steps(model, IDS, strict=True)
        _check_against_eager(model, logits, tokens, IDS)
        exported[side] = logits, tokens
    torch.testing.assert_close(exported["ours"][0], exported["llama"][0], rtol=0, atol=1e-5)
    assert exported["ours"][1] == exported["llama"][1]


def _latent_cache_shapes(config):
    """Size the recipe's cache layers as a latent cache is: (B, 1, T, kv_lora_rank) and (B, 1, T, d_R)."""
    def prepare(wrapper):
        for index, layer in enumerate(wrapper.static_cache.layers):
            layer.is_initialized = False
            layer.lazy_initialization(torch.zeros(1, 1, 0, config.kv_lora_rank),
                                      torch.zeros(1, 1, 0, config.qk_rope_head_dim))
            wrapper.register_buffer(f"key_cache_{index}", layer.keys, persistent=False)
            wrapper.register_buffer(f"value_cache_{index}", layer.values, persistent=False)
    return prepare


def test_executorch_recipe_mla(tmp_path):
    """MLA caches a latent (B, 1, T, d_c) and a rotary key (B, 1, T, d_R) of another width. The recipe (5.24)
    pre-allocates its StaticCache with ONE fake tensor for keys and values, shaped (num_key_value_heads, head_dim)
    from the config (`Cache.early_initialization` via `get_head_shapes`), so the first latent write fails, for
    transformers' own DeepSeek-V3 inside `index_copy_`; ours refuses at its first forward in one line naming the
    per-head keys it found (the recipe's limit). With the cache layers sized as a latent cache, both export (strict)
    and equal their eager forward and each other step by step."""
    torch.manual_seed(0)
    config = DeepseekV3Config(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                              first_k_dense_replace=2, num_attention_heads=4, num_key_value_heads=4,
                              max_position_embeddings=64, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
                              qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=16)
    _perturbed(AutoModelForCausalLM.from_config(config)).save_pretrained(tmp_path / "deepseek_v3")
    convert(tmp_path / "deepseek_v3", tmp_path / "ours", progress=False)
    models = {"deepseek_v3": AutoModelForCausalLM.from_pretrained(tmp_path / "deepseek_v3").eval(),
              "ours": AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()}
    assert models["ours"].config.attention_type == "mla"
    exported = {}
    for name, model in models.items():
        recipe_failure = ((ValueError, r"cannot attend to per-head keys.*ExecuTorch's recipe") if name == "ours"
                          else (RuntimeError, "index_copy_.*same slice shapes.*Destination slice shape"))
        with pytest.raises(recipe_failure[0], match=recipe_failure[1]):
            _exported_steps(model, IDS, strict=False)
        logits, tokens = _exported_steps(model, IDS, strict=True, prepare=_latent_cache_shapes(model.config))
        _check_against_eager(model, logits, tokens, IDS)
        exported[name] = logits, tokens
    torch.testing.assert_close(exported["ours"][0], exported["deepseek_v3"][0], rtol=0, atol=1e-5)
    assert exported["ours"][1] == exported["deepseek_v3"][1]


# ------------------------------------------------------------------------------------------------- compile


def test_torch_compile_fullgraph(folders):
    """`torch.compile(model, fullgraph=True)` (inductor): no graph break, logits equal eager and Llama's."""
    torch._dynamo.reset()
    compiled = {}
    for side in SIDES:
        model = load(folders, side)
        with torch.no_grad():
            eager = model(IDS).logits
            compiled[side] = torch.compile(model, fullgraph=True)(IDS).logits
        torch.testing.assert_close(compiled[side], eager, rtol=0, atol=1e-5)
    torch.testing.assert_close(compiled["ours"], compiled["llama"], rtol=0, atol=1e-5)
    torch._dynamo.reset()


def test_compiled_decode_through_generate(folders, two_threads):
    """transformers' own compiled decoding (`generate` with a static cache and a `CompileConfig`, which on a CPU
    compiles only when asked to: `modular_decoder.compiled_decoding()` does): greedy tokens equal eager decoding
    and Llama's under the same compilation, and the split products are in the compiled decode graph."""
    graphs = []

    prompt_ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    tokens = {}
    for side in SIDES:
        torch._dynamo.reset()
        model = load(folders, side)
        arguments = dict(max_new_tokens=8, do_sample=False,
                         **compiled_decoding(backend=recording_backend(graphs, inductor=True)))
        with torch.no_grad():
            eager = model.generate(prompt_ids, **arguments, disable_compile=True)
            graphs.clear()
            tokens[side] = model.generate(prompt_ids, **arguments)
        assert graphs, f"{side}: generate did not compile its decode step"
        assert torch.equal(tokens[side], eager), side
        if side == "ours":
            assert any(node.target is torch.bmm for graph in graphs for node in graph.graph.nodes)
    torch._dynamo.reset()
    assert torch.equal(tokens["ours"], tokens["llama"])


# ------------------------------------------------------------------------------------------------------ PEFT


def _lora_run(model, config, steps: int = 4):
    """LoRA from the same seed: which modules it wraps, the loss curve, and merged == unmerged."""
    from peft import get_peft_model

    with torch.no_grad():
        base = model(IDS).logits
    torch.manual_seed(0)
    peft_model = get_peft_model(model, config)
    wrapped = sorted(name.removeprefix("base_model.model.") for name, module in peft_model.named_modules()
                     if hasattr(module, "lora_A") and not name.endswith(("lora_A", "lora_B")))
    with torch.no_grad():
        torch.testing.assert_close(peft_model(IDS).logits, base, rtol=0, atol=1e-5)  # B = 0 at init
    peft_model.train()
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = peft_model(IDS, labels=IDS).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    peft_model.eval()
    with torch.no_grad():
        unmerged = peft_model(IDS).logits
        torch.testing.assert_close(peft_model.merge_and_unload()(IDS).logits, unmerged, rtol=0, atol=1e-5)
    return wrapped, losses


def test_lora_config_without_target_modules(folders, tmp_path):
    """`LoraConfig()` picks PEFT's defaults by model_type: Llama's (q_proj, v_proj) for ours too, the same
    modules and the same training; with MLA, the query projection and kv_b_proj (DeepSeek has no PEFT default:
    compared with the same modules named explicitly on transformers' DeepSeek-V3)."""
    from peft import LoraConfig

    runs = {side: _lora_run(load(folders, side), LoraConfig()) for side in SIDES}
    assert runs["ours"][0] == runs["llama"][0] == [f"model.layers.{i}.self_attn.{p}" for i in (0, 1)
                                                   for p in ("q_proj", "v_proj")]
    torch.testing.assert_close(torch.tensor(runs["ours"][1]), torch.tensor(runs["llama"][1]), rtol=0, atol=1e-5)
    assert runs["ours"][1][-1] < runs["ours"][1][0]

    torch.manual_seed(0)
    config = DeepseekV3Config(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                              first_k_dense_replace=2, num_attention_heads=4, max_position_embeddings=64,
                              kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
    _perturbed(AutoModelForCausalLM.from_config(config)).save_pretrained(tmp_path / "deepseek_v3")
    convert(tmp_path / "deepseek_v3", tmp_path / "ours", progress=False)
    ours = _lora_run(AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval(), LoraConfig())
    reference = _lora_run(AutoModelForCausalLM.from_pretrained(tmp_path / "deepseek_v3").eval(),
                          LoraConfig(target_modules=["q_proj", "kv_b_proj"]))
    assert ours[0] == reference[0] == [f"model.layers.{i}.self_attn.{p}" for i in (0, 1)
                                       for p in ("kv_b_proj", "q_proj")]
    torch.testing.assert_close(torch.tensor(ours[1]), torch.tensor(reference[1]), rtol=0, atol=1e-5)


# -------------------------------------------------------------------------------------------------------- TRL


TEXTS = ["the quick brown fox jumps over the lazy dog.", "hello world, what is the capital of france?",
         "paris is the capital of france.", "a decoder only transformer predicts the next token."] * 2


def test_trl_sft_trainer_with_lora(folders, tmp_path):
    """TRL's `SFTTrainer` with a LoRA `peft_config` and default arguments otherwise: the same losses step by step
    and every LoRA B matrix moves, for Llama and ours (whose config reads as "no router": no auxiliary loss)."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    runs = {}
    for side in SIDES:
        args = SFTConfig(output_dir=str(tmp_path / side), max_steps=4, per_device_train_batch_size=2,
                         learning_rate=1e-2, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                         seed=0, max_length=32, dataloader_num_workers=0, disable_tqdm=True)
        torch.manual_seed(0)
        trainer = SFTTrainer(model=load(folders, side), args=args, train_dataset=Dataset.from_dict({"text": TEXTS}),
                             processing_class=tiny_tokenizer(),
                             peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
        trainer.train()
        moved = [n for n, p in trainer.model.named_parameters() if n in before and not torch.equal(before[n], p)]
        assert len(moved) == len(before) == 6, (side, moved)
        runs[side] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(runs["ours"]) == 4
    torch.testing.assert_close(torch.tensor(runs["ours"]), torch.tensor(runs["llama"]), rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------------- lm-eval


def test_lm_eval_hflm(folders):
    """lm-eval's `HFLM` on the loaded model: log-likelihoods, greedy flags, a rolling log-likelihood and
    `generate_until` equal Llama's; `HFLM(pretrained=<folder>)` loads ours itself."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    requests = [("the quick brown", " fox jumps"), ("hello world, what is", " the capital of france?"),
                ("paris is", " the capital")]

    def scores(lm):
        likelihoods = lm.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in enumerate(requests)])
        rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("the quick brown fox jumps",), 0)])
        generated = lm.generate_until([Instance("generate_until", {}, ("hello world", {"max_gen_toks": 4,
                                                                                      "until": ["\n\n"]}), 0)])
        return [x[0] for x in likelihoods], [x[1] for x in likelihoods], rolling, generated

    got = {side: scores(HFLM(pretrained=load(folders, side), tokenizer=tiny_tokenizer(), batch_size=2, device="cpu"))
           for side in SIDES}
    by_path = HFLM(pretrained=str(folders["ours"]), tokenizer=tiny_tokenizer(), batch_size=2, device="cpu")
    assert type(by_path.model).__name__ == "ModularDecoderForCausalLM"
    got["ours, by path"] = scores(by_path)
    for side in ("ours", "ours, by path"):
        torch.testing.assert_close(torch.tensor(got[side][0]), torch.tensor(got["llama"][0]), rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.tensor(got[side][2]), torch.tensor(got["llama"][2]), rtol=0, atol=1e-5)
        assert got[side][1] == got["llama"][1] and got[side][3] == got["llama"][3], side
