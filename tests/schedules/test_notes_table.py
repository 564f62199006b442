"""notes/schedules.md's tables are what notes/schedules_table.py prints today: every schedule's
simulated bubble and peak next to its paper's formula, regenerated here."""

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
