"""Counted nouns and lists for messages: ``plural(1, "tick")`` is ``"1 tick"``, never ``"1 ticks"``."""

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
