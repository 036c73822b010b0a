"""Shared pytest set-up: the repository root (and tools/) on sys.path, one torch thread (tests run beside other work, and
the suite runs one worker a core), in this process and in every process a test starts (OMP_NUM_THREADS)."""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")   # before torch: a child process with more threads than its share
import torch                                     # of the cores spends their time waiting for each other

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.join(ROOT, "tools"))   # bench and the research tools
torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; skipped without one (`pytest -m cuda` runs them)")


# hypothesis: a short profile for the regular suite, a long campaign for `make fuzz` (HYPOTHESIS_PROFILE=fuzz;
# its database of failing examples is kept under .hypothesis/, not committed)
try:
    from hypothesis import HealthCheck, settings
    from hypothesis.database import DirectoryBasedExampleDatabase

    _QUIET = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large,
              HealthCheck.filter_too_much]
    settings.register_profile("ci", max_examples=int(os.environ.get("FUZZ_EXAMPLES", 12)), deadline=None,
                              derandomize=True, database=None, suppress_health_check=_QUIET)
    settings.register_profile("fuzz", max_examples=int(os.environ.get("FUZZ_EXAMPLES", 1000)), deadline=None,
                              database=DirectoryBasedExampleDatabase(os.path.join(ROOT, ".hypothesis")),
                              suppress_health_check=_QUIET)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:   # the property tests skip themselves (pytest.importorskip)
    pass
