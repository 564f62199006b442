"""The public surface of ``fpipe.planning``, and what ``fpipe.schedules`` keeps of it: its old
names for one release, with a warning, and no import of it at all."""

from __future__ import annotations

import subprocess
import sys

import pytest

import fpipe.planning
import fpipe.schedules

MOVED = ["Measured", "Searched", "Tuned", "fit_costs", "load_costs", "save_costs", "search", "tune"]


def test_all_is_sorted_and_complete() -> None:
    names = fpipe.planning.__all__
    assert names == sorted(names)
    public = {n for n in vars(fpipe.planning) if not n.startswith("_")}
    assert set(names) == public


@pytest.mark.parametrize("name", MOVED)
def test_an_old_name_in_schedules_is_the_new_one_with_a_warning_naming_it(name: str) -> None:
    assert name not in fpipe.schedules.__all__
    with pytest.warns(DeprecationWarning, match=rf"fpipe.schedules.{name} moved to fpipe.planning.{name}") as caught:
        moved = getattr(fpipe.schedules, name)
    assert moved is getattr(fpipe.planning, name) and caught[0].filename == __file__  # the caller's line
    with pytest.warns(DeprecationWarning, match=rf"from fpipe.planning import {name}"):
        exec(f"from fpipe.schedules import {name}", {})


def test_timeline_the_function_is_ticks_of_with_a_warning() -> None:
    """ "timeline" means a Simulation (``Recording.timeline``); the unit-cost ticks are ``ticks_of``."""
    assert "timeline" not in fpipe.schedules.__all__
    with pytest.warns(DeprecationWarning, match=r"fpipe.schedules.timeline is now fpipe.schedules.ticks_of"):
        renamed = fpipe.schedules.timeline  # type: ignore[attr-defined]
    assert renamed is fpipe.schedules.ticks_of


def test_other_names_are_still_missing() -> None:
    with pytest.raises(AttributeError, match=r"module 'fpipe.schedules' has no attribute 'plan'"):
        fpipe.schedules.plan  # noqa: B018


# ``fpipe/__init__.py`` imports every unit, so the package ``fpipe`` stands in for itself here:
# an empty module whose path is fpipe's, and ``fpipe.schedules`` is imported alone.
ALONE = """
import sys, types, pathlib, warnings
import fpipe
stand_in = types.ModuleType("fpipe")
stand_in.__path__ = fpipe.__path__
for name in [m for m in sys.modules if m == "fpipe" or m.startswith("fpipe.")]:
    del sys.modules[name]
sys.modules["fpipe"] = stand_in
import fpipe.schedules
print(sorted(m for m in sys.modules if m.startswith("fpipe.planning")))
with warnings.catch_warnings(record=True):
    warnings.simplefilter("always")
    fpipe.schedules.search
print(sorted(m for m in sys.modules if m.startswith("fpipe.planning"))[:1])
"""


def test_schedules_imports_planning_only_when_an_old_name_is_used() -> None:
    shown = subprocess.run([sys.executable, "-c", ALONE], capture_output=True, text=True, check=True, timeout=120)
    assert shown.stdout.split("\n")[:2] == ["[]", "['fpipe.planning']"]
