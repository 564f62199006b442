"""``fpipe.save`` and ``fpipe.load``: bitwise round trips, resharding, atomicity, validation, ranks.

The model is a dict of tensors keyed by global name (``layers.3.w``, ``named_weights`` of
tests/helpers.py); ``stage_weights`` groups its layers into stages, with the embedding tied
between the first and the last stage.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import optree
import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

import fpipe
from fpipe._saving._directory import INDEX, LATEST, LOCK
from fpipe._saving._store import MAX_HEADER_BYTES
from fpipe.schedules import Interleaved1F1B, OneFOneB
from tests._multiprocess import run_ranks
from tests.helpers import (
    EIGHT_STAGES,
    FOUR_STAGES,
    NAMED_VOCAB,
    NAMED_WIDTH,
    ONE_STAGE,
    TWO_STAGES,
    assert_bitwise,
    named_weights,
    stage_weights,
)
from tests.saving._tensor_parallel_saves import (
    PLACEMENTS,
    check_gathered,
    distribute_tp,
    gather_tp,
    tp_params,
)
from tests.saving._tools import edit_index, kill_when_half_written, read_index, template

# --- Round trips ------------------------------------------------------------------------------

Pair = collections.namedtuple("Pair", "first second")


def test_round_trip_is_bitwise_for_every_kind_of_leaf(tmp_path: Path) -> None:
    x = torch.randn(3, 4)
    params = [
        {
            "f64": torch.randn(2, 3),
            "f32": torch.randn(5, dtype=torch.float32),
            "bf16": torch.randn(3, 2).to(torch.bfloat16),
            "f16": torch.tensor([float("nan"), -0.0, 1e-8], dtype=torch.float16),
            "int": torch.arange(6).reshape(2, 3),
            "mask": torch.tensor([True, False, True]),
            "c64": torch.randn(2, dtype=torch.complex64).conj(),  # a lazily conjugated view
            "scalar": torch.tensor(3.5),
            "empty": torch.empty(0, 3),
            "strided": x.t(),  # not contiguous
            "nothing": None,
        },
        {"pair": Pair(torch.randn(2), [torch.randn(1), torch.zeros(2, dtype=torch.int8)])},
    ]
    path = fpipe.save(tmp_path, params)
    assert path.parent == tmp_path and (tmp_path / LATEST).read_text() == f"{path.name}\n"
    params_loaded, optimizer_state, metadata = fpipe.load(tmp_path, params)
    assert_bitwise(params_loaded, params)
    assert optimizer_state is None and metadata == {}
    assert params_loaded[0]["f64"].data_ptr() != params[0]["f64"].data_ptr()  # new tensors
    index = read_index(tmp_path)
    names = ["f64", "f32", "bf16", "f16", "int", "mask", "c64", "scalar", "empty", "strided"]
    assert sorted(index["weight_map"]) == sorted([*names, "pair.first", "pair.second.0", "pair.second.1"])
    assert set(index["weight_map"].values()) == {"model-rank-00000-of-00001.safetensors"}
    assert index["metadata"]["format"] == "fpipe" and index["metadata"]["num_stages"] == 2
    assert_bitwise(fpipe.load(path, params).params, params)  # the version directory loads too


def test_names_are_key_paths_joined_by_dots(tmp_path: Path) -> None:
    w = [torch.randn(2) for _ in range(3)]
    nested = [{"layers": {"0": {"w": w[0]}, "1": {"w": w[1]}}}, {"layers": {"2": {"w": w[2]}}}]
    fpipe.save(tmp_path, nested)
    assert sorted(read_index(tmp_path)["weight_map"]) == ["layers.0.w", "layers.1.w", "layers.2.w"]
    as_list = [{"layers": [{"w": torch.empty(2)}, {"w": torch.empty(2)}, {"w": torch.empty(2)}]}]
    assert_bitwise(fpipe.load(tmp_path, as_list).params, [{"layers": [{"w": t} for t in w]}])
    flat = [{"layers.2.w": torch.empty(2), "layers.0.w": torch.empty(2)}, {"layers.1.w": torch.empty(2)}]
    assert_bitwise(fpipe.load(tmp_path, flat).params, [{"layers.2.w": w[2], "layers.0.w": w[0]}, {"layers.1.w": w[1]}])


def test_reshard_4_2_1_interleaved_and_back(tmp_path: Path) -> None:
    weights = named_weights()
    four = stage_weights(weights, FOUR_STAGES)
    fpipe.save(tmp_path / "a", four)
    two = fpipe.load(tmp_path / "a", template(stage_weights(weights, TWO_STAGES))).params
    assert_bitwise(two, stage_weights(weights, TWO_STAGES))
    fpipe.save(tmp_path / "b", two)
    one = fpipe.load(tmp_path / "b", template(stage_weights(weights, ONE_STAGE))).params
    assert_bitwise(one, stage_weights(weights, ONE_STAGE))
    fpipe.save(tmp_path / "c", one)
    # Interleaved 1F1B over 2 ranks, 8 stages: rank r holds stages r, r + 2, r + 4, r + 6.
    placement = Interleaved1F1B(4, stages_per_rank=4).program(8, 2).placement()
    eight = stage_weights(weights, EIGHT_STAGES)
    per_rank = [[t if placement[s] == r else None for s, t in enumerate(template(eight))] for r in range(2)]
    loaded = [fpipe.load(tmp_path / "c", p, strict=False).params for p in per_rank]
    for r in range(2):
        assert_bitwise(loaded[r], [t if placement[s] == r else None for s, t in enumerate(eight)])
    with pytest.raises(ValueError, match="no stage of the template has"):
        fpipe.load(tmp_path / "c", per_rank[0])  # alone, rank 0's half is not the whole save
    interleaved = [loaded[placement[s]][s] for s in range(8)]
    fpipe.save(tmp_path / "d", interleaved)
    assert_bitwise(fpipe.load(tmp_path / "d", template(four)).params, four)
    assert read_index(tmp_path / "a")["weight_map"].keys() == read_index(tmp_path / "d")["weight_map"].keys()


def test_tied_parameters_are_saved_once_and_loaded_into_every_stage(tmp_path: Path) -> None:
    params = stage_weights(named_weights(), FOUR_STAGES)
    fpipe.save(tmp_path, params)
    with safe_open(
        tmp_path / (tmp_path / LATEST).read_text().strip() / "model-rank-00000-of-00001.safetensors", "pt"
    ) as f:
        assert sorted(f.keys()).count("embed") == 1
    loaded = fpipe.load(tmp_path, params).params
    assert_bitwise(loaded[0]["embed"], loaded[3]["embed"])
    assert loaded[0]["embed"].data_ptr() != loaded[3]["embed"].data_ptr()  # each stage its own copy


def test_optimizer_state_and_metadata_round_trip(tmp_path: Path) -> None:
    params = stage_weights(named_weights(), TWO_STAGES)
    m, v = (
        stage_weights(named_weights(seed=1), TWO_STAGES),
        stage_weights(named_weights(seed=2), TWO_STAGES),
    )  # tied moments are equal too
    state = [{"m": m[s], "v": v[s], "step": torch.tensor(7)} for s in range(2)]
    metadata = {"step": 7, "config": {"lr": 3e-3, "schedule": "1f1b", "sizes": [1, 2]}, "note": None}
    fpipe.save(tmp_path, params, optimizer_state=state, metadata=metadata)
    index = read_index(tmp_path)
    assert "step" in index["optimizer_state_map"] and "m.embed" in index["optimizer_state_map"]
    assert set(index["optimizer_state_map"].values()) == {"optimizer-rank-00000-of-00001.safetensors"}
    assert index["metadata"]["user"] == metadata
    loaded = fpipe.load(tmp_path, template(params), optimizer_state=template(state))
    assert_bitwise(loaded.params, params)
    assert_bitwise(loaded.optimizer_state, state)
    assert loaded.metadata == metadata
    # Optimizer state resharded to one stage: the counter, tied across stages, loads once.
    one_state = {"m": {}, "v": {}, "step": torch.empty((), dtype=torch.int64)}
    for s in state:
        one_state["m"].update(s["m"])
        one_state["v"].update(s["v"])
    merged = fpipe.load(
        tmp_path, template(stage_weights(named_weights(), ONE_STAGE)), optimizer_state=[one_state]
    ).optimizer_state
    assert merged is not None and merged[0]["step"].item() == 7
    assert_bitwise(merged[0]["v"]["layers.6.w"], state[1]["v"]["layers.6.w"])


# --- Atomicity --------------------------------------------------------------------------------

_KILLED_SAVE = """
store._write = half_write
fpipe.save(sys.argv[1], [{"w": torch.full((1000,), 2.0)}, {"b": torch.full((10,), 2.0)}])
"""


def test_a_killed_save_keeps_the_previous_one(tmp_path: Path) -> None:
    params = [{"w": torch.ones(1000)}, {"b": torch.ones(10)}]
    first = fpipe.save(tmp_path / "save", params)
    kill_when_half_written(_KILLED_SAVE, tmp_path / "save", tmp_path / "half-written")
    (tmp,) = [p for p in (tmp_path / "save").iterdir() if p.name.startswith(".tmp-")]
    assert any(tmp.iterdir()) and not (tmp / INDEX).exists()  # the partial save is there, uncommitted
    assert (tmp_path / "save" / LATEST).read_text().strip() == first.name
    assert_bitwise(fpipe.load(tmp_path / "save", params).params, params)
    with pytest.raises(FileNotFoundError, match="no committed save"):
        fpipe.load(tmp, params)
    # The next save commits and clears the debris of the killed one and the previous version.
    params[0]["w"] = torch.full((1000,), 3.0)
    third = fpipe.save(tmp_path / "save", params)
    assert sorted(p.name for p in (tmp_path / "save").iterdir()) == sorted([LOCK, LATEST, third.name])
    assert int(third.name[1:7]) == int(first.name[1:7]) + 2  # numbered after the killed one
    assert_bitwise(fpipe.load(tmp_path / "save", params).params, params)


def test_a_failed_save_keeps_the_previous_one_and_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    params = [{"w": torch.ones(3)}]
    fpipe.save(tmp_path, params)

    def failing(f: Any, data: memoryview) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("fpipe._saving._store._write", failing)
    with pytest.raises(OSError, match="No space left"):
        fpipe.save(tmp_path, [{"w": torch.zeros(3)}])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert_bitwise(fpipe.load(tmp_path, params).params, params)


def test_uncommitted_directories_are_refused(tmp_path: Path) -> None:
    params = [{"w": torch.ones(3)}]
    with pytest.raises(FileNotFoundError, match="no committed save"):
        fpipe.load(tmp_path, params)
    version = fpipe.save(tmp_path / "save", params)
    partial = tmp_path / "partial"
    partial.mkdir()
    for file in version.iterdir():
        if file.name != INDEX:
            (partial / file.name).write_bytes(file.read_bytes())
    with pytest.raises(FileNotFoundError, match="no committed save"):
        fpipe.load(partial, params)
    # A version renamed into place whose ``latest`` was never written is not loaded either.
    (tmp_path / "save" / "v000009-0badf00d").mkdir()
    assert_bitwise(fpipe.load(tmp_path / "save", params).params, params)
    (tmp_path / "save" / LATEST).write_text("v000009-0badf00d\n")
    with pytest.raises(ValueError, match="which is not a committed save"):
        fpipe.load(tmp_path / "save", params)


# --- Validation -------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    fpipe.save(tmp_path, stage_weights(named_weights(), TWO_STAGES))
    return tmp_path


def test_a_shape_mismatch_names_the_key_path_and_both_shapes(saved: Path) -> None:
    bad = template(stage_weights(named_weights(), TWO_STAGES))
    bad[1]["layers.5.w"] = torch.empty(NAMED_WIDTH, NAMED_WIDTH + 1)
    with pytest.raises(
        ValueError,
        match=r"template\[1\]\['layers.5.w'\] \(name 'layers.5.w'\): shape on disk \[4, 4\], expected \[4, 5\]",
    ):
        fpipe.load(saved, bad)


def test_a_dtype_mismatch_names_the_key_path_and_both_dtypes(saved: Path) -> None:
    bad = template(stage_weights(named_weights(), TWO_STAGES))
    bad[0]["layers.0.b"] = torch.empty(NAMED_WIDTH, dtype=torch.float64)
    bad[1]["norm"] = torch.empty(NAMED_WIDTH, dtype=torch.float32)
    with pytest.raises(ValueError) as info:
        fpipe.load(saved, bad)
    message = str(info.value)
    assert "template[0]['layers.0.b'] (name 'layers.0.b'): dtype on disk float32, expected float64" in message
    assert "template[1]['norm'] (name 'norm'): dtype on disk bfloat16, expected float32" in message


def test_missing_and_extra_names_are_listed(saved: Path) -> None:
    more = template(stage_weights(named_weights(), TWO_STAGES))
    more[1]["layers.9.w"] = torch.empty(NAMED_WIDTH, NAMED_WIDTH)
    more[1]["head"] = torch.empty(NAMED_WIDTH, NAMED_VOCAB)
    with pytest.raises(
        ValueError,
        match=r"2 name\(s\) of the template are missing from the save .*: \['head' \(template\[1\]\['head'\]\), 'lay",
    ):
        fpipe.load(saved, more)
    fewer = template(stage_weights(named_weights(), TWO_STAGES))
    del fewer[0]["layers.1.w"], fewer[1]["layers.7.b"]
    with pytest.raises(
        ValueError, match=r"has 2 parameter name\(s\) that no stage of the template has: \['layers.1.w', 'layers.7.b'\]"
    ):
        fpipe.load(saved, fewer)
    loaded = fpipe.load(saved, fewer, strict=False).params
    assert "layers.1.w" not in loaded[0] and torch.equal(loaded[0]["layers.0.w"], named_weights()["layers.0.w"])


def test_template_errors(saved: Path) -> None:
    with pytest.raises(TypeError, match=r"template\[0\]\['embed'\] is a int; template leaves are tensors"):
        fpipe.load(saved, [{"embed": 3}])
    with pytest.raises(TypeError, match="template must be a list with one pytree per stage"):
        fpipe.load(saved, {"embed": torch.empty(NAMED_VOCAB, NAMED_WIDTH)})
    with pytest.raises(ValueError, match="has no optimizer_state; it was saved without it"):
        fpipe.load(
            saved, template(stage_weights(named_weights(), TWO_STAGES)), optimizer_state=[{"step": torch.empty(())}]
        )
    with pytest.raises(ValueError, match=r"both get the name 'a\.b'"):
        fpipe.load(saved, [{"a.b": torch.empty(1), "a": {"b": torch.empty(1)}}])


def test_save_errors(tmp_path: Path) -> None:
    cases: list[tuple[Any, dict[str, Any], type[Exception], str]] = [
        ([{"w": torch.ones(2), "step": 3}], {}, TypeError, r"params\[0\]\['step'\] is a int, not a tensor"),
        ([torch.ones(2)], {}, TypeError, r"params\[0\] is a tensor, not a pytree of named tensors"),
        (
            [{"w": torch.ones(2)}, {"w": torch.zeros(2)}],
            {},
            ValueError,
            r"params\[0\]\['w'\] and params\[1\]\['w'\] have the same name 'w' but different values",
        ),
        (
            [{"w": torch.ones(2)}, {"w": torch.ones(2, dtype=torch.float32)}],
            {},
            ValueError,
            "float64\\[2\\] sha256 .* vs float32\\[2\\]",
        ),
        ([{"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}], {}, ValueError, "both get the name 'a.b'"),
        ([{"z": torch.ones(2, dtype=torch.complex128)}], {}, TypeError, "complex128, which safetensors cannot store"),
        ([{"w": torch.ones(2)}], {"metadata": {"f": print}}, TypeError, "metadata must be JSON-serializable"),
        ([{"w": torch.ones(2)}], {"optimizer_state": []}, ValueError, "optimizer_state has 0 entries but params has 1"),
        ({"w": torch.ones(2)}, {}, TypeError, "params must be a list with one pytree per stage"),
        (
            [{"w": torch.ones(2)}],
            {"parallel": "mesh"},
            TypeError,
            "parallel must be an fpipe.Parallelism or a Step from fpipe.pipeline",
        ),
    ]
    for params, options, error, match in cases:
        with pytest.raises(error, match=match):
            fpipe.save(tmp_path, params, **options)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_the_name_safetensors_reserves_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """A leaf named ``__metadata__`` used to be written into the header's reserved slot: the save
    committed (deleting the previous one) and could never be loaded."""
    previous = [{"w": torch.ones(2)}]
    fpipe.save(tmp_path, previous)
    with pytest.raises(ValueError, match=r"params\[0\]\['__metadata__'\] gets the name '__metadata__'"):
        fpipe.save(tmp_path, [{"__metadata__": torch.ones(2)}])
    with pytest.raises(ValueError, match=r"optimizer_state\[0\]\['__metadata__'\]"):
        fpipe.save(tmp_path, previous, optimizer_state=[{"__metadata__": torch.ones(2)}])
    assert_bitwise(fpipe.load(tmp_path, previous).params, previous)
    nested = [{"__metadata__": {"w": torch.ones(2)}}]  # the name is "__metadata__.w": fine
    fpipe.save(tmp_path, nested)
    assert_bitwise(fpipe.load(tmp_path, nested).params, nested)


# --- Corruption ---------------------------------------------------------------------------------


def _files(path: Path) -> list[Path]:
    version = path / (path / LATEST).read_text().strip()
    return sorted(version.glob("*.safetensors"))


def test_truncated_and_missing_files_are_detected(saved: Path) -> None:
    (file,) = _files(saved)
    data = file.read_bytes()
    file.write_bytes(data[:-5])
    with pytest.raises(
        ValueError, match=f"should have {len(data)} bytes but it has {len(data) - 5}: the file is truncated"
    ):
        fpipe.load(saved, template(stage_weights(named_weights(), TWO_STAGES)))
    file.unlink()
    with pytest.raises(ValueError, match="but it is missing"):
        fpipe.load(saved, template(stage_weights(named_weights(), TWO_STAGES)))


def test_corrupt_bytes_and_headers_are_detected(saved: Path) -> None:
    (file,) = _files(saved)
    data = bytearray(file.read_bytes())
    flipped = bytearray(data)
    flipped[-3] ^= 0x40  # a tensor's byte
    file.write_bytes(flipped)
    with pytest.raises(ValueError, match=r"is corrupt: the bytes of '.*' do not match their sha256 in the index"):
        fpipe.load(saved, template(stage_weights(named_weights(), TWO_STAGES)))
    header = bytearray(data)
    header[8] = ord("]")  # the JSON header no longer parses
    file.write_bytes(header)
    with pytest.raises(ValueError, match=r"is corrupt: .*Load an intact save"):
        fpipe.load(saved, template(stage_weights(named_weights(), TWO_STAGES)))
    (file.parent / INDEX).write_text('{"metadata": ')
    with pytest.raises(ValueError, match=r"is not an index written by fpipe\.save"):
        fpipe.load(saved, template(stage_weights(named_weights(), TWO_STAGES)))


def test_a_header_past_the_limit_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    """NOTE [header size]: a valid header padded with JSON spaces past MAX_HEADER_BYTES, in a file
    whose size the index announces."""
    params = [{"w": torch.ones(3)}]
    fpipe.save(tmp_path, params)
    (file,) = _files(tmp_path)
    data = file.read_bytes()
    n, padded = int.from_bytes(data[:8], "little"), MAX_HEADER_BYTES + 8
    file.write_bytes(padded.to_bytes(8, "little") + data[8 : 8 + n] + b" " * (padded - n) + data[8 + n :])
    index = json.loads((file.parent / INDEX).read_text())
    index["files"][file.name]["bytes"] = file.stat().st_size
    (file.parent / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"{file.name} has a safetensors header of {padded} bytes, more than fpipe"):
        fpipe.load(tmp_path, params)


def test_load_reads_only_the_files_it_needs(tmp_path: Path) -> None:
    """Stage 3's tensors live in their own file here; corrupting it does not matter to stage 0."""
    params = stage_weights(named_weights(), FOUR_STAGES)
    del params[3]["embed"]
    fpipe.save(tmp_path, [params[0], None, None, None])
    fpipe.save(tmp_path / "other", [None, None, None, params[3]])
    (file,) = _files(tmp_path / "other")
    file.write_bytes(file.read_bytes()[:-1])
    assert_bitwise(fpipe.load(tmp_path, [params[0]]).params, [params[0]])


# --- Many ranks ---------------------------------------------------------------------------------


def _interleaved_save(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Rank r holds stages r and r + 2 of 4 (Interleaved 1F1B); the embedding is tied across ranks."""
    step = fpipe.pipeline(
        lambda y, mb: y.sum(),
        [lambda p, x: x] * 4,
        Interleaved1F1B(2),
        parallel=fpipe.Parallelism(group=dist.group.WORLD),
    )
    full = stage_weights(named_weights(), FOUR_STAGES)
    mine = [t if s in step.local_stages else None for s, t in enumerate(full)]
    state = [None if t is None else {"m": optree.tree_map(torch.ones_like, t), "step": torch.tensor(5)} for t in mine]
    out: dict[str, Any] = {"stages": step.local_stages}
    out["version"] = str(fpipe.save(directory, mine, optimizer_state=state, metadata={"step": 5}, parallel=step))
    loaded = fpipe.load(directory, template(mine), optimizer_state=template(state), parallel=step)
    out["loaded"] = loaded.params
    out["state"] = loaded.optimizer_state
    # A rank that fails makes every rank fail, and the previous save stays.
    bad = [t if t is None else {**t, "count": 1} for t in mine] if rank == 1 else mine
    try:
        fpipe.save(directory, bad, parallel=step)
    except (TypeError, RuntimeError) as error:
        out["error"] = f"{type(error).__name__}: {error}"
    # Without the others, a rank's template does not cover the save.
    try:
        fpipe.load(directory, template(mine))
    except ValueError as error:
        out["alone"] = str(error)
    return out


def test_each_rank_writes_its_own_stages(tmp_path: Path) -> None:
    results = run_ranks(2, _interleaved_save, str(tmp_path))
    assert [r["stages"] for r in results] == [(0, 2), (1, 3)]
    version = Path(results[0]["version"])
    assert results[1]["version"] == str(version) and (tmp_path / LATEST).read_text().strip() == version.name
    index = read_index(tmp_path)
    assert index["files"].keys() == {
        "model-rank-00000-of-00002.safetensors",
        "model-rank-00001-of-00002.safetensors",
        "optimizer-rank-00000-of-00002.safetensors",
        "optimizer-rank-00001-of-00002.safetensors",
    }
    full = stage_weights(named_weights(), FOUR_STAGES)
    for rank, stages in enumerate([(0, 2), (1, 3)]):
        assert {f["rank"] for name, f in index["files"].items() if f"rank-0000{rank}" in name} == {rank}
        with safe_open(version / f"model-rank-0000{rank}-of-00002.safetensors", "pt") as f:
            names = set(f.keys())
        expected = {n for s in stages for n in full[s]} - ({"embed"} if rank == 1 else set())  # tied: rank 0 writes it
        assert names == expected
    with safe_open(version / "optimizer-rank-00001-of-00002.safetensors", "pt") as f:
        names = set(f.keys())
    assert "step" not in names and "m.layers.2.w" in names  # the counter is written once, by rank 0
    # One process loads what two wrote, bitwise.
    assert_bitwise(fpipe.load(tmp_path, template(full)).params, full)
    one = fpipe.load(
        tmp_path,
        template(stage_weights(named_weights(), ONE_STAGE)),
        optimizer_state=[{"step": torch.empty((), dtype=torch.int64)}],
        strict=False,
    )
    assert (
        one.metadata == {"step": 5} and one.optimizer_state is not None and one.optimizer_state[0]["step"].item() == 5
    )
    for rank, result in enumerate(results):
        assert_bitwise(result["loaded"], [t if s in result["stages"] else None for s, t in enumerate(full)])
        assert result["state"][rank + 2]["step"].item() == 5
    assert results[1]["error"].startswith("TypeError: fpipe.save: params[1]['count'] is a int, not a tensor")
    assert results[0]["error"].startswith(
        "RuntimeError: fpipe.save: rank(s) [1] failed while naming their tensors; their own errors say why "
        "(rank 1: TypeError: fpipe.save: params[1]['count'] is a int, not a tensor"
    )
    assert "no stage of the template has" in results[0]["alone"]
    assert read_index(tmp_path) == index and not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def _mesh_save(rank: int, world: int, directory: str) -> tuple[tuple[int, ...], str]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    step = fpipe.pipeline(
        lambda y, mb: y.sum(), [lambda p, x: x] * 2, OneFOneB(2), parallel=fpipe.Parallelism(mesh=mesh)
    )
    full = stage_weights(named_weights(), TWO_STAGES)
    mine = [t if s in step.local_stages else None for s, t in enumerate(full)]
    return step.local_stages, str(fpipe.save(directory, mine, parallel=step))


def test_data_parallel_replicas_write_nothing(tmp_path: Path) -> None:
    results = run_ranks(4, _mesh_save, str(tmp_path))
    assert len({version for _, version in results}) == 1
    assert {f["rank"] for f in read_index(tmp_path)["files"].values()} == {0, 1}
    assert_bitwise(
        fpipe.load(tmp_path, template(stage_weights(named_weights(), TWO_STAGES))).params,
        stage_weights(named_weights(), TWO_STAGES),
    )


# --- Hostile indexes (NOTE [trust model]) -------------------------------------------------------

FILE = "model-rank-00000-of-00001.safetensors"


@pytest.fixture
def hostile(tmp_path: Path) -> tuple[Path, dict[str, Any], Path]:
    """A save of ``{"w": ones(3)}``, its index, and outside it a copy of its file that would load."""
    version = fpipe.save(tmp_path / "save", [{"w": torch.ones(3)}])
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes((version / FILE).read_bytes())
    return version, json.loads((version / INDEX).read_text()), secret


def _rename(index: dict[str, Any], name: str) -> dict[str, Any]:
    """``index`` with its one file called ``name``."""
    out = json.loads(json.dumps(index))
    out["weight_map"]["w"] = name
    out["tensors"] = {name: out["tensors"][FILE]}
    out["files"] = {name: out["files"][FILE]}
    return out


def test_file_names_that_leave_the_save_directory_are_refused_unread(
    hostile: tuple[Path, dict[str, Any], Path],
) -> None:
    version, index, secret = hostile
    (version / FILE).unlink()
    size = secret.stat().st_size
    for name in ["../../secret.safetensors", str(secret), "..\\..\\secret.safetensors", ".secret.safetensors"]:
        (version / INDEX).write_text(json.dumps(_rename(index, name)))
        with pytest.raises(ValueError, match="files names a file that is not a plain file name") as info:
            fpipe.load(version.parent, [{"w": torch.empty(3)}])
        assert str(size) not in str(info.value)
    (version / INDEX).write_text(json.dumps(_rename(index, "secret.safetensors")))  # where a plain name leads
    with pytest.raises(ValueError, match="it is missing"):
        fpipe.load(version.parent, [{"w": torch.empty(3)}])


def test_a_file_linked_outside_is_refused_without_a_word_about_its_target(
    hostile: tuple[Path, dict[str, Any], Path],
) -> None:
    version, _, secret = hostile
    (version / FILE).unlink()
    (version / FILE).symlink_to(secret)
    with pytest.raises(ValueError, match=f"{FILE} is a symbolic link leading outside") as info:
        fpipe.load(version.parent, [{"w": torch.empty(3)}])
    (version / FILE).unlink()
    (version / FILE).symlink_to(secret.with_name("missing.safetensors"))
    with pytest.raises(ValueError) as missing:
        fpipe.load(version.parent, [{"w": torch.empty(3)}])
    assert str(info.value) == str(missing.value)  # whether the target exists does not show
    assert str(secret.stat().st_size) not in str(info.value)


W = ["tensors", FILE, "w"]
MALFORMED: list[tuple[Any, str]] = [
    (b'{"a": "\xff"}', r"it is not JSON \(UnicodeDecodeError"),
    (b'{"metadata": ', r"it is not JSON \(JSONDecodeError"),
    (b"[" * 100_000, r"it is not JSON \(RecursionError"),
    (b"[1, 2]", r"the index should be a JSON object \(the index: \[1, 2\]\)"),
    (edit_index(["metadata"], KeyError), r"'metadata' is missing \(keys there: \['files', 'tensors', 'weight_map'\]\)"),
    (
        edit_index(["metadata", "format"], "other"),
        r"it is not in format 'fpipe' version 1 \(metadata: format 'other', version 1\)",
    ),
    (edit_index(["metadata", "user"], []), r"metadata\['user'\] should be a JSON object \(metadata\['user'\]: \[\]\)"),
    (edit_index(["files"], []), r"'files' should be a JSON object"),
    (
        edit_index(["files", FILE], KeyError),
        rf"weight_map\['w'\] names a file that 'files' does not list \(.*: '{FILE}'\)",
    ),
    (edit_index(["files", FILE, "bytes"], "12"), rf"files\['{FILE}'\]\['bytes'\] should be an int >= 0 \(.*: '12'\)"),
    (edit_index(["files", FILE, "bytes"], -1), r"\['bytes'\] should be an int >= 0 \(.*: -1\)"),
    (edit_index(["files", FILE, "bytes"], True), r"\['bytes'\] should be an int >= 0 \(.*: True\)"),
    (edit_index(["tensors", FILE], KeyError), rf"tensors\['{FILE}'\]\['w'\] is missing"),
    (edit_index(["tensors", FILE], 3), rf"tensors\['{FILE}'\] should be a JSON object"),
    (edit_index(["weight_map"], KeyError), r"'weight_map' is missing"),
    (edit_index(["weight_map"], None), r"'weight_map' should be a JSON object \('weight_map': None\)"),
    (edit_index(["weight_map", "w"], 3), r"weight_map\['w'\] should be a file name or a non-empty list of them"),
    (edit_index(["weight_map", "w"], []), r"weight_map\['w'\] should be a file name or a non-empty list"),
    (edit_index(["optimizer_state_map"], "x"), r"'optimizer_state_map' should be a JSON object"),
    (edit_index([*W, "dtype"], "F99"), r"\['dtype'\] should be one of \[.*\] \(.*\['dtype'\]: 'F99'\)"),
    (edit_index([*W, "dtype"], KeyError), r"\['w'\]\['dtype'\] is missing \(keys there: \['sha256', 'shape'\]\)"),
    (edit_index([*W, "shape"], "abc"), r"\['shape'\] should be a list of ints >= 0 \(.*: 'abc'\)"),
    (edit_index([*W, "shape"], [3, -1]), r"\['shape'\] should be a list of ints >= 0 \(.*: \[3, -1\]\)"),
    (edit_index([*W, "sha256"], 5), r"\['sha256'\] should be 64 hex digits \(.*: 5\)"),
    (edit_index([*W, "sha256"], "../x"), r"\['sha256'\] should be 64 hex digits"),
    (edit_index(["weight_map", "w"], [FILE]), r"\['w'\]\['shard'\] is missing"),  # a sharded entry: pieces
    (edit_index([*W, "shard"], [1, 1]), r"\['shard'\] should be \[0, 1\]"),
]


def test_malformed_indexes_say_which_field_is_wrong(hostile: tuple[Path, dict[str, Any], Path]) -> None:
    version, index, _ = hostile
    for malformed, fragment in MALFORMED:
        if isinstance(malformed, bytes):
            (version / INDEX).write_bytes(malformed)
        else:
            edited = json.loads(json.dumps(index))
            if fragment.startswith(r"\['shard'\]"):
                edited["weight_map"]["w"] = [FILE]
            malformed(edited)
            (version / INDEX).write_text(json.dumps(edited))
        with pytest.raises(ValueError, match=r"is not an index written by fpipe\.save: (.*\])?" + fragment):
            fpipe.load(version.parent, [{"w": torch.empty(3)}])
    sharded = json.loads(json.dumps(index))
    sharded["weight_map"]["w"] = [FILE]
    sharded["tensors"][FILE]["w"].update(shard=[0, 1], full_shape=[4])
    (version / INDEX).write_text(json.dumps(sharded))
    with pytest.raises(ValueError, match=r"the pieces of 'w' disagree: .* shape \[4\]"):
        fpipe.load(version.parent, [{"w": torch.empty(3)}])
    sharded["tensors"][FILE]["w"]["full_shape"] = [3]  # one piece of a tensor of 3: a valid index
    (version / INDEX).write_text(json.dumps(sharded))
    assert_bitwise(fpipe.load(version.parent, [{"w": torch.empty(3)}]).params, [{"w": torch.ones(3)}])


# --- With tensor parallelism (tests/saving/_tensor_parallel_saves.py; its spawns: tests/saving/conftest.py) ---


def test_each_rank_writes_and_reads_only_its_own_pieces(tp_saves: tuple[Path, list[Any], Any]) -> None:
    directory, results, _ = tp_saves
    root = directory / "tp"
    version = root / (root / LATEST).read_text().strip()
    index = json.loads((version / INDEX).read_text())
    name = "model-rank-0000{}-of-00002-tp-0000{}-of-00002.safetensors"
    files = {f: (i["rank"], i["tp"]) for f, i in index["files"].items() if f.startswith("model")}
    assert files == {name.format(p, t): (p, t) for p in (0, 1) for t in (0, 1)}
    for p in (0, 1):
        for t in (0, 1):
            with safe_open(version / name.format(p, t), "pt") as f:
                shapes = {n: list(f.get_slice(n).get_shape()) for n in f.keys()}  # noqa: SIM118
            # the pieces of this (pp, tp); whole tensors (norms, biases) once, by tp 0; the tied
            # parameter by pipeline rank 0 only
            expected = {f"b{p}.wq": [4, 8], f"b{p}.wo": [8, 4], f"b{p}.odd": [[3, 3], [2, 3]][t]}
            expected |= {f"b{p}.col": [[3, 3], [3, 2]][t], f"b{p}.tiny": [[1, 4], [0, 4]][t]}
            expected |= {f"b{p}.norm": [8], f"bias{p}": [3]} if t == 0 else {}
            expected |= {"tied": [[4, 4], [3, 4]][t]} if p == 0 else {}
            assert shapes == expected, (p, t)
    assert index["weight_map"]["b1.norm"] == name.format(1, 0)
    assert index["weight_map"]["b1.odd"] == [name.format(1, 0), name.format(1, 1)]
    piece = index["tensors"][name.format(1, 1)]["b1.odd"]
    assert piece["offset"] == [3, 0] and piece["shape"] == [2, 3] and piece["full_shape"] == [5, 3]
    assert index["weight_map"]["tied"] == [name.format(0, 0), name.format(0, 1)]
    for r in results:  # the same layout reads exactly its own pieces, each once (none if empty)
        mine = {k: _local_numel(k, v, r["tp"]) for k, v in tp_params()[r["pp"]].items()}
        expected = {k: n for k, n in mine.items() if n} | {f"m.{k}": n for k, n in mine.items() if n} | {"step": 1}
        assert r["read"] == expected


def _local_numel(name: str, t: torch.Tensor, tp: int) -> int:
    """The elements of ``t`` that tensor-parallel rank ``tp`` of 2 holds (torch.chunk's pieces)."""
    p = PLACEMENTS.get(name.split(".")[-1])
    if p is None or p[0] == "Replicate":
        return t.numel()
    n = t.shape[p[1]]
    c = -(-n // 2)
    return t.numel() // n * max(0, min(n, (tp + 1) * c) - tp * c)


@pytest.mark.timeout(120)
def test_bad_tensor_parallel_saves_fail_on_every_rank(tp_saves: tuple[Path, list[Any], Any]) -> None:
    for r in tp_saves[1]:
        errors = r["errors"]
        # bias0 is the first name checked, the same on every rank
        assert (
            "ValueError: fpipe.save: params[0]['bias0'] differs between tensor-parallel ranks (rank 0: "
            in (errors["differ"])
        )
        assert "; rank 0 tp 1: sha256 " in errors["differ"]
        if (r["pp"], r["tp"]) == (1, 1):
            assert (
                "params[1]['b1.norm'] is a DTensor on a mesh that is not this rank's tensor-parallel"
                in (errors["wrong mesh"])
            )
        else:
            assert "RuntimeError: fpipe.save: rank(s) [1 (tp 1)] failed while naming their" in errors["wrong mesh"]
        assert (
            "the pieces of 'tied' held by params[0]['tied'] (rank 0), params[0]['tied'] (rank 0 tp 1)"
            in (errors["other layout"])
        )
        assert "do not cover its shape [7, 4] exactly once: they cover 56 of its 28 elements" in errors["other layout"]
        b = f"b{r['pp']}"
        assert (
            f"ValueError: fpipe.save: params[{r['pp']}]['{b}.col'] is a DTensor but the save has no tensor-"
            in (errors["no tp"])
        )
        assert (
            f"TypeError: fpipe.save: params[{r['pp']}]['{b}.wq'] is a DTensor with placement Partial"
            in (errors["partial"])
        )
        assert (
            "have the same name 'tied' but different dtypes or shapes (float64[7, 4] vs float64[6, 4])"
            in (errors["other shape"])
        )
        assert (
            f"ValueError: fpipe.load: template[{r['pp']}]['{b}.wq'] is a DTensor whose local piece has shape "
            in (errors["odd piece"])
        )
        assert (
            "[2, 8], but its placements [Shard(dim=0)] cut shape [8, 8] into pieces of shape [4, 8]"
            in (errors["odd piece"])
        )
        assert (
            "ValueError: fpipe.save_hf: the tensor-parallel ranks of pipeline rank 0 hold different leaves (rank 0 "
            "(tp 0): params[0]['bias0']: a Tensor float64[3] sha256 " in errors["save_hf differ"]
        )
        if (r["pp"], r["tp"]) == (1, 1):
            assert (
                "ValueError: fpipe.save_hf: params[1]['b1.norm'] is a DTensor on a mesh that is not this rank's "
                "tensor-parallel sub-mesh" in errors["save_hf wrong mesh"]
            )
        else:
            assert (
                "RuntimeError: fpipe.save_hf: rank(s) [1 (tp 1)] failed while checking their DTensors"
                in errors["save_hf wrong mesh"]
            )
        assert not (tp_saves[0] / "hf bad").exists()


def _three_dimensions(rank: int, world: int, directory: str) -> tuple[int, list[Any]]:
    """dp 2 x pp 2 x tp 2: the first replica's ranks write, the other replica waits; all load."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
    pp = mesh.get_coordinate()[1]
    full = tp_params()
    params = [distribute_tp(p, mesh["tp"]) if s == pp else None for s, p in enumerate(full)]
    fpipe.save(directory, params, parallel=fpipe.Parallelism(mesh=mesh))
    meta = [distribute_tp(template(p), mesh["tp"]) if s == pp else None for s, p in enumerate(full)]
    return pp, gather_tp(fpipe.load(directory, meta, parallel=fpipe.Parallelism(mesh=mesh)).params)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_data_times_pipeline_times_tensor_parallel_saves(tmp_path: Path) -> None:
    results = run_ranks(8, _three_dimensions, str(tmp_path), timeout=200)
    full = tp_params()
    for pp, gathered in results:
        check_gathered(gathered, full, pp)
    index = json.loads((tmp_path / (tmp_path / LATEST).read_text().strip() / INDEX).read_text())
    assert sorted((f["rank"], f["tp"]) for f in index["files"].values()) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert_bitwise(fpipe.load(tmp_path, template(full)).params, full)


@pytest.mark.timeout(120)
def test_each_sharded_tensor_parallel_rank_writes_and_reads_its_own_shards(
    tp_sharded_saves: tuple[Path, list[Any]],
) -> None:
    directory, results = tp_sharded_saves
    root = directory / "sharded"
    version = root / (root / LATEST).read_text().strip()
    index = json.loads((version / INDEX).read_text())
    name = "model-rank-00000-of-00001-dp-0000{}-of-00002-tp-0000{}-of-00002.safetensors"
    files = {f: (i["replica"], i["tp"]) for f, i in index["files"].items() if f.startswith("model")}
    assert files == {name.format(q, t): (q, t) for q in (0, 1) for t in (0, 1)}
    # b0.odd: 5 x 3 by rows over tp 2 (3 and 2 rows), each piece cut in 2 flat shards over dp
    assert index["weight_map"]["b0.odd"] == [name.format(q, t) for t in (0, 1) for q in (0, 1)]
    piece = index["tensors"][name.format(1, 1)]["b0.odd"]
    assert piece == {
        **piece,
        "shard": [1, 2],
        "offset": [3, 0],
        "box_shape": [2, 3],
        "shape": [3],
        "full_shape": [5, 3],
    }
    # a plain tensor and a Replicate DTensor: flat shards of the whole tensor, written by tp 0
    assert index["weight_map"]["b0.norm"] == [name.format(q, 0) for q in (0, 1)]
    assert "offset" not in index["tensors"][name.format(0, 0)]["b0.norm"]
    for r in results:  # the same layout reads exactly its own shards, each once
        with safe_open(version / name.format(r["dp"], r["tp"]), "pt") as f:
            mine = {n: f.get_slice(n).get_shape()[0] for n in f.keys()}  # noqa: SIM118
        shards = {n: t.numel() for p in r["shards"] for n, t in p.items()}
        nonempty = {n: k for n, k in shards.items() if k}
        assert r["read"] == nonempty | {f"m.{n}": k for n, k in nonempty.items()} | {"step": 1}
        assert all(mine[n] == shards[n] for n in mine)


@pytest.mark.timeout(120)
def test_bad_sharded_tensor_parallel_saves_fail_on_every_rank(tp_sharded_saves: tuple[Path, list[Any]]) -> None:
    for rank, r in enumerate(tp_sharded_saves[1]):
        errors = r["errors"]
        if rank == 3:
            assert (
                "ValueError: fpipe.save: params[0]['b0.wq'] should be this rank's shard of the local piece (shape "
                "[4, 8]) of a tensor of shape [8, 8], a 1-D tensor of 16 elements (got: shape [4, 8])"
                in errors["full here"]
            )
        else:
            assert "RuntimeError: fpipe.save: rank(s) [0 (dp 1 tp 1)] failed while naming" in errors["full here"]
        assert (
            "ValueError: fpipe.load: template[0]['b0.col'] should be this rank's shard of the local piece (shape "
            f"{[[3, 3], [3, 2]][r['tp']]}) of a tensor of shape [3, 5]" in errors["unsharded template"]
        )
