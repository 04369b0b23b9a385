import os
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(__file__))
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


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test leaves the process environment as it found it, whatever a client does to it: PEFT's BOFT
    (`get_fbd_cuda`, peft 0.21.2) sets CC=CXX=gcc and, when its CUDA extension fails to build (no CUDA), never
    restores them; every later subprocess of that worker then compiled inductor's C++ kernels with gcc, which
    links no libstdc++ (the README's compiled snippet failed: "undefined symbol ... basic_ostringstream")."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


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
    """Two torch threads, no weight-size threshold and mode "always", so that the split products
    (`split_products.py`: a decode step's few rows over all cores) run on the tiny test weights whatever a timing
    would say on this machine (xdist workers have one thread, and `tuning().min_split_weight` keeps small products
    on F.linear)."""
    from modular_decoder.split_products import using_split_products
    from modular_decoder.tuning import tuned

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    with tuned(min_split_weight=0), using_split_products("always"):
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
