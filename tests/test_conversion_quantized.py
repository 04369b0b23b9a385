"""Checkpoints published quantized convert to what transformers computes when it loads them dequantized.

FP8 (DeepSeek-V3, V3.2, Qwen3 -FP8): tiny transformers models whose linear weights are quantized the way the
published checkpoints store them (`float8_e4m3fn`, one `weight_scale_inv` per 128 x 128 block, per-expert
files, a `quantization_config` with `quant_method: fp8`), loaded by transformers with
`FineGrainedFP8Config(dequantize=True)` as the reference: every converted tensor equals the reference's,
bit for bit, in bf16 (the default) and in float32. MXFP4 (gpt-oss's experts): the reading layer against
transformers' own dequantization function and its `Mxfp4Config(dequantize=True)` load, and a tiny gpt-oss folder
quantized as published converted end to end.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import transformers as tf
from conversion_cases import perturbed
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config

import modular_decoder  # noqa: F401
from modular_decoder import ModularDecoderConfig
from modular_decoder.conversion import convert, get_family
from modular_decoder.conversion.core import apply_rules
from modular_decoder.conversion.quantized import dequantize_fp8, dequantize_mxfp4

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
BLOCK = 128
QUANTIZATION = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK]}
# widths in multiples of the block, so that transformers' dequantization (which derives the block from the scale
# grid) reads the blocks the checkpoint was written with
FP8_CASES = {
    "deepseek_v3": lambda: tf.DeepseekV3Config(
        vocab_size=96, hidden_size=256, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=64, qk_nope_head_dim=64,
        v_head_dim=64, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        n_group=2, topk_group=1, max_position_embeddings=64),
    # DeepSeek-V3.2: V3 with an indexer in every layer (its wq_b and wk in FP8, its head weights not)
    "deepseek_v32": lambda: tf.DeepseekV32Config(
        vocab_size=96, hidden_size=256, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=64,
        qk_nope_head_dim=64, v_head_dim=64, index_n_heads=2, index_head_dim=128, index_topk=4, first_k_dense_replace=1,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
        max_position_embeddings=64),
    "qwen3": lambda: tf.Qwen3Config(vocab_size=96, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                                    max_position_embeddings=64),
}


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, float32 inverse scale per block) as DeepSeek's FP8 checkpoints store them: each 128 x 128
    block divided by its max |w| / 448 (the last blocks cut short by the shape)."""
    rows, cols = weight.shape[-2:]
    grid = (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    scale_inv = torch.empty(*weight.shape[:-2], *grid)
    out = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    w = weight.float()
    for i in range(grid[0]):
        for j in range(grid[1]):
            block = w[..., i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            s = block.abs().amax(dim=(-2, -1)).clamp(min=1e-12) / FP8_MAX
            scale_inv[..., i, j] = s
            out[..., i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (block / s[..., None, None]).to(out.dtype)
    return out, scale_inv


def is_quantized_linear(name: str, tensor: torch.Tensor) -> bool:
    """The linear weights DeepSeek-V3 (V3.2) and Qwen3 -FP8 publish in FP8 (not the embedding, the head, norms, the
    router or V3.2's indexer head weights)."""
    return (tensor.dim() >= 2 and name.endswith((".weight", "_proj")) and "embed_tokens" not in name
            and not name.startswith("lm_head") and not name.endswith(("mlp.gate.weight", "indexer.weights_proj.weight")))


def fp8_folder(case: str, path: Path, fused: bool = False) -> Path:
    """A tiny FP8 checkpoint of `case`: per-expert files as published, or (`fused`) the experts stacked as
    transformers' own FP8 experts hold them (`gate_up_proj` with `gate_up_proj_scale_inv`)."""
    config = FP8_CASES[case]()
    config.architectures = None
    torch.manual_seed(0)
    model = perturbed(AutoModelForCausalLM.from_config(config)).to(torch.bfloat16)
    model.save_pretrained(path)
    state = model.state_dict() if fused else load_file(path / "model.safetensors")
    weights = {}
    for name, tensor in state.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if is_quantized_linear(name, tensor):
            weights[name], weights[name + "_scale_inv"] = quantize_fp8(tensor)
        else:
            weights[name] = tensor.contiguous()
    (path / "model.safetensors").unlink()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    saved = json.loads((path / "config.json").read_text())
    saved.update(quantization_config=QUANTIZATION, dtype="bfloat16")
    (path / "config.json").write_text(json.dumps(saved, indent=2))
    return path


def reference_state(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """transformers' dequantized load of the folder, in the model's names."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                 quantization_config=FineGrainedFP8Config(dequantize=True))
    return {k: v for k, v in model.state_dict().items() if not k.endswith("inv_freq")}


def expected_contract(path: Path, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference's tensors through the family's own map (the map itself is tested in test_conversion)."""
    src_cfg = AutoConfig.from_pretrained(path)
    family = get_family(src_cfg.model_type)
    # transformers' class loads no multi-token-prediction module (nor do these folders hold one), whatever
    # config.json's `num_nextn_predict_layers` declares; convert counts the modules the files hold
    fields = family.to_contract(src_cfg) | {"num_mtp_layers": 0}
    cfg = ModularDecoderConfig(**fields)
    out = apply_rules(family.rules(src_cfg), state, cfg)
    return {k: v for k, v in out.items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}


@pytest.mark.parametrize("case", sorted(FP8_CASES))
@pytest.mark.parametrize("dtype", [None, "float32"])
def test_fp8_checkpoint_converts_to_transformers_dequantized_weights(case, dtype, tmp_path):
    src = fp8_folder(case, tmp_path / "src")
    assert any(t.dtype == torch.float8_e4m3fn for t in load_file(src / "model.safetensors").values())
    out = convert(src, tmp_path / "md", dtype=dtype, progress=False)
    torch_dtype = torch.float32 if dtype else torch.bfloat16  # the default: the checkpoint's compute dtype
    expected = expected_contract(src, reference_state(src, torch_dtype))
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == torch_dtype and torch.equal(got[name], tensor), name
    card = (out / "README.md").read_text()
    assert "FP8 (`float8_e4m3fn`) with one scale per 128x128 block" in card
    assert json.loads((out / "config.json").read_text())["dtype"] == str(torch_dtype).split(".")[1]


def test_fp8_fused_experts_read_as_the_published_per_expert_layout(tmp_path):
    """transformers' fused layout (`mlp.experts.gate_up_proj` with its `_scale_inv`, blocks within each expert)
    converts to the same tensors as the per-expert files."""
    per_expert = convert(fp8_folder("deepseek_v3", tmp_path / "a"), tmp_path / "a-md", progress=False)
    src = fp8_folder("deepseek_v3", tmp_path / "b", fused=True)
    assert "model.layers.1.mlp.experts.gate_up_proj_scale_inv" in load_file(src / "model.safetensors")
    fused = convert(src, tmp_path / "b-md", progress=False)
    a, b = load_file(per_expert / "model.safetensors"), load_file(fused / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_fp8_scales_that_do_not_fit_the_weight_are_refused_by_name():
    weight = torch.randn(3, 192, 200).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"kv_a: its scales have shape \(3, 2, 1\), but .* needs \(3, 2, 2\)"):
        dequantize_fp8(weight, torch.rand(3, 2, 1), (128, 128), torch.float32, "kv_a")


def deepseek_weight_dequant(x: torch.Tensor, s: torch.Tensor, block_size: int = 128) -> torch.Tensor:
    """DeepSeek's reference `weight_dequant` (DeepSeek-V3's inference/kernel.py), written element by element: its
    Triton program (pid_m, pid_n) loads rows pid_m * B... and columns pid_n * B... of x (masked where the shape ends),
    multiplies them in float32 by s[pid_m * cdiv(N, B) + pid_n] (s flat, row-major) and stores them in the default
    dtype (bf16 in its fp8_cast_bf16.py)."""
    rows, cols = x.shape
    per_row = math.ceil(cols / block_size)
    index = (torch.arange(rows)[:, None] // block_size) * per_row + torch.arange(cols)[None, :] // block_size
    return (x.to(torch.float32) * s.reshape(-1)[index]).to(torch.bfloat16)


# DeepSeek-V3's kv_a_proj_with_mqa (576 = 512 + 64 rows: four blocks of 128 and one of 64), a 192-row weight (one
# block of 128 and one of 64; transformers reads its (2, 2) grid as blocks of 96), and columns cut short too
PARTIAL_BLOCKS = [(576, 320), (192, 256), (192, 200), (130, 1)]


@pytest.mark.parametrize("shape", PARTIAL_BLOCKS, ids=lambda shape: "x".join(map(str, shape)))
def test_fp8_partial_blocks_follow_deepseeks_weight_dequant(shape):
    """A block cut short by the weight's shape takes its own scale, as DeepSeek's `weight_dequant` computes it (an
    independent transcription of its kernel above): bit for bit, alone and in a fused experts tensor."""
    torch.manual_seed(0)
    rows, cols = shape
    grid = (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    weight, scale_inv = quantize_fp8(torch.randn(2, rows, cols) * 0.02)
    assert tuple(scale_inv.shape) == (2, *grid)
    for e in range(2):
        expected = deepseek_weight_dequant(weight[e], scale_inv[e])
        assert torch.equal(dequantize_fp8(weight[e], scale_inv[e], (BLOCK, BLOCK), torch.bfloat16), expected)
        assert torch.equal(dequantize_fp8(weight, scale_inv, (BLOCK, BLOCK), torch.bfloat16)[e], expected)


def test_transformers_fp8_dequantize_reads_partial_blocks_otherwise():
    """What docs/upstream.md reports (a test that fails when transformers changes it, so the page is rewritten):
    transformers' `Fp8Dequantize` derives the block from the scale grid, rows // grid rows: a 192-row weight with
    DeepSeek's (2, 2) grid is read as blocks of 96 rows (rows 96-127 get the second row block's scale), and DeepSeek-V3's
    576-row `kv_a_proj_with_mqa` (5 scale rows) is refused."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    torch.manual_seed(0)
    dequantize = Fp8Dequantize(None)._dequantize_one
    weight, scale_inv = quantize_fp8(torch.randn(1, 192, 256) * 0.02)
    weight, scale_inv = weight[0], scale_inv[0]
    theirs = dequantize(weight, scale_inv, output_dtype=torch.bfloat16)
    ours = deepseek_weight_dequant(weight, scale_inv)
    assert torch.equal(theirs[:96], ours[:96]) and torch.equal(theirs[128:], ours[128:])
    assert not torch.equal(theirs[96:128], ours[96:128])
    as_96 = (weight.float().reshape(2, 96, 2, 128) * scale_inv[:, None, :, None]).reshape(192, 256)
    assert torch.equal(theirs, as_96.to(torch.bfloat16))
    weight, scale_inv = quantize_fp8(torch.randn(1, 576, 256) * 0.02)
    with pytest.raises(ValueError, match=r"Weight shape \(576, 256\) not divisible by scale grid \(5, 2\)"):
        dequantize(weight[0], scale_inv[0], output_dtype=torch.bfloat16)


def test_fp8_byte_scales_are_powers_of_two():
    """E8M0 scales stored as bytes stand for 2**(byte - 127), as transformers reads them."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    torch.manual_seed(0)
    weight = (torch.randn(256, 128) * 10).to(torch.float8_e4m3fn)
    scales = torch.randint(100, 150, (2, 1), dtype=torch.uint8)
    reference = Fp8Dequantize(None)._dequantize_one(weight, scales, output_dtype=torch.bfloat16)
    assert torch.equal(dequantize_fp8(weight, scales, (128, 128), torch.bfloat16), reference)


def test_other_quantization_methods_are_refused_by_name(tmp_path):
    src = fp8_folder("qwen3", tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantized with `quant_method`='awq', which convert cannot read"):
        convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_float8_weights_without_their_scales_are_refused_by_name(tmp_path):
    """Cast to bf16 without its scale, a float8 weight would load wrong in silence."""
    src = fp8_folder("qwen3", tmp_path / "src")
    weights = load_file(src / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight_scale_inv"]
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.down_proj.weight'\] cannot be dequantized: "
                                         r"`model.layers.1.mlp.down_proj.weight_scale_inv` is missing"):
        convert(src, tmp_path / "a", progress=False)
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="the config has no `quantization_config` to scale them by"):
        convert(src, tmp_path / "b", progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mxfp4_experts_equal_transformers_dequantization(dtype):
    """Every byte value of blocks and scales (NaN and infinity where the exponent overflows included): the same
    bits as transformers' `convert_moe_packed_tensors` (what `Mxfp4Config(dequantize=True)` loads)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    blocks = torch.randint(0, 256, (3, 64, 4, 16), dtype=torch.uint8)
    scales = torch.arange(3 * 64 * 4).reshape(3, 64, 4).remainder(256).to(torch.uint8)
    reference = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    got = dequantize_mxfp4(blocks, scales, dtype)
    assert got.shape == reference.shape == (3, 128, 64)
    bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
    assert torch.equal(got.view(bits), reference.view(bits))


FP4_CODES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) as gpt-oss publishes its experts: `weight` (E, in, out) as transformers' `GptOssExperts`
    holds it is stored transposed, (E, out, in / 32, 16) bytes of two E2M1 codes (low nibble first) and (E, out,
    in / 32) E8M0 exponents, each group of 32 scaled so that its largest |value| fits E2M1's 6."""
    rows = weight.transpose(1, 2).float()  # (E, out, in)
    groups = rows.reshape(*rows.shape[:2], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0**-126) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled.abs()[..., None] - FP4_CODES).abs().argmin(-1) | ((scaled < 0).long() << 3)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # (E, out, G, 16)
    return packed, (exponent + 127).to(torch.uint8)


def mxfp4_folder(path: Path) -> Path:
    """A tiny gpt-oss checkpoint with its experts in MXFP4, as the published ones (`quant_method: mxfp4`)."""
    config = tf.GptOssConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                             num_experts_per_tok=2, sliding_window=8, max_position_embeddings=64)
    config.architectures = None
    torch.manual_seed(0)
    perturbed(AutoModelForCausalLM.from_config(config)).to(torch.bfloat16).save_pretrained(path)
    weights = {}
    for name, tensor in load_file(path / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            weights[name + "_blocks"], weights[name + "_scales"] = quantize_mxfp4(tensor)
        else:
            weights[name] = tensor
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    saved = json.loads((path / "config.json").read_text())
    saved.update(quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
        dtype="bfloat16")
    (path / "config.json").write_text(json.dumps(saved, indent=2))
    return path


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_folder_reads_as_transformers_loads_it_dequantized(tmp_path, dtype):
    """The reading layer over a gpt-oss folder as published: every tensor it yields equals what transformers'
    `Mxfp4Config(dequantize=True)` load holds, bit for bit (the experts dequantized and transposed)."""
    from transformers import Mxfp4Config

    from modular_decoder.conversion.sources import dequantized, folder_tensors, quantization_of

    src = mxfp4_folder(tmp_path / "gpt-oss")
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in load_file(src / "model.safetensors")
    reference = AutoModelForCausalLM.from_pretrained(src, dtype=dtype,
                                                     quantization_config=Mxfp4Config(dequantize=True)).state_dict()
    reference = {k: v for k, v in reference.items() if not k.endswith("inv_freq")}
    read = dequantized(folder_tensors(src), quantization_of(AutoConfig.from_pretrained(src)), dtype, str(src))
    assert sorted(read) == sorted(reference)
    for name, tensor in reference.items():
        got = read[name].read()
        if "experts" in name and not name.endswith("bias"):
            assert got.dtype == dtype and tuple(read[name].shape) == tuple(tensor.shape), name
        assert torch.equal(got.to(tensor.dtype), tensor), name


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_mxfp4_gpt_oss_converts_to_transformers_dequantized_model(tmp_path, dtype):
    """A gpt-oss folder as published (experts in MXFP4) converts to the tensors of transformers' dequantized load
    through the family's map, bit for bit, and to its logits."""
    from transformers import Mxfp4Config

    from modular_decoder import ModularDecoderForCausalLM

    src = mxfp4_folder(tmp_path / "gpt-oss")
    out = convert(src, tmp_path / "md", dtype=dtype, progress=False)
    torch_dtype = torch.float32 if dtype else torch.bfloat16  # the default: the checkpoint's compute dtype
    reference = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype,
                                                     quantization_config=Mxfp4Config(dequantize=True)).eval()
    expected = expected_contract(src, {k: v for k, v in reference.state_dict().items() if not k.endswith("inv_freq")})
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == torch_dtype and torch.equal(got[name], tensor), name
    assert "MXFP4 experts" in (out / "README.md").read_text()
    if dtype == "float32":
        ids = torch.tensor([[5, 17, 3, 42, 8, 61, 23, 11, 2, 90]])
        ours = ModularDecoderForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            torch.testing.assert_close(ours(ids).logits, reference(ids).logits, atol=1e-4, rtol=0)


def test_mxfp4_experts_convert_and_export_one_slice_of_experts_at_a_time(tmp_path, monkeypatch):
    """An experts tensor larger than a block (`stream.BLOCK_BYTES`, made one expert's size here) is read,
    dequantized, de-interleaved and written a slice of experts at a time, both ways: no step sees a layer's whole
    (E, ...) tensor. The folders written are those of the whole-tensor path, byte for byte."""
    from modular_decoder.conversion import core, export, sources, stream

    src = mxfp4_folder(tmp_path / "gpt-oss")
    whole = convert(src, tmp_path / "whole", progress=False)
    whole_back = export(whole, tmp_path / "whole-back", family="gpt_oss", progress=False)
    dequantized, rearranged = [], []
    original = sources.dequantize_mxfp4

    def counted(blocks, scales, dtype, name="weight"):
        dequantized.append((name, blocks.shape[0]))
        return original(blocks, scales, dtype, name)

    def recorded(transform):
        def wrapped(fn):
            def call(tensors, cfg):
                rearranged.extend(tuple(t.shape) for t in tensors if t.dim() == 3 and t.device.type != "meta")
                return fn(tensors, cfg)
            return call
        return dataclasses.replace(transform, forward=wrapped(transform.forward), inverse=wrapped(transform.inverse))

    monkeypatch.setattr(sources, "dequantize_mxfp4", counted)
    for name in ("interleaved_gate_up", "transpose_experts"):
        monkeypatch.setitem(core.TRANSFORMS, name, recorded(core.TRANSFORMS[name]))
    monkeypatch.setattr(stream, "BLOCK_BYTES", 64 * 64 * 2)  # one expert's down product in bf16 (its (64, 64))
    sliced = convert(src, tmp_path / "sliced", progress=False)
    assert len(dequantized) == 2 * 2 * 4 and {experts for _, experts in dequantized} == {1}  # layers, tensors, E
    converted = len(rearranged)
    assert converted == 2 * 2 * 4 and {shape[0] for shape in rearranged} == {1}
    sliced_back = export(sliced, tmp_path / "sliced-back", family="gpt_oss", progress=False)
    assert len(rearranged) - converted == 2 * 2 * 4 and {shape[0] for shape in rearranged} == {1}
    for a, b in ((whole, sliced), (whole_back, sliced_back)):
        assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


# --------------------------------------------------------------------------------------------- other FP8 layouts

FP8_CASES["minimax_m2"] = lambda: tf.MiniMaxM2Config(  # MiniMax-M2 as published: 128x128 blocks, per-expert files
    vocab_size=96, hidden_size=256, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=128, num_local_experts=4, num_experts_per_tok=2, rotary_dim=64,
    max_position_embeddings=64, bos_token_id=1, eos_token_id=2)


def quantize_per_row(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, float32 scale per output row, (rows, 1)): compressed-tensors' and fbgemm's channel strategy."""
    scale = weight.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (weight.float() / scale).to(torch.float8_e4m3fn), scale


def quantize_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, its one float32 scale, a 0-d tensor): Ministral 3's FP8 (`weight_block_size: null`)."""
    scale = weight.float().abs().amax().clamp(min=1e-12) / FP8_MAX
    return (weight.float() / scale).to(torch.float8_e4m3fn), scale


def quantized_folder(case: str, path: Path, quantize, scale_suffix: str, quantization: dict,
                     scale_dtype=torch.float32, extra=None) -> Path:
    """A tiny checkpoint of conversion case `case` (bf16) whose linear weights `quantize` made FP8, each scale saved
    as `<weight><scale_suffix>` in `scale_dtype`, `extra(name)` adding tensors beside it (activation scales)."""
    from conversion_cases import CASES

    config = CASES[case][1]()
    config.architectures = None
    torch.manual_seed(0)
    perturbed(AutoModelForCausalLM.from_config(config)).to(torch.bfloat16).save_pretrained(path)
    weights = {}
    for name, tensor in load_file(path / "model.safetensors").items():
        if is_quantized_linear(name, tensor):
            weights[name], scale = quantize(tensor)
            weights[name + scale_suffix] = scale.to(scale_dtype)
            weights.update((extra or (lambda _: {}))(name))
        else:
            weights[name] = tensor
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    saved = json.loads((path / "config.json").read_text())
    saved.update(quantization_config=quantization, dtype="bfloat16")
    (path / "config.json").write_text(json.dumps(saved, indent=2))
    return path


PER_TENSOR = {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None,
              "modules_to_not_convert": ["lm_head"]}


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_per_tensor_fp8_converts_to_transformers_dequantized_weights(dtype, tmp_path):
    """Ministral 3's FP8 (`weight_block_size: null`): one `weight_scale_inv` per tensor and a static
    `activation_scale` beside it; every converted tensor is transformers' `FineGrainedFP8Config(dequantize=True)`
    load's, bit for bit."""
    src = quantized_folder("ministral3", tmp_path / "src", quantize_per_tensor, "_scale_inv", PER_TENSOR,
                           extra=lambda name: {name[:-len("weight")] + "activation_scale": torch.tensor(0.5)})
    assert load_file(src / "model.safetensors")["model.layers.0.mlp.up_proj.weight_scale_inv"].dim() == 0
    out = convert(src, tmp_path / "md", dtype=dtype, progress=False)
    torch_dtype = torch.float32 if dtype else torch.bfloat16
    expected = expected_contract(src, reference_state(src, torch_dtype))
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == torch_dtype and torch.equal(got[name], tensor), name
    assert "FP8 (`float8_e4m3fn`) with one scale per tensor" in (out / "README.md").read_text()


def compressed_tensors(strategy: str, block=None) -> dict:
    """A compressed-tensors `quantization_config` as llm-compressor writes FP8 (GLM-4.5 -FP8: per channel, dynamic
    per-token activations)."""
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False,
               "block_structure": block, "group_size": None}
    activations = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}},
            "ignore": ["lm_head"]}


def compressed_tensors_dequantized(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """compressed-tensors' own dequantization of a channel- or tensor-scaled weight (`lifecycle.forward._dequantize`):
    the weight in the scale's dtype times the scale, then the dtype asked for."""
    return (weight.to(scale.dtype) * scale).to(dtype)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_compressed_tensors_channel_fp8_converts_as_compressed_tensors_dequantizes(scale_dtype, tmp_path):
    """GLM-4.5 -FP8's layout: compressed-tensors 'float-quantized', a `weight_scale` (rows, 1) per linear weight
    (per-expert files included), bf16 out. Every converted tensor is compressed-tensors' dequantization of its source
    tensor (float32 or bf16 scales: the same bits, the product of an 8-bit float and a bf16 scale being exact in
    float32), mapped by the family's rules."""
    src = quantized_folder("glm4_moe", tmp_path / "src", quantize_per_row, "_scale", compressed_tensors("channel"),
                           scale_dtype)
    files = load_file(src / "model.safetensors")
    assert files["model.layers.1.mlp.experts.0.up_proj.weight_scale"].shape == (12, 1)
    state = {}
    for name, tensor in files.items():
        if tensor.dtype == torch.float8_e4m3fn:
            state[name] = compressed_tensors_dequantized(tensor, files[name + "_scale"], torch.bfloat16)
        elif not name.endswith("_scale"):
            state[name] = tensor
    out = convert(src, tmp_path / "md", progress=False)
    for stack in get_family("glm4_moe").experts:  # the files' per-expert tensors, stacked as transformers holds them
        state = stack.stack(state)
    expected = expected_contract(src, state)
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], tensor), name
    assert "one scale per output channel (compressed-tensors)" in (out / "README.md").read_text()


def test_compressed_tensors_block_fp8_reads_each_block_with_its_scale(tmp_path):
    """compressed-tensors' block strategy (`weight_scale` one per 128x128 block) reads as DeepSeek's blocks do: the
    qwen3 case's tensors equal those of the same weights stored with `weight_scale_inv` under `quant_method: fp8`."""
    block = fp8_folder("qwen3", tmp_path / "fp8")
    weights = {name.replace("_scale_inv", "_scale"): t for name, t in load_file(block / "model.safetensors").items()}
    (tmp_path / "ct").mkdir()
    save_file(weights, str(tmp_path / "ct" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((block / "config.json").read_text())
    config["quantization_config"] = compressed_tensors("block", [BLOCK, BLOCK])
    (tmp_path / "ct" / "config.json").write_text(json.dumps(config))
    a = load_file(convert(block, tmp_path / "a", progress=False) / "model.safetensors")
    b = load_file(convert(tmp_path / "ct", tmp_path / "b", progress=False) / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("quantization, named", [
    ({**compressed_tensors("channel"), "format": "pack-quantized"}, "'pack-quantized'"),
    ({**compressed_tensors("group"), "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int",
                                                                         "strategy": "group"}}}}, "of 4 bits"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "not 2-D"),
])
def test_other_fp8_layouts_are_refused_by_name(quantization, named, tmp_path):
    src = quantized_folder("qwen3", tmp_path / "src", quantize_per_row, "_scale", quantization)
    with pytest.raises(ValueError, match=named):
        convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# --- DeepSeek-V4: FP8 linears and FP4 experts, power-of-two (E8M0) scales ---------------------------------------

FP4_VALUES = torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0))


def _e8m0(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(x.clamp(min=2**-100))))  # the power of two at or above x


def quantize_fp8_e8m0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, E8M0 scale per 128 x 128 block): DeepSeek-V4's `scale_fmt: ue8m0`."""
    rows, cols = weight.shape
    grid = (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    scales, out = torch.empty(grid), torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            block = weight[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float()
            scales[i, j] = _e8m0(block.abs().amax() / FP8_MAX)
            out[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (block / scales[i, j]).to(out.dtype)
    return out, scales.to(torch.float8_e8m0fnu)


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 bytes of two E2M1 codes each, low nibble first; E8M0 scale per 32 values of a row): DeepSeek-V4's
    `expert_dtype: fp4` experts."""
    rows, cols = weight.shape
    groups = weight.float().view(rows, cols // 32, 32)
    scales = _e8m0(groups.abs().amax(-1) / 6.0)
    values = (groups / scales[..., None]).reshape(rows, cols)
    codes = (values[..., None] - FP4_VALUES).abs().argmin(-1).to(torch.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8), scales.to(torch.float8_e8m0fnu)


def deepseek_v4_folder(path: Path) -> Path:
    config = tf.DeepseekV4Config(
        vocab_size=96, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
        head_dim=128, q_lora_rank=128, n_routed_experts=4, num_experts_per_tok=2, o_groups=2, o_lora_rank=128,
        index_n_heads=2, index_head_dim=128, index_topk=2, sliding_window=4, partial_rotary_factor=0.5,
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"], hc_mult=2, hc_sinkhorn_iters=3, max_position_embeddings=64)
    config.architectures = None
    torch.manual_seed(0)
    perturbed(AutoModelForCausalLM.from_config(config)).to(torch.bfloat16).save_pretrained(path)
    weights = {}
    for name, tensor in load_file(path / "model.safetensors").items():
        if ".ffn.experts." in name:
            weights[name], weights[name + "_scale_inv"] = quantize_fp4(tensor)
        elif tensor.dim() == 2 and (".attn.w" in name or ".shared_experts." in name or ".indexer.wq_b" in name):
            weights[name], weights[name + "_scale_inv"] = quantize_fp8_e8m0(tensor)  # (the compressors stay bf16)
        else:
            weights[name] = tensor.contiguous()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    saved = json.loads((path / "config.json").read_text())
    saved.update(quantization_config={**QUANTIZATION, "scale_fmt": "ue8m0", "expert_dtype": "fp4"}, dtype="bfloat16")
    (path / "config.json").write_text(json.dumps(saved, indent=2))
    return path


@pytest.mark.skipif(not hasattr(tf, "DeepseekV4Config"), reason="this transformers has no DeepSeek-V4 class")
@pytest.mark.parametrize("dtype", [None, "float32"])
def test_deepseek_v4_fp8_and_fp4_experts_convert_to_transformers_dequantized_weights(dtype, tmp_path):
    """Every tensor equals transformers' `FineGrainedFP8Config(dequantize=True)` load: in float32 bit for bit; in
    bf16 (the default) rounded once, which is the reference's own bf16 tensor except where transformers keeps a
    tensor fp32 (hyper-connections, sinks, position biases, norms), rounded from it."""
    src = deepseek_v4_folder(tmp_path / "src")
    assert {torch.int8, torch.float8_e4m3fn, torch.float8_e8m0fnu} <= {t.dtype for t in load_file(src / "model.safetensors").values()}
    out = convert(src, tmp_path / "md", dtype=dtype, progress=False)
    torch_dtype = torch.float32 if dtype else torch.bfloat16
    try:
        reference = reference_state(src, torch_dtype)
    except AttributeError as error:  # 5.16's FP8 quantizer reads DeepSeek-V4's `modules_to_not_convert` as None
        pytest.skip(f"this transformers cannot load DeepSeek-V4 dequantized ({error})")
    expected = expected_contract(src, reference)
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        if tensor.is_floating_point():
            tensor = tensor.to(torch_dtype)
        assert torch.equal(got[name], tensor), name
    assert "FP4 experts" in (out / "README.md").read_text()
