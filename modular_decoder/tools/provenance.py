"""Where a measured figure came from: the commit, versions, machine, load and command a result file records.

`benchmarks/harness.py` (every benchmark's JSON) and `modular-decoder experiment ablation` write the same record
under "provenance"; `line` renders it in one sentence for a docs page.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout, when the package runs from one
# Environment variables that change what a measurement measures: recorded with it
RECORDED_ENV = ("MODULAR_DECODER_", "OMP_", "MKL_", "VLLM_", "CUDA_VISIBLE_DEVICES", "PYTORCH_", "TORCHINDUCTOR_")
VERSIONS = ("torch", "transformers", "modular-decoder", "peft", "accelerate", "safetensors")


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.rstrip() if done.returncode == 0 else None  # (a status line starts with a space)


def commit(root: Path = ROOT, ignore=lambda path: False) -> dict:
    """The checkout's commit and the tracked files changed since it, less those `ignore(path)` names (a result
    file rewritten by the run itself is not a change of the code measured). Outside a checkout of this project
    (an installed wheel) the commit is `MODULAR_DECODER_COMMIT` or says it is unknown."""
    top = _git(root, "rev-parse", "--show-toplevel")
    head = _git(root, "rev-parse", "HEAD") if top and Path(top).resolve() == Path(root).resolve() else None
    if head is None:
        return {"commit": os.environ.get("MODULAR_DECODER_COMMIT", "unknown (no git checkout)"), "changed_files": []}
    changed = [line[3:] for line in (_git(root, "status", "--porcelain", "--untracked-files=no") or "").splitlines()]
    return {"commit": head, "changed_files": [path for path in changed if not ignore(path)]}


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


def record(command: str, code: dict, started: float, load_average_start, arguments: dict) -> dict:
    """The provenance of a run that began at `started` (`time.time()`) on the code `code` (`commit()`, read as
    it began) with the load average `load_average_start` (`os.getloadavg()`, read then); call as it ends."""
    return {
        "command": command,
        **code,
        "date_utc": datetime.datetime.fromtimestamp(started, datetime.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.time() - started, 1),
        "versions": versions(),
        "machine": machine(),
        "load_average_start": list(load_average_start),
        "load_average_end": list(os.getloadavg()),
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith(RECORDED_ENV)},
        "arguments": arguments,
    }


def line(record: dict) -> str:
    """A record (`record`) in one sentence: commit, versions, machine, load, duration."""
    versions, host = record["versions"], record["machine"]
    where = host.get("gpu") or f"{host['cpu']} ({host['cpu_count']} cores, {host['torch_threads']} torch threads)"
    changed = (f" with {len(record['changed_files'])} changed file(s) ({', '.join(record['changed_files'][:3])})"
               if record["changed_files"] else "")
    return (f"Measured {record['date_utc'][:10]} at commit `{record['commit'][:10]}`{changed}: torch "
            f"{versions['torch']}, transformers {versions['transformers']}, modular-decoder "
            f"{versions['modular-decoder']}, Python {versions['python']}; {where}; 1-minute load average "
            f"{record['load_average_start'][0]:.1f} at the start, {record['load_average_end'][0]:.1f} at the end; "
            f"{_duration(record['seconds'])}.")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
