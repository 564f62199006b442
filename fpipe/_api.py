"""``fpipe.pipeline``: the transform from stage functions and a schedule to a step function."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from ._compile import Compile, CompiledRun, compile_option
from ._distributed import CompiledRows, Topology, WireState, resolve_topology, run_distributed
from ._microbatch import Microbatches
from ._parallelism import Parallelism, deprecated, parallelism_of
from ._plural import brief, plural
from ._precision import LossScaleState, Precision
from ._pytree import PyTree, leaves_with_paths, stage_list, tensor_map
from ._random import check_key, draw_key
from ._run import Order, order_for, run_local
from ._sharding import StageLayout
from ._stage import StageFn, not_inference
from ._strategy import Strategy
from .schedules import (
    Action,
    OneFOneB,
    Program,
    Schedule,
    ScheduleError,
    validate,
)
from .schedules._registry import BUILTINS


def pipeline(
    loss_fn: Callable[[Any, Any], Any],
    stages: Sequence[StageFn],
    schedule: Schedule | Program | Sequence[Sequence[Action | str]],
    /,
    *,
    has_aux: bool = False,
    batch_dims: PyTree = 0,
    weight_fn: Callable[[Any], Any] | None = None,
    split: Callable[[Any, int], Sequence[Any]] | None = None,
    recompute: bool | Collection[int] = False,
    parallel: Parallelism | None = None,
    precision: Precision | None = None,
    compile: bool | str | Callable[..., Any] | Compile = False,
    mesh: Any = None,
    group: Any = None,
    shard_params: bool | None = None,
    regather: bool | None = None,
    timeout: float | None = None,
) -> Step:
    """Turn stage functions and a schedule into ``step(params, batch) -> (loss, grads)``.

    Args:
        loss_fn: ``loss_fn(y, microbatch) -> loss`` (or ``(loss, aux)`` with ``has_aux``), where
            ``y`` is the last stage's output and ``loss`` a real scalar tensor. For the step to
            equal the unsplit model, it should be a mean over the microbatch's examples.
        stages: callables ``stage(stage_params, x) -> y``. Stage 0 receives the microbatch,
            stage ``s > 0`` the output of stage ``s - 1``; ``x`` and ``y`` are any pytrees whose
            leaves may be tensors of any dtype or non-tensors. Stages must be pure: no
            in-place updates of their params or inputs.
        schedule: a schedule value (``GPipe(8)``, ``OneFOneB(8)``, ``Interleaved1F1B(8)``, ...),
            a ``Program``, or a hand-written program: one list of actions per rank, e.g.
            ``[["0F0", "0B0"], ["1F0", "1B0"]]``. The number of ranks (virtual in one process)
            is the program's: one stage per rank for GPipe and 1F1B, ``stages_per_rank`` for
            interleaved schedules.
        has_aux: ``loss_fn`` returns ``(loss, aux)``; the step then returns ``((loss, aux),
            grads)`` where ``aux`` gathers the microbatches' aux: tensor leaves stacked along a
            new leading dimension of size ``num_microbatches`` (like ``jax.lax.scan``), other
            leaves as a tuple with one entry per microbatch.
        batch_dims: where to split the batch: an int for every tensor leaf (default 0), or a
            prefix pytree of the batch with an int or ``None`` per subtree (``None``: pass the
            leaf whole to every microbatch, e.g. a RoPE table). Non-tensor leaves always pass
            whole. ``batch`` may also be ``fpipe.Microbatches([mb0, mb1, ...])``: the microbatches
            as given (shapes may differ between them), one per microbatch of the schedule.
        weight_fn: ``weight_fn(microbatch) -> count`` (a non-negative int, or an integer tensor
            such as ``mask.sum()``): how many tokens of the microbatch count. ``loss_fn`` then
            returns the *sum* of its per-token losses, and the step divides by the count of the
            whole batch, summed over data-parallel replicas too: loss and grads are the per-token
            mean of everything, a replica with more tokens counting more (NOTE [loss weights] in
            ``fpipe/_run.py``). Evaluated on each microbatch, before the step runs, on the rank
            that holds the batch. Default: microbatches weigh by their number of examples.
        split: ``split(batch, num_microbatches) -> [mb0, mb1, ...]``: your own split of a batch
            (packing, length buckets), instead of cutting it along ``batch_dims``; the same as
            passing ``fpipe.Microbatches(split(batch, num_microbatches))`` as the batch.
        recompute: activation recomputation: ``True`` for every stage, or the indices of the
            stages that keep only their inputs after a forward and recompute it inside their
            backward (less memory, one more forward; results bitwise unchanged).
        parallel: where and how the step runs, an ``fpipe.Parallelism``: over a ``DeviceMesh``
            (``Parallelism(mesh=mesh)``: one pipeline rank per process along its ``"pp"``
            dimension, data-parallel replicas along ``"dp"``, each with its own batch, grads and
            loss averaged over them; DTensor stages along ``"tp"``) or a process group
            (``Parallelism(group=group)``), with ``shard_params`` (each stage's parameters
            sharded over the data-parallel ranks: ``params[s]`` and ``grads[s]`` are this rank's
            shards, cut by ``step.shard(params)``; the step all-gathers a stage's parameters
            before its first forward and reduce-scatters its gradients after its last backward,
            ``notes/sharding.md``), ``regather`` and the ``timeout`` a rank waits for a peer
            before raising ``PipelineTimeoutError``. ``None`` (default): ``Parallelism()``, the
            whole pipeline in this process. ``step.parallel`` holds it.
        precision: an ``fpipe.Precision``: the dtype stages compute in (master weights), the
            dtype gradients are summed in over microbatches (and replicas), the dtype they are
            returned in, and float16 loss scaling (``step.loss_scale``, ``step.last_skipped``).
            ``None`` (default): everything in the parameters' own dtypes.
        compile: run each step's whole program as one graph compiled by ``torch.compile``
            (``fullgraph=True``): ``True`` for Inductor, a backend's name (``"aot_eager"``) or
            callable, or an ``fpipe.Compile`` (a backend and Inductor's mode). The checks and
            the split stay eager; every forward and backward of every stage and the ordered
            gradient sums are traced once per batch structure (in one process a changed
            sequence length compiles once more, with a dynamic dimension). On a pipeline group
            each rank's row is one graph with its sends and receives inside it, its shapes
            dynamic (NOTE [compiled rows] in ``fpipe/_distributed/_compiled.py``); sharded
            parameters are gathered before it, and replicas reduce (or reduce-scatter) after
            it; tensor- and expert-parallel stages compile where dynamo traces their code;
            ``regather`` raises ``NotImplementedError``. Random draws are
            counted from the key, stage and microbatch (NOTE [counted draws] in
            ``fpipe/_random.py``: not the eager step's numbers). A step that cannot be traced
            (``.item()``, control flow on data in a stage, ``rand_like``) warns, naming the
            action, and runs eagerly (NOTE [the compiled step] in ``fpipe/_compile.py``;
            notes/compile.md).
        mesh: deprecated, the field of ``parallel``: accepted for one release with a
            ``DeprecationWarning`` (``parallel=fpipe.Parallelism(mesh=mesh, shard_params=True)``
            for ``mesh=mesh, shard_params=True``), as are the four below.
        group: deprecated, the field of ``parallel``.
        shard_params: deprecated, the field of ``parallel``.
        regather: deprecated, the field of ``parallel``.
        timeout: deprecated, the field of ``parallel``.

    When distributed, every rank calls ``step(params, batch)``: ``params[s]`` is ``None`` for
    the stages the rank does not hold (``step.local_stages`` lists those it does), ``batch``
    is needed on the rank of stage 0 only (the rank of the last stage may pass it too, which
    saves sending the microbatches to it; other ranks pass ``None``), ``grads[s]`` is ``None``
    for stages held elsewhere, and the loss (and aux) is returned on every rank.

    Returns:
        A ``Step``. ``step(params, batch)`` takes one parameter pytree per stage and returns
        ``(loss, grads)``: ``grads[s]`` has the structure of ``params[s]``, with the gradient of
        every floating or complex tensor leaf and ``None`` for other leaves.

    Conceptually, with microbatch sizes ``n_i`` summing to ``N``, a step computes::

        loss, grads = 0, zeros_like(params)
        for i, mb in enumerate(split(batch, num_microbatches, batch_dims)):
            loss_i, grads_i = torch.func.grad_and_value(
                lambda p: loss_fn(compose(stages)(p, mb), mb))(params)   # returns (grads, value)
            loss += n_i / N * loss_i            # the products added by one torch.sum
            grads += n_i / N * grads_i          # summed in microbatch order 0, 1, 2, ...

    but runs the stages' forwards and backwards in the order of the schedule, with explicit
    vector-Jacobian products. With a per-example mean loss this equals the full-batch loss and
    its gradient. User tensors are never mutated, their ``.grad`` is never touched, and the result
    does not depend on the ambient grad mode.

    Examples:
        >>> import torch, fpipe
        >>> from fpipe.schedules import OneFOneB
        >>> stages = [lambda p, x: x @ p, lambda p, x: torch.tanh(x @ p)]
        >>> loss_fn = lambda y, mb: ((y - mb) ** 2).mean()
        >>> step = fpipe.pipeline(loss_fn, stages, OneFOneB(num_microbatches=4))
        >>> params = [torch.randn(3, 3), torch.randn(3, 3)]
        >>> loss, grads = step(params, torch.randn(8, 3))
        >>> [g.shape for g in grads]
        [torch.Size([3, 3]), torch.Size([3, 3])]

    Raises:
        TypeError: if ``loss_fn`` or a stage is not callable, a stage is an ``nn.Module`` whose
            ``forward`` cannot take ``(params, x)`` (use ``fpipe.functionalize`` or
            ``fpipe.split_module``), ``schedule`` is a class rather than
            a schedule value, ``has_aux`` is not a bool, ``parallel`` is not an
            ``fpipe.Parallelism`` (or is given with the keywords it replaces), or ``precision`` is
            not an ``fpipe.Precision``; the deprecated keywords raise as ``fpipe.Parallelism`` does.
        ValueError: if ``recompute`` names no stages.
        ScheduleError: if the schedule cannot run with ``len(stages)`` stages (a hand-written
            program has as many stages as the largest stage it names, plus one).
    """
    if not callable(loss_fn):
        raise TypeError(
            f"fpipe.pipeline: loss_fn must be callable (loss_fn: {brief(loss_fn)}). "
            "Pass a function loss_fn(y, microbatch) -> loss, y being the last stage's output."
        )
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence) or not stages:
        raise TypeError(
            f"fpipe.pipeline: stages must be a non-empty list of callables stage(params, x) (stages: {brief(stages)}). "
            "Pass one function per stage, e.g. stages, params = fpipe.split_module(model, names)."
        )
    for s, fn in enumerate(stages):
        if not callable(fn):
            raise TypeError(
                f"fpipe.pipeline: stage {s} is not callable (stages[{s}]: {brief(fn)}). "
                "Pass a function stage(params, x) -> y for every stage."
            )
        if isinstance(fn, torch.nn.Module):
            _check_module_stage(s, fn)
    parallel = parallelism_of(
        "fpipe.pipeline",
        parallel,
        mesh=mesh,
        group=group,
        shard_params=shard_params,
        regather=regather,
        timeout=timeout,
    )
    if not isinstance(has_aux, bool):
        raise TypeError(f"fpipe.pipeline: has_aux must be True or False (has_aux: {brief(has_aux)}). Pass a bool.")
    if weight_fn is not None and not callable(weight_fn):
        raise TypeError(
            "fpipe.pipeline: weight_fn must be callable, weight_fn(microbatch) -> count "
            f"(weight_fn: {brief(weight_fn)}). "
            "Pass a function, or None to weigh microbatches by their examples."
        )
    if split is not None and not callable(split):
        raise TypeError(
            "fpipe.pipeline: split must be callable, split(batch, num_microbatches) -> microbatches "
            f"(split: {brief(split)}). Pass a function, or None to cut the batch along batch_dims."
        )
    if isinstance(recompute, bool):
        recompute = range(len(stages)) if recompute else ()
    if (
        isinstance(recompute, (str, bytes))
        or not isinstance(recompute, Collection)
        or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < len(stages) for s in recompute)
    ):
        raise ValueError(
            f"fpipe.pipeline: recompute must be a bool or stage indices in 0..{len(stages) - 1} "
            f"(recompute: {brief(recompute)}). Pass True, False or e.g. recompute={{0}}."
        )
    if precision is not None and not isinstance(precision, Precision):
        raise TypeError(
            f"fpipe.pipeline: precision must be an fpipe.Precision (precision: {brief(precision)}). "
            "Pass e.g. fpipe.Precision(compute=torch.bfloat16, accumulate=torch.float32)."
        )
    topology = resolve_topology(parallel.mesh, parallel.group)
    program = _program(schedule, len(stages), None if topology is None else topology.size)
    validate(program)
    if topology is not None and program.num_ranks != topology.size:
        raise ScheduleError(
            f"fpipe.pipeline: the program has {plural(program.num_ranks, 'rank')} but the pipeline group has "
            f"{plural(topology.size, 'process')}. Use a schedule and stage count that fit the group size."
        )
    spec = StepSpec(
        loss_fn,
        tuple(stages),
        program,
        has_aux=has_aux,
        batch_dims=batch_dims,
        weight_fn=weight_fn,
        split=split,
        recompute=frozenset(recompute),
        parallel=parallel,
        precision=precision,
        compile=compile_option(compile, _distributed_parts(topology, parallel, program)),
    )
    return Step(spec, topology)


def _check_module_stage(s: int, module: torch.nn.Module) -> None:
    """A module passed as stage ``s`` is called ``module(params, x)``: its forward must take two
    positional arguments (a module written as a stage may), or the call fails on the first
    microbatch with "forward() takes 2 positional arguments but 3 were given"."""
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):  # no signature to read (a builtin, a scripted forward): let it run
        return
    try:
        signature.bind(None, None)
    except TypeError:
        name = type(module).__name__
        raise TypeError(
            f"fpipe.pipeline: stage {s} is a torch.nn.Module whose forward cannot take (params, x) "
            f"(stages[{s}]: {name}, forward{signature}). Stages are pure functions stage(params, x) -> y: "
            "make one with fn, params = fpipe.functionalize(module) and pass fn, with params as its stage "
            "params, or cut a whole model with stages, params = fpipe.split_module(model, stages)."
        ) from None


def _distributed_parts(topology: Topology | None, parallel: Parallelism, program: Program) -> list[str]:
    """What a distributed step has that a compiled row cannot run (``compile_option``): ``[]``
    in one process, ``["nothing"]`` for a plain pipeline over a group."""
    if topology is None:
        return []
    regathered = topology.data_group is not None and parallel.regather
    return ["regathered sharded parameters"] if regathered else ["nothing"]


def _program(
    schedule: Schedule | Program | Sequence[Sequence[Action | str]], num_stages: int, num_ranks: int | None
) -> Program:
    if isinstance(schedule, type):
        raise TypeError(
            f"fpipe.pipeline: schedule is the class {schedule.__name__}, not a schedule (schedule: {brief(schedule)}). "
            f"Call it with the number of microbatches, e.g. {_example(schedule)}."
        )
    if isinstance(schedule, str):
        named = _NAMED.get("".join(c for c in schedule.lower() if c.isalnum()))
        fix = (
            f"Pass the schedule value: {_example(named)} (from fpipe.schedules import {named.__name__})"
            if named is not None
            else f"Pass a schedule value from fpipe.schedules, e.g. {_example(OneFOneB)} (built-ins: "
            + ", ".join(sorted({cls.__name__ for cls in _NAMED.values()}))
            + "), or one list of actions per rank, e.g. [['0F0', '0B0'], ['1F0', '1B0']]"
        )
        raise TypeError(f"fpipe.pipeline: schedule is a name, not a schedule (schedule: {brief(schedule)}). {fix}.")
    if isinstance(schedule, Program):
        program = schedule
    elif isinstance(getattr(schedule, "program", None), Program):  # a Searched, a Tuned: it holds the program
        raise TypeError(
            f"fpipe.pipeline: schedule is a {type(schedule).__name__} that holds a program, not a schedule "
            f"(schedule: {brief(schedule)}). Pass its program, e.g. found.program."
        )
    elif isinstance(schedule, Sequence):
        program = Program.from_lists(schedule)  # its stage count is the largest stage named, plus one
    elif callable(getattr(schedule, "program", None)):
        program = schedule.program(num_stages, num_ranks)
    else:
        raise TypeError(
            f"fpipe.pipeline: schedule must be a schedule such as OneFOneB(num_microbatches=8), a Program, "
            f"or one list of actions per rank (schedule: {brief(schedule)})."
        )
    if program.num_stages != num_stages:
        raise ScheduleError(
            f"fpipe.pipeline: the schedule's program has {plural(program.num_stages, 'stage')} but stages has "
            f"{plural(num_stages, 'function')} (len(stages): {num_stages}). Give one stage function per stage of "
            "the program."
        )
    return program


# The built-in schedules by the names the command line gives them (fpipe/schedules/_registry.py)
# and by their class names, lower case: only for the message of a schedule passed as a name, never
# to look one up.
_NAMED: dict[str, type[Schedule]] = {b.command: b.schedule for b in BUILTINS}
_NAMED.update({cls.__name__.lower(): cls for cls in list(_NAMED.values())})


def _example(cls: type) -> str:
    """A call that builds a ``cls``: ``OneFOneB(num_microbatches=8)`` (a looped one: 2 stages per rank)."""
    return f"{cls.__name__}(num_microbatches=8)"


def _check_not_meta(params: Sequence[PyTree], batch: PyTree, local_stages: Sequence[int]) -> None:
    """Raise if a parameter of a local stage or a batch leaf is on the ``meta`` device: it holds
    no data, and the step would return meta results without complaint."""
    if isinstance(batch, Microbatches):  # an opaque leaf to the pytree library: look inside
        batch = list(batch.microbatches)
    for s in [*local_stages, None]:
        tree = batch if s is None else params[s]
        if not tensor_map(_meta, tree).kept:
            continue  # names and key paths are built only for the error
        what, name = ("stage 0's batch leaf", "batch") if s is None else (f"stage {s}'s parameter", f"params[{s}]")
        paths, leaves, _ = leaves_with_paths(tree)
        i = next(i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.is_meta)
        raise ValueError(
            f"fpipe.step: {what} {paths[i]} is on the meta device and holds no data "
            f"({name}{paths[i]}: {leaves[i]!r}). Materialize it first (module.to_empty(device=...) and "
            "initialize it, or fpipe.load)."
        )


def _checked(
    step: Step, params: Sequence[PyTree], batch: PyTree, key: int | None, keep_outputs: bool
) -> tuple[PyTree, int]:
    """The batch (split by the step's ``split=``, if given) and the step's key, ``params``, both
    and ``evaluate``'s ``outputs`` (``keep_outputs``) checked: what depends on the data.

    Raises:
        TypeError, ValueError: for ``params`` that are not one pytree per stage, meta tensors,
            a key out of range, or ``outputs`` not a bool; the user's ``split`` may raise anything.
    """
    if not isinstance(keep_outputs, bool):
        raise TypeError(f"fpipe.step.evaluate: outputs must be True or False (outputs: {keep_outputs!r}).")
    stage_list("fpipe.step", "params", params, step.num_stages)
    if step.split is not None and batch is not None and not isinstance(batch, Microbatches):
        batch = Microbatches(step.split(batch, step.num_microbatches))
    _check_not_meta(params, batch, step.local_stages)
    return batch, draw_key() if key is None else check_key(key)


def _meta(leaf: torch.Tensor) -> tuple[torch.Tensor, bool]:
    return leaf, leaf.is_meta


@dataclass(frozen=True)
class StepSpec:
    """What ``pipeline`` validated, fixed for a step's life: ``step.spec``.

    Attributes:
        loss_fn: ``loss_fn(y, microbatch) -> loss`` (or ``(loss, aux)`` with ``has_aux``).
        stages: the stage functions, one per stage.
        program: the validated ``Program`` the step runs.
        has_aux: ``loss_fn`` returns ``(loss, aux)``.
        batch_dims: where the batch is split (an int, or a prefix pytree of the batch).
        weight_fn: the microbatches' token counts, or ``None`` (weighed by their examples).
        split: the user's split of a batch into microbatches, or ``None``.
        recompute: the stages that recompute their forward inside their backward.
        parallel: where and how the step runs, an ``fpipe.Parallelism``.
        precision: the ``fpipe.Precision`` policy, or ``None``.
        compile: how the step's program is compiled (``pipeline(..., compile=)``), or ``None``: eager.
    """

    loss_fn: Callable[[Any, Any], Any]
    stages: tuple[StageFn, ...]
    program: Program
    has_aux: bool
    batch_dims: PyTree
    weight_fn: Callable[[Any], Any] | None
    split: Callable[[Any, int], Sequence[Any]] | None
    recompute: frozenset[int]
    parallel: Parallelism
    precision: Precision | None
    compile: Compile | None = None


@dataclass
class StepState:
    """What a call or ``step.shard`` changes in a step, by name; everything else is its ``spec``.

    Attributes:
        loss_scale: under loss scaling, the ``LossScaleState`` the next call scales by (a frozen
            value, replaced by each call; ``None`` without loss scaling).
        last_skipped: whether the last call found ``inf``/``nan`` under loss scaling.
        shard_layouts: with ``shard_params``, the full shapes ``step.shard`` recorded.
        wire: distributed, the channels' layouts, kept from call to call so headers travel only
            when a layout changes (notes/wire.md).
    """

    loss_scale: LossScaleState | None
    last_skipped: bool = False
    shard_layouts: Mapping[int, StageLayout] = field(default_factory=lambda: MappingProxyType({}))
    wire: WireState = field(default_factory=WireState)


class Step:
    """The step function returned by ``fpipe.pipeline``: ``step(params, batch) -> (loss, grads)``.

    A step is a frozen ``spec`` (what ``pipeline`` validated: stages, program, options, its
    ``Parallelism`` and ``Precision``) and a small named state (the loss scale, the last skip,
    the shard layouts ``shard`` records, the wire's layouts); its attributes read them.

    Attributes:
        spec: the ``StepSpec``: every option ``pipeline`` was given, validated, fixed.
        parallel: the ``fpipe.Parallelism`` it runs on (``spec.parallel``); a save or load of
            its shards takes the step itself (``fpipe.save(..., parallel=step)``).
        program: the validated ``Program`` it runs.
        num_stages: the number of stages.
        num_microbatches: how many microbatches each batch is split into.
        rank: this process's pipeline rank (``None`` in one process).
        local_stages: the stages this process holds (all of them in one process).
        precision: the ``fpipe.Precision`` policy, or ``None``.
        loss_scale: with ``Precision(loss_scale=...)``, the ``LossScaleState`` the next call
            scales its backward by, updated by each call (``None`` without loss scaling). A
            plain value: save it with the parameters and assign it back to resume.
        last_skipped: whether the last call found ``inf``/``nan`` in a gradient (of any stage,
            on any rank) under loss scaling: the caller must then skip its update. Every rank
            reports the same. Always ``False`` without loss scaling.

    ``loss_fn``, ``stages``, ``has_aux``, ``batch_dims``, ``weight_fn``, ``split`` and
    ``recompute`` read ``spec``; ``timeout``, ``shard_params`` and ``regather`` read ``parallel``.
    """

    def __init__(self, spec: StepSpec, topology: Topology | None) -> None:
        self.spec = spec
        # The parallel strategy, composed once here and handed to every run (fpipe/_strategy.py);
        # with weight_fn each replica's share is already over the total, so replicas sum.
        self._strategy = Strategy(topology, spec.parallel, spec.weight_fn is None, spec.precision)
        scaling = None if spec.precision is None else spec.precision.loss_scale
        self._state = StepState(None if scaling is None else scaling.start())
        self._topology = topology
        self._rank = None if topology is None else topology.rank
        program = spec.program
        self._local_stages = tuple(range(program.num_stages)) if topology is None else program.stages_of(topology.rank)
        self._order = order_for(program, self._rank)
        self._forward_order = order_for(program, self._rank, forward=True)
        # NOTE [the compiled step] in fpipe/_compile.py; on a rank, NOTE [compiled rows]
        self._compiled = None if spec.compile is None or topology is not None else CompiledRun(spec.compile)
        self._compiled_rows = None if spec.compile is None or topology is None else CompiledRows(spec.compile)

    # What pipeline() fixed (``spec``), read-only.
    @property
    def loss_fn(self) -> Callable[[Any, Any], Any]:
        return self.spec.loss_fn

    @property
    def stages(self) -> tuple[StageFn, ...]:
        return self.spec.stages

    @property
    def program(self) -> Program:
        return self.spec.program

    @property
    def has_aux(self) -> bool:
        return self.spec.has_aux

    @property
    def batch_dims(self) -> PyTree:
        return self.spec.batch_dims

    @property
    def weight_fn(self) -> Callable[[Any], Any] | None:
        return self.spec.weight_fn

    @property
    def split(self) -> Callable[[Any, int], Sequence[Any]] | None:
        return self.spec.split

    @property
    def recompute(self) -> frozenset[int]:
        return self.spec.recompute

    @property
    def parallel(self) -> Parallelism:
        return self.spec.parallel

    @property
    def precision(self) -> Precision | None:
        return self.spec.precision

    @property
    def num_stages(self) -> int:
        return self.spec.program.num_stages

    @property
    def counted_draws(self) -> bool:
        """Whether the stages' random draws are counted (a compiled step's, NOTE [counted draws]
        in fpipe/_random.py), rather than drawn from torch's seeded generators."""
        return self.spec.compile is not None

    @property
    def num_microbatches(self) -> int:
        return self.spec.program.num_microbatches

    @property
    def timeout(self) -> float:
        return self.spec.parallel.timeout

    @property
    def shard_params(self) -> bool:
        return self.spec.parallel.shard_params

    @property
    def regather(self) -> bool:
        return self.spec.parallel.regather

    @property
    def rank(self) -> int | None:
        return self._rank

    @property
    def local_stages(self) -> tuple[int, ...]:
        return self._local_stages

    @property
    def shared_stages(self) -> tuple[int, ...]:
        """The stages this process holds with other processes (DualPipe's: NOTE [a stage on several
        ranks] in fpipe/schedules/_program.py); empty in one process."""
        program = self.program
        return () if self._rank is None else tuple(s for s in self._local_stages if len(program.holders(s)) > 1)

    def __repr__(self) -> str:
        p = self.program
        return (
            f"<fpipe.Step: {plural(p.num_stages, 'stage')}, {plural(p.num_microbatches, 'microbatch')}, "
            f"{plural(p.num_ranks, 'rank')}>"
        )

    # The step is an interpreter of Python data (programs, pytrees, autograd calls) with an eager
    # prologue: torch.compile(step) runs it as it is, and pipeline(..., compile=) compiles its
    # whole program (NOTE [the compiled step] in fpipe/_compile.py).
    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def __call__(
        self, params: Sequence[PyTree], batch: PyTree, /, *, key: int | None = None
    ) -> tuple[Any, list[PyTree]]:
        """Run one step: the loss (or ``(loss, aux)``) and one gradient pytree per stage.

        Random draws inside the stages (dropout) are a function of ``key``, the stage, the
        microbatch and the data-parallel replica, never of the schedule's order, the process
        count or recomputation (NOTE [randomness as data] in ``fpipe/_random.py``): every
        schedule gives bitwise the same results. Without ``key`` the step draws one from torch's
        default generator (``torch.manual_seed`` fixes it; ``save_state`` resumes it);
        distributed, every rank uses the key of the first stage's rank (of replica 0).

        Stage functions may be ``torch.compile``'d (forward and backward run compiled, and
        dynamic shapes avoid recompiling when the sequence length changes); ``torch.compile``
        of the step itself runs the step as it is: eagerly, or its compiled program when built
        with ``pipeline(..., compile=...)``.

        Raises:
            TypeError, ValueError: if ``params`` is not one pytree per stage, a parameter of a
                stage this process holds or a batch leaf is on the ``meta`` device, or the batch
                cannot be split as ``batch_dims`` says.
        """
        (loss, aux, _), grads = self._run(self._order, params, batch, key=key, keep_outputs=False)
        # With a precision policy: unscaled and cast; under loss scaling, the next state and the skip, agreed.
        state = self._state
        grads, state.loss_scale, state.last_skipped = self._strategy.unscale(
            params, grads, self.local_stages, state.loss_scale
        )
        return ((loss, aux), grads) if self.has_aux else (loss, grads)

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def evaluate(
        self, params: Sequence[PyTree], batch: PyTree, /, *, outputs: bool = False, key: int | None = None
    ) -> Any:
        """The loss (or ``(loss, aux)``) of a forward-only step, and with ``outputs`` the last stage's outputs.

        Runs the forwards of the step's schedule in its order (each rank's row kept to its
        ``F`` actions) with no graph recorded: no activation is kept past the next stage, no
        backward runs, no gradient is made, so a rank holds one microbatch's activations at a
        time. The loss is bitwise that of ``step(params, batch)`` (same microbatches, same
        weights, the same sum), and averaged over data-parallel replicas like it.

        Conceptually::

            loss, ys = 0, []
            for i, mb in enumerate(split(batch, num_microbatches, batch_dims)):
                with torch.no_grad():
                    y = compose(stages)(params, mb)
                loss += n_i / N * loss_fn(y, mb)
                ys.append(y)
            outputs = torch.cat(ys)             # per tensor leaf, along dim 0

        Args:
            params: one parameter pytree per stage, as ``step`` takes them.
            batch: the batch, as ``step`` takes it.
            outputs: also return the last stage's outputs for the whole batch: the microbatches'
                outputs stitched back in example order (tensor leaves concatenated along dim 0,
                which must be their batch dimension; other leaves as a tuple per microbatch), or
                for a batch given as ``fpipe.Microbatches``, a list of each microbatch's output.
                Distributed, they are returned on every rank, as the loss is (the rank of the
                first stage, which holds the batch, can then build the next batch from them,
                as greedy sampling does); data-parallel replicas each get their own batch's.
            key: the key of the stages' random draws, as for ``step`` (``stage_info().training``
                is ``False`` here).

        Returns:
            ``loss`` (``(loss, aux)`` with ``has_aux``), or ``(loss, outputs)`` (``((loss, aux),
            outputs)``) with ``outputs=True``.

        Raises:
            TypeError, ValueError: as ``step`` does for its inputs. With ``shard_params=True``
                ``params`` are the shards, as ``step`` takes them (each stage is gathered for its
                forwards; no reduce-scatter runs).
        """
        (loss, aux, ys), _ = self._run(self._forward_order, params, batch, key=key, keep_outputs=outputs)
        result = (loss, aux) if self.has_aux else loss
        return (result, ys) if outputs else result

    def _run(
        self, order: Order, params: Sequence[PyTree], batch: PyTree, *, key: int | None, keep_outputs: bool
    ) -> tuple[tuple[torch.Tensor, Any, Any], list[PyTree]]:
        """Check the inputs and run ``order`` here or distributed: ``((loss, aux, outputs), grads)``.

        Distributed, what the checks find wrong is raised after the step's handshake, so that
        every rank fails (NOTE [a handshake of fixed size] in fpipe/_distributed/_rank_step.py).
        """
        rejected = None
        try:
            batch, key = _checked(self, params, batch, key, keep_outputs)
        except Exception as error:  # the user's split may raise anything
            if self._topology is None:
                raise
            rejected, key = error, 0
        strategy = self._sharded_strategy()
        with not_inference():  # results are plain tensors whatever the ambient mode
            if self._topology is None:
                local = run_local if self._compiled is None else self._compiled  # NOTE [the compiled step]
                return local(self, order, strategy, params, batch, key=key, keep_outputs=keep_outputs)
            return run_distributed(
                self,
                order,
                self._topology,
                self._state.wire,
                params,
                batch,
                strategy=strategy,
                key=key,
                rejected=rejected,
                keep_outputs=keep_outputs,
                compiled=self._compiled_rows,
            )

    def _sharded_strategy(self) -> Strategy:
        """The step's strategy with the shard layouts its state holds (the strategy as built
        when there are none)."""
        layouts = self._state.shard_layouts
        return self._strategy.with_layouts(layouts) if layouts else self._strategy

    @property
    def loss_scale(self) -> LossScaleState | None:
        """The loss scaling state of the next call (see the class docstring); assignable to resume."""
        return self._state.loss_scale

    @loss_scale.setter
    def loss_scale(self, state: LossScaleState) -> None:
        if self._state.loss_scale is None:
            raise ValueError(
                "fpipe.Step.loss_scale: this step does not scale its loss. Build it with "
                "pipeline(..., precision=fpipe.Precision(compute=torch.float16, loss_scale=fpipe.LossScale()))."
            )
        if not isinstance(state, LossScaleState):
            raise TypeError(f"fpipe.Step.loss_scale: expected an fpipe.LossScaleState (loss_scale: {state!r}).")
        self._state.loss_scale = state

    @property
    def last_skipped(self) -> bool:
        """Whether the last call found ``inf``/``nan`` under loss scaling (see the class docstring)."""
        return self._state.last_skipped

    @property
    def topology(self) -> Topology | None:
        """Where this process sits (its pipeline and data-parallel groups, its device); ``None``
        in one process. Read-only: saving and sharding read it."""
        return self._topology

    @property
    def shard_layouts(self) -> Mapping[int, StageLayout]:
        """With ``shard_params``: the full shapes and dtypes of the local stages' parameters,
        recorded by ``shard`` (empty before). A read-only view."""
        return self._state.shard_layouts

    def global_norm(self, grads: Sequence[PyTree], /) -> torch.Tensor:
        """The 2-norm of all gradients of the pipeline, for clipping, on every rank: a norm
        function for ``fpipe.optim.clip_by_global_norm`` (``Strategy.global_norm``, over the
        mesh by ``norm_over``).

        Each rank holds only its stages' gradients, so the local sums of squares are summed over
        the pipeline group (data-parallel replicas hold the same averaged gradients). With
        ``shard_params`` each replica holds only its shards of them, so the sums are also summed
        over the data-parallel group (padding is zero and adds nothing). With a ``"tp"`` mesh
        dimension the sums are also summed over the tensor-parallel group, each DTensor shard
        counted once and each replicated gradient (plain, or ``Replicate``) on one rank only
        (with ``shard_params`` too: the plain shards of a DTensor's local piece count as it does).
        With an ``"ep"`` dimension each rank's block of experts (a DTensor on ``mesh["ep"]``)
        counts once, on tensor-parallel rank 0, and the blocks are summed over the expert group;
        dense gradients, the same on every ep rank, count once (notes/experts.md). A stage on
        several ranks (DualPipe), whose holders hold the same summed gradients, counts once, on its
        first holder.
        """
        program, rank = self.program, self._rank
        counted = [s for s in self.local_stages if rank is None or program.holders(s)[0] == rank]
        return self._sharded_strategy().global_norm(counted, grads)

    def replica_sum(self, tree: PyTree, /) -> PyTree:
        """``tree``'s tensor leaves summed over the step's replicas, on every rank: a collective.

        The replicas are the ranks that hold this rank's stages (the same pipeline and
        tensor-parallel coordinates) and ran batches of their own: the data-parallel ranks and
        the expert-parallel ones (notes/experts.md). A step returns what ``has_aux`` gathers per
        replica; this sums such a metric over the job, as ``jax.lax.psum`` over the data axes
        would, e.g. a mixture of experts' token counts for DeepSeek-V3's bias update::

            (loss, counts), grads = step(params, batch)  # counts: [num_microbatches, E] per replica
            counts = step.replica_sum(counts.sum(0))  # the global batch's tokens per expert

        Every replica must call it with the same structure and dtypes. In one process, or
        without replicas, ``tree`` as it is. Non-tensor leaves are kept as they are.
        """
        return self._strategy.replica_sum(tree)

    def shard(self, params: Sequence[PyTree], /) -> list[PyTree]:
        """This rank's shards of full per-stage parameters, for a step built with
        ``parallel=fpipe.Parallelism(mesh=mesh, shard_params=True)``.

        ``params`` has one full pytree per stage, as an unsharded step takes them (entries for
        stages held elsewhere are ignored and may be ``None``). Each tensor leaf of ``n`` elements
        becomes a 1-D tensor of ``ceil(n / d)`` elements (NOTE [shard layout] in
        ``fpipe/_sharding/_stages.py``). The full shapes and dtypes are recorded in the step's
        state (``step.shard_layouts``), which ``gather``, the step and a save of the shards
        (``fpipe.save(..., parallel=step)``) need; tensors on the ``meta`` device will do when
        only shapes are known. No communication.

        On each rank of a mesh with a ``"dp"`` dimension::

            shards = step.shard(params)
            loss, grads = step(shards, batch)  # grads[s]: shards, like shards[s]
            shards = [update(p, g) for p, g in zip(shards, grads)]  # the optimizer sees shards only
        """
        shards, self._state.shard_layouts = self._strategy.shard(self, params)
        return shards

    def gather(self, shards: Sequence[PyTree], /) -> list[PyTree]:
        """The full per-stage pytrees of ``shards`` (parameters, grads or optimizer state shaped
        like them), all-gathered over the data-parallel group: a collective, for checks.

        ``fpipe.gather(shards[s], like, step)`` of each local stage with the full shapes
        ``step.shard`` recorded as ``like``, on the same code (``gather_tree`` in
        fpipe/_sharding/_stages.py). ``None`` leaves (the grads of non-float leaves) stay
        ``None``; stages held elsewhere are ``None``.
        """
        return self._sharded_strategy().gather(self, shards)

    def unshard(self, shards: Sequence[PyTree], /) -> list[PyTree]:
        """Deprecated: ``step.gather(shards)``, under its old name (one release, with a ``DeprecationWarning``)."""
        deprecated("fpipe.Step.unshard(shards)", "step.gather(shards), its new name")
        return self.gather(shards)
