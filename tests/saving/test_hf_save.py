"""``fpipe.save_hf``: parameters out as a Hugging Face checkpoint that ``from_pretrained`` loads
(NOTE [Hugging Face export]). Its last test exports tensor-parallel stages
(the spawn: tests/saving/_tensor_parallel_saves.py, once per session)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

import fpipe
from fpipe._saving import _hf_load, _hf_save
from fpipe.schedules import OneFOneB
from tests._multiprocess import run_ranks
from tests.helpers import HF_SIZE, HF_TWO_STAGES, assert_bitwise, hf_example, hf_meta_model, hf_padded_batch

transformers = pytest.importorskip("transformers")

# from_pretrained's dtype argument: dtype= since transformers 4.56, torch_dtype= (deprecated since) before
_NEW = tuple(int(part) for part in transformers.__version__.split(".")[:2]) >= (4, 56)
DTYPE = {"dtype" if _NEW else "torch_dtype": torch.float64}


def logits(model: Any, hf: ModuleType) -> torch.Tensor:
    batch = hf_padded_batch(hf)
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def from_pretrained(directory: Path) -> Any:
    """The model ``from_pretrained`` loads, its weights copied out of the memory-mapped files.

    Copied, because BLAS kernels round differently on data aligned differently, and a weight's
    alignment in a mapped file depends on what precedes it: the same weights read from two files
    can give logits 1e-17 apart.
    """
    model = transformers.LlamaForCausalLM.from_pretrained(directory, **DTYPE, attn_implementation="eager")
    for p in model.parameters():
        p.data = p.data.clone()
    return model


def assert_same_logits(directory: Path, model: Any, hf: ModuleType) -> None:
    """The export gives the logits of ``model`` saved by ``save_pretrained`` and reloaded, bitwise.

    (Not bitwise those of ``model`` itself: a reloaded model computes its rotary table afresh,
    in float32, which moves the logits by about 1e-16.)
    """
    reference = directory.parent / f"{directory.name}-reference"
    model.save_pretrained(reference)
    expected = logits(from_pretrained(reference), hf)
    assert_bitwise(logits(from_pretrained(directory), hf), expected)
    torch.testing.assert_close(expected, logits(model, hf), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_an_export_loads_with_from_pretrained_and_gives_the_same_logits(
    hf: ModuleType, tmp_path: Path, tied: bool
) -> None:
    model = hf.build_model(**HF_SIZE, tied=tied)
    _, params = hf.split(model, 2)
    out = fpipe.save_hf(tmp_path / "out", params, config=model.config, max_shard_size="20KB")
    assert out == tmp_path / "out"
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"].keys() == {n for n, _ in model.named_parameters()}
    assert ("lm_head.weight" in index["weight_map"]) == (not tied)  # a tied head is left out, as HF does
    assert index["metadata"]["total_size"] == sum(p.numel() * 8 for p in model.parameters())
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary directory left
    assert from_pretrained(out).config.tie_word_embeddings == tied
    assert_same_logits(out, model, hf)
    # And fpipe.load_hf reads it back bitwise.
    _, meta = hf.split(hf_meta_model(hf, tied), 2)
    assert_bitwise(fpipe.load_hf(out, meta), [{n: t.detach() for n, t in p.items()} for p in params])


def test_config_may_be_a_directory_a_file_or_a_dict(hf: ModuleType, tmp_path: Path) -> None:
    model = hf.build_model(**HF_SIZE)
    model.save_pretrained(tmp_path / "source")
    (tmp_path / "source" / "generation_config.json").write_text('{"max_length": 5}')
    _, params = hf.split(model, 2)
    fpipe.save_hf(tmp_path / "a", params, config=tmp_path / "source")
    assert (tmp_path / "a" / "config.json").read_bytes() == (tmp_path / "source" / "config.json").read_bytes()
    assert (tmp_path / "a" / "generation_config.json").read_text() == '{"max_length": 5}'
    fpipe.save_hf(tmp_path / "b", params, config=tmp_path / "source" / "config.json")
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [
        "config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]
    fpipe.save_hf(tmp_path / "c", [{"w": torch.ones(2)}], config={"model_type": "x"})
    assert json.loads((tmp_path / "c" / "config.json").read_text()) == {"model_type": "x"}
    fpipe.save_hf(tmp_path / "d", [{"w": torch.ones(2)}])
    assert not (tmp_path / "d" / "config.json").exists()
    assert_same_logits(tmp_path / "a", model, hf)


def test_tensors_are_cut_into_files_of_at_most_max_shard_size(tmp_path: Path) -> None:
    params = [{"a": torch.ones(10), "b": torch.ones(10)}, {"c": torch.ones(30), "d": torch.ones(1)}]
    fpipe.save_hf(tmp_path / "out", params, max_shard_size=200)  # 80, 80, 240 and 8 bytes
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {
        "a": "model-00001-of-00003.safetensors",
        "b": "model-00001-of-00003.safetensors",
        "c": "model-00002-of-00003.safetensors",  # larger than the limit: a file of its own
        "d": "model-00003-of-00003.safetensors",
    }


def test_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ValueError, match=r"full exists and is not an empty directory"):
        fpipe.save_hf(tmp_path / "full", [{"w": torch.ones(1)}])
    with pytest.raises(ValueError, match=r"params\[0\]\['w'\] and params\[1\]\['w'\] have the same name 'w' but"):
        fpipe.save_hf(tmp_path / "a", [{"w": torch.ones(1)}, {"w": torch.zeros(1)}])
    with pytest.raises(TypeError, match=r"params\[0\]\['w'\] is a Tensor on meta; leaves are dense tensors"):
        fpipe.save_hf(tmp_path / "a", [{"w": torch.ones(1, device="meta")}])
    with pytest.raises(TypeError, match=r"max_shard_size must be a number of bytes > 0 or a string"):
        fpipe.save_hf(tmp_path / "a", [{"w": torch.ones(1)}], max_shard_size="5 parsecs")
    with pytest.raises(TypeError, match=r"config must be a checkpoint directory, a path to a config.json, a dict"):
        fpipe.save_hf(tmp_path / "a", [{"w": torch.ones(1)}], config=3)
    with pytest.raises(FileNotFoundError, match=r"config names a directory without config.json"):
        fpipe.save_hf(tmp_path / "a", [{"w": torch.ones(1)}], config=tmp_path / "full")
    with pytest.raises(ValueError, match=r"gets the name '__metadata__', which safetensors reserves"):
        fpipe.save_hf(tmp_path / "a", [{"__metadata__": torch.ones(1)}])

    def fail(path: Path, tensors: Any) -> int:
        raise OSError("disk full")

    monkeypatch.setattr(_hf_save, "write_safetensors", fail)
    with pytest.raises(OSError, match=r"disk full"):
        fpipe.save_hf(tmp_path / "a", [{"w": torch.ones(1)}])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # nothing half-written left


# --- Two processes ------------------------------------------------------------------------------


def _ranks(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Each rank exports its stage of the model (the tied embedding is held by both); then, as the
    data-parallel ranks of a sharded step, both export their shards of the whole model."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_default_dtype(torch.float64)  # as the tests' process: the same random weights
    hf = hf_example()
    model = hf.build_model(**HF_SIZE)
    stages, params = fpipe.split_module(model, HF_TWO_STAGES, call=hf.CALL)
    step = fpipe.pipeline(hf.loss_fn, stages, OneFOneB(3), parallel=fpipe.Parallelism(group=dist.group.WORLD))
    mine = [p if s in step.local_stages else None for s, p in enumerate(params)]
    out = {"path": str(fpipe.save_hf(directory, mine, config=model.config, max_shard_size="20KB", parallel=step))}
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "pp"))
    sharded = fpipe.pipeline(hf.loss_fn, stages, OneFOneB(3), parallel=fpipe.Parallelism(mesh=mesh, shard_params=True))
    fpipe.save_hf(Path(directory).parent / "sharded", sharded.shard(params), config=model.config, parallel=sharded)
    for name, wrong, where in [
        ("twice", params, {"group": dist.group.WORLD}),
        ("other", params if rank == 0 else [None, None], {"step": step}),
    ]:
        try:
            fpipe.save_hf(Path(directory).parent / name, wrong, **where)
        except (ValueError, RuntimeError) as error:
            out[name] = str(error)
    bad = [None if p is None else {**p, "model.norm.weight": torch.full((16,), float(rank))} for p in mine]
    try:
        fpipe.save_hf(Path(directory).parent / "bad", bad, parallel=fpipe.Parallelism(group=dist.group.WORLD))
    except (ValueError, RuntimeError) as error:
        out["error"] = f"{type(error).__name__}: {error}"
    out.update(_one_rank_reads_badly(rank, Path(directory), mine, step))
    return out


def _one_rank_reads_badly(rank: int, directory: Path, mine: list[Any], step: fpipe.Step) -> dict[str, str]:
    """``fpipe.load_hf`` of the export when rank 1 alone cannot read it: a file of its stage
    truncated (found in its headers), then a read that fails after the headers (an I/O error, a
    file cut meanwhile). Each rank's outcome: ``"loaded"``, or its error."""
    template = [None if p is None else {k: torch.empty_like(v, device="meta") for k, v in p.items()} for p in mine]
    truncated = directory.parent / "truncated"
    if rank == 0:
        shutil.copytree(directory, truncated)
        index = json.loads((truncated / "model.safetensors.index.json").read_text())
        file = truncated / index["weight_map"]["model.norm.weight"]  # stage 1's, read by rank 1 alone
        file.write_bytes(file.read_bytes()[:-8])
    dist.barrier()
    out = {}
    read = _hf_load._read

    def unreadable(root: Path, wanted: Any) -> Any:
        raise OSError(f"[Errno 5] Input/output error: '{root / 'model-00002.safetensors'}'")

    for case, where in [("truncated", truncated), ("unreadable", directory)]:
        if rank == 1 and case == "unreadable":
            _hf_load._read = unreadable
        try:
            fpipe.load_hf(where, template, parallel=step)
            out[case] = "loaded"
        except (ValueError, OSError, RuntimeError) as error:
            out[case] = f"{type(error).__name__}: {error}"
        finally:
            _hf_load._read = read
    dist.barrier()
    if rank == 0:
        shutil.rmtree(truncated)
    return out


def test_every_rank_writes_its_own_stages(hf: ModuleType, tmp_path: Path) -> None:
    results = run_ranks(2, _ranks, str(tmp_path / "out"), timeout=120)
    assert {r["path"] for r in results} == {str(tmp_path / "out")}
    model = hf.build_model(**HF_SIZE)
    _, params = fpipe.split_module(model, HF_TWO_STAGES, call=hf.CALL)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    for rank, stage in enumerate(params):
        files = {index["weight_map"][n] for n in stage if not (rank == 1 and n == "model.embed_tokens.weight")}
        for file in files:
            with safe_open(tmp_path / "out" / file, "pt") as f:
                assert set(f.keys()) <= set(stage)  # a file holds one rank's names
    first_of_rank_1 = min(index["weight_map"][n] for n in params[1] if n != "model.embed_tokens.weight")
    assert index["weight_map"]["model.embed_tokens.weight"] < first_of_rank_1  # tied: written by rank 0
    # A tied name with different values on two ranks fails on both, and nothing is left.
    assert "have the same name 'model.norm.weight' but different values" in results[0]["error"]
    assert "have the same name 'model.norm.weight' but different values" in results[1]["error"]
    assert (
        "fpipe.save_hf: stages are held by several ranks ({stage: ranks}: {0: [0, 1], 1: [0, 1]})"
        in (results[0]["twice"])
    )
    assert results[0]["other"].startswith("fpipe.save_hf: rank 0 holds stages [0] but params[1] is not None.")
    assert results[1]["other"].startswith("fpipe.save_hf: rank(s) [0] failed")
    # A load that rank 1 alone cannot read fails on every rank (none returns tensors).
    assert results[1]["truncated"].startswith("ValueError: fpipe.load_hf: ") and "truncated" in results[1]["truncated"]
    assert results[0]["truncated"].startswith("RuntimeError: fpipe.load_hf: rank(s) [1] failed while reading their")
    assert results[1]["unreadable"].startswith("OSError: [Errno 5] Input/output error")
    assert results[0]["unreadable"].startswith(
        "RuntimeError: fpipe.load_hf: rank(s) [1] failed while reading their tensors; their own errors say why "
        "(rank 1: OSError: [Errno 5] Input/output error"
    ), results[0]["unreadable"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "sharded"]
    assert_same_logits(tmp_path / "out", model, hf)
    assert_same_logits(tmp_path / "sharded", model, hf)


# --- With tensor parallelism (tests/saving/_tensor_parallel_saves.py; its spawns: tests/saving/conftest.py) ---


def test_save_hf_from_tensor_parallel_stages_loads_with_from_pretrained(tp_saves: tuple[Path, list[Any], Any]) -> None:
    """The pp 2 x tp 2 stages that ``load_hf`` filled, exported by ``save_hf`` (each DTensor
    gathered to tensor-parallel rank 0): ``from_pretrained`` gives the model's weights and logits."""
    directory, _, model = tp_saves
    out = directory / "hf_out"
    assert_bitwise(dict(from_pretrained(out).state_dict()), dict(model.state_dict()))
    assert_same_logits(out, model, hf_example())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
