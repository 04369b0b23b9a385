"""The README as a new user meets it: every bash and Python block runs as written, in order, in a fresh
folder; its generated parts (the headline table, docs/benchmarks.md) equal what `benchmarks.pages` renders
from the committed JSON; its test command is the one CI runs.

A block that cannot run here says so on its first line, visibly, with the reason (`SKIP`); a Python block
whose first line is `# run with: COMMAND` is saved under the file name COMMAND ends with and run by COMMAND
(the vLLM one, in `.venv-vllm`). The blocks run in a temporary folder standing in for the repository root
(so that they write nothing into the checkout): it holds `.venv` (this interpreter's environment) and
`.venv-vllm` (vLLM's, as tests/test_vllm.py finds it), the checkout is on PYTHONPATH (`python -m benchmarks...`)
and `.venv/bin` first on PATH, as the README's "`.venv` active" asks.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks import pages

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(bash|python)\n(.*?)^```$", re.S | re.M)
SKIP = re.compile(r"\A# ⏭ not run by tests/test_readme\.py: (.+)$", re.M)
RUN_WITH = re.compile(r"\A# run with: (.+)$", re.M)
VLLM_PYTHON = Path(os.environ.get("MODULAR_DECODER_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
BLOCK_TIMEOUT_S = 900  # vLLM's first start on a loaded 2-core machine takes minutes


@dataclass
class Block:
    line: int  # of the opening fence, for the failure message
    language: str
    code: str

    @property
    def skip(self) -> str | None:
        found = SKIP.match(self.code)
        return found.group(1) if found else None


def readme_blocks(text: str) -> list[Block]:
    return [Block(text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def test_readme_blocks_are_found_and_skips_give_a_reason():
    blocks = readme_blocks(README.read_text())
    assert {b.language for b in blocks} == {"bash", "python"}
    skipped = [b for b in blocks if b.skip is not None]
    assert all(len(b.skip) > 20 for b in skipped)  # a reason, not a bare marker
    assert len(skipped) < len(blocks) / 3, "most of the README must run"


def test_the_family_count_is_the_registry_s():
    """The opening paragraph's number of convertible families is `conversion.FAMILIES`' (it said "about twenty"
    while 28 converted)."""
    from modular_decoder.conversion import FAMILIES

    intro = " ".join(README.read_text().split("```")[0].split())
    assert f"{len(FAMILIES)} public families convert in and out" in intro


def test_readme_test_command_is_what_ci_runs():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert len(ci) == 1 and ci[0] in README.read_text().splitlines()


def test_generated_pages_equal_the_renderer_output():
    """docs/benchmarks.md and the README's headline table are `python -m benchmarks.pages` of the committed JSON."""
    assert (ROOT / "docs" / "benchmarks.md").read_text() == pages.page(), "run python -m benchmarks.pages"
    readme = README.read_text()
    assert pages.readme_with_headline(readme) == readme, "run python -m benchmarks.pages"


def test_reshape_page_s_recorded_runs_equal_the_renderer_output():
    """docs/reshape.md's tables between its reshape-runs markers are `python -m benchmarks.pages` of the committed
    reshape JSON, and every figure of its recorded runs is between them."""
    from benchmarks import reshape_page

    text = reshape_page.PAGE.read_text()
    assert reshape_page.page_with_runs(text) == text, "run python -m benchmarks.pages"
    recorded = text.split("## Recorded runs", 1)[1]
    outside = recorded.split(reshape_page.RUNS_START)[0] + recorded.split(reshape_page.RUNS_END)[1]
    assert not [line for line in outside.splitlines() if line.startswith("|")], "a table outside the markers"


def test_headline_ratios_are_the_json_ratios():
    """The renderer itself against the JSON, computed independently: the SmolLM2 decode ratio, the serving median
    and the MLA chunked prefill's speed and memory."""
    import json
    import statistics

    results = json.loads((ROOT / "benchmarks" / "results.json").read_text())
    decode = results["families"]["llama"]["metrics"]["decode_1"]
    assert f"| {statistics.median(decode['ours']['all']) / statistics.median(decode['transformers']['all']):.2f}x |" \
        in pages.headline().splitlines()[2]
    serving = json.loads((ROOT / "benchmarks" / "results_serving.json").read_text())["results"]
    rounds = [serving[f"ours_vllm_transformers_backend/{r}"]["tokens_per_s"]
              / serving[f"llama_vllm_native/{r}"]["tokens_per_s"] for r in (1, 2, 3, 4)]
    assert f"| {statistics.median(rounds):.2f}x |" in pages.headline()
    mla = json.loads((ROOT / "benchmarks" / "results_mla_prefill.json").read_text())
    speed = statistics.median(mla["seconds"]["transformers"]) / statistics.median(mla["seconds"]["ours"])
    memory = mla["peak_mb"]["ours"] / mla["peak_mb"]["transformers"]
    assert f"| {speed:.2f}x / {memory:.2f}x |" in pages.headline()


def _dead_stores(code: str) -> list[str]:
    """Names a block assigns at its top level and assigns again before reading them: a value a reader is shown
    and that is thrown away (as `config = preset_config(...)` was, overwritten on the next line)."""
    import ast

    unread, dead = set(), []
    for statement in ast.parse(code).body:
        names = [node for node in ast.walk(statement) if isinstance(node, ast.Name)]
        unread -= {node.id for node in names if isinstance(node.ctx, ast.Load)}
        if isinstance(statement, ast.Assign):
            for target in statement.targets:
                if isinstance(target, ast.Name):
                    dead += [target.id] if target.id in unread else []
                    unread.add(target.id)
    return dead


def test_no_python_block_overwrites_a_value_it_never_read():
    for block in readme_blocks(README.read_text()):
        if block.language == "python":
            assert not _dead_stores(block.code), f"README.md line {block.line}: {_dead_stores(block.code)}"


WRITES = [re.compile(r"modular-decoder (?:convert|export|reshape) \S+ (\S+)"), re.compile(r" > (\S+)"),
          re.compile(r"--out (\S+)"), re.compile(r"save_pretrained\(\"([^\"]+)\"\)"),
          re.compile(r"\A# run with: .* (\S+\.py)$", re.M)]


def test_what_the_readme_writes_in_the_checkout_is_git_ignored():
    """A new user runs the README in the repository root: the folders and files its commands write do not show up
    as changes (`git status`)."""
    written = {match for block in readme_blocks(README.read_text()) if block.skip is None
               for pattern in WRITES for match in pattern.findall(block.code)}
    assert {"smollm2", "my-variant", "my-variant-mqa", "calibration.txt"} <= written, written
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *sorted(written)], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    assert set(ignored) == written, f"not git-ignored: {sorted(written - set(ignored))}"


def _workdir(tmp_path: Path) -> dict:
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    if not VLLM_PYTHON.exists():  # as tests/test_vllm.py: a missing engine is a broken install, not a pass
        pytest.fail(f"no vLLM environment at {VLLM_PYTHON}: scripts/setup.sh makes .venv-vllm "
                    "(MODULAR_DECODER_VLLM_PYTHON names another)")
    (tmp_path / ".venv-vllm").symlink_to(VLLM_PYTHON.parent.parent)
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PATH=path, PYTHONPATH=pythonpath, HF_HUB_OFFLINE="1")


def _command(block: Block, folder: Path) -> list[str]:
    if block.language == "bash":
        return ["bash", "-euo", "pipefail", "-c", block.code]
    run_with = RUN_WITH.match(block.code)
    if run_with:
        script = shlex.split(run_with.group(1))[-1]
        (folder / script).write_text(block.code)
        return ["bash", "-euo", "pipefail", "-c", run_with.group(1)]
    script = folder / f"readme_line_{block.line}.py"
    script.write_text(block.code)
    return [sys.executable, script.name]


@pytest.mark.slow  # converts the real SmolLM2 checkpoint and starts vLLM on it
def test_every_readme_block_runs_as_written(tmp_path):
    env = _workdir(tmp_path)
    ran = []
    for block in readme_blocks(README.read_text()):
        if block.skip is not None:
            continue
        start = time.perf_counter()
        result = subprocess.run(_command(block, tmp_path), cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=BLOCK_TIMEOUT_S)
        assert result.returncode == 0, (f"README.md line {block.line} ({block.language}) exited "
                                        f"{result.returncode}:\n{block.code}\n--- stdout\n{result.stdout[-3000:]}"
                                        f"\n--- stderr\n{result.stderr[-5000:]}")
        if block.language == "python":  # a Python block shows what it made (the compiled snippet printed nothing)
            assert result.stdout.strip(), f"README.md line {block.line} printed nothing"
        ran.append((block.line, round(time.perf_counter() - start, 1)))
    print("README blocks run (line, seconds):", ran)
    # what the blocks promise to leave behind
    assert (tmp_path / "smollm2" / "tokenizer.json").exists() and (tmp_path / "my-variant" / "tokenizer.json").exists()
    assert (tmp_path / "my-variant-mqa" / "reshape_report.json").exists()
