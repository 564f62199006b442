"""``fpipe.save_state`` and ``fpipe.load_state``: a killed run resumes bitwise, and what a state holds.

The training runs are ``tests/_resume_run.py`` in processes of their own: uninterrupted, killed with
SIGKILL at a step drawn from a fixed seed (saving its state every few steps), and resumed from
its last save. From the resume on, losses and final parameters must equal the uninterrupted
run's bit for bit. A state of DTensors on pp 2 x tp 2 round trips too (the spawn:
tests/saving/_tensor_parallel_saves.py, once per session).
"""

from __future__ import annotations

import json
import random
import signal
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fpipe
import fpipe.optim
from fpipe._saving._directory import INDEX, LATEST
from tests import _resume_run
from tests._multiprocess import free_port, run_processes, run_ranks
from tests.helpers import assert_bitwise
from tests.saving._tensor_parallel_saves import (
    check_gathered,
    tp_params,
)

STEPS, EVERY = 12, 3
KILL_AT = random.Random(14).randint(EVERY + 1, STEPS - 1)  # the step the killed run dies before
RESUMED_AT = KILL_AT // EVERY * EVERY  # its last save


def launch(world: int, *args: str, timeout: float = 120.0) -> list[int]:
    """Run ``tests/_resume_run.py`` on ``world`` processes; their exit codes."""
    port = str(free_port())
    extra = ["--world", str(world), "--port", port] if world > 1 else []
    with tempfile.TemporaryDirectory() as directory:
        errors = [str(Path(directory, f"stderr.rank{r}")) for r in range(world)]
        codes = run_processes(world, _each_rank, [*args, *extra], errors, timeout=timeout)
        for code, path in zip(codes, errors):
            err = Path(path).read_text()
            if code not in (0, -signal.SIGKILL):
                raise AssertionError(err)
            launch.stderr.append(err)  # type: ignore[attr-defined]
    return codes


def _each_rank(rank: int, argv: list[str], errors: list[str]) -> None:
    _resume_run.run(rank, argv, errors[rank])


launch.stderr = []  # type: ignore[attr-defined]


def outputs(out: Path, world: int) -> list[dict[str, Any]]:
    paths = [out] if world == 1 else [Path(f"{out}.rank{r}") for r in range(world)]
    return [torch.load(p) for p in paths]


def kill_and_resume(tmp_path: Path, world: int, *flags: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The uninterrupted run's outputs and the resumed run's."""
    save = str(tmp_path / "save")
    assert launch(world, save, str(tmp_path / "full"), "full", *flags) == [0] * world
    killed = launch(world, save, str(tmp_path / "killed"), "killed", "--kill-at", str(KILL_AT), *flags)
    assert killed == [-signal.SIGKILL] * world
    assert launch(world, save, str(tmp_path / "resumed"), "resume", *flags) == [0] * world
    return outputs(tmp_path / "full", world), outputs(tmp_path / "resumed", world)


@pytest.mark.parametrize(("world", "flags"), [(1, ()), (2, ()), (2, ("--asynchronous",))])
def test_a_killed_run_resumes_bitwise(tmp_path: Path, world: int, flags: tuple[str, ...]) -> None:
    full, resumed = kill_and_resume(tmp_path, world, *flags)
    for f, r in zip(full, resumed):
        assert sorted(r["losses"]) == list(range(RESUMED_AT, STEPS))
        assert_bitwise({i: f["losses"][i] for i in r["losses"]}, r["losses"])
        assert_bitwise(f["params"], r["params"])
    if world == 1:  # the stages' randomness is what makes the restored generators matter
        launch(world, str(tmp_path / "unused"), str(tmp_path / "plain"), "full", "--no-random")
        assert not torch.equal(full[0]["losses"][STEPS - 1], outputs(tmp_path / "plain", 1)[0]["losses"][STEPS - 1])


def test_a_two_process_save_resumes_in_one_process(tmp_path: Path) -> None:
    save = str(tmp_path / "save")
    launch(2, save, str(tmp_path / "full"), "full", "--no-random")
    launch(2, save, str(tmp_path / "killed"), "killed", "--kill-at", str(KILL_AT), "--no-random")
    launch.stderr.clear()  # type: ignore[attr-defined]
    assert launch(1, save, str(tmp_path / "resumed"), "resume", "--no-random") == [0]
    assert "those of ranks [1] are not restored" in launch.stderr[0]  # type: ignore[attr-defined]
    full, (resumed,) = outputs(tmp_path / "full", 2), outputs(tmp_path / "resumed", 1)
    for i, loss in resumed["losses"].items():  # within reduction order (here: bitwise, as it happens)
        torch.testing.assert_close(loss, full[0]["losses"][i], rtol=1e-12, atol=0)
    stages = [full[0]["params"][0], full[1]["params"][1]]
    torch.testing.assert_close(resumed["params"], stages, rtol=1e-12, atol=0)


# --- What a state holds -----------------------------------------------------------------------


def state_of(seed: int) -> fpipe.TrainState:
    g = torch.Generator().manual_seed(seed)
    params = [{"w": torch.randn(3, 2, generator=g)}, {"h": torch.randn(2, generator=g)}]
    opt = fpipe.optim.adamw(0.1)
    return fpipe.TrainState(
        params, opt.init(params), step=5, metadata={"batch": 50}, extra={"loss_scale": torch.tensor(1024.0)}
    )


def test_a_state_round_trips_and_restores_the_generator(tmp_path: Path) -> None:
    state = state_of(0)
    fpipe.save_state(tmp_path, state)
    expected = torch.rand(4)  # what the run would draw next
    torch.manual_seed(99)
    loaded = fpipe.load_state(tmp_path, state.params, optimizer_state=state.optimizer_state)
    assert torch.equal(torch.rand(4), expected)
    assert_bitwise(loaded.params, state.params)
    assert_bitwise(loaded.optimizer_state, state.optimizer_state)
    assert (loaded.step, loaded.metadata) == (5, {"batch": 50})
    assert_bitwise(loaded.extra, state.extra)
    assert loaded.rng is not None and sorted(loaded.rng) == ["cpu"]
    # restore_rng=False leaves the generator alone
    torch.manual_seed(99)
    fpipe.load_state(tmp_path, state.params, optimizer_state=state.optimizer_state, restore_rng=False)
    assert not torch.equal(torch.rand(4), expected)


def test_a_given_rng_is_saved_instead_of_the_current_one(tmp_path: Path) -> None:
    torch.manual_seed(7)
    earlier = torch.get_rng_state()
    expected = torch.rand(2)
    fpipe.save_state(tmp_path, fpipe.TrainState(state_of(0).params, rng={"cpu": earlier}))
    fpipe.load_state(tmp_path, state_of(0).params)
    assert torch.equal(torch.rand(2), expected)


def test_a_save_of_another_model_is_refused_with_nothing_changed(tmp_path: Path) -> None:
    fpipe.save_state(tmp_path, state_of(0))
    other = [{"w": torch.zeros(3, 3)}, {"h": torch.zeros(2)}]
    generator = torch.get_rng_state()
    with pytest.raises(
        ValueError, match=r"template\[0\]\['w'\] \(name 'w'\): shape on disk \[3, 2\], expected \[3, 3\]"
    ):
        fpipe.load_state(tmp_path, other)
    with pytest.raises(ValueError, match=r"missing from the save .*\['v' \(template\[1\]\['v'\]\)\]"):
        fpipe.load_state(tmp_path, [{"w": torch.zeros(3, 2)}, {"v": torch.zeros(2)}], strict=False)
    assert torch.equal(torch.get_rng_state(), generator)
    assert torch.equal(other[0]["w"], torch.zeros(3, 3))


def test_a_plain_save_is_not_a_state(tmp_path: Path) -> None:
    fpipe.save(tmp_path, state_of(0).params)
    with pytest.raises(ValueError, match=r"holds no training state .* Load it with fpipe\.load"):
        fpipe.load_state(tmp_path, state_of(0).params)


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("step", -1, r"malformed \(step: -1\)"),
        ("metadata", [1], r"malformed \(metadata: \[1\]\)"),
        ("extra", "not base64!", r"malformed \(extra: "),
        ("rng", {"0": "AAAA"}, r"malformed \(rng of rank 0: "),
    ],
)
def test_a_malformed_state_says_which_field(tmp_path: Path, field: str, value: Any, fragment: str) -> None:
    version = fpipe.save_state(tmp_path, state_of(0))
    index = json.loads((version / INDEX).read_text())
    index["metadata"]["user"]["fpipe_train_state"][field] = value
    (version / INDEX).write_text(json.dumps(index))
    assert (tmp_path / LATEST).read_text().strip() == version.name
    with pytest.raises(ValueError, match=fragment):
        fpipe.load_state(tmp_path, state_of(0).params)


def test_save_state_errors(tmp_path: Path) -> None:
    params = state_of(0).params
    with pytest.raises(TypeError, match=r"state must be a fpipe\.TrainState"):
        fpipe.save_state(tmp_path, params)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"state.step must be an int >= 0 \(step: -2\)"):
        fpipe.save_state(tmp_path, fpipe.TrainState(params, step=-2))
    with pytest.raises(TypeError, match=r"state.extra must be a dict of tensors by name \(not: 'scale'\)"):
        fpipe.save_state(tmp_path, fpipe.TrainState(params, extra={"scale": 2.0}))  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="metadata must be JSON-serializable"):
        fpipe.save_state(tmp_path, fpipe.TrainState(params, metadata={"x": object()}))
    assert not (tmp_path / LATEST).exists()


def _mesh_state(rank: int, world: int, directory: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    from torch.distributed.device_mesh import init_device_mesh

    from fpipe.schedules import OneFOneB

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    step = fpipe.pipeline(
        lambda y, mb: y.sum(), [lambda p, x: x] * 2, OneFOneB(2), parallel=fpipe.Parallelism(mesh=mesh)
    )
    params = [p if s in step.local_stages else None for s, p in enumerate(state_of(0).params)]
    torch.manual_seed(100 + rank)  # every process its own generator
    fpipe.save_state(directory, fpipe.TrainState(params, step=1), parallel=step)
    expected = torch.rand(3)
    torch.manual_seed(0)
    loaded = fpipe.load_state(directory, params, parallel=step)
    drawn = torch.rand(3)
    # NOTE [resuming in another layout]: the same 4 processes as ("pp", "dp"), global ranks 1 and 2 swap roles
    swapped = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    other = fpipe.pipeline(
        lambda y, mb: y.sum(), [lambda p, x: x] * 2, OneFOneB(2), parallel=fpipe.Parallelism(mesh=swapped)
    )
    params = [p if s in other.local_stages else None for s, p in enumerate(state_of(0).params)]
    torch.manual_seed(7)
    with pytest.raises((ValueError, RuntimeError)) as info:
        fpipe.load_state(directory, params, parallel=other)
    kept = torch.equal(torch.rand(3), _drawn(7))  # no generator restored on any rank
    torch.manual_seed(7)
    fpipe.load_state(directory, params, parallel=other, restore_rng=False)
    after = torch.equal(torch.rand(3), _drawn(7))
    return expected, drawn, loaded.step, f"{type(info.value).__name__}: {info.value}", kept, after


def test_every_process_of_a_mesh_saves_and_restores_its_own_generator_and_refuses_another_layout(
    tmp_path: Path,
) -> None:
    results = run_ranks(4, _mesh_state, str(tmp_path), timeout=120)
    for rank, (expected, drawn, number, error, kept, after) in enumerate(results):
        assert torch.equal(expected, drawn) and number == 1
        if rank in (1, 2):
            said = f"ValueError: fpipe.load_state: this process (global rank {rank}) is pipeline rank {rank - 1} "
            assert error.startswith(said)
            assert "restore_rng=False" in error
        else:
            assert error.startswith("RuntimeError: fpipe.load_state: rank(s) [0 (dp 1), 1 (dp 0)] failed while")
        assert kept and after  # restore_rng=False keeps them too
    assert len({tuple(e.tolist()) for e, *_ in results}) == 4  # four different generators
    index = json.loads((tmp_path / (tmp_path / LATEST).read_text().strip() / INDEX).read_text())
    assert sorted(index["metadata"]["user"]["fpipe_train_state"]["rng"]) == ["0", "1", "2", "3"]


# --- Every rank or none ----------------------------------------------------------------------


def _one_rank_corrupt(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Rank 1's optimizer file is truncated, changed by one byte or deleted: every rank raises, none
    restores anything."""
    from fpipe.schedules import OneFOneB

    step = fpipe.pipeline(
        lambda y, mb: y.sum(),
        [lambda p, x: x] * 2,
        OneFOneB(2),
        parallel=fpipe.Parallelism(group=dist.group.WORLD, timeout=30),
    )
    state = state_of(0)
    params = [p if s in step.local_stages else None for s, p in enumerate(state.params)]
    opt = [o if s in step.local_stages else None for s, o in enumerate(state.optimizer_state or [])]
    out = {}
    for case in ("truncated", "one byte", "deleted"):
        root = Path(directory) / case
        version = fpipe.save_state(root, fpipe.TrainState(params, opt, step=3), parallel=step)
        if rank == 1:
            path = version / "optimizer-rank-00001-of-00002.safetensors"
            data = bytearray(path.read_bytes())
            data[-1] ^= 1  # the last byte of the last tensor
            if case == "deleted":
                path.unlink()
            else:
                path.write_bytes(data[: len(data) // 2] if case == "truncated" else data)
        dist.barrier()
        torch.manual_seed(100 + rank)
        with pytest.raises((ValueError, RuntimeError)) as info:
            fpipe.load_state(root, params, optimizer_state=opt, parallel=step)
        out[case] = (f"{type(info.value).__name__}: {info.value}", torch.equal(torch.rand(3), _drawn(100 + rank)))
    with pytest.raises((TypeError, RuntimeError)) as info:  # rank 1's template is not a list
        fpipe.load_state(root.parent / "one byte", params if rank == 0 else params[1], parallel=step)
    out["template"] = (f"{type(info.value).__name__}: {info.value}", True)
    return out


def _drawn(seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.rand(3)


def test_a_load_fails_on_every_rank_when_one_ranks_file_is_bad(tmp_path: Path) -> None:
    results = run_ranks(2, _one_rank_corrupt, str(tmp_path), timeout=60)
    for case, fragment in [("truncated", "truncated or corrupt"), ("one byte", "is corrupt"), ("deleted", "missing")]:
        (own, own_kept), (other, other_kept) = results[1][case], results[0][case]
        assert own.startswith("ValueError: fpipe.load: ") and fragment in own
        assert "optimizer-rank-00001-of-00002.safetensors" in own
        assert other.startswith("RuntimeError: fpipe.load_state: rank(s) [1] failed while reading the save")
        assert fragment in other and "optimizer-rank-00001-of-00002.safetensors" in other
        assert own_kept and other_kept, case  # no generator restored anywhere
    assert results[1]["template"][0].startswith("TypeError: fpipe.load: template must be a list")
    assert results[0]["template"][0].startswith("RuntimeError: fpipe.load_state: rank(s) [1] failed while reading")


# --- With tensor parallelism (tests/saving/_tensor_parallel_saves.py; its spawns: tests/saving/conftest.py) ---


def test_save_state_round_trips_with_tensor_parallel(tp_saves: tuple[Path, list[Any], Any]) -> None:
    full = tp_params()
    for r in tp_saves[1]:
        params, state, number, metadata = r["state"]
        check_gathered(params, full, r["pp"])
        check_gathered([None if t is None else t["m"] for t in state], full, r["pp"], state=True)
        assert (number, metadata) == (5, {"at": 1})
