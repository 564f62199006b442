"""notes/schedules.md's tables are what notes/schedules_table.py prints today: every schedule's
simulated bubble and peak next to its paper's formula, regenerated here; and notes/search.md's
what notes/search_table.py prints."""

from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path

NOTES = Path(__file__).resolve().parents[2] / "notes"


def test_the_notes_tables_are_the_script_output() -> None:
    spec = importlib.util.spec_from_file_location("schedules_table", NOTES / "schedules_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        module.main()
    rows = [line for line in printed.getvalue().splitlines() if line.startswith("|")]
    notes = (NOTES / "schedules.md").read_text().splitlines()
    missing = [row for row in rows if row not in notes]
    assert len(rows) > 40 and not missing, f"notes/schedules.md lacks rows; rerun notes/schedules_table.py: {missing}"


def test_the_search_notes_tables_are_the_script_output() -> None:
    """notes/search.md: every ninth row of the grid (searched vs the built-ins that fit and the
    bound) and the whole table of small cases with the exact search, regenerated."""
    spec = importlib.util.spec_from_file_location("search_table", NOTES / "search_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        module.main(every=9)
    rows = [line for line in printed.getvalue().splitlines() if line.startswith("|")]
    notes = (NOTES / "search.md").read_text().splitlines()
    missing = [row for row in rows if row not in notes]
    assert len(rows) > 30 and not missing, f"notes/search.md lacks rows; rerun notes/search_table.py: {missing}"
