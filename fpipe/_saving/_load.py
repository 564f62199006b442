"""``fpipe.load``: a save read into the layout of a template, checked against it and the files.

A template is a params-shaped list, one pytree per stage, whose tensor leaves say what to read
(NOTE [names] in ``fpipe/_saving/_save.py``: the stage index is not part of a name, so any number of
stages and any grouping of them loads the same save) and what it must look like. Each rank reads
only the tensors its template names, verified by ``fpipe/_saving/_store.py`` (sizes, dtypes, shapes,
sha256). Loading needs no communication; distributed (``parallel=``) the ranks
all-gather their names once, so that names in the save that no rank loads are found, and once
their outcome, so that a file one rank cannot read fails every rank (``agree``): a load succeeds on
every rank or raises on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar, cast

from .._distributed import Topology
from .._parallelism import Parallelism
from .._pytree import PyTree, stage_list
from .._sharding import ParallelView
from ._directory import committed
from ._index import read_index
from ._ranks import Ranks, Setup, Sharding, agree, resolve, sharded_leaves
from ._store import DTYPES, MAPS, entry, read_tensors
from ._template import Use, dtype_name, fill, label, listing, template_uses


class Loaded(NamedTuple):
    """What ``fpipe.load`` returns: ``params, optimizer_state, metadata = fpipe.load(...)``."""

    params: list[PyTree]
    optimizer_state: list[PyTree] | None
    metadata: dict[str, Any]


def load(
    directory: str | os.PathLike[str],
    template: Sequence[PyTree],
    /,
    *,
    optimizer_state: Sequence[PyTree] | None = None,
    strict: bool = True,
    parallel: Parallelism | ParallelView | None = None,
    step: Any = None,
    group: Any = None,
    mesh: Any = None,
    timeout: float | None = None,
) -> Loaded:
    """Load a save into the layout of ``template``, as new tensors, checked against it.

    ``template`` says which tensors to read and where they go: one pytree per stage, for any
    number of stages (a save made with 4 stages loads into 2, 1, or an interleaved layout: only
    names matter, NOTE [names] in ``fpipe/_saving/_save.py``), ``None`` for the stages this rank does not
    hold. Before anything is read, every name of the template must be in the save with the same
    shape and dtype; then each rank reads only its tensors (safetensors' ``safe_open`` reads them
    one by one), checks each file's size and each tensor's dtype, shape and sha256 against the
    index, and returns them on the template leaves' devices.

    Args:
        directory: a directory passed to ``save`` (its ``latest`` version is read) or a version
            directory that ``save`` returned. A directory without a committed index is refused.
        template: one pytree per stage whose leaves are tensors (they give the expected shape and
            dtype, and the device of the result; ``device="meta"`` tensors load to the CPU) or
            ``None`` (kept as is). The result has the template's structure. A DTensor leaf (on
            the meta device too) gets a DTensor with its mesh and placements around this rank's
            piece (``Shard`` or ``Replicate``), whatever layout the save had: a save from a
            tensor-parallel mesh loads into plain tensors and the other way round (NOTE
            [tensor-parallel saves] in ``fpipe/_saving/_boxes.py``). Expert weights likewise: a
            ``Shard(0)`` DTensor on ``mesh["ep"]`` gets its block of experts, from a save at any
            expert-parallel size, a plain tensor every expert; with ``parallel=``, an expert
            template whose experts its ep ranks do not divide is refused.
        optimizer_state: a template for the optimizer state, to load it too.
        strict: names in the save that no stage of the template has (on any rank, when
            distributed) are an error; ``strict=False`` ignores them. Names of the template that
            are missing from the save are always an error.
        parallel: when distributed, the ranks whose templates together cover the save: the
            ``Step`` or an ``fpipe.Parallelism`` (as in ``save``; only ``strict`` needs them), whose
            ``timeout`` is the seconds a rank waits for the others while gathering names.
            With a step built with ``shard_params=True``, the template is this rank's shards
            (``step.shard`` of meta tensors of the full shapes) and the result is the step's
            shards, re-cut from a save made with any data-parallel size or none
            (NOTE [sharded saves] in ``fpipe/_saving/_store.py``); on a mesh with a ``"tp"``
            dimension too, a DTensor parameter's shard is cut from its local piece, read from
            whatever boxes and shards the save has (``parallel=step``: the step knows the shards).
        step: deprecated, as for ``fpipe.save``: ``parallel=``.
        group: deprecated, as for ``fpipe.save``: ``parallel=``.
        mesh: deprecated, as for ``fpipe.save``: ``parallel=``.
        timeout: deprecated, as for ``fpipe.save``: ``parallel=``.

    Returns:
        ``Loaded(params, optimizer_state, metadata)``: tensors in the template's structure (plain
        tensors, not requiring grad; a name in several stages gives each stage its own copy),
        ``optimizer_state`` likewise or ``None`` without a template for it, and the ``metadata``
        dict given to ``save`` as JSON gives it back (tuples become lists).

    Examples:
        >>> import tempfile, torch, fpipe
        >>> directory = tempfile.mkdtemp()
        >>> _ = fpipe.save(directory, [{"a": torch.ones(2)}, {"b": torch.zeros(3)}, {"c": torch.ones(1)}])
        >>> params, _, _ = fpipe.load(directory, [{"a": torch.empty(2), "b": torch.empty(3)}, {"c": torch.empty(1)}])
        >>> params
        [{'a': tensor([1., 1.]), 'b': tensor([0., 0., 0.])}, {'c': tensor([1.])}]

    Raises:
        FileNotFoundError: ``directory`` holds no committed save.
        TypeError: a template leaf is neither a tensor nor ``None``, or a DTensor with a ``Partial`` placement.
        ValueError: names of the template missing from the save, with ``strict`` names of the
            save missing from the template, a shape or dtype that differs (each named with its
            key path, the value on disk and the expected one), or a file that is truncated or
            corrupt, or an index whose pieces of a tensor do not cover it exactly once, or an
            expert weight's template whose experts the expert-parallel ranks do not divide.
        RuntimeError: another rank failed (with ``parallel=``): the message names
            the rank and the first line of its error, which names the file.
    """
    setup = resolve("load", parallel, step=step, group=group, mesh=mesh, timeout=timeout)
    return load_then(
        directory, template, lambda loaded, _: loaded, optimizer_state=optimizer_state, strict=strict, setup=setup
    )


def load_then(
    directory: str | os.PathLike[str],
    template: Sequence[PyTree],
    then: Callable[[Loaded, Topology | None], T],
    /,
    *,
    optimizer_state: Sequence[PyTree] | None,
    strict: bool,
    setup: Setup,
    function: str = "load",
) -> T:
    """``then(loaded, topology)`` of what ``load`` reads, run on every rank before the ranks agree
    on their outcome: it (``load_state``: reading this rank's training state) may raise on one
    rank, and every rank raises (``agree``); the arguments as ``load`` takes them, ``function``
    names the caller; ``setup`` is where it runs (``resolve``)."""
    topology = setup.topology
    ranks = Ranks(function, topology, setup.timeout, all_replicas=True)
    trees: dict[str, list[PyTree]] = {}
    root, index, wanted, problem = Path(), {}, {}, None
    try:  # what one rank finds wrong here, every rank raises (``agree``)
        root = Path(directory)
        trees["params"] = stage_list("fpipe.load", "template", template)
        if optimizer_state is not None:
            trees["optimizer_state"] = stage_list("fpipe.load", "optimizer_state", optimizer_state)
        sharding = sharded_leaves("load", setup.step, trees)
        root = committed(root)
        index = read_index(root)
        experts = None if topology is None else topology.expert_ranks
        wanted = {kind: _wanted(root, index, kind, kind_trees, sharding, experts) for kind, kind_trees in trees.items()}
    except (TypeError, ValueError, OSError) as error:
        problem = error
    names = {kind: sorted(uses) for kind, uses in wanted.items()}
    statuses = agree(ranks, problem, {"names": names}, "reading their templates")
    if strict:
        for kind in trees:
            everywhere = {name for st in statuses for name in st["names"][kind]}
            extra = sorted(set(index[MAPS[kind]]) - everywhere)
            if extra:
                any_rank = " on any rank" if ranks.size > 1 else ""
                raise ValueError(
                    f"fpipe.load: the save at {root} has {len(extra)} {_KIND_NAMES[kind]} name(s) that no stage of the "
                    f"template{any_rank} has: {listing([repr(n) for n in extra])}. Add them to the template, or "
                    "pass strict=False to leave them out."
                )
    result, failure = None, None
    try:
        out = {}
        for kind, kind_trees in trees.items():
            requests = list(
                dict.fromkeys((name, use.part) for name, uses in sorted(wanted[kind].items()) for use in uses)
            )
            out[kind] = fill(kind_trees, wanted[kind], read_tensors(root, index, kind, requests))
        user = dict(index["metadata"].get("user", {}))
        result = then(Loaded(out["params"], out.get("optimizer_state"), user), topology)
    except Exception as error:  # a file missing, truncated or corrupt on one rank fails every rank
        failure = error
    agree(ranks, failure, {}, "reading the save")
    return cast(T, result)


def _wanted(
    root: Path,
    index: dict[str, Any],
    kind: str,
    trees: Sequence[PyTree],
    sharding: Sharding | None,
    expert_ranks: Sequence[int] | None,
) -> dict[str, list[Use]]:
    """Each name the template of ``kind`` needs, with the leaves it fills, checked against the index."""
    wanted = template_uses("fpipe.load", kind, trees, sharding, expert_ranks)
    if MAPS[kind] not in index:
        raise ValueError(f"fpipe.load: the save at {root} has no {label(kind)}; it was saved without it.")
    saved = index[MAPS[kind]]
    missing = [f"{name!r} ({uses[0].where})" for name, uses in sorted(wanted.items()) if name not in saved]
    if missing:
        raise ValueError(
            f"fpipe.load: {len(missing)} name(s) of the {label(kind)} are missing from the save at {root}: "
            f"{listing(missing)}. The save has {listing([repr(n) for n in sorted(saved)])}."
        )
    mismatches = []
    for name, uses in sorted(wanted.items()):
        e = entry(index, kind, name)
        for use in uses:
            for what, on_disk, expected in [
                ("shape", e.shape, use.full_shape),
                ("dtype", dtype_name(DTYPES.get(e.dtype, e.dtype)), dtype_name(use.leaf.dtype)),
            ]:
                if on_disk != expected:
                    mismatches.append(f"  {use.where} (name {name!r}): {what} on disk {on_disk}, expected {expected}")
    if mismatches:
        raise ValueError(f"fpipe.load: the {label(kind)} does not match the save at {root}:\n" + "\n".join(mismatches))
    return wanted


T = TypeVar("T")
_KIND_NAMES = {"params": "parameter", "optimizer_state": "optimizer state"}
