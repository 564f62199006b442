"""The one door to optree: every flatten in fpipe goes through here, with the same options.

``None`` is a leaf (``none_is_leaf=True``): a ``None`` in a batch travels as a non-tensor leaf,
and a ``None`` in a ``batch_dims`` prefix means "do not split". Registrations made in optree's
default namespace (and optree's built-in types) are honoured.
"""

from __future__ import annotations

import itertools
import sys
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch

from ._plural import plural

PyTree = Any
TreeSpec = optree.PyTreeSpec

_NONE_IS_LEAF = True
_OPTIONS: dict[str, Any] = {"none_is_leaf": _NONE_IS_LEAF}


# NOTE [one-tensor fast path]
# A plain tensor is the usual activation, microbatch and stage output, and a stage's forward and
# backward flatten several per action. It is a leaf (no pytree library flattens one), so its
# answer is known without asking optree: ``flatten`` and ``tensor_map`` test ``type(tree) is
# torch.Tensor`` (one test, cheaper than an ``isinstance``) and give the shared structure
# ``_LEAF``, which ``unflatten`` recognizes by identity. This module is the one place that tests
# for a plain tensor: every "one tensor, no loop" shortcut of the stage (its inputs, its outputs
# that carry the graph, moving a microbatch to its device) is ``tensor_map``, whose answer for a
# plain tensor equals its general path's (``_tensor_map``) bit for bit (tests/test_pytree.py).
# Its one sibling, ``scatter``, places a backward's input cotangents: for one input, no loop, and
# bitwise its general path's (``_scatter``). Neither the stage nor microbatching keeps a shortcut
# of its own: the stage's ``_seeds`` loops over its one graph output, and ``split``
# (fpipe/_microbatch.py) cuts a plain tensor on the general path, which skips laying out the rows
# of a laid-out batch. A shortcut stays only where it saves 3% of an action or more, as
# ``benchmarks/bench_overhead.py --ab`` measures (the readings: notes/design.md, "Per-action overhead").
def flatten(tree: PyTree) -> tuple[list[Any], TreeSpec]:
    """Leaves (in optree's order) and the structure of ``tree`` (NOTE [one-tensor fast path])."""
    # The option goes by keyword, not ``**_OPTIONS`` (unpacking a dict costs a third of a flatten).
    if type(tree) is torch.Tensor:
        return [tree], _LEAF
    return optree.tree_flatten(tree, none_is_leaf=_NONE_IS_LEAF)


_LEAF = optree.treespec_leaf(none_is_leaf=_NONE_IS_LEAF)  # the structure of any leaf
_FIRST = (0,)  # the position of the one leaf of a plain tensor


def unflatten(spec: TreeSpec, leaves: Sequence[Any]) -> PyTree:
    """Inverse of ``flatten``."""
    if spec is _LEAF:  # what ``flatten`` gave a plain tensor
        return leaves[0]
    return spec.unflatten(leaves)


class Mapped(NamedTuple):
    """What ``tensor_map`` returns."""

    leaves: list[Any]  # the tree's leaves, each tensor leaf replaced by what ``fn`` made of it
    spec: TreeSpec  # the tree's structure
    positions: Sequence[int]  # the positions (in leaf order) of the tensor leaves ``fn`` kept
    kept: list[Any]  # their new leaves


def tensor_map(fn: Callable[[torch.Tensor], tuple[Any, bool]], tree: PyTree) -> Mapped:
    """``flatten(tree)`` with each tensor leaf ``t`` replaced by ``fn(t)[0]``; the positions of
    the tensor leaves for which ``fn(t)[1]`` holds (in leaf order), and their new leaves.

    Conceptually::

        leaves, spec = flatten(tree)
        positions, kept = [], []
        for k, t in enumerate(leaves):
            if isinstance(t, torch.Tensor):
                leaves[k], keep = fn(t)
                if keep: positions.append(k); kept.append(leaves[k])
        return Mapped(leaves, spec, positions, kept)

    which it is, but for a plain tensor (NOTE [one-tensor fast path]): no loop, no list to fill.
    """
    if type(tree) is torch.Tensor:  # (flatten's test, not a call to it: this runs twice per forward)
        leaf, keep = fn(tree)
        return Mapped([leaf], _LEAF, _FIRST, [leaf]) if keep else Mapped([leaf], _LEAF, (), [])
    return _tensor_map(fn, *optree.tree_flatten(tree, none_is_leaf=_NONE_IS_LEAF))


def _tensor_map(fn: Callable[[torch.Tensor], tuple[Any, bool]], leaves: list[Any], spec: TreeSpec) -> Mapped:
    """``tensor_map``'s general path, on ``flatten``'s ``leaves`` (replaced in place) and ``spec``."""
    positions: list[int] = []
    kept: list[Any] = []
    for k, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            leaves[k], keep = fn(leaf)
            if keep:
                positions.append(k)
                kept.append(leaves[k])
    return Mapped(leaves, spec, positions, kept)


def scatter(
    fn: Callable[[Any], torch.Tensor | None], index: Sequence[int], values: Sequence[Any], size: int
) -> list[torch.Tensor | None]:
    """``size`` leaves, ``None`` but at the positions ``index``, where ``fn`` of each of ``values``
    goes (a ``None`` value stays ``None``).

    Conceptually::

        out = [None] * size
        for k, v in zip(index, values):
            if v is not None: out[k] = fn(v)
        return out

    which it is, but for one value in one position (NOTE [one-tensor fast path]): no loop.
    """
    if size == 1 and len(values) == 1:  # then ``index`` is ``(0,)``; a stage's one input, once per backward
        value = values[0]
        return [None if value is None else fn(value)]
    return _scatter(fn, index, values, size)


def _scatter(
    fn: Callable[[Any], torch.Tensor | None], index: Sequence[int], values: Sequence[Any], size: int
) -> list[torch.Tensor | None]:
    """``scatter``'s general path."""
    out: list[torch.Tensor | None] = [None] * size
    for k, value in zip(index, values):
        if value is not None:
            out[k] = fn(value)
    return out


class WithPaths(NamedTuple):
    """What ``leaves_with_paths`` returns."""

    paths: list[str]  # each leaf's key path, such as ``['tokens'][0]``
    leaves: list[Any]
    spec: TreeSpec


class WithNames(NamedTuple):
    """What ``leaves_with_names`` returns."""

    names: list[tuple[str, ...]]  # each leaf's name parts, as ``fpipe.save`` names it
    codes: list[str]  # each leaf's key path as code, such as ``['h'].a[0]``
    leaves: list[Any]
    spec: TreeSpec


def leaves_with_paths(tree: PyTree) -> WithPaths:
    """Like ``flatten``, plus each leaf's key path as a string such as ``['tokens'][0]``."""
    paths, leaves, spec = optree.tree_flatten_with_path(tree, **_OPTIONS)
    return WithPaths([keystr(p) for p in paths], leaves, spec)


def leaves_with_names(tree: PyTree) -> WithNames:
    """Like ``flatten``, plus each leaf's key path as name parts and as code such as ``['h'].a[0]``.

    The name parts are how ``fpipe.save`` names tensors: a mapping key as ``str(key)``, a
    sequence index in decimal, a named field (namedtuple, dataclass, attribute) by its name.
    """
    accessors, leaves, spec = optree.tree_flatten_with_accessor(tree, **_OPTIONS)
    names = [tuple(_entry_name(e) for e in accessor) for accessor in accessors]
    return WithNames(names, [accessor.codify("") for accessor in accessors], leaves, spec)


def _entry_name(entry: Any) -> str:
    if isinstance(getattr(entry, "field", None), str):  # namedtuple and structseq fields
        return str(entry.field)
    if isinstance(entry, optree.GetAttrEntry):  # dataclass fields, attributes
        return str(entry.name)
    return str(entry.entry)


def keystr(path: Sequence[Any]) -> str:
    """A key path tuple as ``['h'][0]``; the root is ``<root>``."""
    return "".join(f"[{k!r}]" for k in path) or "<root>"


def broadcast_prefix(prefix: PyTree, tree: PyTree) -> list[Any]:
    """The leaves of ``prefix`` repeated over the leaves of ``tree`` that each one covers.

    Raises ``ValueError`` naming the mismatch if ``prefix`` is not a prefix of ``tree``.
    """
    return optree.broadcast_prefix(prefix, tree, **_OPTIONS)


def stage_list(
    where: str,
    argument: str,
    value: Any,
    num_stages: int | None = None,
    *,
    against: str = "the pipeline",
    each: str = "pytree",
    got: str = "got",
    fix: str = "",
) -> list[PyTree]:
    """``value`` as a list with one ``each`` per stage: the one check of "one pytree per stage".

    Raises ``TypeError`` if ``value`` is not a list (a ``str``, ``bytes`` or ``dict`` is not one),
    ``ValueError`` if it has not ``num_stages`` entries (when given; ``against`` names what has
    that many: "the pipeline", "the step", "params"). ``where`` starts the message
    ("fpipe.step"), ``got`` labels the type found ("got", or the argument's name), ``fix`` is
    a last sentence added to the message.
    """
    extra = f" {fix}" if fix else ""
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Sequence):
        entries = (
            "a list, one entry per stage" if not num_stages else f"[{argument}_0, ..., {argument}_{num_stages - 1}]"
        )
        raise TypeError(
            f"{where}: {argument} must be a list with one {each} per stage ({got}: {type(value).__name__}). "
            f"Pass {entries}.{extra}"
        )
    if num_stages is not None and len(value) != num_stages:
        raise ValueError(
            f"{where}: {argument} has {plural(len(value), 'entry')} but {against} has "
            f"{plural(num_stages, 'stage')}. Pass one {each} per stage.{extra}"
        )
    return list(value)


def is_differentiable(leaf: Any) -> bool:
    """Floating and complex tensors get gradients; everything else passes through untouched."""
    return isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())


def detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its graph: a detached alias, or a copy if ``t`` is an inference tensor
    (made under ``torch.inference_mode()``), which autograd could not record or save."""
    return t.clone() if t.is_inference() else t.detach()


def boundary_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor crossing a stage boundary is laid out: contiguous, with conjugate and
    negative bits resolved (NOTE [boundary layout] in fpipe/_stage.py). ``t`` itself if it is so."""
    if t.is_contiguous() and not t.is_conj() and not t.is_neg():  # the usual case: three cheap reads
        return t
    return t.resolve_conj().resolve_neg().contiguous()


def map_tensors(fn: Any, tree: PyTree) -> PyTree:
    """Apply ``fn`` to every tensor leaf of ``tree``; other leaves are kept as they are."""
    leaves, spec = flatten(tree)
    return unflatten(spec, [fn(x) if isinstance(x, torch.Tensor) else x for x in leaves])


# NOTE [structure as data]
# A pytree's structure crosses processes (the wire's header) as plain data, never as pickled
# classes, so that a peer can only name classes this process already has:
#
#   leaf -> its index in ``flatten`` order
#   node -> [kind, data, children]
#     "tuple", "list"            data None
#     "dict", "OrderedDict"      data: the keys, children in the keys' (insertion) order
#     "defaultdict"              data: [the default factory's name (a builtin type) or None, keys]
#     "deque"                    data: maxlen
#     "namedtuple", "structseq"  data: [module, qualname, fields], found among the modules this
#                                process has already imported: a peer never makes it import one
#     "custom"                   data: [module, qualname, node data], found among the classes
#                                registered with optree in the namespace fpipe flattens with
#
# Keys and node data go through the caller's ``encode``/``decode`` (the wire's plain values). A
# class is built from its children by its own constructor or registered ``unflatten``, first with
# stand-ins for children, to read the structure (optree's and JAX's docs ask that ``unflatten``
# accept any children).

_FACTORIES: dict[str, Any] = {f.__name__: f for f in (list, dict, set, tuple, int, float, complex, str, bytes, bool)}
_KINDS = {
    optree.PyTreeKind.TUPLE: "tuple",
    optree.PyTreeKind.LIST: "list",
    optree.PyTreeKind.DICT: "dict",
    optree.PyTreeKind.ORDEREDDICT: "OrderedDict",
    optree.PyTreeKind.DEFAULTDICT: "defaultdict",
    optree.PyTreeKind.DEQUE: "deque",
    optree.PyTreeKind.NAMEDTUPLE: "namedtuple",
    optree.PyTreeKind.STRUCTSEQUENCE: "structseq",
    optree.PyTreeKind.CUSTOM: "custom",
}
_MAPPINGS = ("dict", "OrderedDict", "defaultdict")
_CLASSES = ("namedtuple", "structseq", "custom")


def structure_data(tree: PyTree, spec: TreeSpec, encode: Callable[[Any, str], Any]) -> Any:
    """The structure ``spec`` of ``tree`` as plain data (NOTE [structure as data]).

    ``encode(value, path)`` turns a key or a node's data found at key path ``path`` into plain data.

    Raises:
        TypeError: naming the key path, for a node that cannot be named to another process (a
            namedtuple defined in a function, a ``defaultdict`` whose factory is not a builtin
            type), or what ``encode`` raises.
    """
    counter = itertools.count()

    def walk(node: Any, spec: TreeSpec, path: str) -> Any:
        if spec.is_leaf():
            return next(counter)
        children, meta, entries, _ = optree.tree_flatten_one_level(node, **_OPTIONS)
        subtrees = [walk(c, s, f"{path}[{e!r}]") for c, s, e in zip(children, spec.children(), entries, strict=True)]
        kind, cls, here = _KINDS.get(spec.kind), spec.type, path or "<root>"
        data: Any = None
        if kind in _MAPPINGS:
            index = {key: i for i, key in enumerate(entries)}
            subtrees = [subtrees[index[key]] for key in node]  # in insertion order, as ``unflatten`` keeps it
            data = [encode(key, here) for key in node]
            if kind == "defaultdict":
                data = [_factory_name(node.default_factory, here), data]
        elif kind == "deque":
            data = encode(meta, here)
        elif kind in _CLASSES and cls is not None:
            if kind != "custom" and "<locals>" in cls.__qualname__:
                raise TypeError(
                    f"fpipe.step: a {kind} defined inside a function cannot be named to another rank "
                    f"(at {here}: {cls.__module__}.{cls.__qualname__}). Define it at module level."
                )
            data = [cls.__module__, cls.__qualname__, encode(meta, here) if kind == "custom" else _field_names(cls)]
        elif kind is None:
            raise TypeError(f"fpipe.step: a pytree node of this kind cannot travel between ranks (at {here}: {cls}).")
        return [kind, data, subtrees]

    return walk(tree, spec, "")


def _factory_name(factory: Any, path: str) -> str | None:
    name = getattr(factory, "__name__", "")
    if factory is not None and _FACTORIES.get(name) is not factory:
        raise TypeError(
            f"fpipe.step: a defaultdict's default factory cannot be named to another rank (at {path}: "
            f"{factory!r}). Use a builtin type such as list as the factory, or a dict."
        )
    return None if factory is None else str(name)


class _Slot:
    """A stand-in leaf: the ``index``-th leaf of a structure read from plain data."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def structure_from_data(data: Any, decode: Callable[[Any], Any]) -> TreeSpec:
    """Inverse of ``structure_data``; ``decode`` inverts its ``encode``.

    Raises:
        ValueError: ``data`` is no such structure (``decode`` raises it too), or its leaves are not
            numbered in the order this process flattens them.
        TypeError: it names a class this process does not have or has not registered with optree,
            or a namedtuple or structseq with other fields.
    """

    def build(data: Any, path: str) -> Any:
        if type(data) is int:
            return _Slot(data)
        here = path or "<root>"
        if not (type(data) is list and len(data) == 3 and type(data[2]) is list):
            raise ValueError(f"at {here}: neither a leaf index nor a [kind, data, children] node: {data!r:.80}")
        kind, meta, subtrees = data
        if kind in _MAPPINGS:
            factory, keys = _mapping_data(kind, meta, here)
            if len(keys) != len(subtrees):
                raise ValueError(
                    f"at {here}: a {kind} of {plural(len(subtrees), 'child')} with {plural(len(keys), 'key')}"
                )
            keys = [_hashable(decode(key), here) for key in keys]
            items = [(key, build(c, f"{path}[{key!r}]")) for key, c in zip(keys, subtrees, strict=True)]
            if kind == "defaultdict":
                return defaultdict(factory, items)
            return dict(items) if kind == "dict" else OrderedDict(items)
        children = [build(c, f"{path}[{i}]") for i, c in enumerate(subtrees)]
        if kind in ("tuple", "list") and meta is None:
            return tuple(children) if kind == "tuple" else children
        if kind == "deque":
            maxlen = decode(meta)
            if not (maxlen is None or (type(maxlen) is int and maxlen >= len(children))):
                raise ValueError(f"at {here}: a deque of {plural(len(children), 'child')} with maxlen {maxlen!r:.80}")
            return deque(children, maxlen)
        if kind in _CLASSES and type(meta) is list and len(meta) == 3:
            module, qualname, more = meta
            if type(module) is not str or type(qualname) is not str:
                raise ValueError(f"at {here}: a {kind}'s module and qualname are not strings")
            if kind == "custom":
                return _registered(f"{module}.{qualname}", here).unflatten_func(decode(more), children)
            cls = _imported(kind, module, qualname, here)
            if more != _field_names(cls) or len(children) != len(more):
                raise TypeError(
                    f"fpipe.step: a {kind} from the peer does not match the class here (at {here}: "
                    f"{module}.{qualname} with fields {more!r:.200} and {plural(len(children), 'child')}, here fields "
                    f"{_field_names(cls)}). Run the same code on every rank."
                )
            return cls(*children) if kind == "namedtuple" else cls(children)
        raise ValueError(f"at {here}: not a node: {data!r:.80}")

    slots, spec = flatten(build(data, ""))
    if [s.index if isinstance(s, _Slot) else None for s in slots] != list(range(len(slots))):
        raise ValueError("its leaves are not numbered 0, 1, ... in the order this rank flattens them")
    return spec


def _mapping_data(kind: str, meta: Any, path: str) -> tuple[Any, list[Any]]:
    """The default factory (``None`` but for a ``defaultdict``) and keys of a mapping node's data."""
    factory = None
    if kind == "defaultdict":
        named = type(meta) is list and len(meta) == 2 and (meta[0] is None or type(meta[0]) is str)
        if not (named and (meta[0] is None or meta[0] in _FACTORIES)):
            raise ValueError(f"at {path}: not a defaultdict's [factory, keys]: {meta!r:.80}")
        factory, meta = _FACTORIES.get(meta[0]), meta[1]
    if type(meta) is not list:
        raise ValueError(f"at {path}: a {kind}'s keys are not a list: {meta!r:.80}")
    return factory, meta


def _hashable(key: Any, path: str) -> Any:
    try:
        hash(key)
    except TypeError:
        raise ValueError(f"at {path}: an unhashable key {key!r:.80}") from None
    return key


def _registered(name: str, path: str) -> Any:
    """The optree registry entry of the class registered as ``name`` (``module.qualname``)."""
    registry = optree.register_pytree_node.get(None, namespace="")  # type: ignore[arg-type]  # None: all of them
    assert isinstance(registry, dict)
    entries = [entry for cls, entry in registry.items() if f"{cls.__module__}.{cls.__qualname__}" == name]
    if len(entries) != 1:
        raise TypeError(
            f"fpipe.step: a pytree node from the peer is not registered here (at {path}: {name}, registered "
            f"{plural(len(entries), 'time')}). Register the class with optree on every rank, in optree's global "
            f"namespace, before the step."
        )
    return entries[0]


def _imported(kind: str, module: str, qualname: str, path: str) -> type:
    """The namedtuple or structseq class ``module.qualname``, if that module is already imported."""
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        found = vars(found).get(part) if hasattr(found, "__dict__") else None  # no __getattr__ hook runs
    is_kind = optree.is_namedtuple_class if kind == "namedtuple" else optree.is_structseq_class
    if not (isinstance(found, type) and is_kind(found)):
        raise TypeError(
            f"fpipe.step: a {kind} from the peer is not defined here (at {path}: {module}.{qualname}). Import "
            f"the module that defines it on every rank before the step: fpipe never imports a module a peer names."
        )
    return found


def _field_names(cls: type) -> list[str]:
    if optree.is_namedtuple_class(cls):
        return list(optree.namedtuple_fields(cls))
    return list(optree.structseq_fields(cls))
