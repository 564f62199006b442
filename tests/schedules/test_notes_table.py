"""notes/schedules.md's tables are what notes/schedules_table.py prints today: every schedule's
simulated bubble and peak next to its paper's formula, regenerated here; and notes/search.md's
what notes/search_table.py prints."""

from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path

NOTES = Path(__file__).resolve().parents[2] / "notes"


def missing_rows(script: str, notes: str, **options: object) -> tuple[list[str], list[str]]:
    """The table rows ``notes/<script>``'s ``main(**options)`` prints, and those ``notes/<notes>`` lacks."""
    spec = importlib.util.spec_from_file_location(script.removesuffix(".py"), NOTES / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        module.main(**options)
    rows = [line for line in printed.getvalue().splitlines() if line.startswith("|")]
    lines = (NOTES / notes).read_text().splitlines()
    return rows, [row for row in rows if row not in lines]


def test_the_notes_tables_are_the_script_output() -> None:
    rows, missing = missing_rows("schedules_table.py", "schedules.md")
    assert len(rows) > 40 and not missing, f"notes/schedules.md lacks rows; rerun notes/schedules_table.py: {missing}"


def test_the_search_notes_tables_are_the_script_output() -> None:
    """notes/search.md: every ninth row of the grid (searched vs the built-ins that fit and the
    bound) and the row of the smallest problem in the table of small cases (its 81 cases end in
    well under a second each, whatever the machine), regenerated."""
    rows, missing = missing_rows("search_table.py", "search.md", every=9, small=[("looped", 1, 2, 4)])
    assert len(rows) > 30 and not missing, f"notes/search.md lacks rows; rerun notes/search_table.py: {missing}"
