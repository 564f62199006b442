"""Every ``>>>`` example of fpipe's docstrings runs and prints what it shows, and every public name
has a docstring and a place in the API reference of the documentation site (``docs/reference/``).

The examples run with ``torch`` and ``fpipe`` already imported, as the reference's pages say.
Examples that need several processes or files fpipe does not ship are written as plain code
blocks (``::``), not as ``>>>`` lines, so every ``>>>`` line runs here."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
from pathlib import Path

import pytest
import torch

import fpipe

ROOT = Path(__file__).resolve().parents[1]
PUBLIC_PACKAGES = ("fpipe", "fpipe.schedules", "fpipe.planning", "fpipe.optim", "fpipe.moe")


def _doctests() -> list[doctest.DocTest]:
    modules = [fpipe, *(importlib.import_module(m.name) for m in pkgutil.walk_packages(fpipe.__path__, "fpipe."))]
    found: dict[str, doctest.DocTest] = {}
    for module in modules:
        for test in doctest.DocTestFinder().find(module):
            if test.examples and test.name not in found:
                found[test.name] = test
    return sorted(found.values(), key=lambda test: test.name)


DOCTESTS = _doctests()


def test_the_docstrings_have_examples() -> None:
    assert sum(len(test.examples) for test in DOCTESTS) >= 100


@pytest.mark.parametrize("test", DOCTESTS, ids=lambda test: test.name)
def test_docstring_examples_run(test: doctest.DocTest) -> None:
    test.globs.update(torch=torch, fpipe=fpipe)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)  # as a reader's session has it (the suite's is float64)
    try:
        result = runner.run(test, out=report.append)
    finally:
        torch.set_default_dtype(default)
    assert result.failed == 0, "".join(report)


def _public_names() -> list[str]:
    names = []
    for package in PUBLIC_PACKAGES:
        module = importlib.import_module(package)
        names += [f"{package}.{name}" for name in module.__all__ if f"{package}.{name}" not in PUBLIC_PACKAGES]
    return names


def test_every_public_name_has_a_docstring_and_a_reference_entry() -> None:
    documented = set()
    for page in (ROOT / "docs" / "reference").glob("*.md"):
        documented |= set(re.findall(r"^::: ([\w.]+)$", page.read_text(), flags=re.M))
    names = _public_names()
    missing = [name for name in names if name not in documented]
    assert not missing, f"public names missing from docs/reference/: {missing}"
    stale = sorted(documented - set(names))
    assert not stale, f"docs/reference/ documents names that are not public: {stale}"
    undocumented = []
    for name in names:
        package, _, attribute = name.rpartition(".")
        value = getattr(importlib.import_module(package), attribute)
        if not (getattr(value, "__doc__", None) or "").strip():
            undocumented.append(name)
    assert not undocumented, f"public names without a docstring: {undocumented}"
