import atexit
import os
import shutil
import sys
import tempfile

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(__file__))
# Inductor's on-disk kernel cache is one folder per user (/tmp/torchinductor_$USER) that every process on the
# machine reads: a kernel another run left there is loaded as is, and one left linked without libstdc++ failed
# the README's compiled snippet ("undefined symbol ... basic_ostringstream"). The session compiles into its own
# folder, which xdist workers and subprocesses inherit, unless the caller names one.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="modular-decoder-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
# Under pytest-xdist (`-n 2`, the README's command) each worker gets one core: tiny models gain
# nothing from a second thread, and two workers with two threads each thrash two cores.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))

# Property-based tests (tests/test_properties.py): a fixed, derandomized example budget keeps CI fast
# and reproducible; `HYPOTHESIS_PROFILE=thorough` runs many more examples on demand (README, Tests).
try:
    from hypothesis import HealthCheck, settings
except ImportError:  # only the property tests need it (the `test` extra installs it)
    pass
else:
    _QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]
    settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True, database=None,
                              suppress_health_check=_QUIET, print_blob=True)
    settings.register_profile("thorough", max_examples=600, deadline=None, suppress_health_check=_QUIET,
                              print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """One torch thread for the test: tiny models gain nothing from threads and lose a lot on a
    busy 2-core machine (opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def two_threads(monkeypatch):
    """Two torch threads and no weight-size threshold, so that the split products (`split_products.py`: a
    decode step's few rows over all cores) run on the tiny test weights (xdist workers have one thread, and
    `tuning().min_split_weight` keeps small products on F.linear)."""
    from modular_decoder.tuning import tuned

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    with tuned(min_split_weight=0):
        yield
    torch.set_num_threads(threads)


@pytest.fixture
def uncompiled_flex(monkeypatch):
    """FlexAttention run uncompiled (torch's own implementation of its semantics), patched in where transformers
    calls its compiled wrapper: on this CPU the inductor-compiled kernel gave wrong outputs in probes, failed to
    compile some shapes, and took minutes per compile (tests/test_backends_flex.py). The compiled kernel is
    checked on CUDA by tests/gpu/run_gpu_checks.py."""
    import transformers.integrations.flex_attention as transformers_flex
    import transformers.masking_utils as transformers_masking
    from torch.nn.attention.flex_attention import flex_attention

    def call(query, key, value, training=False, **kwargs):
        return flex_attention(query, key, value, **kwargs)

    monkeypatch.setattr(transformers_flex, "compile_friendly_flex_attention", call)
    # the BlockMask too is built uncompiled (same mask_mod semantics, no minutes of compilation)
    build_mask = transformers_masking.create_block_mask
    monkeypatch.setattr(transformers_masking, "create_block_mask", lambda *a, _compile=True, **k: build_mask(*a, **k))
