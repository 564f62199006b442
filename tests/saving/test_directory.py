"""The save directory: concurrent saves take turns on its lock; ``latest`` and links stay inside it.

NOTE [save concurrency] and NOTE [the save directory] in ``fpipe/_saving/_directory.py``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import multiprocessing
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fpipe
from fpipe._saving._directory import INDEX, LATEST, LOCK
from tests._multiprocess import free_port, run_processes, run_ranks, start_process
from tests.helpers import assert_bitwise

ROUNDS, N = 8, 50_000


def _params(round_: int, rank: int) -> list[dict[str, torch.Tensor]]:
    """A save that is recognisable whole: every element of both stages is ``100 * round + rank``."""
    value = float(100 * round_ + rank)
    return [{"w": torch.full((N,), value)}, {"b": torch.full((N // 7,), value)}]


def _hammer(rank: int, world: int, directory: str) -> list[Any]:
    """Every rank saves to one directory at once, without parallel= (as each rank of a torchrun job
    calling fpipe.save alone), round after round; rank 0 loads what the round left."""
    out: list[Any] = []
    template = [{"w": torch.empty(N)}, {"b": torch.empty(N // 7)}]
    for round_ in range(ROUNDS):
        dist.barrier()
        try:
            out.append(str(fpipe.save(directory, _params(round_, rank), metadata={"round": round_, "rank": rank})))
        except Exception as error:  # the test accepts only the lock's timeout here
            out.append(f"{type(error).__name__}: {error}")
        dist.barrier()
        if rank == 0:
            loaded = fpipe.load(directory, template)
            assert loaded.metadata["round"] == round_  # the last to commit in this round
            assert_bitwise(loaded.params, _params(round_, loaded.metadata["rank"]))
            latest = (Path(directory) / LATEST).read_text().strip()
            assert sorted(os.listdir(directory)) == sorted([LOCK, LATEST, latest])  # the older ones are gone
        dist.barrier()
    return out


@pytest.mark.timeout(60)
def test_concurrent_saves_to_one_directory_each_commit_and_the_last_one_wins(tmp_path: Path) -> None:
    results = run_ranks(3, _hammer, str(tmp_path), timeout=50)
    versions = [Path(v).name for rank in results for v in rank]
    assert all(Path(v).parent == tmp_path for rank in results for v in rank), results  # no call failed
    assert len(set(versions)) == 3 * ROUNDS  # each save is a version of its own
    last = max(versions)
    assert (tmp_path / LATEST).read_text() == f"{last}\n"
    assert sorted(os.listdir(tmp_path)) == sorted([LOCK, LATEST, last])


def test_a_save_waits_for_the_lock_at_most_timeout_seconds(tmp_path: Path) -> None:
    previous = [{"w": torch.ones(3)}]
    fpipe.save(tmp_path, previous)
    fd = os.open(tmp_path / LOCK, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another save, holding the lock
        with pytest.raises(TimeoutError, match=r"another save to .* has held its lock .* \(timeout: 0.2\)"):
            fpipe.save(tmp_path, [{"w": torch.zeros(3)}], parallel=fpipe.Parallelism(timeout=0.2))
    finally:
        os.close(fd)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert_bitwise(fpipe.load(tmp_path, previous).params, previous)


def test_without_file_locks_a_save_warns_and_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    params = [{"w": torch.ones(3)}]
    with monkeypatch.context() as patch:
        patch.setattr(fcntl, "flock", no_locks)
        with pytest.warns(RuntimeWarning, match=r"cannot be locked \(No locks available\)") as record:
            fpipe.save(tmp_path / "filesystem", params)
    assert record[0].filename == __file__  # the warning points at the call to save
    assert_bitwise(fpipe.load(tmp_path / "filesystem", params).params, params)
    monkeypatch.setitem(sys.modules, "fcntl", None)  # Windows: import fcntl fails
    with pytest.warns(RuntimeWarning, match=r"cannot be locked \(this platform has no fcntl\)"):
        fpipe.save(tmp_path / "platform", params)
    assert_bitwise(fpipe.load(tmp_path / "platform", params).params, params)


def test_a_save_is_numbered_after_everything_in_the_directory_and_removes_what_is_older(tmp_path: Path) -> None:
    params = [{"w": torch.ones(3)}]
    fpipe.save(tmp_path, params)
    (tmp_path / "v000009-0badf00d").mkdir()  # e.g. a version renamed into place, never committed
    (tmp_path / ".tmp-v000008-0badf00d").mkdir()  # a killed save
    (tmp_path / "latest.tmp-0badf00d").write_text("v000009-0badf00d\n")  # a killed commit's pointer
    version = fpipe.save(tmp_path, params)
    assert version.name.startswith("v000010-")
    assert sorted(os.listdir(tmp_path)) == sorted([LOCK, LATEST, version.name])
    # A directory listing that is behind (NFS) still shows latest, so numbers never go back.
    (tmp_path / LATEST).write_text("v000041-0badf00d\n")
    assert fpipe.save(tmp_path, params).name.startswith("v000042-")


# --- Links ------------------------------------------------------------------------------------


def test_latest_the_version_and_the_index_may_not_lead_outside(tmp_path: Path) -> None:
    params = [{"w": torch.ones(3)}]
    elsewhere = fpipe.save(tmp_path / "elsewhere", [{"w": torch.full((3,), 7.0)}])
    save = tmp_path / "save"
    version = fpipe.save(save, params)
    pointer = save / LATEST
    pointer.unlink()
    pointer.symlink_to(tmp_path / "elsewhere" / LATEST)  # would name a version that exists here too
    with pytest.raises(ValueError, match=r"latest is a symbolic link leading outside"):
        fpipe.load(save, params)
    pointer.unlink()
    pointer.write_text(f"{elsewhere.name}\n")
    (save / elsewhere.name).symlink_to(elsewhere)  # a version that is a link to another save
    with pytest.raises(ValueError, match=rf"{elsewhere.name} is a symbolic link leading outside"):
        fpipe.load(save, params)
    pointer.write_text(f"{version.name}\n")
    (version / INDEX).rename(save / "index")
    (version / INDEX).symlink_to(elsewhere / INDEX)
    with pytest.raises(ValueError, match=r"model.safetensors.index.json is a symbolic link leading outside"):
        fpipe.load(save, params)
    (version / INDEX).unlink()
    (version / INDEX).symlink_to(save / "index")  # leads to the save directory, not into the version
    with pytest.raises(ValueError, match="leading outside"):
        fpipe.load(save, params)
    (version / INDEX).unlink()
    (save / "index").rename(version / "index")
    (version / INDEX).symlink_to("index")  # a link to another file of the version is followed
    assert_bitwise(fpipe.load(save, params).params, params)


def _save_and_wait(directory: str, release: Any) -> None:
    """Another run: save into ``directory``, then stay alive until ``release`` is set."""
    fpipe.save(directory, [{"w": torch.zeros(3)}])
    release.wait(30)


def test_a_second_live_run_saving_into_the_directory_is_warned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [a second live writer]: warned while the other run lives, not once it has exited."""
    for name in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)  # two runs of no job
    params = [{"w": torch.ones(3)}]
    release = multiprocessing.get_context("forkserver").Event()
    other = start_process(_save_and_wait, str(tmp_path), release)
    try:
        while not (tmp_path / LATEST).exists() and other.is_alive():
            other.join(0.05)
        said = rf"another run saves into .*process {other.pid} \(job: None\)"
        with pytest.warns(RuntimeWarning, match=said) as record:
            fpipe.save(tmp_path, params)
        assert record[0].filename == __file__  # the warning points at the call to save
    finally:
        release.set()
        other.join(30)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    other = start_process(_save_and_wait, str(tmp_path), release)  # released: saves and exits
    other.join(30)
    assert other.exitcode == 0
    fpipe.save(tmp_path, params)  # its writer is gone: no warning (warnings are errors here)
    assert_bitwise(fpipe.load(tmp_path, params).params, params)


def _jobs(index: int, directory: str, port: int, said: str) -> None:
    """Processes 0 and 1 are one job (``init_method="tcp://..."``), process 2 another
    (``"file://..."``), with no launcher's environment. In turn each saves into ``directory`` without ``parallel=``
    while the others live, and writes the warnings it got into ``said/<index>``."""
    for name in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        os.environ.pop(name, None)
    if index < 2:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=2)
    else:
        dist.init_process_group("gloo", init_method=f"file://{said}/store", rank=0, world_size=1)
    try:
        deadline = time.monotonic() + 60
        while index > 0 and not Path(said, str(index - 1)).exists():  # the previous one's turn
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fpipe.save(directory, [{"w": torch.full((3,), float(index))}])
        Path(said, f"{index}.tmp").write_text(json.dumps([str(w.message) for w in caught]))
        os.replace(Path(said, f"{index}.tmp"), Path(said, str(index)))
        while not Path(said, "2").exists():  # alive until the last one has saved
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        dist.destroy_process_group()


def test_a_job_is_told_by_its_store_whatever_its_init_method(tmp_path: Path) -> None:
    """NOTE [a second live writer]: with ``init_method="tcp://..."`` and no environment, the
    processes of one job saving in turn are not warned of each other, and another job is, both
    named by their stores (before, every such process was of "no job")."""
    port, said = free_port(), tmp_path / "said"
    said.mkdir()
    assert run_processes(3, _jobs, str(tmp_path / "save"), port, str(said), timeout=90) == [0, 0, 0]
    warned = [json.loads((said / str(i)).read_text()) for i in range(3)]
    assert warned[:2] == [[], []]
    assert len(warned[2]) == 1 and f"(job: 127.0.0.1:{port}), still alive" in warned[2][0], warned[2]
    assert f"(job: file://{said}/store)" in warned[2][0], warned[2]
