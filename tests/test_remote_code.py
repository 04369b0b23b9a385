"""A saved folder loads with trust_remote_code=True in a process that cannot import the package."""

import json
import subprocess
import sys
import textwrap

import torch

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
    with torch.no_grad():
        logits = model(ids).logits
    tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
    print(json.dumps({"logits": logits[0, -1].tolist(), "tokens": tokens[0].tolist(),
                      "base": type(base).__name__}))
    """
)


def test_trust_remote_code_without_package(tmp_path):
    torch.manual_seed(0)
    model = ModularDecoderForCausalLM(preset_config("gemma3", tiny=True)).eval()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    result = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    child = json.loads(result.stdout.strip().splitlines()[-1])
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        expected = model(ids).logits[0, -1]
    torch.testing.assert_close(torch.tensor(child["logits"]), expected, rtol=0, atol=1e-6)
    assert child["tokens"] == model.generate(ids, max_new_tokens=6, do_sample=False)[0].tolist()
    assert child["base"] == "ModularDecoderModel"
