"""``fpipe.load`` (fpipe/_saving/_load.py) in one process: a save read into any grouping of stages
by names, new tensors on the template's devices, the metadata back from JSON, and every refusal
before anything is returned (distributed and hostile saves: test_save.py, test_save_sharded.py).
Its last tests read DTensor saves of pp 2 x tp 2 and dp 2 x pp 1 x tp 2 ranks back into every layout
(the spawns: tests/saving/_tensor_parallel_saves.py, once per session)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import fpipe
from fpipe._saving._load import Loaded, load_then
from fpipe._saving._ranks import Setup
from tests.helpers import assert_bitwise
from tests.saving._tensor_parallel_saves import (
    check_gathered,
    tp_params,
    tp_state,
    tp_state_template,
)
from tests.saving._tools import template

F32 = torch.float32


def saved(directory: Path) -> list[dict[str, Any]]:
    """Two stages, with optimizer state on the first only and metadata, saved to ``directory``."""
    params = [{"a": torch.arange(3.0), "b": {"c": torch.ones(2, 2, dtype=F32)}}, {"e": torch.tensor(5)}]
    fpipe.save(directory, params, optimizer_state=[{"a": torch.full((3,), 0.5)}, None], metadata={"step": (1, 2)})
    return params


def test_a_save_loads_into_any_grouping_by_names(tmp_path: Path) -> None:
    params = saved(tmp_path)
    template = [
        {"a": torch.empty(3)},
        None,  # a stage this rank does not hold
        {"b": {"c": torch.empty(2, 2, dtype=F32, device="meta")}, "e": torch.empty((), dtype=torch.int64)},
    ]
    loaded = fpipe.load(tmp_path, template, optimizer_state=[None, None, {"a": torch.empty(3)}])
    assert loaded.params[1] is None
    a, c, e = loaded.params[0]["a"], loaded.params[2]["b"]["c"], loaded.params[2]["e"]
    for got, want in ((a, params[0]["a"]), (c, params[0]["b"]["c"]), (e, params[1]["e"])):
        assert_bitwise(got, want)  # on the CPU, as the template's meta tensor asks
        assert not got.requires_grad and got.untyped_storage().data_ptr() != want.untyped_storage().data_ptr()
    assert loaded.optimizer_state is not None and loaded.optimizer_state[:2] == [None, None]
    assert torch.equal(loaded.optimizer_state[2]["a"], torch.full((3,), 0.5))
    assert loaded.metadata == {"step": [1, 2]}  # as JSON gives it back
    twice = fpipe.load(tmp_path, [{"a": torch.empty(3)}, {"a": torch.empty(3)}], strict=False).params
    assert torch.equal(twice[0]["a"], twice[1]["a"]) and twice[0]["a"].data_ptr() != twice[1]["a"].data_ptr()


def test_names_of_the_save_no_stage_loads_are_refused_unless_not_strict(tmp_path: Path) -> None:
    saved(tmp_path)
    extra = r"has 2 parameter name\(s\) that no stage of the template has: \['b.c', 'e'\]"
    with pytest.raises(ValueError, match=extra):
        fpipe.load(tmp_path, [{"a": torch.empty(3)}])
    loaded = fpipe.load(tmp_path, [{"a": torch.empty(3)}], strict=False)
    assert torch.equal(loaded.params[0]["a"], torch.arange(3.0)) and loaded.optimizer_state is None


@pytest.mark.parametrize(
    ("template", "error", "message"),
    [
        ([{"zz": torch.empty(3)}], ValueError, r"1 name\(s\) of the template are missing .* \['zz' \(template\[0\]"),
        ([{"a": torch.empty(4)}], ValueError, r"template\[0\]\['a'\] \(name 'a'\): shape on disk \[3\], expected \[4"),
        ([{"b": {"c": torch.empty(2, 2, dtype=torch.float64)}}], ValueError, r"\['b'\]\['c'\] \(name 'b.c'\): dtype"),
        ([{"a": 3}], TypeError, r"template\[0\]\['a'\] is a int; template leaves are tensors"),
    ],
)
def test_a_template_that_does_not_match_is_refused_naming_the_leaf(
    tmp_path: Path, template: list[Any], error: type[Exception], message: str
) -> None:
    saved(tmp_path)
    with pytest.raises(error, match=message):
        fpipe.load(tmp_path, template, strict=False)


def test_a_directory_without_a_committed_save_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no committed save in"):
        fpipe.load(tmp_path, [{"a": torch.empty(3)}])


def test_load_then_returns_what_then_makes_of_the_loaded_save(tmp_path: Path) -> None:
    saved(tmp_path)
    seen: list[Any] = []

    def then(loaded: Loaded, topology: Any) -> str:
        seen.append((loaded.metadata, topology))
        return "made"

    result = load_then(
        tmp_path, [{"a": torch.empty(3)}], then, optimizer_state=None, strict=False, setup=Setup(None, 5.0)
    )
    assert result == "made" and seen == [({"step": [1, 2]}, None)]  # no group: no topology


# --- With tensor parallelism (tests/saving/_tensor_parallel_saves.py; its spawns: tests/saving/conftest.py) ---


def test_a_tensor_parallel_save_reloads_bitwise_into_the_same_layout(tp_saves: tuple[Path, list[Any], Any]) -> None:
    _, results, _ = tp_saves
    full = tp_params()
    for r in results:
        params, state, metadata = r["same layout"]
        check_gathered(params, full, r["pp"])
        check_gathered([None if t is None else t["m"] for t in state], full, r["pp"], state=True)
        assert [None if t is None else t["step"][0] for t in state] == [
            torch.tensor(3) if s == r["pp"] else None for s in range(2)
        ]
        assert metadata == {"step": 3}
        # Uneven pieces as torch.chunk cuts them: 5 rows as 3 and 2, 1 row as 1 and 0.
        stage = params[r["pp"]]
        assert stage[f"b{r['pp']}.odd"][3] == [[3, 3], [2, 3]][r["tp"]]
        assert stage[f"b{r['pp']}.tiny"][3] == [[1, 4], [0, 4]][r["tp"]]
        check_gathered(r["after"], full, r["pp"])


@pytest.mark.timeout(120)
def test_a_tensor_parallel_save_loads_into_one_process_and_a_plain_save_into_tensor_parallel(
    tp_saves: tuple[Path, list[Any], Any],
) -> None:
    directory, results, _ = tp_saves
    full = tp_params()
    loaded = fpipe.load(directory / "tp", template(full), optimizer_state=tp_state_template(template(full)))
    assert_bitwise(loaded.params, full)
    assert_bitwise(loaded.optimizer_state, tp_state(full))
    merged = fpipe.load(directory / "tp", [{**template(full[0]), **template(full[1])}]).params[0]
    assert_bitwise(merged, {**full[0], **full[1]})  # one stage: every name, the tied one once
    for r in results:
        check_gathered(r["from plain"], full, r["pp"])
        check_gathered(r["async"], full, r["pp"])


@pytest.mark.timeout(120)
def test_sharded_tensor_parallel_saves_reload_bitwise_into_every_layout(
    tp_sharded_saves: tuple[Path, list[Any]],
) -> None:
    directory, results = tp_sharded_saves
    full = tp_params()
    for r in results:
        params, state, metadata = r["same layout"]
        assert_bitwise(params, r["shards"])
        assert_bitwise(state, r["state"])
        assert metadata == {"step": 3}
        tp_layout_params, tp_layout_state = r["tp layout"]
        for s in (0, 1):
            check_gathered([t if i == s else None for i, t in enumerate(tp_layout_params)], full, s)
            check_gathered([t if i == s else None for i, t in enumerate(tp_layout_state)], full, s, state=True)
        assert_bitwise(r["from plain"], r["shards"])
        assert_bitwise(*r["dp 4"])
        assert_bitwise(r["train state"][:2], (r["shards"], r["state"]))
        assert r["train state"][2] == 5
        assert_bitwise(r["async"], (r["shards"], r["state"]))
        assert_bitwise(r["hf"], r["shards"])
        assert r["hf read"] == {n: k for n, k in r["hf expected"].items() if k}
    # the replicated run's params, bitwise: into one process, from the shards of every rank, and
    # exported by save_hf (each DTensor's local piece gathered over dp, then over tp)
    assert_bitwise(fpipe.load_hf(directory / "hf_out", template(full)), full)
    loaded = fpipe.load(directory / "sharded", template(full), optimizer_state=tp_state_template(template(full)))
    assert_bitwise(loaded.params, full)
    assert_bitwise(loaded.optimizer_state, tp_state(full))
