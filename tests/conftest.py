"""Shared test settings: float64 and a fixed seed by default, and a fast hypothesis profile; the
fixtures more than one test module uses."""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
from hypothesis import HealthCheck, settings

from tests.helpers import hf_example

# Every hypothesis test draws its own tensor seed, so the per-test fixture below needs no reset
# between examples; hence the function_scoped_fixture health check is off. The default profile
# is small and derandomized (the suite stays fast and reproducible); FPIPE_HYPOTHESIS=thorough
# explores more, with fresh examples on every run.
_COMMON = {"deadline": None, "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]}
settings.register_profile("fpipe", max_examples=40, derandomize=True, **_COMMON)
settings.register_profile("thorough", max_examples=500, **_COMMON)
settings.load_profile(os.environ.get("FPIPE_HYPOTHESIS", "fpipe"))

# The tests' tensors are tiny: one intra-op thread is fastest for them, and keeps the suite's
# time steady on a shared 2-core machine (multi-process tests set one thread per rank too).
torch.set_num_threads(1)


# marker -> the option that runs its tests; skipped without it (CI runs each: .ci/run)
OPT_IN = {"slow": "--slow", "bench": "--bench"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", help="also run the tests marked slow (many processes, Inductor)")
    parser.addoption("--bench", action="store_true", help="also run the benchmarks' smoke tests (marked bench)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the tests marked slow (many processes, Inductor's compiles, long runs) unless pytest runs with --slow, and
    those marked bench (the benchmarks run end to end in quick mode) unless it runs with --bench."""
    for marker, option in OPT_IN.items():
        if config.getoption(option):
            continue
        skip = pytest.mark.skip(reason=f"marked {marker}: run with {option}")
        for item in items:
            if item.get_closest_marker(marker) is not None:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def float64_and_seed() -> Iterator[None]:
    """Run each test in float64 with ``torch.manual_seed(0)``; restore the default dtype after."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    try:
        yield
    finally:
        torch.set_default_dtype(dtype)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny matrices: one thread is fastest, and many are very slow on a busy machine (modules of
    such tests use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf() -> ModuleType:
    """examples/hf_llama.py as a module (``hf_example``), once per test module; skips without transformers."""
    pytest.importorskip("transformers")
    return hf_example()
