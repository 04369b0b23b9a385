#!/usr/bin/env bash
# transformers' own common model tests (tests/test_modeling_common.py of the installed release, from its sdist
# on the package index) on transformers' LlamaModel / LlamaForCausalLM and on ours, same tester sizes, side by
# side: `scripts/transformers_common/run.sh [pytest args, e.g. -k missing_keys]`. Needs the package index (not
# part of the test suite). The sdist carries no tests/generation or tests/exporters: their mixins are stubbed,
# so `test_generation_tester_mixin_inheritance` fails for both.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
python="$root/.venv/bin/python"
version="$("$python" -c 'import transformers; print(transformers.__version__)')"
work="${TMPDIR:-/tmp}/transformers-common-$version"
if [ ! -d "$work/tests" ]; then
    mkdir -p "$work"
    "$python" -m pip download -q --no-deps --no-binary :all: "transformers==$version" -d "$work"
    tar -xzf "$work/transformers-$version.tar.gz" -C "$work" "transformers-$version/tests"
    mv "$work/transformers-$version/tests" "$work/tests"
    "$python" -m pip install -q --no-deps --target "$work/site" parameterized
    touch "$work/tests/__init__.py"
    mkdir -p "$work/tests/generation" "$work/tests/exporters" "$work/tests/models"
    touch "$work/tests/generation/__init__.py" "$work/tests/exporters/__init__.py" "$work/tests/models/__init__.py"
    printf 'class GenerationTesterMixin:\n    pass\n' > "$work/tests/generation/test_utils.py"
    printf 'class ExportTesterMixin:\n    pass\n' > "$work/tests/exporters/test_export.py"
fi
cp "$root/scripts/transformers_common/test_ours_vs_llama.py" "$work/tests/models/"
cd "$work"
PYTHONPATH="$work/site" HF_HUB_OFFLINE=1 "$python" -m pytest -q -p no:cacheprovider tests/models/test_ours_vs_llama.py "$@"
