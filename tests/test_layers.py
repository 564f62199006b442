"""The layering is a test (STYLE.md, point 18): fpipe/ is parsed with ``ast``, never imported.

Four rules, each shown to fail on a small package written to ``tmp_path``:

- **No import cycle**, between modules or between units (a unit is a top-level module such as
  ``fpipe._api`` or a subpackage such as ``fpipe._saving``, all its modules together). Every
  import counts: at module level, inside functions, ``from . import x``, and imports under
  ``if TYPE_CHECKING:`` too (a type-only import still ties the two modules: moving it under
  ``TYPE_CHECKING`` hides a cycle from the interpreter, not from the reader).
- **No private read across modules**: ``from ._x import _y`` (``_y`` not a module), and
  ``thing._y`` (read, written or deleted) where ``_y`` is a private name that another fpipe module
  defines (at its top level, in a class body, or as ``self._y``) and this one does not. Reads
  through ``self`` and ``cls`` are a class's own business and are not checked.
- **Faces**: a private subpackage (``fpipe._saving``) is imported from outside only through its
  ``__init__.py``, which exports what the rest of fpipe may use; each subpackage has a README.md
  saying what it owns and may import. The public ``fpipe.schedules`` and ``fpipe.optim`` have
  faces too, but their ``__init__.py`` is public API (its ``__all__``), so fpipe's own modules
  take the names it exports from it and only the program's internals (action kinds,
  ``checksum``) from its modules.
- **Rows**: notes/design.md's table "The map of the package" numbers the units top to bottom;
  a module imports only from its own unit and from units on rows above its own. The table must
  name every unit once and nothing else, so the note stays true.

And the tests mirror the tree: every module that holds logic (defines a function or a class at
its top level; ``__init__.py`` and ``__main__.py`` are faces) has a test module named after it,
its path without the leading underscores (notes/design.md, "Tests mirror the tree"): ``fpipe/_saving/_async.py`` ->
``tests/saving/test_async.py``, ``fpipe/_api.py`` -> ``tests/test_api.py``. What the tests share
lives in helper modules (tests/helpers.py, and the ``_``-prefixed ones such as tests/_multiprocess.py):
no module under tests/ imports a ``test_*.py`` module, or a private name of another module (STYLE.md,
point 20).
"""

from __future__ import annotations

import ast
import functools
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fpipe"
DESIGN = ROOT / "notes" / "design.md"
TESTS = ROOT / "tests"
FACES = ("__init__", "__main__")


@dataclass(frozen=True)
class Import:
    """``source`` imports ``target`` (a module of the package) at ``line``, taking ``names`` from it."""

    source: str
    target: str
    names: tuple[str, ...]
    line: int


@functools.cache
def parse(path: Path) -> ast.Module:
    """The syntax tree of one file, parsed once per run."""
    return ast.parse(path.read_text(), str(path))


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package in ``root`` by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(root: Path) -> list[Import]:
    """Every import of a module of the package in ``root``, wherever it stands in its file."""
    known = modules(root)
    found = []
    for source, path in known.items():
        here = source.split(".") if path.name == "__init__.py" else source.split(".")[:-1]
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Import):
                found += [Import(source, a.name, (), node.lineno) for a in node.names if a.name in known]
            elif isinstance(node, ast.ImportFrom):
                parts = here[: len(here) - node.level + 1] if node.level else []
                base = ".".join([*parts, *([node.module] if node.module else [])])
                if base not in known:
                    continue
                names = []
                for alias in node.names:
                    if f"{base}.{alias.name}" in known:  # a submodule: ``from . import x``
                        found.append(Import(source, f"{base}.{alias.name}", (), node.lineno))
                    else:
                        names.append(alias.name)
                if names:
                    found.append(Import(source, base, tuple(names), node.lineno))
    return found


def unit(module: str) -> str:
    """The unit a module belongs to: its top-level module or subpackage (``fpipe._saving``)."""
    return ".".join(module.split(".")[:2])


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """A cycle (``a -> b -> ... -> a``) of ``edges``, for each group of nodes that has some."""
    found: list[list[str]] = []
    done: set[str] = set()
    for start in sorted(edges):
        cycle = None if start in done else _cycle_from(start, edges, [], done)
        if cycle is not None:
            found.append(cycle)
            done.update(cycle)
    return found


def _cycle_from(node: str, edges: dict[str, set[str]], path: list[str], done: set[str]) -> list[str] | None:
    """A cycle through ``path`` (the nodes on the way here) or reached from ``node``, else None;
    ``done`` collects the nodes known to reach no cycle."""
    path.append(node)
    for nxt in sorted(edges.get(node, ())):
        if nxt in path:
            return [*path[path.index(nxt) :], nxt]
        cycle = None if nxt in done else _cycle_from(nxt, edges, path, done)
        if cycle is not None:
            return cycle
    path.pop()
    done.add(node)
    return None


def import_cycles(root: Path) -> list[str]:
    """The import cycles of the package in ``root``, between modules and between units."""
    by_module: dict[str, set[str]] = defaultdict(set)
    by_unit: dict[str, set[str]] = defaultdict(set)
    for i in imports(root):
        by_module[i.source].add(i.target)
        if unit(i.source) != unit(i.target):
            by_unit[unit(i.source)].add(unit(i.target))
    return [" -> ".join(c) for c in cycles(by_module) + cycles(by_unit)]


def defined_private(tree: ast.Module) -> set[str]:
    """The private names a module defines: top-level and class-body names, and ``self._x``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _on_self(node):
            names.add(node.attr)
    return {n for n in names if _private(n)}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def private_reads(root: Path) -> list[str]:
    """Where a module of the package in ``root`` reads another module's private names."""
    known = modules(root)
    trees = {name: parse(path) for name, path in known.items()}
    own = {name: defined_private(tree) for name, tree in trees.items()}
    found = [
        f"{i.source}:{i.line} imports {name} from {i.target}"
        for i in imports(root)
        for name in i.names
        if _private(name)
    ]
    anywhere = set().union(*own.values())
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or node.attr not in anywhere or node.attr in own[name]:
                continue
            if not _on_self(node):
                found.append(f"{name}:{node.lineno} reads {ast.unparse(node)}, private to another module")
    return found


def exported(tree: ast.Module) -> set[str]:
    """The names in a face's ``__all__``."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return {e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def face_violations(root: Path) -> list[str]:
    """Imports from outside a subpackage that go around its face: any of a private subpackage's
    modules, and a name a public subpackage's face exports taken from one of its modules."""
    known = modules(root)
    found = []
    for i in imports(root):
        face = unit(i.target)
        if face == i.target or face == unit(i.source):
            continue
        if face.rsplit(".", 1)[-1].startswith("_"):
            found.append(f"{i.source}:{i.line} imports {i.target}, not the face {face}")
            continue
        public = sorted(set(i.names) & exported(parse(known[face])))
        if public:
            names = ", ".join(public)
            found.append(f"{i.source}:{i.line} imports {names} from {i.target}, which the face {face} exports")
    return found


_ROW = re.compile(r"^\| *(\d+) *\| *`([\w/.]+)`")


def rows(design: str, package: str) -> dict[str, int]:
    """The row of each unit in the table of ``design``: lines ``| 3 | `fpipe/_x.py` | ...``."""
    found: dict[str, int] = {}
    for line in design.splitlines():
        match = _ROW.match(line)
        if match:
            path = match.group(2).removesuffix("/").removesuffix(".py").removesuffix("/__init__")
            name = path.replace("/", ".")
            assert name not in found, f"{name} is on two rows of the table"
            found[name] = int(match.group(1))
    assert found, f"no row of the form '| 1 | `{package}/_x.py` | ...' in the design note"
    return found


def row_violations(root: Path, design: str) -> list[str]:
    """Imports against the rows of ``design``, and units the table misses or invents."""
    units = {unit(m) for m in modules(root)}
    row = rows(design, root.name)
    found = [f"{u} is in the package but on no row of the table" for u in sorted(units - set(row))]
    found += [f"{u} is on a row of the table but not in the package" for u in sorted(set(row) - units)]
    for i in imports(root):
        a, b = unit(i.source), unit(i.target)
        if a != b and a in row and b in row and row[b] >= row[a]:
            found.append(f"{i.source}:{i.line} (row {row[a]}) imports {i.target} (row {row[b]})")
    return found


def holds_logic(tree: ast.Module) -> bool:
    """Whether a module defines a function or a class at its top level."""
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for node in tree.body)


def mirror(path: Path, root: Path, tests: Path) -> Path:
    """The test module of the package module ``path``: its path under ``root`` without leading
    underscores, under ``tests``, its name prefixed ``test_`` (``_saving/_async.py`` -> ``saving/test_async.py``)."""
    *folders, name = (part.removeprefix("_") for part in path.relative_to(root).with_suffix("").parts)
    return tests.joinpath(*folders, f"test_{name}.py")


def untested_modules(root: Path, tests: Path) -> list[str]:
    """The modules of the package in ``root`` that hold logic and have no test module in ``tests``."""
    return [
        f"{path.relative_to(root.parent)} has no {mirror(path, root, tests).relative_to(tests.parent)}"
        for path in sorted(root.rglob("*.py"))
        if path.stem not in FACES and holds_logic(parse(path)) and not mirror(path, root, tests).is_file()
    ]


def modules_under(tests: Path) -> dict[str, Path]:
    """Every module under ``tests`` by dotted name from the repository root (``tests.saving.test_save``)."""
    paths = sorted(tests.rglob("*.py"))
    return {".".join(path.relative_to(tests.parent).with_suffix("").parts): path for path in paths}


def _resolve(name: str, source: str, tests: Path, known: dict[str, Path]) -> str | None:
    """The module of ``tests`` that ``import name`` in ``source`` finds, if any: ``name`` from the
    repository root (``tests.test_x``), from the importing file's folder or from ``tests`` itself
    (pytest puts both on ``sys.path``: ``from test_x import y``)."""
    folder = source.rsplit(".", 1)[0]
    for candidate in (name, f"{folder}.{name}", f"{tests.name}.{name}"):
        if candidate in known:
            return candidate
    return None


def import_violations_in_tests(tests: Path) -> list[str]:
    """Where a module under ``tests`` imports a ``test_*`` module, or a private name of another module
    under ``tests`` (``from tests._x import _y``, or ``_x._y`` on a module imported whole)."""
    known = modules_under(tests)
    found: dict[str, None] = {}  # in order, once each (one statement may take several names)
    for source, path in known.items():
        aliases: dict[str, str] = {}  # a module imported whole, by the name it is read through
        for node in ast.walk(parse(path)):
            pairs: list[tuple[str | None, str, str]] = []  # (module, name taken from it or "", alias)
            if isinstance(node, ast.Import):
                pairs = [(_resolve(a.name, source, tests, known), "", a.asname or a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                base = _resolve(node.module, source, tests, known)
                for a in node.names:
                    module = _resolve(f"{node.module}.{a.name}", source, tests, known)
                    pairs.append((module, "", a.asname or a.name) if module else (base, a.name, a.asname or a.name))
            for module, name, alias in pairs:
                if module is None or module == source:
                    continue
                if module.rsplit(".", 1)[-1].startswith("test_"):
                    found[f"{source}:{node.lineno} imports the test module {module}"] = None
                elif _private(name):
                    found[f"{source}:{node.lineno} imports {name}, private to {module}"] = None
                elif not name:
                    aliases[alias] = module
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr):
                module = aliases.get(node.value.id)
                if module is not None and not module.rsplit(".", 1)[-1].startswith("test_"):
                    found[f"{source}:{node.lineno} reads {ast.unparse(node)}, private to {module}"] = None
    return list(found)


def test_no_import_cycle() -> None:
    assert import_cycles(PACKAGE) == []


def test_no_private_read_across_modules() -> None:
    assert private_reads(PACKAGE) == []


def test_private_subpackages_are_imported_through_their_faces() -> None:
    assert face_violations(PACKAGE) == []


def test_every_subpackage_has_a_face_and_a_readme() -> None:
    for package in sorted(p for p in PACKAGE.iterdir() if (p / "__init__.py").exists()):
        assert ast.get_docstring(parse(package / "__init__.py")), package
        assert (package / "README.md").exists(), package


def test_imports_follow_the_rows_of_the_design_note() -> None:
    assert row_violations(PACKAGE, DESIGN.read_text()) == []


def test_every_module_that_holds_logic_has_a_test_module_named_after_it() -> None:
    assert untested_modules(PACKAGE, TESTS) == []


def test_no_test_module_imports_another_or_a_private_name() -> None:
    assert import_violations_in_tests(TESTS) == []


# The rules on synthetic packages: each one fails.


def write(root: Path, files: dict[str, str]) -> Path:
    """A package ``pkg`` under ``root`` with ``files`` (paths relative to it)."""
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_imports_are_found_wherever_they_stand(tmp_path: Path) -> None:
    root = write(
        tmp_path,
        {
            "__init__.py": "from . import _a\n",
            "_a.py": "def f():\n    from ._b import g\n    import pkg._c\n",
            "_b.py": "from .sub import _d, x\n",
            "_c.py": "import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import _b\n",
            "sub/__init__.py": "from ._d import x as x\n",
            "sub/_d.py": "from .. import _c\nfrom ..sub import x\nx = 1\n",
        },
    )
    found = {(i.source, i.target, i.names) for i in imports(root)}
    assert found == {
        ("pkg", "pkg._a", ()),
        ("pkg._a", "pkg._b", ("g",)),
        ("pkg._a", "pkg._c", ()),
        ("pkg._b", "pkg.sub._d", ()),
        ("pkg._b", "pkg.sub", ("x",)),
        ("pkg._c", "pkg._b", ()),
        ("pkg.sub", "pkg.sub._d", ("x",)),
        ("pkg.sub._d", "pkg._c", ()),
        ("pkg.sub._d", "pkg.sub", ("x",)),
    }


@pytest.mark.parametrize(
    ("files", "cycle"),
    [
        ({"_a.py": "from ._b import x\ny = 1\n", "_b.py": "from ._a import y\nx = 1\n"}, "pkg._a -> pkg._b -> pkg._a"),
        (  # inside a function, with ``from . import``
            {"_a.py": "def f():\n    from . import _b\n", "_b.py": "from . import _a\n"},
            "pkg._a -> pkg._b -> pkg._a",
        ),
        (  # under TYPE_CHECKING: counted
            {
                "_a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._b import x\ny = 1\n",
                "_b.py": "from ._a import y\nx = 1\n",
            },
            "pkg._a -> pkg._b -> pkg._a",
        ),
        (  # units only: no module imports itself back, but the subpackages do
            {
                "one/__init__.py": "",
                "one/_a.py": "from ..two._c import z\nx = 1\n",
                "one/_b.py": "y = 1\n",
                "two/__init__.py": "",
                "two/_c.py": "z = 1\n",
                "two/_d.py": "from ..one._b import y\n",
            },
            "pkg.one -> pkg.two -> pkg.one",
        ),
    ],
)
def test_an_import_cycle_fails(tmp_path: Path, files: dict[str, str], cycle: str) -> None:
    root = write(tmp_path, {"__init__.py": "", **files})
    assert cycle in import_cycles(root)


@pytest.mark.parametrize(
    ("b", "read"),
    [
        ("from ._a import _helper\n", "pkg._b:1 imports _helper from pkg._a"),
        ("from . import _a\nvalue = _a._helper()\n", "pkg._b:2 reads _a._helper, private to another module"),
        ("def f(step):\n    return step._cache\n", "pkg._b:2 reads step._cache, private to another module"),
        ("def f(step):\n    step._cache = None\n", "pkg._b:2 reads step._cache, private to another module"),
    ],
)
def test_a_private_read_across_modules_fails(tmp_path: Path, b: str, read: str) -> None:
    a = "def _helper():\n    pass\nclass Step:\n    def __init__(self):\n        self._cache = {}\n"
    root = write(tmp_path, {"__init__.py": "", "_a.py": a, "_b.py": b})
    assert private_reads(root) == [read]


def test_an_import_around_a_face_fails(tmp_path: Path) -> None:
    files = {"__init__.py": "from ._sub import x as x\n", "_sub/__init__.py": "from ._a import x as x\n"}
    files |= {"_sub/_a.py": "x = 1\n", "_sub/_b.py": "from ._a import x\n", "pub/_c.py": "y = z = 1\n"}
    files["pub/__init__.py"] = 'from ._c import y as y\n__all__ = ["y"]\n'
    files["_d.py"] = "from ._sub import x\nfrom .pub._c import z\nfrom ._sub._a import x\nfrom .pub._c import y, z\n"
    root = write(tmp_path, files)
    assert face_violations(root) == [
        "pkg._d:3 imports pkg._sub._a, not the face pkg._sub",
        "pkg._d:4 imports y from pkg.pub._c, which the face pkg.pub exports",
    ]


def test_own_private_names_and_foreign_ones_pass(tmp_path: Path) -> None:
    a = "class Step:\n    def __init__(self):\n        self._cache = {}\n    def same(self, other):\n"
    a += "        return self._cache == other._cache\n"
    b = "import collections\ndef f(t):\n    return t._replace(x=1), t._fields\n"
    root = write(tmp_path, {"__init__.py": "", "_a.py": a, "_b.py": b})
    assert private_reads(root) == []


TABLE = """\
| row | unit | one line |
|---|---|---|
| 1 | `pkg/_a.py` | the bottom |
| 2 | `pkg/_b.py` | beside c |
| 2 | `pkg/_c.py` | beside b |
| 3 | `pkg/sub/` | a subpackage |
| 4 | `pkg/__init__.py` | the face |
"""


@pytest.mark.parametrize(
    ("files", "violation"),
    [
        ({"_a.py": "from . import _b\n"}, "pkg._a:1 (row 1) imports pkg._b (row 2)"),
        ({"_b.py": "from ._c import x\n"}, "pkg._b:1 (row 2) imports pkg._c (row 2)"),
        ({"_c.py": "def f():\n    from .sub._d import x\n"}, "pkg._c:2 (row 2) imports pkg.sub._d (row 3)"),
        ({"_e.py": ""}, "pkg._e is in the package but on no row of the table"),
        ({}, None),
    ],
)
def test_an_import_against_the_rows_fails(tmp_path: Path, files: dict[str, str], violation: str | None) -> None:
    base = {"__init__.py": "from .sub import x\n", "_a.py": "x = 1\n", "_b.py": "from ._a import x\n"}
    base["_c.py"] = "x = 1\n"
    base |= {"sub/__init__.py": "from ._d import x as x\n", "sub/_d.py": "from .._a import x\nfrom .._c import x\n"}
    root = write(tmp_path, base | files)
    found = row_violations(root, TABLE)
    assert found == ([] if violation is None else [violation])


def test_a_table_naming_a_missing_unit_fails(tmp_path: Path) -> None:
    root = write(tmp_path, {"__init__.py": "", "_a.py": "", "_b.py": "", "_c.py": ""})
    assert row_violations(root, TABLE) == ["pkg.sub is on a row of the table but not in the package"]


def test_the_design_note_numbers_its_rows_from_one_without_gaps() -> None:
    numbers = sorted(set(rows(DESIGN.read_text(), "fpipe").values()))
    assert numbers == list(range(1, len(numbers) + 1))


def test_a_module_with_logic_and_no_test_module_fails(tmp_path: Path) -> None:
    files = {"__init__.py": "def face():\n    pass\n", "__main__.py": "def main():\n    pass\n"}
    files |= {"_a.py": "def f():\n    pass\n", "_data.py": "X = 1\n", "_sub/__init__.py": ""}
    files |= {"_sub/_b.py": "class B:\n    pass\n", "_sub/_c.py": "async def c():\n    pass\n"}
    root = write(tmp_path, files)
    tests = tmp_path / "tests"
    (tests / "sub").mkdir(parents=True)
    (tests / "sub" / "test_b.py").write_text("")
    assert untested_modules(root, tests) == [
        "pkg/_a.py has no tests/test_a.py",
        "pkg/_sub/_c.py has no tests/sub/test_c.py",
    ]


def test_a_test_module_imported_or_a_private_name_read_across_tests_fails(tmp_path: Path) -> None:
    files = {
        "helpers.py": "def model():\n    pass\ndef _seed():\n    pass\n",
        "_spawn.py": "def run():\n    pass\n",
        "conftest.py": "from tests.test_a import fixture\n",
        "test_a.py": "from tests.helpers import model\nfrom tests import _spawn\ndef _own():\n    pass\n_own()\n",
        "test_b.py": "from test_a import _own, x\nimport tests.test_a\nfrom tests.helpers import _seed\n",
        "sub/test_c.py": "from tests import helpers as h\nfrom test_d import x\nh._seed()\n",
        "sub/test_d.py": "x = 1\ndef f():\n    from tests import _spawn\n    _spawn._run()\n",
    }
    for name, text in files.items():
        path = tmp_path / "tests" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert import_violations_in_tests(tmp_path / "tests") == [
        "tests.conftest:1 imports the test module tests.test_a",
        "tests.sub.test_c:2 imports the test module tests.sub.test_d",  # from its own folder, as pytest finds it
        "tests.sub.test_c:3 reads h._seed, private to tests.helpers",
        "tests.sub.test_d:4 reads _spawn._run, private to tests._spawn",
        "tests.test_b:1 imports the test module tests.test_a",
        "tests.test_b:2 imports the test module tests.test_a",
        "tests.test_b:3 imports _seed, private to tests.helpers",
    ]
