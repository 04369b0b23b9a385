"""What the shipped source says about itself: every document it cites is in the repository, and it states no
measured figure (a speed-up, a time, a bandwidth, a measured difference), which a test cannot hold there; those
belong in docs (from a committed benchmark JSON) and in commit messages."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "modular_decoder").rglob("*.py"))
# a speed-up, a time or rate with its unit, a difference "measured ... apart"
FIGURE = re.compile(r"\b\d+(\.\d+)?x (faster|slower)\b|\b\d+(\.\d+)? ?(ms|µs|us|GB/s)\b|\b\d+(\.\d+)? s on\b"
                    r"|\d(\.\d+)?e-\d+ apart")
CITED = re.compile(r"\b(docs/[\w-]+\.md|benchmarks/[\w-]+\.md|[A-Z][A-Z_]+\.md)\b")  # docs/X.md, DESIGN.md


def test_every_document_the_source_cites_is_in_the_repository():
    missing = []
    for path in SHIPPED:
        missing += [f"{path.relative_to(ROOT)}: {name}" for name in CITED.findall(path.read_text())
                    if not (ROOT / name).exists() and not list(ROOT.glob(f"*/{name}"))]  # a bare name: any folder
    assert not missing, missing


def test_the_shipped_source_states_no_measured_figure():
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in SHIPPED
             for number, line in enumerate(path.read_text().splitlines(), 1) if FIGURE.search(line)]
    assert not found, found
