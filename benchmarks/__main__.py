"""`python -m benchmarks NAME [options]`: runs benchmark NAME (`python -m benchmarks --help` lists them)."""

from __future__ import annotations

import difflib
import importlib
import sys
import textwrap

from .registry import BENCHMARKS, BY_NAME

USAGE = "usage: python -m benchmarks NAME [options]   (python -m benchmarks NAME --help: its options)"


def listing() -> str:
    width = max(len(b.name) for b in BENCHMARKS)
    lines = [USAGE, "", "Ours against transformers' own classes (and vLLM's), same weights, one process; each "
             "writes a result JSON with --out.", "", "benchmarks:"]
    for benchmark in BENCHMARKS:
        text = benchmark.measures + (f" [writes benchmarks/{benchmark.writes}]" if benchmark.writes else "")
        wrapped = textwrap.wrap(text, 110 - width - 4)
        lines.append(f"  {benchmark.name:<{width}}  {wrapped[0]}")
        lines += [" " * (width + 4) + line for line in wrapped[1:]]
    lines += ["", "python -m benchmarks.pages renders the committed JSON into docs/benchmarks.md (benchmarks/README.md "
              "says how a benchmark registers)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(listing())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BY_NAME:
        close = difflib.get_close_matches(name, BY_NAME, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        print(f"python -m benchmarks: no benchmark named {name!r}{hint}; python -m benchmarks --help lists them",
              file=sys.stderr)
        return 2
    module = importlib.import_module(f"benchmarks.{BY_NAME[name].module}")
    return module.main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
