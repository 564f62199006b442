"""The README's Python snippets run, in order, in one namespace (blocks marked ``python skip`` excepted)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_snippets_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "no runnable python block in README.md"
    namespace: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)


def test_readme_tables_are_whole() -> None:
    """A table row after a blank line would start a new table without a header: markdown shows it as text."""
    lines = README.read_text().splitlines()
    broken = [
        n + 1
        for n, line in enumerate(lines)
        if line.startswith("|") and n > 1 and not lines[n - 1].strip() and lines[n - 2].startswith("|")
    ]
    assert not broken, f"README.md: a blank line splits a table before line(s) {broken}"
