"""The README's Python snippets run, in order, in one namespace (blocks marked ``python skip``
excepted), and print what the README shows: a ``text`` block right after a snippet is its whole
output, and a ``print(...)  # text`` line prints that text."""

from __future__ import annotations

import ast
import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```(\w*)( skip)?\n(.*?)^```\n", flags=re.S | re.M)


def snippets() -> list[tuple[str, str | None]]:
    """Each runnable python block, with the text block that follows it (after blank lines only), if any."""
    text = README.read_text()
    fences = list(FENCE.finditer(text))
    found = []
    for n, fence in enumerate(fences):
        if fence.group(1) != "python" or fence.group(2):
            continue
        after = fences[n + 1] if n + 1 < len(fences) else None
        shown = None
        if after is not None and after.group(1) == "text" and not text[fence.end() : after.start()].strip():
            shown = after.group(3)
        found.append((fence.group(3), shown))
    return found


def test_readme_snippets_print_what_the_readme_shows() -> None:
    blocks = snippets()
    assert blocks, "no runnable python block in README.md"
    assert sum(shown is not None for _, shown in blocks) >= 4  # the grids, the deadlock, the PipelineError
    namespace: dict[str, object] = {}
    checked_comments = 0
    for source, shown in blocks:
        lines = source.splitlines()
        printed = io.StringIO()
        for statement in ast.parse(source).body:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(ast.Module([statement], []), str(README), "exec"), namespace)
            printed.write(out.getvalue())
            comment = re.search(r"\)\s+# (.*)$", lines[statement.end_lineno - 1])  # type: ignore[operator]
            call = statement.value if isinstance(statement, ast.Expr) else None
            if comment and isinstance(call, ast.Call) and getattr(call.func, "id", None) == "print":
                assert out.getvalue() == comment.group(1) + "\n", lines[statement.lineno - 1]
                checked_comments += 1
        if shown is not None:
            assert printed.getvalue() == shown, f"README.md shows:\n{shown}\nthe snippet prints:\n{printed.getvalue()}"
    assert checked_comments >= 3  # accuracy shape, grads' names, split_module's names


def test_readme_tables_are_whole() -> None:
    """A table row after a blank line would start a new table without a header: markdown shows it as text."""
    lines = README.read_text().splitlines()
    broken = [
        n + 1
        for n, line in enumerate(lines)
        if line.startswith("|") and n > 1 and not lines[n - 1].strip() and lines[n - 2].startswith("|")
    ]
    assert not broken, f"README.md: a blank line splits a table before line(s) {broken}"
