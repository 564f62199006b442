"""``fpipe.split_module``: cut an ``nn.Module`` into pure stage functions and per-stage parameters.

A stage is a list of *segments*, each a module name of the model (``"embed"``, ``"layers.3"``)
or a range of a ``ModuleList``/``Sequential`` (``"layers[0:4]"``, ``"layers[4:]"``); a stage may
also be written as one string, ``"embed + layers[0:4]"``. The stage calls its modules in order
through ``torch.func.functional_call``, each through an *adapter* ``call(module, x) -> x`` (NOTE
[adapters]). Its parameters are a flat dict keyed by the model's own parameter names.

NOTE [adapters]
    What flows between the modules of a model is often more than one tensor: a decoder layer
    takes the hidden states and an attention mask, position ids, a RoPE table. ``split_module``
    fixes no format. The activation ``x`` is any pytree (stage 0 receives the microbatch), and
    each called module goes through an adapter ``call(module, x) -> x`` where ``module(*args,
    **kwargs)`` runs that module with the stage's parameters. The default adapter is
    ``module(x)``. A convention that works for transformers: the activation is a dict
    ``{"hidden": h, **extras}``; the first adapter builds it from the batch, block adapters
    replace ``"hidden"`` and pass the extras on, the last one returns what ``loss_fn`` takes.
    Adapters are looked up by module name, the longest dotted prefix winning, so one adapter
    keyed ``"layers"`` serves ``layers.0``, ``layers.1``, ...; the key ``""`` is the default.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._plural import listing, plural
from ._functionalize import call_with

Adapter = Callable[[Callable[..., Any], Any], Any]
StageNames = str | Sequence[str]

# A module name is any text without brackets: ModuleDict keys may hold "-" or spaces ("conv-1").
_SEGMENT = re.compile(r"^(?P<name>[^\[\]]*?)(?:\[(?P<start>-?\d*)(?P<colon>:(?P<stop>-?\d*))?\])?$")
_PLAIN_NAME = re.compile(r"^[\w.]*$")


def split_module(
    model: nn.Module,
    stages: Sequence[StageNames],
    /,
    *,
    call: Adapter | Mapping[str, Adapter] | None = None,
) -> tuple[list[ModuleStage], list[dict[str, torch.Tensor]]]:
    """Cut ``model`` into stage functions and one parameter dict per stage.

    Args:
        model: the module to cut. It is not modified; stages call its submodules.
        stages: one entry per stage, each a list of segments or one string joining them with
            ``+``. A segment is a module name as in ``model.named_modules()`` (``"embed"``,
            ``"layers.3"``) or a range of a ``ModuleList``/``Sequential`` with Python's slice
            bounds (``"layers[0:4]"``, ``"layers[4:]"``, ``"layers[-1]"``); a ``ModuleList``
            (which has no ``forward``), named whole or in a range, stands for all its modules,
            nested ``ModuleList``s expanded too. A stage calls its segments' modules in the
            order written.
        call: how each module is called (NOTE [adapters] in ``fpipe/_modules/_split.py``): one adapter
            ``call(module, x) -> x`` for every module, or a mapping from module names to
            adapters, looked up by the longest dotted prefix of the called module's name
            (``"layers"`` serves ``layers.0``; ``""`` is the default). Without an adapter, a
            module is called as ``module(x)``. Inside an adapter, ``module(*args, **kwargs)``
            runs the module with the stage's parameters; ``module.module`` is the ``nn.Module``
            itself, for reading attributes (calling it directly would use its own parameters).

    Returns:
        ``(stages, params)``: ``stages[s](params[s], x) -> y`` is a pure function of the kind
        ``fpipe.pipeline`` takes, and ``params[s]`` maps the model's name of every trainable
        parameter the stage uses (as in ``model.named_parameters()``) to a detached alias of it.

    Conceptually, stage ``s`` computes::

        for name in stage_module_names[s]:               # segments expanded, in order
            x = adapter_of(name)(partial(functional_call, model.get_submodule(name), params[s]), x)
        return x

    Contracts:
        - Buffers and parameters with ``requires_grad=False`` are not in ``params``: stages read
          them from the model at each call, like ``fpipe.functionalize``. Which parameters are
          trainable is fixed when ``split_module`` is called.
        - Every trainable parameter of the model must be used by some stage.
        - A module belongs to one stage, once; a module without trainable parameters (a rotary
          embedding holding only buffers) may be named again in other stages.
        - A parameter shared by modules of several stages (tied input and output embeddings)
          appears in each of those stages' ``params`` under the same name. Their gradients
          are partial sums; ``fpipe.sum_tied`` adds them up.

    Examples:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        >>> stages, params = fpipe.split_module(model, ["0 + 1", ["2"]])
        >>> [sorted(p) for p in params]
        [['0.bias', '0.weight'], ['2.bias', '2.weight']]
        >>> step = fpipe.pipeline(lambda y, b: y.square().mean(), stages, fpipe.schedules.GPipe(2))

    Raises:
        TypeError: if ``model`` is not a module, or ``stages`` or ``call`` has the wrong type.
        ValueError: for a segment that is malformed, names no module, or selects no module; a
            module used twice; trainable parameters no stage uses; an adapter key naming no module.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fpipe.split_module: expected an nn.Module (model: {type(model).__name__}).")
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence) or not stages:
        raise TypeError(
            "fpipe.split_module: stages must be a non-empty list with one entry per stage, e.g. "
            f'[["embed", "layers[0:4]"], "layers[4:8] + norm + head"] (stages: {stages!r}).'
        )
    modules = dict(model.named_modules(remove_duplicate=False))
    adapters = _adapters(modules, call)
    segments = [_parse_stage(modules, s, spec) for s, spec in enumerate(stages)]
    _check_overlaps(segments)
    names = {id(p): name for name, p in model.named_parameters() if p.requires_grad}  # first name of each
    _check_coverage(segments, names)

    result_stages: list[ModuleStage] = []
    result_params: list[dict[str, torch.Tensor]] = []
    for s, stage_segments in enumerate(segments):
        calls: list[_Call] = []
        params: dict[str, torch.Tensor] = {}
        for segment in stage_segments:
            for name, module in segment.modules:
                local = []
                for local_name, p in module.named_parameters(remove_duplicate=False):
                    if p.requires_grad:
                        key = names[id(p)]
                        local.append((local_name, key))
                        params.setdefault(key, p.detach())
                calls.append(_Call(name, module, tuple(local), lookup(adapters, name)))
        result_stages.append(ModuleStage(s, tuple(seg.text for seg in stage_segments), tuple(calls), tuple(params)))
        result_params.append(params)
    return result_stages, result_params


class ModuleStage:
    """One stage built by ``fpipe.split_module``: ``stage(stage_params, x) -> y``.

    Attributes:
        index: the stage's position.
        segments: the segments as written (``"layers[0:4]"``).
        module_names: the modules it calls, in order (``"layers.0"``, ...).
        param_names: the keys ``stage_params`` must have, in order.
    """

    def __init__(
        self, index: int, segments: tuple[str, ...], calls: tuple[_Call, ...], param_names: tuple[str, ...]
    ) -> None:
        self.index = index
        self.segments = segments
        self.module_names = tuple(c.name for c in calls)
        self.param_names = param_names
        self._calls = calls

    def __repr__(self) -> str:
        return f"<fpipe.ModuleStage {self.index}: {' + '.join(self.segments)}>"

    def __call__(self, stage_params: Mapping[str, torch.Tensor], x: Any, /) -> Any:
        """Run the stage's modules in order on ``x`` with ``stage_params``."""
        if not isinstance(stage_params, Mapping):
            raise TypeError(
                f"fpipe stage {self.index}: stage_params must be the dict of parameters split_module returned "
                f"for this stage (got: {type(stage_params).__name__})."
            )
        missing = [k for k in self.param_names if k not in stage_params]
        unexpected = [k for k in stage_params if k not in set(self.param_names)]
        if missing or unexpected:
            raise ValueError(
                f"fpipe stage {self.index}: stage_params does not match the stage (missing: {listing(missing)}; "
                f"unexpected: {listing(unexpected)}). Pass params[{self.index}] as split_module returned it."
            )
        for c in self._calls:
            x = c.adapter(_BoundModule(c, stage_params), x)
        return x


class _BoundModule:
    """A submodule with the stage's parameters: calling it is ``functional_call``.

    Frozen parameters and buffers are read from the module at each call, so they follow
    ``model.to(...)``, ``model.train()``/``eval()`` and ``load_state_dict``.
    """

    def __init__(self, c: _Call, stage_params: Mapping[str, torch.Tensor]) -> None:
        self.module = c.module
        self._call = c
        self._stage_params = stage_params

    def __repr__(self) -> str:
        return f"<fpipe module {self._call.name!r} with stage parameters>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        params = ((local, self._stage_params[key]) for local, key in self._call.params)
        return call_with(self.module, params, args, kwargs, remove_duplicate=False)


@dataclass(frozen=True)
class _Call:
    name: str
    module: nn.Module
    params: tuple[tuple[str, str], ...]  # (name in the module, key in stage_params)
    adapter: Adapter


@dataclass(frozen=True)
class _Segment:
    stage: int
    text: str
    modules: tuple[tuple[str, nn.Module], ...]


def _default_adapter(module: Callable[..., Any], x: Any) -> Any:
    return module(x)


def adapter_map(function: str, call: Adapter | Mapping[str, Adapter] | None) -> Mapping[str, Adapter]:
    """``call`` as a mapping from module names to adapters (one adapter: the key ``""``)."""
    if call is None:
        return {}
    if isinstance(call, Mapping):
        return call
    if callable(call):
        return {"": call}
    raise TypeError(
        f"fpipe.{function}: call must be an adapter call(module, x) -> x or a dict from module names "
        f"to adapters (call: {call!r})."
    )


def _adapters(modules: Mapping[str, nn.Module], call: Adapter | Mapping[str, Adapter] | None) -> Mapping[str, Adapter]:
    """``call`` as a mapping from module names to adapters, checked against the model."""
    adapters = adapter_map("split_module", call)
    for key, adapter in adapters.items():
        if not isinstance(key, str) or key not in modules:
            raise ValueError(
                f"fpipe.split_module: call has an adapter for {key!r}, which names no module of the model. "
                f"{_suggestion(str(key), modules)}Key adapters by module name, e.g. 'layers'."
            )
        if not callable(adapter):
            raise TypeError(
                f"fpipe.split_module: the adapter for {key!r} is not callable (call[{key!r}]: {adapter!r})."
            )
    return adapters


def lookup(adapters: Mapping[str, Adapter], name: str) -> Adapter:
    """The adapter whose key is the longest dotted prefix of ``name`` (``""`` matches all)."""
    parts = name.split(".") if name else []
    for k in range(len(parts), -1, -1):
        key = ".".join(parts[:k])
        if key in adapters:
            return adapters[key]
    return _default_adapter


def _parse_stage(modules: Mapping[str, nn.Module], s: int, spec: Any) -> list[_Segment]:
    if isinstance(spec, str):
        texts = [t.strip() for t in spec.split("+")]
    elif isinstance(spec, range):  # what fpipe.balance returns for a list of layers
        raise TypeError(
            f"fpipe.split_module: stage {s} is a range of indices, not module names (stages[{s}]: {spec!r}). "
            f'Name the layers: "layers[{spec.start}:{spec.stop}]" for a ModuleList named layers, or pass '
            "fpipe.balance a dict of named layers (or the nn.Sequential itself), which gives names."
        )
    elif isinstance(spec, Sequence) and all(isinstance(t, str) for t in spec):
        texts = [t.strip() for t in spec]
    else:
        raise TypeError(
            f"fpipe.split_module: stage {s} must be a list of module names and ranges or one string joining "
            f'them with "+" (stages[{s}]: {spec!r}).'
        )
    if not any(texts):
        raise ValueError(f"fpipe.split_module: stage {s} names no module (stages[{s}]: {spec!r}). Give each stage one.")
    if not all(texts):
        raise ValueError(f"fpipe.split_module: stage {s} has an empty segment (stages[{s}]: {spec!r}).")
    return [_resolve(modules, s, text) for text in texts]


def _resolve(modules: Mapping[str, nn.Module], s: int, text: str) -> _Segment:
    """A segment's modules: one named module, or the children of a range."""
    match = _SEGMENT.match(text)
    if (
        match is None
        or (match["start"] == "" and not match["colon"])
        or (match["name"] not in modules and not _PLAIN_NAME.match(match["name"]))
    ):
        raise ValueError(
            f"fpipe.split_module: cannot read segment {text!r} of stage {s}. {_suggestion(text, modules)}Write a "
            "module name ('layers.3') or a range ('layers[0:4]', 'layers[4:]')."
        )
    name = match["name"]
    if name not in modules:
        top = [n for n in modules if n and "." not in n]
        raise ValueError(
            f"fpipe.split_module: the model has no module {name!r} (stage {s}: {text!r}). {_suggestion(name, modules)}"
            f"Its top-level modules: {listing(top)}."
        )
    module = modules[name]
    prefix = f"{name}." if name else ""
    if match["start"] is None:
        return _nonempty(s, text, _expand(name, module), f"{name!r} is an empty {type(module).__name__}")
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        raise ValueError(
            f"fpipe.split_module: {name!r} is a {type(module).__name__}, not a ModuleList or Sequential, so it "
            f"cannot be indexed (stage {s}: {text!r}). Name the module itself, or index a list of modules."
        )
    n = len(module)
    start = _bound(match["start"], 0, n)
    stop = _bound(match["stop"], n, n) if match["colon"] else start + 1
    if not (0 <= start <= n and 0 <= stop <= n):
        raise ValueError(
            f"fpipe.split_module: {text!r} of stage {s} is out of range: its list has {plural(n, 'module')} "
            f"(0 to {n - 1})."
        )
    if start >= stop:
        raise ValueError(
            f"fpipe.split_module: {text!r} of stage {s} selects no module ({name!r} has {n}). "
            "Give a non-empty range, or drop the segment."
        )
    selected = tuple(item for i in range(start, stop) for item in _expand(f"{prefix}{i}", module[i]))
    return _nonempty(s, text, selected, "its ModuleLists are empty")


def _nonempty(s: int, text: str, selected: tuple[tuple[str, nn.Module], ...], why_empty: str) -> _Segment:
    if not selected:
        raise ValueError(
            f"fpipe.split_module: {text!r} of stage {s} selects no module ({why_empty}). Drop the segment."
        )
    return _Segment(s, text, selected)


def _expand(name: str, module: nn.Module) -> tuple[tuple[str, nn.Module], ...]:
    """``module`` with its name, or for a ``ModuleList`` (no ``forward``) its modules in order, nested too."""
    if not isinstance(module, nn.ModuleList):
        return ((name, module),)
    prefix = f"{name}." if name else ""
    return tuple(item for i, m in enumerate(module) for item in _expand(f"{prefix}{i}", m))


def _bound(digits: str, default: int, n: int) -> int:
    """A slice bound as Python reads it (negative from the end), not yet checked against ``n``."""
    value = default if digits == "" else int(digits)
    return value + n if value < 0 else value


def _check_overlaps(segments: list[list[_Segment]]) -> None:
    """A module is called from one place only: no duplicate, no module inside another that is called."""
    seen: list[tuple[str, _Segment]] = []
    for segment in (seg for stage in segments for seg in stage):
        for name, module in segment.modules:
            for other, where in seen:
                inside = other == name or _contains(other, name) or _contains(name, other)
                if not inside or (other == name and not any(p.requires_grad for p in module.parameters())):
                    continue
                relation = "is named twice" if other == name else f"overlaps {other!r}"
                raise ValueError(
                    f"fpipe.split_module: module {name!r} {relation}: it is in stage {segment.stage} "
                    f"({segment.text!r}) and {other!r} in stage {where.stage} ({where.text!r}). "
                    "Put each module in one stage, once."
                )
            seen.append((name, segment))


def _contains(outer: str, inner: str) -> bool:
    return outer == "" or inner.startswith(outer + ".")


def _check_coverage(segments: list[list[_Segment]], names: dict[int, str]) -> None:
    """Every trainable parameter is used by some stage; otherwise name the modules left out."""
    used = {id(p) for stage in segments for seg in stage for _, m in seg.modules for p in m.parameters()}
    missing = {name for key, name in names.items() if key not in used}
    if not missing:
        return
    trainable = list(names.values())  # model order
    report: list[str] = []
    for name in (n for n in trainable if n in missing):
        parts = name.split(".")  # named by the outermost module whose trainable parameters are all missing
        outer = (".".join(parts[:k]) for k in range(1, len(parts)))
        owner = next((o for o in outer if all(n in missing for n in trainable if n.startswith(o + "."))), name)
        if owner not in report:
            report.append(owner)
    raise ValueError(
        f"fpipe.split_module: {len(missing)} trainable parameter(s) belong to no stage (modules or parameters: "
        f"{listing(report)}). Add them to a stage, or freeze them with requires_grad_(False)."
    )


def _suggestion(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, [c for c in candidates if c], n=1)
    return f"Did you mean {close[0]!r}? " if close else ""
