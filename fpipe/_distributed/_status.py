"""One codec for what ranks tell each other about themselves (NOTE [one status codec]).

NOTE [one status codec]
A rank's status (its program and batch in the step's handshake, a failure in an ERROR meta or the
step's closing all-gather, the failure board's record, a save's "did this rank fail" report) is
a ``Status``: a frozen dataclass whose fields have names, read and written only by name. It
travels in one of two forms, both written here once:

- **words** (``encode``, ``decode``, ``width``): a fixed number of int64 words, for the
  collectives whose size must not depend on what a rank says (an all-gather of different
  lengths aborts gloo in C++: NOTE [a handshake of fixed size] in
  fpipe/_distributed/_rank_step.py) and for the ERROR meta of the wire. A field is an ``int``
  or ``bool`` (one word), a nested ``Status`` (its words), or a tuple of ints of a width fixed
  by the class (``words(n)``);
- **JSON** (``to_json``, ``from_json``): a dict keyed by field name, for statuses of any size
  (file names, manifests, the board's record in the store). A nested ``Status`` or ``NamedTuple``
  is a dict too, rebuilt from the field's annotation.

No code indexes a status by position: a new field is one line in its class, and every reader
sees it by name.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Sequence
from typing import Any, ClassVar, TypeVar

S = TypeVar("S", bound="Status")

_WORDS = "fpipe_words"  # a tuple field's width, in its dataclass field's metadata


def words(n: int) -> Any:
    """A ``Status`` field holding a tuple of exactly ``n`` ints (``n`` words in the words form)."""
    return dataclasses.field(default=(0,) * n, metadata={_WORDS: n})


@dataclasses.dataclass(frozen=True)
class Status:
    """A record of named fields that ranks exchange (NOTE [one status codec]); subclass it as a
    frozen dataclass."""

    _layouts: ClassVar[dict[type, list[tuple[str, Any, int]]]] = {}

    @classmethod
    def _layout(cls) -> list[tuple[str, Any, int]]:
        """``(name, type, width in words)`` of each field, in order; width 0: no words form."""
        layout = Status._layouts.get(cls)
        if layout is None:
            hints = typing.get_type_hints(cls)
            layout = []
            for f in dataclasses.fields(cls):
                kind = hints[f.name]
                if _WORDS in f.metadata:
                    width = int(f.metadata[_WORDS])
                elif kind is int or kind is bool:
                    width = 1
                elif isinstance(kind, type) and issubclass(kind, Status):
                    width = kind.width()
                else:
                    width = 0
                layout.append((f.name, kind, width))
            Status._layouts[cls] = layout
        return layout

    @classmethod
    def width(cls) -> int:
        """How many int64 words ``encode`` gives: the same for every value of the class."""
        layout = cls._layout()
        if any(width == 0 for _, _, width in layout):
            raise TypeError(f"fpipe: {cls.__name__} has fields that are not words (a bug)")
        return sum(width for _, _, width in layout)

    def encode(self) -> list[int]:
        """The status as ``width()`` int64 words, field by field."""
        out: list[int] = []
        for name, _, width in self._layout():
            value = getattr(self, name)
            if isinstance(value, Status):
                out += value.encode()
            elif isinstance(value, tuple):
                if len(value) != width:
                    raise ValueError(f"fpipe: {type(self).__name__}.{name} has {len(value)} words, not {width} (a bug)")
                out += [int(v) for v in value]
            elif width == 1:
                out.append(int(value))
            else:
                raise TypeError(f"fpipe: {type(self).__name__}.{name} is not words (a bug)")
        return out

    @classmethod
    def decode(cls: type[S], data: Sequence[int]) -> S:
        """The status whose ``encode`` is ``data`` (``width()`` words)."""
        if len(data) != cls.width():
            raise ValueError(f"fpipe: {cls.__name__} takes {cls.width()} words, got {len(data)} (a bug)")
        values: dict[str, Any] = {}
        at = 0
        for name, kind, width in cls._layout():
            part = data[at : at + width]
            at += width
            if isinstance(kind, type) and issubclass(kind, Status):
                values[name] = kind.decode(part)
            elif kind is bool:
                values[name] = bool(part[0])
            elif kind is int:
                values[name] = int(part[0])
            else:
                values[name] = tuple(int(v) for v in part)
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        """The status as a JSON value: a dict by field name (nested records as dicts)."""
        return {name: _json_of(getattr(self, name)) for name, _, _ in self._layout()}

    @classmethod
    def from_json(cls: type[S], value: dict[str, Any]) -> S:
        """The status whose ``to_json`` is ``value``."""
        return cls(**{name: _from_json(kind, value[name]) for name, kind, _ in cls._layout()})


def _json_of(value: Any) -> Any:
    if isinstance(value, Status):
        return value.to_json()
    if isinstance(value, tuple) and hasattr(value, "_asdict"):  # a NamedTuple: by name too
        return {k: _json_of(v) for k, v in value._asdict().items()}
    return value


def _from_json(kind: Any, value: Any) -> Any:
    """``value`` read back as the annotation ``kind`` says (``X | None``: ``None`` or an ``X``)."""
    if value is None:
        return None
    options = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
    for option in options:
        if isinstance(option, type) and issubclass(option, Status):
            return option.from_json(value)
        if isinstance(option, type) and issubclass(option, tuple) and hasattr(option, "_fields"):
            hints = typing.get_type_hints(option)
            return option(**{k: _from_json(hints[k], v) for k, v in value.items()})
        if option is tuple or typing.get_origin(option) is tuple:
            return tuple(value)
    return value
