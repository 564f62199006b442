"""The parallel set-up as a value (``fpipe.Parallelism``, fpipe/_parallelism.py): checked when
built, frozen, equal by its fields; taken as ``parallel=`` by ``pipeline`` and by every save and
load (a ``Parallelism``, or the step whose shards they read); the keywords it replaced warn for
one release and keep their meaning. Distributed cases run on a one-rank ``("dp", "pp")`` mesh of
a process group of this process alone (as tests/sharding/test_public.py does); many ranks:
every distributed test, which builds its steps and saves with ``parallel=``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import fpipe
from fpipe.schedules import GPipe


def _loss(y: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return (y**2).mean()


def _stage(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ params["w"])


def _params() -> list[dict[str, torch.Tensor]]:
    return [{"w": torch.arange(9.0).reshape(3, 3) / 10}]


def test_a_parallelism_is_a_frozen_value_equal_by_its_fields() -> None:
    default = fpipe.Parallelism()
    assert (default.mesh, default.group, default.shard_params, default.regather) == (None, None, False, False)
    assert default.timeout == 300.0 and not default.distributed
    assert fpipe.Parallelism(timeout=60) == fpipe.Parallelism(timeout=60.0) != default
    assert isinstance(fpipe.Parallelism(timeout=60).timeout, float)  # 60 and 60.0 are one value, shown alike
    assert hash(fpipe.Parallelism(timeout=60)) == hash(fpipe.Parallelism(timeout=60.0))
    assert dataclasses.replace(default, timeout=5.0) == fpipe.Parallelism(timeout=5.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        default.timeout = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"timeout": 0}, ValueError, r"timeout must be a positive number of seconds \(timeout: 0, type int\)"),
        ({"timeout": True}, ValueError, r"timeout must be a positive number of seconds \(timeout: True, type bool\)"),
        ({"timeout": math.inf}, ValueError, r"\(timeout: inf, type float\)\. Pass e\.g\. timeout=300, the default"),
        ({"timeout": "30"}, ValueError, r"\(timeout: '30', type str\)"),
        ({"shard_params": 1}, TypeError, r"shard_params must be True or False \(shard_params: 1, type int\)"),
        ({"regather": "yes"}, TypeError, r"regather must be True or False \(regather: 'yes', type str\)"),
        ({"regather": True}, ValueError, r"regather=True re-gathers sharded parameters; it needs shard_params=True"),
        (
            {"shard_params": True},
            ValueError,
            r"the data-parallel ranks, but this set-up has none \(mesh: None, type NoneType\)",
        ),
        ({"mesh": "pp"}, TypeError, r"mesh must be a torch DeviceMesh \(mesh: 'pp', type str\)\. Build one"),
        ({"group": 0}, TypeError, r"group must be a torch\.distributed ProcessGroup \(group: 0, type int\)"),
        ({"mesh": object(), "group": object()}, TypeError, r"pass mesh= or group=, not both \(mesh: <object"),
    ],
)
def test_what_is_wrong_fails_when_built(fields: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=rf"^fpipe\.Parallelism: .*{match}"):
        fpipe.Parallelism(**fields)


def test_pipeline_takes_a_parallelism_and_nothing_else() -> None:
    step = fpipe.pipeline(_loss, [_stage], GPipe(2), parallel=fpipe.Parallelism(timeout=9.0))
    assert step.parallel == fpipe.Parallelism(timeout=9.0) and step.timeout == 9.0 and step.rank is None
    with pytest.raises(TypeError, match=r"parallel must be an fpipe\.Parallelism \(parallel: 'dp', type str\)"):
        fpipe.pipeline(_loss, [_stage], GPipe(2), parallel="dp")  # type: ignore[arg-type]


# -- on a one-rank mesh: the checks that need one, and every save and load --------------------


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    """A one-rank ("dp", "pp") CPU mesh on a process group of this process alone, destroyed after the module."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DeviceMesh("cpu", [[0]], mesh_dim_names=("dp", "pp"))
    finally:
        dist.destroy_process_group()


def test_the_mesh_names_its_dimensions_and_sharding_needs_a_data_one(mesh: DeviceMesh) -> None:
    assert fpipe.Parallelism(mesh=mesh, shard_params=True, regather=True).distributed
    assert fpipe.Parallelism(group=dist.group.WORLD).distributed
    with pytest.raises(ValueError, match=r"^fpipe\.Parallelism: shard_params=True cuts .* has none \(mesh: Devic"):
        fpipe.Parallelism(mesh=mesh["pp"], shard_params=True)
    with pytest.raises(ValueError, match=r"^fpipe\.Parallelism: shard_params=True cuts .* \(group: type ProcessGroup"):
        fpipe.Parallelism(group=dist.group.WORLD, shard_params=True)
    unnamed = DeviceMesh("cpu", [[0]], mesh_dim_names=("dp", "stages"))
    with pytest.raises(ValueError, match=r"^fpipe\.Parallelism: the mesh needs one pipeline dimension named 'pp'"):
        fpipe.Parallelism(mesh=unnamed)
    assert fpipe.Parallelism(mesh=mesh) == fpipe.Parallelism(mesh=mesh) != fpipe.Parallelism(mesh=mesh, timeout=1)


def test_every_save_and_load_takes_the_parallelism(mesh: DeviceMesh, tmp_path: Path) -> None:
    parallel = fpipe.Parallelism(mesh=mesh, timeout=30.0)
    params, template = _params(), [{"w": torch.empty(3, 3)}]
    fpipe.save(tmp_path / "save", params, parallel=parallel)
    assert torch.equal(fpipe.load(tmp_path / "save", template, parallel=parallel).params[0]["w"], params[0]["w"])
    fpipe.save_state(tmp_path / "state", fpipe.TrainState(params, step=3), parallel=parallel)
    assert fpipe.load_state(tmp_path / "state", template, parallel=parallel).step == 3
    fpipe.save_hf(tmp_path / "hf", params, parallel=parallel)
    assert torch.equal(fpipe.load_hf(tmp_path / "hf", template, parallel=parallel)[0]["w"], params[0]["w"])
    with fpipe.AsyncSaver(parallel=parallel) as saver:
        saver.save(tmp_path / "async", params)
    assert torch.equal(fpipe.load(tmp_path / "async", template).params[0]["w"], params[0]["w"])


def test_a_sharded_save_takes_the_step_whose_layouts_it_needs(mesh: DeviceMesh, tmp_path: Path) -> None:
    parallel = fpipe.Parallelism(mesh=mesh, shard_params=True, timeout=30.0)
    step = fpipe.pipeline(_loss, [_stage], GPipe(2), parallel=parallel)
    assert step.parallel is parallel and step.shard_params and step.local_stages == (0,)
    shards = step.shard(_params())
    fpipe.save(tmp_path / "sharded", shards, parallel=step)
    loaded = fpipe.load(tmp_path / "sharded", step.shard([{"w": torch.empty(3, 3, device="meta")}]), parallel=step)
    assert torch.equal(loaded.params[0]["w"], shards[0]["w"])
    assert torch.equal(step.gather(shards)[0]["w"], _params()[0]["w"])
    assert torch.equal(fpipe.gather(shards[0], _params()[0], parallel)["w"], _params()[0]["w"])
    with pytest.raises(ValueError, match=r"^fpipe\.save: a save or load of shards needs their full shapes, which"):
        fpipe.save(tmp_path / "refused", shards, parallel=parallel)
    with pytest.raises(ValueError, match=r"^fpipe\.load: a save or load of shards needs .* Pass parallel=step, the"):
        fpipe.load(tmp_path / "sharded", shards, parallel=parallel)


def test_step_unshard_is_step_gather_under_its_old_name_for_one_release(mesh: DeviceMesh) -> None:
    step = fpipe.pipeline(_loss, [_stage], GPipe(2), parallel=fpipe.Parallelism(mesh=mesh, shard_params=True))
    shards = step.shard(_params())
    with pytest.warns(DeprecationWarning, match=r"fpipe\.Step\.unshard\(shards\) is deprecated .* step\.gather") as w:
        gathered = step.unshard(shards)
    assert w[0].filename == __file__ and torch.equal(gathered[0]["w"], step.gather(shards)[0]["w"])


@pytest.mark.parametrize("function", ["save", "load", "save_state", "load_state", "save_hf", "load_hf", "AsyncSaver"])
def test_the_replaced_save_keywords_warn_and_keep_their_meaning(
    mesh: DeviceMesh, tmp_path: Path, function: str
) -> None:
    params, template = _params(), [{"w": torch.empty(3, 3)}]
    fpipe.save(tmp_path / "save", params)
    fpipe.save_state(tmp_path / "state", fpipe.TrainState(params))
    fpipe.save_hf(tmp_path / "hf", params)
    calls = {
        "save": lambda **old: fpipe.save(tmp_path / "new", params, **old),
        "load": lambda **old: fpipe.load(tmp_path / "save", template, **old),
        "save_state": lambda **old: fpipe.save_state(tmp_path / "new", fpipe.TrainState(params), **old),
        "load_state": lambda **old: fpipe.load_state(tmp_path / "state", template, **old),
        "save_hf": lambda **old: fpipe.save_hf(tmp_path / f"new hf {sorted(old)}", params, **old),
        "load_hf": lambda **old: fpipe.load_hf(tmp_path / "hf", template, **old),
        "AsyncSaver": lambda **old: fpipe.AsyncSaver(**old).close(),
    }
    step = fpipe.pipeline(_loss, [_stage], GPipe(2), parallel=fpipe.Parallelism(mesh=mesh))
    with pytest.warns(
        DeprecationWarning,
        match=rf"fpipe\.{function}\(mesh=, timeout=\) is deprecated .* use parallel=fpipe\.Parallelism\(mesh=",
    ) as warned:
        calls[function](mesh=mesh, timeout=30.0)
    assert warned[0].filename == __file__  # the warning names the caller's line
    with pytest.warns(DeprecationWarning, match=rf"fpipe\.{function}\(step=\) is deprecated .* use parallel=step"):
        calls[function](step=step)
    with pytest.raises(TypeError, match=rf"fpipe\.{function}: pass parallel= alone; it replaces step="):
        calls[function](parallel=step, step=step)
