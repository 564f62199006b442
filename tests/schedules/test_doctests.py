"""The examples in the schedules' docstrings run and print what they show."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import fpipe.schedules

MODULES = sorted(f"fpipe.schedules.{m.name}" for m in pkgutil.iter_modules(fpipe.schedules.__path__))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
