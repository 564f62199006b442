"""The error contract (STYLE.md, point 8): each public entry point's argument errors, in one place.

Each case calls one public function with one wrong argument and matches a short fragment of the
message: ``fpipe.<function>: <what is wrong> (<name>: <value>). <how to fix>.`` (deeper cases,
with data or many processes, stay with their modules' tests). ``PipelineError``'s own contract,
the action, stage, microbatch and rank it names, closes the file.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fpipe
from fpipe._cli import SCHEDULES
from fpipe.planning import Searched, search
from fpipe.schedules import Action, Costs, GPipe, OneFOneB, ScheduleError


def _stage(params: Any, x: torch.Tensor) -> torch.Tensor:
    return x * params


def _loss(y: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return y.sum()


def _pipeline(**options: Any) -> fpipe.Step:
    return fpipe.pipeline(_loss, [_stage, _stage], GPipe(2), **options)


def _step(params: Any, batch: Any = None, **options: Any) -> Any:
    return _pipeline(**options)(params, torch.ones(4, 3) if batch is None else batch)


TWO = [torch.ones(()), torch.ones(())]


@functools.cache
def _searched() -> Searched:
    """A search result whose repr is long (about 10,000 characters): what a message must not print whole."""
    found = search(2, 16, Costs(forward=1.0, backward_input=1.0, backward_weight=1.0), placement="v", exact=False)
    assert len(repr(found)) > 5000
    return found


# (what, call, exception, fragment)
CASES: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    # fpipe.pipeline: what needs no data fails when the step is built
    (
        "loss_fn",
        lambda: fpipe.pipeline(1, [_stage], GPipe(2)),
        TypeError,
        "loss_fn must be callable (loss_fn: 1, type int). Pass a function loss_fn(y, microbatch)",
    ),
    ("no stages", lambda: fpipe.pipeline(_loss, [], GPipe(2)), TypeError, "stages must be a non-empty list"),
    ("stage", lambda: fpipe.pipeline(_loss, [_stage, 3], GPipe(2)), TypeError, "stage 1 is not callable (stages[1]"),
    (
        "stage count",
        lambda: fpipe.pipeline(_loss, [_stage] * 3, [["0F0", "0B0"], ["1F0", "1B0"]]),
        ScheduleError,
        "the schedule's program has 2 stages but stages has 3 functions",
    ),
    (
        "schedule class",
        lambda: fpipe.pipeline(_loss, [_stage], OneFOneB),
        TypeError,
        "schedule is the class OneFOneB, not a schedule",
    ),
    ("schedule", lambda: fpipe.pipeline(_loss, [_stage], 8), TypeError, "schedule must be a schedule such as"),
    (
        "schedule name",
        lambda: fpipe.pipeline(_loss, [_stage, _stage], "zbv"),
        TypeError,
        "schedule is a name, not a schedule (schedule: 'zbv', type str). Pass the schedule value: "
        "ZeroBubbleV(num_microbatches=8) (from fpipe.schedules import ZeroBubbleV).",
    ),
    (
        "schedule unknown name",
        lambda: fpipe.pipeline(_loss, [_stage], "fast"),
        TypeError,
        "Pass a schedule value from fpipe.schedules, e.g. OneFOneB(num_microbatches=8) "
        "(built-ins: DualPipe, DualPipeV, GPipe,",
    ),
    (
        "schedule search result",
        lambda: fpipe.pipeline(_loss, [_stage] * 4, _searched()),
        TypeError,
        "schedule is a Searched that holds a program, not a schedule (schedule: type Searched, repr of",
    ),
    (
        "parallel",
        lambda: _pipeline(parallel="mesh"),
        TypeError,
        "parallel must be an fpipe.Parallelism (parallel: 'mesh', type str). Pass e.g. "
        "parallel=fpipe.Parallelism(mesh=mesh)",
    ),
    (
        "has_aux",
        lambda: _pipeline(has_aux=1),
        TypeError,
        "has_aux must be True or False (has_aux: 1, type int). Pass a bool.",
    ),
    ("weight_fn", lambda: _pipeline(weight_fn=2), TypeError, "weight_fn must be callable"),
    ("split", lambda: _pipeline(split=2), TypeError, "split must be callable"),
    ("recompute", lambda: _pipeline(recompute=[5]), ValueError, "recompute must be a bool or stage indices in 0..1"),
    ("precision", lambda: _pipeline(precision=torch.float16), TypeError, "precision must be an fpipe.Precision"),
    # step(params, batch): what depends on the data fails when the step is called
    ("params type", lambda: _step({"w": 1}), TypeError, "params must be a list with one pytree per stage (got: dict)"),
    ("params length", lambda: _step([torch.ones(())]), ValueError, "params has 1 entry but the pipeline has 2 stages"),
    ("key", lambda: _pipeline()(TWO, torch.ones(4, 3), key=1.5), TypeError, "key must be an int (key: 1.5)"),
    ("key range", lambda: _pipeline()(TWO, torch.ones(4, 3), key=-1), ValueError, "key must be in [0, 2**53)"),
    ("batch too small", lambda: _step(TWO, torch.ones(1, 3)), ValueError, "a batch of 1 cannot be split into 2"),
    (
        "meta params",
        lambda: _step([torch.ones((), device="meta"), torch.ones(())]),
        ValueError,
        "is on the meta device and holds no data",
    ),
    (
        "evaluate outputs",
        lambda: _pipeline().evaluate(TWO, torch.ones(4, 3), outputs=1),
        TypeError,
        "outputs must be True or False (outputs: 1)",
    ),
    ("loss_scale", lambda: setattr(_pipeline(), "loss_scale", None), ValueError, "this step does not scale its loss"),
    ("shard", lambda: _pipeline().shard(TWO), ValueError, "fpipe.step.shard: this step does not shard"),
    # the parallel set-up
    (
        "Parallelism timeout",
        lambda: fpipe.Parallelism(timeout=0),
        ValueError,
        "fpipe.Parallelism: timeout must be a positive number of seconds (timeout: 0, type int). Pass e.g.",
    ),
    ("Parallelism shard_params", lambda: fpipe.Parallelism(shard_params=1), TypeError, "shard_params must be True"),
    ("Parallelism regather", lambda: fpipe.Parallelism(regather=True), ValueError, "regather=True re-gathers sharded"),
    ("shard_params alone", lambda: fpipe.Parallelism(shard_params=True), ValueError, "but this set-up has none"),
    (
        "Parallelism mesh",
        lambda: fpipe.Parallelism(mesh="pp"),
        TypeError,
        "mesh must be a torch DeviceMesh (mesh: 'pp'",
    ),
    (
        "Parallelism group",
        lambda: fpipe.Parallelism(group=1),
        TypeError,
        "group must be a torch.distributed ProcessGroup",
    ),
    (
        "save parallel",
        lambda: fpipe.save("unused", TWO, parallel=1),  # type: ignore[arg-type]
        TypeError,
        "fpipe.save: parallel must be an fpipe.Parallelism or a Step from fpipe.pipeline (parallel: 1, type int)",
    ),
    # precision
    ("Precision compute", lambda: fpipe.Precision(compute="half"), TypeError, "compute must be a torch.dtype"),
    (
        "Precision loss_scale",
        lambda: fpipe.Precision(compute=torch.bfloat16, loss_scale=fpipe.LossScale()),
        ValueError,
        "loss scaling is for float16 compute",
    ),
    ("LossScale", lambda: fpipe.LossScale(growth=0.5), ValueError, "growth must be a number > 1 (growth: 0.5)"),
    ("LossScaleState", lambda: fpipe.LossScaleState(scale=-1.0), ValueError, "scale must be a positive finite number"),
    # batches, randomness, records
    ("Microbatches", lambda: fpipe.Microbatches([]), TypeError, "give a non-empty list of microbatch pytrees"),
    ("stage_info", fpipe.stage_info, RuntimeError, "no stage is running"),
    ("record", lambda: fpipe.record().__enter__().timeline, LookupError, "no step ran inside the block"),
    # shards
    ("shard", lambda: fpipe.shard({"w": torch.ones(2)}, object()), ValueError, "shards are cut over the data-parallel"),
    ("gather", lambda: fpipe.gather(TWO, TWO, None), ValueError, "and this has none (got: None)"),
    # schedules
    ("GPipe", lambda: GPipe(0), ScheduleError, "num_microbatches must be a positive int (num_microbatches: 0)"),
    (
        "simulate a schedule",
        lambda: fpipe.schedules.simulate(OneFOneB(8)),  # type: ignore[arg-type]
        TypeError,
        "simulate: program must be a Program (program: OneFOneB(num_microbatches=8), type OneFOneB). Pass "
        "schedule.program(num_stages)",
    ),
    (
        "simulate a search result",
        lambda: fpipe.schedules.simulate(_searched()),  # type: ignore[arg-type]
        TypeError,
        "(program: type Searched, repr of",
    ),
    (
        "draw a search result",
        lambda: fpipe.schedules.terminal_grid(_searched()),  # type: ignore[arg-type]
        TypeError,
        "terminal_grid: program must be a Program (program: type Searched, repr of",
    ),
    (
        "dump_csv a search result",
        lambda: fpipe.schedules.dump_csv(_searched(), "never.csv"),  # type: ignore[arg-type]
        TypeError,
        "Pass its program, e.g. found.program.",
    ),
    (
        "placement of a class",
        lambda: fpipe.schedules.placement(OneFOneB, 4),  # type: ignore[arg-type]
        TypeError,
        "placement: schedule must be a schedule value (schedule: the class OneFOneB). Call it with the number",
    ),
    (
        "save_costs of a search result",
        lambda: fpipe.planning.save_costs("never.json", _searched()),  # type: ignore[arg-type]
        TypeError,
        "costs must be a sequence of one Costs per stage (costs: type Searched, repr of",
    ),
    # modules
    ("split_module", lambda: fpipe.split_module(3, [["a"]]), TypeError, "expected an nn.Module (model: int)"),
    (
        "split_module name",
        lambda: fpipe.split_module(nn.Sequential(nn.Linear(2, 2)), [["nothere"]]),
        ValueError,
        "the model has no module 'nothere' (stage 0: 'nothere')",
    ),
    ("functionalize", lambda: fpipe.functionalize(3), TypeError, "expected an nn.Module (got: int)"),
    ("balance stages", lambda: fpipe.balance([1.0, 2.0], 3), ValueError, "num_stages must be between 1 and"),
    ("balance cost", lambda: fpipe.balance([1.0, -2.0], 1), ValueError, "costs must be finite and >= 0"),
    (
        "balance schedule class",
        lambda: fpipe.balance([1.0] * 8, 4, schedule=OneFOneB),  # type: ignore[arg-type]
        TypeError,
        "schedule is the class OneFOneB, not a schedule (schedule: the class OneFOneB). Call it with the number of "
        "microbatches, e.g. schedule=OneFOneB(num_microbatches=8).",
    ),
    (
        "balance schedule",
        lambda: fpipe.balance([1.0] * 8, 4, schedule="1f1b"),  # type: ignore[arg-type]
        TypeError,
        "schedule must be a schedule value such as OneFOneB(num_microbatches=8) (schedule: '1f1b', type str)",
    ),
    ("sum_tied", lambda: fpipe.sum_tied({"w": torch.ones(())}), TypeError, "grads must be a list with one dict"),
    # optimizers
    ("sgd", lambda: fpipe.optim.sgd(-1.0), ValueError, "must be a finite number >= 0 (learning_rate: -1.0)"),
    ("adamw", lambda: fpipe.optim.adamw(float("nan")), ValueError, "(learning_rate: nan)"),
    (
        "clip_by_global_norm",
        lambda: fpipe.optim.clip_by_global_norm(TWO, torch.tensor(1.0), max_norm=-1.0),
        ValueError,
        "max_norm must be positive (max_norm: -1.0)",
    ),
    (
        "warmup_cosine",
        lambda: fpipe.optim.warmup_cosine(1.0, warmup_steps=1, total_steps=2)(-1),
        ValueError,
        "a non-negative int (step: -1)",
    ),
]


@pytest.mark.parametrize(("call", "exception", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_argument_errors(call: Callable[[], Any], exception: type[Exception], fragment: str) -> None:
    with pytest.raises(exception) as raised:
        call()
    assert fragment in str(raised.value)
    assert len(str(raised.value)) <= 400, f"{len(str(raised.value))} characters: {raised.value}"


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_a_schedule_named_as_the_command_line_names_it_points_to_its_class(name: str) -> None:
    """pipeline(..., "zbv") names the value to pass: the class the command line builds for the name."""
    choice = SCHEDULES[name]
    built = type(choice.build(8, choice.stages_per_rank)).__name__
    with pytest.raises(TypeError) as raised:
        fpipe.pipeline(_loss, [_stage, _stage], name)
    assert f"Pass the schedule value: {built}(num_microbatches=8) (from fpipe.schedules import {built})." in str(
        raised.value
    )
    with pytest.raises(TypeError, match=f"Pass the schedule value: {built}\\("):
        fpipe.pipeline(_loss, [_stage, _stage], name.upper().replace("ZB", "ZB-"))


def test_messages_name_their_function() -> None:
    for _, call, exception, _ in CASES:
        with pytest.raises(exception) as raised:
            call()
        assert str(raised.value).startswith("fpipe."), raised.value


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda d: fpipe.save(d, TWO, metadata=[1]), "metadata must be a dict (metadata: [1])"),
        (lambda d: fpipe.save(d, TWO, optimizer_state=[{}]), "optimizer_state has 1 entry but params has"),
        (lambda d: fpipe.save(d, [torch.ones(()), torch.ones(())]), "is a tensor, not a pytree of named tensors"),
        (lambda d: fpipe.load(d, [{"w": torch.ones(())}]), "fpipe.load: no committed save in"),
        (lambda d: fpipe.save_state(d, {"params": TWO}), "state must be a fpipe.TrainState (got: dict)"),
        (lambda d: fpipe.load_state(d, [{"w": torch.ones(())}]), "no committed save in"),
        (lambda d: fpipe.save_hf(d, {"w": torch.ones(())}), "params must be a list with one pytree per stage"),
        (lambda d: fpipe.load_hf(d, [{"w": torch.ones(())}]), "is not a directory. Pass a Hugging Face checkpoint"),
    ],
)
def test_saving_argument_errors(tmp_path: Path, call: Callable[[Path], Any], fragment: str) -> None:
    with pytest.raises((ValueError, TypeError, FileNotFoundError)) as raised:
        call(tmp_path / "save")
    assert fragment in str(raised.value)


@pytest.mark.parametrize(
    ("call", "exception", "fragment"),
    [
        (lambda d: _step({"w": 1}), TypeError, "fpipe.step: params must be a list with one pytree per stage"),
        (lambda d: fpipe.optim.sgd(0.1).init({"w": 1}), TypeError, "fpipe.optim.sgd: params must be a list with one"),
        (lambda d: fpipe.save(d, {"w": torch.ones(())}), TypeError, "fpipe.save: params must be a list with one"),
        (lambda d: fpipe.load(d, {"w": torch.ones(())}), TypeError, "fpipe.load: template must be a list with one"),
        (lambda d: fpipe.save_hf(d, {"w": torch.ones(())}), TypeError, "fpipe.save_hf: params must be a list with"),
        (lambda d: fpipe.load_hf(d, {"w": torch.ones(())}), TypeError, "fpipe.load_hf: template must be a list"),
        (lambda d: fpipe.sum_tied({"w": None}), TypeError, "fpipe.sum_tied: grads must be a list with one dict per"),
        (lambda d: _step([torch.ones(())]), ValueError, "fpipe.step: params has 1 entry but the pipeline has 2 stages"),
        (lambda d: fpipe.save(d, TWO, optimizer_state=[{}]), ValueError, "optimizer_state has 1 entry but params has"),
        (lambda d: fpipe.sum_tied([{}], params=[{}, {}]), ValueError, "fpipe.sum_tied: params has 2 entries but grads"),
    ],
)
def test_one_pytree_per_stage_is_one_check(
    tmp_path: Path, call: Callable[[Path], Any], exception: type, fragment: str
) -> None:
    """Every function that takes one pytree per stage checks it alike (``stage_list`` of
    fpipe/_pytree.py): ``TypeError`` for what is not a list, ``ValueError`` for a wrong length."""
    with pytest.raises(exception) as raised:
        call(tmp_path / "save")
    assert type(raised.value) is exception and fragment in str(raised.value)


def test_a_failing_action_names_it() -> None:
    def broken(params: Any, x: torch.Tensor) -> torch.Tensor:
        raise ArithmeticError("bad stage")

    step = fpipe.pipeline(_loss, [_stage, broken], GPipe(2))
    with pytest.raises(fpipe.PipelineError) as raised:
        step(TWO, torch.ones(4, 3))
    error = raised.value
    assert (error.action, error.stage, error.microbatch) == (Action(1, "F", 0), 1, 0)
    assert "1F0" in str(error) and isinstance(error.__cause__, ArithmeticError)


def test_a_module_stage_that_cannot_take_params_is_refused() -> None:
    with pytest.raises(TypeError, match="whose forward cannot take"):
        fpipe.pipeline(_loss, [nn.Linear(2, 2)], GPipe(1))


def test_a_failing_loss_fn_is_named_and_the_error_pickles() -> None:
    def failing(y: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        raise KeyError("labels")

    with pytest.raises(fpipe.PipelineError) as raised:
        fpipe.pipeline(failing, [_stage, _stage], GPipe(2))(TWO, torch.ones(4, 3))
    error = raised.value
    assert error.in_loss_fn and str(error).startswith("fpipe: loss_fn in ")
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), str(copy), copy.rank, copy.action, copy.in_loss_fn) == (
        fpipe.PipelineError,
        str(error),
        error.rank,
        error.action,
        True,
    )


def test_a_timeout_is_a_pipeline_error_and_a_timeout_error() -> None:
    error = fpipe.PipelineTimeoutError("fpipe: rank 1 waited", rank=1)
    assert isinstance(error, fpipe.PipelineError) and isinstance(error, TimeoutError)
    assert (error.action, error.stage, error.microbatch) == (None, None, None)
    assert type(pickle.loads(pickle.dumps(error))) is fpipe.PipelineTimeoutError
