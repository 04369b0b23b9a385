"""What every benchmark shares: its flags, and the result JSON that says where its figures came from.

A benchmark's `main(argv)` starts with `parser(...)` (the shared flags `--out`, `--smoke`, `--repeats`,
`--threads`), calls `begin(name, argv, args)` before it measures anything and ends with
`write_result(args.out, results, run)`: the JSON then holds, under "provenance", the commit, the versions, the
machine, the load average at the start and at the end, and the exact command (`python -m benchmarks NAME ...`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

from modular_decoder.tools import provenance

ROOT = Path(__file__).resolve().parents[1]


def parser(name: str, doc: str | None, *, repeats: int | None = 3, smoke: str = "tiny shapes, short runs: a smoke "
           "test of the code paths, not a measurement") -> argparse.ArgumentParser:
    """An `ArgumentParser` for benchmark NAME with the flags every benchmark spells the same way: `--out FILE`
    (the result JSON), `--smoke` (`smoke` says what it shrinks), `--repeats N` (timed repeats; `repeats=None` for
    a benchmark that times nothing) and `--threads N` (torch threads). `doc` is the module docstring: its first
    paragraph is the description, the rest the epilog."""
    first, _, rest = (doc or "").strip().partition("\n\n")
    result = argparse.ArgumentParser(prog=f"python -m benchmarks {name}", description=first or None,
                                     epilog=rest or None, formatter_class=argparse.RawDescriptionHelpFormatter)
    result.add_argument("--out", type=Path, help="write the result JSON here (with its provenance)")
    result.add_argument("--smoke", action="store_true", help=smoke)
    if repeats is not None:
        result.add_argument("--repeats", type=int, default=repeats,
                            help=f"timed repeats, sides alternating (default {repeats}); the median is reported")
    result.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    return result


def commit() -> dict:
    """The checkout's commit and the tracked files changed since it (a result JSON rewritten by the run
    itself is not a change of the code measured)."""
    return provenance.commit(ROOT, ignore=lambda path: path.startswith("benchmarks/") and path.endswith(".json"))


def canonical_command(name: str, argv: list[str]) -> str:
    return shlex.join(["python", "-m", "benchmarks", name, *argv])


@dataclass
class Run:
    """One benchmark run: what `write_result` records beside the figures."""

    name: str
    argv: list[str]
    arguments: dict = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    load_average_start: tuple = field(default_factory=os.getloadavg)
    code: dict = field(default_factory=lambda: commit())  # the code as the run starts (later edits are not its own)

    @property
    def command(self) -> str:
        return canonical_command(self.name, self.argv)

    def provenance(self) -> dict:
        return provenance.record(self.command, self.code, self.started, self.load_average_start, self.arguments)


def begin(name: str, argv: list[str] | None, args: argparse.Namespace | None = None) -> Run:
    """Start the record of a run of benchmark NAME (call before measuring: the load average is read here), and
    apply the shared `--threads`."""
    import sys

    import torch

    if args is not None and getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    argv = list(sys.argv[1:] if argv is None else argv)
    arguments = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args or argparse.Namespace()).items()}
    return Run(name, argv, arguments)


def write_result(path: Path | None, results: dict, run: Run) -> dict:
    """`results` with "provenance" added, written atomically to `path` (nothing when `path` is None); returns
    the dict written."""
    record = {"provenance": run.provenance(), **results}
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(record, indent=1, default=str) + "\n")
        partial.replace(path)
        print(f"wrote {path}", flush=True)
    return record
