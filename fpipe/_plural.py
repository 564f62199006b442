"""Words for messages: counted nouns (``plural(1, "tick")`` is ``"1 tick"``, never ``"1 ticks"``),
lists cut short, and values named briefly (``brief``: a wrong argument's type, never its whole repr)."""

from __future__ import annotations

from collections.abc import Sequence


def plural(count: int, noun: str) -> str:
    """``count`` and ``noun``, the noun in the plural unless ``count`` is 1.

    English plurals: ``"stage"`` gives ``"stages"``, ``"entry"`` ``"entries"``,
    ``"process"`` ``"processes"``, ``"microbatch"`` ``"microbatches"``, ``"leaf"`` ``"leaves"``.
    """
    if count == 1:
        return f"1 {noun}"
    if noun in _IRREGULAR:
        return f"{count} {_IRREGULAR[noun]}"
    if noun.endswith(("s", "x", "ch", "sh")):
        return f"{count} {noun}es"
    if noun.endswith("y") and noun[-2:-1] not in ("a", "e", "i", "o", "u"):
        return f"{count} {noun[:-1]}ies"
    return f"{count} {noun}s"


_IRREGULAR = {"leaf": "leaves", "child": "children"}


def listing(names: Sequence[str], limit: int = 8) -> str:
    """``names`` joined by commas, the first ``limit`` of them and a count of the rest (``"none"`` if empty)."""
    if not names:
        return "none"
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def brief(value: object, limit: int = 60) -> str:
    """``value`` as an error message shows a wrong argument: its type, and its repr when short.

    ``brief(1.0)`` is ``"1.0, type float"``, ``brief("zbv")`` ``"'zbv', type str"``, a class
    ``"the class OneFOneB"``; a repr longer than ``limit`` characters is cut:
    ``"type Searched, repr of 28,419 characters: Searched(program=Program(ranks=((Action(stage=0,..."``.
    So a message stays a line or two whatever was passed (a search result, a tensor, a model).
    """
    if isinstance(value, type):
        return f"the class {value.__name__}"
    name = type(value).__name__
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the error being reported
        return f"type {name}"
    if len(text) <= limit:
        return f"{text}, type {name}"
    return f"type {name}, repr of {len(text):,} characters: {text[:limit]}..."
