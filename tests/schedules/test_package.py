"""The public surface of ``fpipe.schedules``, and the examples in its docstrings."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import fpipe.schedules

MODULES = sorted(f"fpipe.schedules.{m.name}" for m in pkgutil.iter_modules(fpipe.schedules.__path__))


def test_all_is_sorted_and_complete() -> None:
    names = fpipe.schedules.__all__
    assert names == sorted(names)
    public = {n for n in vars(fpipe.schedules) if not n.startswith("_")}
    assert set(names) == public


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
