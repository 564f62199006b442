"""Stages are pure (fpipe/_purity.py, NOTE [in-place updates of leaves]): ``raise_if_in_place``
turns autograd's refusal of an in-place update into an error naming the stage, the leaf's key
path and the op; any other error, or a second call that finds nothing, is left as it was."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fpipe._purity import raise_if_in_place

AUTOGRAD = RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")


def _leaves() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    return {"w": torch.ones(3, requires_grad=True)}, torch.ones(3, requires_grad=True)


def _update(params: dict[str, torch.Tensor], x: torch.Tensor, how: str) -> Any:
    updates: dict[str, Callable[[], Any]] = {
        "method": lambda: params["w"].add_(1),
        "setitem": lambda: x.__setitem__(0, 0.0),
        "view": lambda: params["w"].view(3).mul_(2),
        "inplace=True": lambda: torch.nn.functional.threshold(x, 0.0, 0.0, inplace=True),
    }
    return updates[how]()


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("method", "stage 2 updates its parameter params['w'] in place (params['w']: add_)"),
        ("setitem", "stage 2 updates its input x in place (x: __setitem__)"),
        ("view", "stage 2 updates a view of its parameter params['w'] in place (params['w']: mul_)"),
        ("inplace=True", "stage 2 updates its input x in place (x: _threshold(inplace=True))"),
    ],
)
def test_the_updated_leaf_is_named(how: str, message: str) -> None:
    params, x = _leaves()
    with pytest.raises(RuntimeError) as raised:
        raise_if_in_place(AUTOGRAD, 2, lambda: _update(params, x, how), params, x)
    assert message in str(raised.value) and "w = w + 1 instead of w.add_(1)" in str(raised.value)
    assert raised.value.__cause__ is AUTOGRAD


def test_other_errors_and_pure_second_calls_are_left_alone() -> None:
    params, x = _leaves()
    calls = []
    raise_if_in_place(RuntimeError("shapes do not match"), 0, lambda: calls.append(1), params, x)
    assert calls == []  # another error: the stage is not called again
    raise_if_in_place(AUTOGRAD, 0, lambda: x * 2, params, x)  # nothing found: autograd's error stands

    def fails() -> None:
        raise ValueError("the second call fails otherwise")

    raise_if_in_place(AUTOGRAD, 0, fails, params, x)


def test_updates_of_tensors_that_are_not_leaves_pass() -> None:
    params, x = _leaves()
    raise_if_in_place(AUTOGRAD, 0, lambda: (x * 2).add_(1), params, x)  # a fresh tensor: allowed
    raise_if_in_place(AUTOGRAD, 0, lambda: x.detach().requires_grad_(), params, x)  # not an update
