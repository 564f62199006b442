"""The ranks of a save or load (fpipe/_saving/_ranks.py), in one process: which ranks take part,
their JSON all-gathers, the agreement that fails every rank together, and argument checks (over
many ranks: tests/saving/test_save.py, tests/saving/test_save_sharded.py)."""

from __future__ import annotations

import pytest
import torch

import fpipe
from fpipe._errors import DEFAULT_TIMEOUT
from fpipe._pytree import stage_list
from fpipe._saving._ranks import Ranks, Setup, agree, check_stage_count, resolve
from fpipe.schedules import GPipe


def _step() -> fpipe.Step:
    return fpipe.pipeline(lambda y, b: y.sum(), [lambda p, x: x * p] * 2, GPipe(1))


def test_one_process_is_one_rank_that_gathers_itself() -> None:
    ranks = Ranks("save", None, 1.0)
    assert (ranks.rank, ranks.size, ranks.writer, ranks.replicas, ranks.inner) == (0, 1, 0, False, [])
    assert ranks.gather({"n": (1, 2)}, "x") == [{"n": [1, 2]}]  # as JSON gives it back
    assert ranks.name(0) == "0"


def test_agree_raises_the_problem_here() -> None:
    ranks = Ranks("save", None, 1.0)
    # each rank's value: its error travels beside it (``_Report``), not among its keys
    assert agree(ranks, None, {"bytes": 3}, "writing") == [{"bytes": 3}]
    with pytest.raises(OSError, match="disk full"):
        agree(ranks, OSError("disk full"), {}, "writing")


def test_resolve_takes_a_parallelism_or_a_step() -> None:
    step = _step()
    assert resolve("save", None) == Setup(None, DEFAULT_TIMEOUT)
    assert resolve("save", fpipe.Parallelism(timeout=7.0)) == Setup(None, 7.0)
    assert resolve("save", step) == Setup(None, step.parallel.timeout, step) and resolve("save", step).held == (0, 1)
    with pytest.raises(TypeError, match=r"fpipe\.load: pass parallel= alone; it replaces group="):
        resolve("load", step, group=object())
    with pytest.raises(TypeError, match=r"fpipe\.save: parallel must be an fpipe\.Parallelism or a Step"):
        resolve("save", "step")  # type: ignore[arg-type]


def test_the_replaced_keywords_warn_and_keep_their_meaning() -> None:
    step = _step()
    with pytest.warns(DeprecationWarning, match=r"fpipe\.save\(step=, timeout=\) is deprecated .* use parallel=step"):
        assert resolve("save", None, step=step, timeout=5.0) == Setup(None, 5.0, step)
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="pass one of step=, group= and mesh="):
        resolve("load", None, step=step, group=object())
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match=r"step must be a Step from fpipe\.pipeline"):
        resolve("save", None, step="step")
    with pytest.warns(DeprecationWarning), pytest.raises(RuntimeError, match=r"torch\.distributed is not initialized"):
        resolve("save", None, group=object())


def test_stage_lists_and_counts() -> None:
    assert stage_list("fpipe.save", "params", ({"w": 1}, None)) == [{"w": 1}, None]
    with pytest.raises(TypeError, match=r"fpipe\.save: params must be a list with one pytree per stage \(got: dict\)"):
        stage_list("fpipe.save", "params", {"w": torch.ones(1)})
    check_stage_count("save", [None, None], _step())
    check_stage_count("save", [None], None)
    with pytest.raises(ValueError, match="params has 1 entry but the step has 2 stages"):
        check_stage_count("save", [None], _step())
