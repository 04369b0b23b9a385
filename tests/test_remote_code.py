"""A saved folder carries exactly the model code and loads with trust_remote_code=True in a process
that cannot import the package; folders saved by earlier code still load."""

import json
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from modular_decoder import ModularDecoderForCausalLM, preset_config

CHILD = textwrap.dedent(
    """
    import sys
    sys.modules["modular_decoder"] = None  # any `import modular_decoder` now raises ImportError
    try:
        import modular_decoder  # noqa: F401
        raise SystemExit("the package is still importable")
    except ImportError:
        pass
    import json, torch
    from transformers import AutoModel, AutoModelForCausalLM
    folder = sys.argv[1]
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert "transformers_modules" in type(model).__module__, type(model).__module__
    base = AutoModel.from_pretrained(folder, trust_remote_code=True)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    routed = model.config.mlp_type == "moe"
    with torch.no_grad():
        out = model(ids, output_router_logits=routed)
    tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
    # the config and the model share one copy of the code (else the router classes the model records differ)
    assert type(model.config) is type(model).config_class, (type(model.config), type(model).config_class)
    print(json.dumps({"logits": out.logits[0, -1].tolist(), "tokens": tokens[0].tolist(),
                      "aux_loss": out.aux_loss.item() if routed else None, "base": type(base).__name__}))
    """
)


@pytest.mark.parametrize("preset", ["gemma3", "deepseek_v3"])  # local/global layers; MLA with routed experts
def test_trust_remote_code_without_package(preset, tmp_path):
    torch.manual_seed(0)
    model = ModularDecoderForCausalLM(preset_config(preset, tiny=True)).eval()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    result = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    child = json.loads(result.stdout.strip().splitlines()[-1])
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    routed = model.config.mlp_type == "moe"
    with torch.no_grad():
        expected = model(ids, output_router_logits=routed)
    torch.testing.assert_close(torch.tensor(child["logits"]), expected.logits[0, -1], rtol=0, atol=1e-6)
    if routed:  # every sparse layer's router logits were recorded
        assert child["aux_loss"] == pytest.approx(expected.aux_loss.item(), abs=1e-6)
    assert child["tokens"] == model.generate(ids, max_new_tokens=6, do_sample=False)[0].tolist()
    assert child["base"] == "ModularDecoderModel"


# The model code a saved folder carries: the modules the modeling and config files reach through
# relative imports, and nothing else (no CLI, tools, conversion, presets or contract arithmetic).
SHIPPED = {
    "configuration_modular_decoder.py", "modeling_modular_decoder.py", "attention.py", "attention_layer.py",
    "chunked_attention.py", "backend_features.py", "eager_attention.py", "alibi_kernels.py", "sinks.py", "blocks.py",
    "cache.py", "compat.py", "growing_cache.py", "int8_cache.py", "kinds.py", "latent_cache.py",
    "mla.py", "mlp.py", "moe.py", "routers.py", "experts.py", "router_losses.py", "norms.py", "positions.py",
    "registries.py", "split_products.py", "input_checks.py", "checkpoint_checks.py", "peft_targets.py", "tuning.py",
    "sparse_attention.py", "lightning_indexer.py", "gated_deltanet.py", "delta_rule.py", "recurrent_cache.py",
    "mtp.py", "mtp_generation.py", "draft_schedule.py", "packed_documents.py", "draft_vocab.py", "query_temperature.py",
    "mamba2.py", "mamba2_scan.py", "recurrent_mixer.py", "hybrid_cache.py", "mup.py", "short_conv.py", "kda.py",
    "kda_rule.py", "attention_shapes.py", "kv_sharing.py", "kept_positions.py", "per_layer_embeddings.py",
    "residual_streams.py", "altup.py", "laurel.py", "shared_kv_attention.py", "compressed_attention.py",
    "compressed_cache.py", "hyper_connections.py", "kv_assistant.py",
}


def test_saved_folder_carries_exactly_the_model_code(tmp_path):
    ModularDecoderForCausalLM(preset_config("llama", tiny=True)).save_pretrained(tmp_path)
    assert {p.name for p in tmp_path.glob("*.py")} == SHIPPED
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]
    package = Path(__file__).resolve().parents[1] / "modular_decoder"
    for name in SHIPPED:  # copies of the package's own files
        assert (tmp_path / name).read_text() == (package / name).read_text()


OLD_CHILD = textwrap.dedent(
    """
    import sys
    sys.modules["modular_decoder"] = None
    import json, torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    with torch.no_grad():
        print(json.dumps(model(ids).logits[0].tolist()))
    """
)


@pytest.mark.parametrize(
    "archive, name",
    [
        ("saved_before_move", "saved_before_move_gemma3"),
        ("saved_before_move", "saved_before_move_mla"),
        # saved by e99ccd5, when every config (dense too) was written with router_aux_loss_coef=0.001
        ("saved_before_router_default", "saved_before_router_default_smollm2"),
    ],
)
def test_folder_saved_by_an_earlier_version_still_loads(archive, name, tmp_path):
    """tests/fixtures/*.tar.gz hold folders saved by earlier versions of the code (with that code
    inside): before `conversion/`, `commands/` and the registries moved, and before
    `router_aux_loss_coef` took its default from the feed-forward kind. The package loads them, and
    computes what their own saved code computes."""
    with tarfile.open(Path(__file__).resolve().parent / "fixtures" / f"{archive}.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    folder = tmp_path / name
    result = subprocess.run([sys.executable, "-c", OLD_CHILD, str(folder)], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    old = torch.tensor(json.loads(result.stdout.strip().splitlines()[-1]))
    model = AutoModelForCausalLM.from_pretrained(folder).eval()  # this package's classes, no remote code
    assert type(model) is ModularDecoderForCausalLM
    with torch.no_grad():
        new = model(torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])).logits[0]
    torch.testing.assert_close(new, old, rtol=0, atol=1e-5)
