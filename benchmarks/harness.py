"""What every benchmark shares: its flags, and the result JSON that says where its figures came from.

A benchmark's `main(argv)` starts with `parser(...)` (the shared flags `--out`, `--smoke`, `--repeats`,
`--threads`), calls `begin(name, argv, args)` before it measures anything and ends with
`write_result(args.out, results, run)`: the JSON then holds, under "provenance", the commit, the versions, the
machine, the load average at the start and at the end, and the exact command (`python -m benchmarks NAME ...`).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Environment variables that change what a benchmark measures: recorded with it
RECORDED_ENV = ("MODULAR_DECODER_", "OMP_", "MKL_", "VLLM_", "CUDA_VISIBLE_DEVICES", "PYTORCH_", "TORCHINDUCTOR_")
VERSIONS = ("torch", "transformers", "modular-decoder", "peft", "accelerate", "safetensors")


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


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.rstrip() if done.returncode == 0 else None  # (a status line starts with a space)


def commit() -> dict:
    """The checkout's commit and the tracked files changed since it (a result JSON rewritten by the run
    itself is not a change of the code measured)."""
    head = _git("rev-parse", "HEAD")
    if head is None:
        return {"commit": os.environ.get("MODULAR_DECODER_COMMIT", "unknown (no git checkout)"), "changed_files": []}
    changed = [line[3:] for line in (_git("status", "--porcelain", "--untracked-files=no") or "").splitlines()]
    return {"commit": head, "changed_files": [p for p in changed if not (p.startswith("benchmarks/") and
                                                                          p.endswith(".json"))]}


def versions() -> dict:
    found = {"python": platform.python_version()}
    for package in VERSIONS:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine() -> dict:
    """The CPU (model, cores, torch threads, memory) and the GPU, if one is visible."""
    import torch

    result = {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
              "platform": platform.platform()}
    try:
        result["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name()
        result["cuda"] = torch.version.cuda
    return result


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
        return {
            "command": self.command,
            **self.code,
            "date_utc": datetime.datetime.fromtimestamp(self.started, datetime.timezone.utc).isoformat(
                timespec="seconds"),
            "seconds": round(time.time() - self.started, 1),
            "versions": versions(),
            "machine": machine(),
            "load_average_start": list(self.load_average_start),
            "load_average_end": list(os.getloadavg()),
            "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith(RECORDED_ENV)},
            "arguments": self.arguments,
        }


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
