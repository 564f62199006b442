"""The README and every page of the documentation site (``docs/``, the design notes included):
each page's Python snippets run, in order, in one namespace per page (blocks marked ``python skip``
excepted), and print what the page shows: a ``text`` block right after a snippet is its whole
output, and a ``print(...)  # text`` line prints that text. Their fences pair up, no code is left
outside a fence, and their commands, scripts, extras and links exist."""

from __future__ import annotations

import ast
import contextlib
import io
import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md")), *sorted((ROOT / "notes").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)( skip)?\n(.*?)^```\n", flags=re.S | re.M)


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def snippets(page: Path) -> list[tuple[str, str | None]]:
    """Each runnable python block of ``page``, with the text block that follows it (after blank
    lines only), if any."""
    text = page.read_text()
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


def run_snippets(page: Path) -> tuple[int, int]:
    """Runs ``page``'s snippets in one namespace, checking what they print. Returns the number of
    text blocks and of ``print(...)  # text`` comments checked."""
    # A module of its own, importable by name: dynamo (``compile=``) looks up a function's module.
    module = types.ModuleType(f"docs_{page.stem.replace('-', '_')}")
    sys.modules[module.__name__] = module
    namespace: dict[str, object] = module.__dict__
    checked_blocks = checked_comments = 0
    for source, shown in snippets(page):
        lines = source.splitlines()
        printed = io.StringIO()
        for statement in ast.parse(source).body:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(ast.Module([statement], []), str(page), "exec"), namespace)
            printed.write(out.getvalue())
            comment = re.search(r"\)\s+# (.*)$", lines[statement.end_lineno - 1])  # type: ignore[operator]
            call = statement.value if isinstance(statement, ast.Expr) else None
            if comment and isinstance(call, ast.Call) and getattr(call.func, "id", None) == "print":
                assert out.getvalue() == comment.group(1) + "\n", f"{_name(page)}: {lines[statement.lineno - 1]}"
                checked_comments += 1
        if shown is not None:
            got = printed.getvalue()
            assert got == shown, f"{_name(page)} shows:\n{shown}\nthe snippet prints:\n{got}"
            checked_blocks += 1
    return checked_blocks, checked_comments


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_snippets_print_what_the_page_shows(page: Path) -> None:
    run_snippets(page)


def test_the_readme_shows_a_checked_example() -> None:
    assert snippets(README), "no runnable python block in README.md"
    blocks, comments = run_snippets(README)
    assert blocks + comments >= 1


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_tables_are_whole(page: Path) -> None:
    """A table row after a blank line would start a new table without a header: markdown shows it as text."""
    lines = page.read_text().splitlines()
    broken = [
        n + 1
        for n, line in enumerate(lines)
        if line.startswith("|") and n > 1 and not lines[n - 1].strip() and lines[n - 2].startswith("|")
    ]
    assert not broken, f"{_name(page)}: a blank line splits a table before line(s) {broken}"


def fence_problems(text: str) -> list[str]:
    """What keeps the ``` fences of ``text`` from pairing up: a block is opened by a fence with a
    language (```python, ```bash, ```text) and closed by a bare ```; an opener inside an open block
    means the block before it was never closed (markdown shows the rest of the file as code)."""
    problems, opened = [], None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.lstrip().startswith("```"):
            continue
        info = line.strip()[3:].strip()
        if opened is None:  # an opener, as markdown reads it
            if not info:
                problems.append(f"line {n}: a bare ``` opens a block (an opening fence needs a language)")
            opened = n
        elif info:  # markdown reads it as a line of the open block
            problems.append(f"line {n}: ```{info} opens a block inside the block opened at line {opened}")
            opened = n
        else:
            opened = None
    if opened is not None:
        problems.append(f"line {opened}: this block is never closed")
    return problems


def _outside_fences(text: str) -> list[tuple[int, str]]:
    """The numbered lines of ``text`` that markdown shows as prose (fence lines excluded)."""
    lines, inside = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            inside = not inside if not inside or not line.strip()[3:].strip() else inside
        elif not inside:
            lines.append((n, line))
    return lines


def unfenced_code(text: str) -> list[str]:
    """Prose lines that are Python statements (an assignment, a call, a loop): code left unfenced.
    A line of prose is almost never valid Python; a single word or a heading is, and is let pass."""
    found = []
    for n, line in _outside_fences(text):
        if line.startswith("|"):
            continue
        try:
            body = ast.parse(line).body
        except SyntaxError:
            continue
        if any(not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Name | ast.Constant)) for s in body):
            found.append(f"line {n}: {line}")
    return found


def _commands(text: str) -> list[str]:
    """Every shell command the README shows: each line of a ```bash block and each inline code span
    of the prose, cut at ``&&``, ``;`` and ``|``, without comments."""
    blocks = [m.group(3) for m in FENCE.finditer(text) if m.group(1) == "bash"]
    prose = "\n".join(line for _, line in _outside_fences(text))
    spans = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]  # a span may wrap lines
    lines = [line for block in blocks for line in block.splitlines()] + spans
    return [part.strip() for line in lines for part in re.split(r"&&|;|\|", re.sub(r"\s#.*", "", line))]


def _fpipe_command_problem(args: list[str]) -> str | None:
    """Whether ``python -m fpipe *args`` parses (a bare subcommand: whether it exists)."""
    from fpipe._cli import _parser

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            _parser().parse_args(args if len(args) > 1 else [*args, "--help"])
    except SystemExit as exit:
        if exit.code:
            return out.getvalue().strip().splitlines()[-1]
    return None


def command_problems(text: str, root: Path) -> tuple[list[str], list[str]]:
    """The commands of ``text`` that name what ``root`` does not hold: a script (``python X.py``,
    ``torchrun ... X.py``, ``bash X.sh``) that is missing or lacks a ``--flag`` given to it, a
    ``python -m fpipe`` command its parser refuses, a ``pip install '.[extra]'`` extra that
    pyproject.toml does not define. Returns (the problems, the scripts run)."""
    import shlex

    pyproject = (root / "pyproject.toml").read_text()
    problems, scripts = [], []
    for command in _commands(text):
        try:
            words = shlex.split(command)
        except ValueError:
            continue
        if not words or "..." in words:  # an elided command: the prose says what goes there
            continue
        if words[0] in ("python", "python3") and words[1:3] == ["-m", "fpipe"]:
            problem = _fpipe_command_problem(words[3:])
            if problem is not None:
                problems.append(f"{command}: {problem}")
            continue
        if words[0] == "pip":
            for extra in re.findall(r"\.\[(\w+)\]", command):
                if not re.search(rf"^{extra} = \[", pyproject, flags=re.M):
                    problems.append(f"{command}: pyproject.toml has no extra {extra!r}")
            continue
        if words[0] in ("python", "python3") and len(words) > 1 and words[1].endswith(".py"):
            at = 1
        elif words[0] == "torchrun" and any(w.endswith(".py") for w in words):
            at = next(n for n, w in enumerate(words) if w.endswith(".py"))
        elif words[0] == "bash" and len(words) > 1:
            at = 1
        else:
            continue
        script = root / words[at]
        scripts.append(words[at])
        if not script.is_file():
            problems.append(f"{command}: there is no {words[at]}")
            continue
        source = _options_source(script)
        for flag in (w.split("=")[0] for w in words[at + 1 :] if w.startswith("--")):
            if flag != "--help" and f'"{flag}"' not in source:
                problems.append(f"{command}: {words[at]} has no {flag} option")
    return problems, scripts


def _options_source(script: Path) -> str:
    """Where ``script``'s options may be defined: its text and that of the modules beside it that it
    imports, directly or through one another (``import _common``, whose shared parser gives the
    benchmarks ``--quick``, ``--json`` and ``--repeats``). A module beside it that is a script
    itself (``if __name__ == "__main__"``) is left out: its options are its own."""
    texts, seen, todo = [], {script}, [script]
    while todo:
        text = todo.pop().read_text()
        texts.append(text)
        if script.suffix != ".py":
            break
        for node in ast.walk(ast.parse(text)):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            for name in names:
                module = script.parent / f"{name}.py"
                if module.is_file() and module not in seen:
                    seen.add(module)
                    if 'if __name__ == "__main__"' not in module.read_text():
                        todo.append(module)
    return "\n".join(texts)


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def link_problems(text: str, root: Path, base: Path | None = None) -> list[str]:
    """Relative links and paths of ``text`` that lead nowhere: a ``[..](notes/x.md#part)`` whose file
    or heading is missing, a ``(#part)`` with no such heading here, and a path written in the prose
    (``examples/...``, ``tests/...``, ``fpipe/...``, ``benchmarks/...``, ``notes/...``) that is
    not a file of the repository. Links are relative to ``base`` (default ``root``), the page's
    folder; paths in the prose to ``root``."""
    base = root if base is None else base

    def anchors(markdown: str) -> set[str]:
        return {_slug(line.lstrip("#")) for _, line in _outside_fences(markdown) if line.startswith("#")}

    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"\w+://", target):
            continue
        path, _, anchor = target.partition("#")
        if path and not (base / path).is_file():
            problems.append(f"link ({target}): there is no {path}")
        elif anchor and anchor not in anchors((base / path).read_text() if path else text):
            problems.append(f"link ({target}): {path or 'README.md'} has no heading #{anchor}")
    paths = re.findall(r"(?<![\w/.-])((?:examples|benchmarks|notes|tests|fpipe)/[\w/.-]*\w\.(?:py|md|sh))\b", text)
    problems += [f"{path}: no such file" for path in sorted(set(paths)) if not (root / path).is_file()]
    return problems


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_fences_are_closed_and_no_code_is_left_outside(page: Path) -> None:
    text = page.read_text()
    problems = fence_problems(text)
    assert not problems, f"{_name(page)}:\n" + "\n".join(problems)
    fence_lines = [line for line in text.splitlines() if line.lstrip().startswith("```")]
    assert len(fence_lines) == 2 * len(FENCE.findall(text))  # the snippets' reader sees every block too
    code = unfenced_code(text)
    assert not code, f"{_name(page)}, code outside a fence:\n" + "\n".join(code)


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_commands_and_links_exist(page: Path) -> None:
    text = page.read_text()
    problems, _ = command_problems(text, ROOT)
    problems += link_problems(text, ROOT, page.parent)
    assert not problems, f"{_name(page)}:\n" + "\n".join(problems)


def test_every_example_and_the_gpu_check_have_a_command() -> None:
    scripts = {script for page in PAGES for script in command_problems(page.read_text(), ROOT)[1]}
    examples = {f"examples/{path.name}" for path in (ROOT / "examples").glob("*.py")}
    assert examples <= scripts, f"no run command in the docs for {sorted(examples - scripts)}"
    assert "bash benchmarks/gpu_check.sh" in {c for page in PAGES for c in _commands(page.read_text())}


def test_the_readme_checks_catch_what_they_look_for() -> None:
    """Each check fails on a broken copy of a README: these tests can fail."""
    broken = "intro\n```python skip\nx = 1\n```\ntext\n```python skip\ny = 2\n## Next\n```bash\nls\n```\n"
    assert fence_problems(broken) == ["line 9: ```bash opens a block inside the block opened at line 6"]
    assert fence_problems("```\nls\n```\ntext\n```text\nout\n```\n") == [
        "line 1: a bare ``` opens a block (an opening fence needs a language)"
    ]
    assert fence_problems("```python\nx = 1\n") == ["line 1: this block is never closed"]
    assert fence_problems(README.read_text() + "```python skip\nstep()\n") != []
    unfenced = "hand it fpipe's gradients:\nfor t, g in zip(a, b): t.grad = g\nopt.step()\n# fpipe\nfpipe\n"
    assert unfenced_code(unfenced) == ["line 2: for t, g in zip(a, b): t.grad = g", "line 3: opt.step()"]
    commands = (
        "```bash\npython examples/train_gpt.py --steps 3 --no-such-flag  # a comment\n"
        "torchrun --standalone --nproc-per-node 2 examples/missing.py\n"
        "python benchmarks/bench_search.py --quick --repeats 2 --json /tmp/search.json\n"
        "python benchmarks/bench_search.py --per-action-only\n```\n"
        "Run `bash benchmarks/missing.sh`, `python -m fpipe show nope --ranks 2 --microbatches 2`, "
        "`python -m fpipe draw` and `pip install -e '.[nope]'`; see [notes](notes/missing.md), "
        "[wire](notes/wire.md#no-such-part), [here](#nowhere) and tests/test_missing.py.\n"
    )
    problems, scripts = command_problems(commands, ROOT)
    assert scripts == [
        "examples/train_gpt.py",
        "examples/missing.py",
        "benchmarks/bench_search.py",
        "benchmarks/bench_search.py",
        "benchmarks/missing.sh",
    ]
    assert [p.split(": ", 1)[1].split(":")[0] for p in problems] == [
        "examples/train_gpt.py has no --no-such-flag option",
        "there is no examples/missing.py",
        # --quick, --repeats and --json come from benchmarks/_common.py, which bench_search imports;
        # --per-action-only is bench_vs_torch's own, a script bench_search imports too
        "benchmarks/bench_search.py has no --per-action-only option",
        "there is no benchmarks/missing.sh",
        "python -m fpipe show",  # argparse: "python -m fpipe show: error: argument SCHEDULE: invalid choice"
        "python -m fpipe",  # "python -m fpipe: error: argument COMMAND: invalid choice: 'draw'"
        "pyproject.toml has no extra 'nope'",
    ], problems
    assert link_problems(commands, ROOT) == [
        "link (notes/missing.md): there is no notes/missing.md",
        "link (notes/wire.md#no-such-part): notes/wire.md has no heading #no-such-part",
        "link (#nowhere): README.md has no heading #nowhere",
        "benchmarks/missing.sh: no such file",
        "examples/missing.py: no such file",
        "notes/missing.md: no such file",
        "tests/test_missing.py: no such file",
    ]
