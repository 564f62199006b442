"""``fpipe.AsyncSaver``: the same save as ``fpipe.save`` at the call, written while training goes on.

An asynchronous save must load bitwise equal to a synchronous save of the same values even when
the caller changes its tensors right after the call; an error in the writer surfaces at the next
``wait``/``save``/exit; a process killed while its saver writes leaves the previous save loadable;
on 2 gloo processes the save's collectives and the training step's run at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fpipe
import fpipe.optim
from fpipe._saving import _save
from fpipe._saving._directory import INDEX, LATEST
from fpipe.schedules import OneFOneB
from tests._multiprocess import run_ranks
from tests.helpers import assert_bitwise
from tests.saving._tools import kill_when_half_written


def trained() -> tuple[list[Any], list[Any]]:
    g = torch.Generator().manual_seed(0)
    params = [{"w": torch.randn(5, 4, generator=g)}, {"head": torch.randn(4, 1, generator=g).float()}]
    opt = fpipe.optim.adamw(0.1)
    state = opt.init(params)
    grads = [{"w": torch.ones(5, 4)}, {"head": torch.ones(4, 1, dtype=torch.float32)}]
    return opt.update(params, grads, state)


def test_an_async_save_loads_bitwise_equal_to_a_sync_save(tmp_path: Path) -> None:
    params, state = trained()
    synchronous = fpipe.save(tmp_path / "sync", params, optimizer_state=state, metadata={"step": 1})
    with fpipe.AsyncSaver() as saver:
        saver.save(tmp_path / "async", params, optimizer_state=state, metadata={"step": 1})
        for tree in (*params, *state):  # training goes on, in place, while the save is written
            for leaf in tree.values() if isinstance(tree, dict) else ():
                if isinstance(leaf, torch.Tensor):
                    leaf.add_(1)
    asynchronous = saver.wait()
    assert asynchronous is not None and (tmp_path / "async" / LATEST).read_text().strip() == asynchronous.name
    tensors = [json.loads((d / INDEX).read_text())["tensors"] for d in (synchronous, asynchronous)]
    assert tensors[0] == tensors[1]  # names, dtypes, shapes and sha256
    a = fpipe.load(tmp_path / "async", params, optimizer_state=state)
    s = fpipe.load(tmp_path / "sync", params, optimizer_state=state)
    assert_bitwise([a.params, a.optimizer_state, a.metadata], [s.params, s.optimizer_state, s.metadata])
    assert not torch.equal(a.params[0]["w"], params[0]["w"])  # the values at the call, not after


def test_async_save_state_equals_save_state(tmp_path: Path) -> None:
    params, state = trained()
    train_state = fpipe.TrainState(params, state, step=3, extra={"scale": torch.tensor(2.0)})
    torch.manual_seed(5)
    fpipe.save_state(tmp_path / "sync", train_state)
    torch.manual_seed(5)
    with fpipe.AsyncSaver() as saver:
        saver.save_state(tmp_path / "async", train_state)
        torch.rand(3)  # drawn after the call: not in the save
    a, s = (fpipe.load_state(tmp_path / d, params, optimizer_state=state) for d in ("async", "sync"))
    assert_bitwise(
        [a.params, a.optimizer_state, a.step, a.extra, a.rng], [s.params, s.optimizer_state, 3, s.extra, s.rng]
    )


def test_an_error_in_the_writer_surfaces_and_keeps_the_previous_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    params, _ = trained()
    saver = fpipe.AsyncSaver()
    saver.save(tmp_path, params)
    first = saver.wait()

    def broken(path: Path, tensors: dict[str, torch.Tensor]) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_save, "write_safetensors", broken)
    saver.save(tmp_path, params)
    with pytest.raises(OSError, match="No space left on device"):
        saver.wait()
    assert saver.wait() == first and saver.done()  # raised once
    saver.save(tmp_path, params)
    with pytest.raises(OSError, match="No space left"):  # at the next save
        saver.save(tmp_path, params)
    saver.wait()
    with pytest.raises(OSError, match="No space left"), fpipe.AsyncSaver() as other:  # at exit
        other.save(tmp_path, params)
    assert first is not None and (tmp_path / LATEST).read_text().strip() == first.name
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []
    assert_bitwise(fpipe.load(tmp_path, params).params, params)


def test_argument_errors_are_raised_at_the_call(tmp_path: Path) -> None:
    saver = fpipe.AsyncSaver()
    with pytest.raises(TypeError, match="metadata must be JSON-serializable"):
        saver.save(tmp_path, [{"w": torch.ones(1)}], metadata={"x": object()})
    with pytest.raises(TypeError, match=r"state must be a fpipe\.TrainState"):
        saver.save_state(tmp_path, [{"w": torch.ones(1)}])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"state\.extra must be a dict of tensors by name \(not: 'scale'\)"):
        saver.save_state(tmp_path, fpipe.TrainState([{"w": torch.ones(1)}], extra={"scale": 2.0}))  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="pass mesh= or group=, not both"):
        fpipe.AsyncSaver(parallel=fpipe.Parallelism(mesh=object(), group=object()))
    assert saver.wait() is None


_KILLED_WHILE_WRITING = """
saver = fpipe.AsyncSaver()
params = [{"w": torch.full((1000,), 1.0)}]
saver.save(sys.argv[1], params)
saver.wait()
store._write = half_write
saver.save(sys.argv[1], [{"w": torch.full((1000,), 2.0)}])
while True:  # training goes on
    params[0]["w"].mul_(1.0)
"""


def test_a_process_killed_while_its_saver_writes_leaves_the_previous_save(tmp_path: Path) -> None:
    kill_when_half_written(_KILLED_WHILE_WRITING, tmp_path / "save", tmp_path / "half-written")
    assert [p for p in (tmp_path / "save").iterdir() if p.name.startswith(".tmp-")]  # the half-written one
    loaded = fpipe.load(tmp_path / "save", [{"w": torch.empty(1000, dtype=torch.float32)}])
    assert torch.equal(loaded.params[0]["w"], torch.full((1000,), 1.0, dtype=torch.float32))


def _train_while_saving(rank: int, world_size: int, directory: str) -> Any:
    torch.set_default_dtype(torch.float64)

    def body(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ p["w"])

    def head(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        return h @ p["head"]

    step = fpipe.pipeline(
        lambda y, x: (y**2).mean(), [body, head], OneFOneB(4), parallel=fpipe.Parallelism(group=dist.group.WORLD)
    )
    g = torch.Generator().manual_seed(0)
    full = [{"w": torch.randn(6, 32, generator=g)}, {"head": torch.randn(32, 3, generator=g)}]
    params: list[Any] = [p if s in step.local_stages else None for s, p in enumerate(full)]
    opt = fpipe.optim.adamw(0.01)
    state = opt.init(params)
    saver = fpipe.AsyncSaver(parallel=step)
    snapshots = []
    for i in range(6):
        if i % 2 == 0:
            saver.save(f"{directory}/async-{i}", params, optimizer_state=state, metadata={"i": i})
            fpipe.save(f"{directory}/sync-{i}", params, optimizer_state=state, metadata={"i": i}, parallel=step)
        _, grads = step(params, torch.randn(16, 6, generator=torch.Generator().manual_seed(i)) if rank == 0 else None)
        opt.update_(params, grads, state)  # in place, while the save may still be writing
    saver.wait()
    for i in range(0, 6, 2):
        loaded = [
            fpipe.load(f"{directory}/{kind}-{i}", params, optimizer_state=state, parallel=step)
            for kind in ("async", "sync")
        ]
        snapshots.append([(x.params, x.optimizer_state, x.metadata) for x in loaded])
    return snapshots


def test_async_saves_on_two_processes_while_they_train(tmp_path: Path) -> None:
    for snapshots in run_ranks(2, _train_while_saving, str(tmp_path), timeout=120):
        for asynchronous, synchronous in snapshots:
            assert_bitwise(asynchronous, synchronous)
