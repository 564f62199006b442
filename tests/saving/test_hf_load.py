"""``fpipe.load_hf``: a Hugging Face checkpoint read into the stages of ``split_module`` (NOTE [Hugging
Face checkpoints]).

The checkpoint is a tiny random ``LlamaForCausalLM`` of ``examples/hf_llama.py``, written by
``save_pretrained`` in float64 and cut into several files. Templates come from the same model
built on the meta device, so nothing is allocated before loading. A spy on ``safe_open`` counts
what each load reads: the names of its own stages only, and with ``shard_params=True`` the
elements of its own shards only.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
import torch.distributed as dist

import fpipe
from fpipe._saving._hf_load import read_range
from fpipe._saving._store import MAX_HEADER_BYTES
from fpipe.schedules import OneFOneB
from tests._multiprocess import run_ranks
from tests.helpers import (
    HF_SIZE,
    HF_TWO_STAGES,
    assert_bitwise,
    hf_checkpoint,
    hf_example,
    hf_meta_model,
    hf_padded_batch,
)
from tests.saving._tensor_parallel_saves import (
    TP_PLAN,
)
from tests.saving._tools import Spy, template

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def saved(request: pytest.FixtureRequest, hf: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    directory = tmp_path_factory.mktemp("hf")
    return directory, hf_checkpoint(hf, directory, tied=request.param)


# --- One process --------------------------------------------------------------------------------


def test_a_sharded_checkpoint_loads_bitwise_into_a_meta_template(
    hf: ModuleType, saved: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    directory, model = saved
    files = sorted(p.name for p in directory.glob("*.safetensors"))
    assert len(files) > 2 and (directory / "model.safetensors.index.json").is_file()
    tied = model.config.tie_word_embeddings
    _, meta = hf.split(hf_meta_model(hf, tied), 2)
    assert all(t.device.type == "meta" for p in meta for t in p.values())
    spy = Spy(monkeypatch)
    params = fpipe.load_hf(directory, meta)
    named = dict(model.named_parameters())
    assert_bitwise(params, [{name: named[name].detach() for name in p} for p in meta])
    assert ("lm_head.weight" in spy.read) == (not tied)
    # The tied embedding is read once and copied into stages 0 and 2.
    assert spy.read == {name: p.numel() for name, p in named.items()}
    if tied:
        assert params[0]["model.embed_tokens.weight"].data_ptr() != params[2]["model.embed_tokens.weight"].data_ptr()


def test_each_load_reads_only_the_names_of_its_stages(
    hf: ModuleType, saved: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    directory, model = saved
    _, meta = hf.split(hf_meta_model(hf, model.config.tie_word_embeddings), 2)
    spy = Spy(monkeypatch)
    params = fpipe.load_hf(directory, [None, meta[1], None], strict=False)
    assert params[0] is None and params[2] is None
    assert set(spy.read) == set(meta[1]) == {n for n, _ in model.named_parameters() if n.startswith("model.layers.2.")}


def test_a_single_file_checkpoint_loads_too(hf: ModuleType, tmp_path: Path) -> None:
    model = hf.build_model(**HF_SIZE)
    model.save_pretrained(tmp_path)
    assert [p.name for p in tmp_path.glob("*.safetensors")] == ["model.safetensors"]
    _, meta = hf.split(hf_meta_model(hf), 2)
    named = dict(model.named_parameters())
    assert_bitwise(fpipe.load_hf(tmp_path, meta), [{n: named[n].detach() for n in p} for p in meta])


def test_floating_dtypes_convert_on_request(hf: ModuleType, tmp_path: Path) -> None:
    model = hf_checkpoint(hf, tmp_path, dtype=torch.bfloat16)
    _, meta = hf.split(hf_meta_model(hf, dtype=torch.float32), 2)
    with pytest.raises(ValueError, match=r"dtype on disk bfloat16, expected float32 \(pass dtype=torch.float32"):
        fpipe.load_hf(tmp_path, meta)
    params = fpipe.load_hf(tmp_path, meta, dtype=torch.float32)
    named = dict(model.named_parameters())
    assert_bitwise(params, [{n: named[n].detach().float() for n in p} for p in meta])
    with pytest.raises(ValueError, match=r"dtype on disk bfloat16 converted to float64, expected float32"):
        fpipe.load_hf(tmp_path, meta, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"dtype must be a floating-point torch.dtype"):
        fpipe.load_hf(tmp_path, meta, dtype=torch.int64)


def test_results_go_to_the_template_device(hf: ModuleType, saved: tuple[Path, Any]) -> None:
    directory, model = saved
    _, params = hf.split(model, 2)
    loaded = fpipe.load_hf(directory, [{n: torch.empty_like(t) for n, t in p.items()} for p in params])
    assert_bitwise(loaded, [{n: t.detach() for n, t in p.items()} for p in params])


def _both_names(hf: ModuleType, directory: Path, head: Any = None) -> Any:
    """A tied model's checkpoint that stores the embedding as ``lm_head.weight`` too (``head``: its value there)."""
    model = hf.build_model(**HF_SIZE, tied=True)
    model.save_pretrained(directory)
    tensors = safetensors.torch.load_file(directory / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone() if head is None else head
    safetensors.torch.save_file(tensors, directory / "model.safetensors")
    return model


def test_a_tied_weight_stored_under_both_names_loads_when_equal(
    hf: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _both_names(hf, tmp_path)
    _, meta = hf.split(hf_meta_model(hf), 2)
    spy = Spy(monkeypatch)
    params = fpipe.load_hf(tmp_path, meta)  # strict: lm_head.weight is accepted as the embedding's copy
    named = dict(model.named_parameters())
    assert_bitwise(params, [{n: named[n].detach() for n in p} for p in meta])
    assert spy.read["lm_head.weight"] == named["model.embed_tokens.weight"].numel()  # read once, to compare


def test_a_tied_weight_stored_under_both_names_with_other_values_is_refused(hf: ModuleType, tmp_path: Path) -> None:
    embed = hf.build_model(**HF_SIZE, tied=True).model.embed_tokens.weight.detach()
    _both_names(hf, tmp_path, head=embed + 1)
    _, meta = hf.split(hf_meta_model(hf), 2)
    with pytest.raises(
        ValueError,
        match=r"stores 'lm_head.weight' as well as its tied partner 'model.embed_tokens.weight' \(config.json: "
        r"tie_word_embeddings\), with other values \(compared on rank 0\)",
    ):
        fpipe.load_hf(tmp_path, meta)
    assert fpipe.load_hf(tmp_path, meta, strict=False)[0]["model.embed_tokens.weight"].equal(embed)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    with pytest.raises(ValueError, match=r"has 1 name\(s\) that no stage of the template has: \['lm_head.weight'\]"):
        fpipe.load_hf(tmp_path, meta)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match=r"config.json is not JSON \(JSONDecodeError"):
        fpipe.load_hf(tmp_path, meta)


# --- Errors -------------------------------------------------------------------------------------


def test_missing_unexpected_and_mismatched_names_are_listed(hf: ModuleType, saved: tuple[Path, Any]) -> None:
    directory, model = saved
    _, meta = hf.split(hf_meta_model(hf, model.config.tie_word_embeddings), 2)
    with pytest.raises(ValueError, match=r"has 9 name\(s\) that no stage of the template has: \['model.layers.2"):
        fpipe.load_hf(directory, [meta[0], None, meta[2]])
    extra = {**meta[2], "head.bias": torch.empty(3, device="meta")}
    with pytest.raises(
        ValueError, match=r"1 name\(s\) of the template are missing .*'head.bias' \(template\[2\]\['head.bias'\]\)"
    ):
        fpipe.load_hf(directory, [meta[0], meta[1], extra])
    wrong = {**meta[1], "model.layers.2.mlp.up_proj.weight": torch.empty(3, 16, device="meta")}
    with pytest.raises(
        ValueError,
        match=r"template\[1\]\['model.layers.2.mlp.up_proj.weight'\] \(name 'model.layers.2.mlp.up_proj.weight'\): "
        r"shape on disk \[32, 16\], expected \[3, 16\]",
    ):
        fpipe.load_hf(directory, [meta[0], wrong, meta[2]])
    with pytest.raises(TypeError, match=r"template\[1\]\['x'\] is a int; template leaves are tensors"):
        fpipe.load_hf(directory, [meta[0], {**meta[1], "x": 3}, meta[2]], strict=False)
    with pytest.raises(TypeError, match=r"template must be a list with one pytree per stage"):
        fpipe.load_hf(directory, meta[0])


def test_pickled_checkpoints_are_refused_unread(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even a pickle")
    with pytest.raises(
        ValueError, match=r"is pickled \(pytorch_model.bin\).*save_pretrained\(new_path, safe_serialization=True\)"
    ):
        fpipe.load_hf(tmp_path, [{"w": torch.empty(1)}])
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "pytorch_model-1.bin"}}))
    with pytest.raises(ValueError, match=r"is pickled \(pytorch_model-1.bin\)"):
        fpipe.load_hf(tmp_path, [{"w": torch.empty(1)}])


@pytest.mark.parametrize(
    "file", ["../outside.safetensors", "/etc/passwd.safetensors", ".hidden.safetensors", "a/b.safetensors"]
)
def test_index_names_outside_the_directory_are_refused(tmp_path: Path, file: str) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": file}}))
    with pytest.raises(ValueError, match=r"names a file that is not a plain file name in the checkpoint directory"):
        fpipe.load_hf(tmp_path, [{"w": torch.empty(1)}])


def test_a_file_linked_outside_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    safetensors.torch.save_file({"w": torch.ones(1)}, outside / "model.safetensors")
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    os.symlink(outside / "model.safetensors", directory / "model.safetensors")
    with pytest.raises(ValueError, match=r"is a symbolic link leading outside"):
        fpipe.load_hf(directory, [{"w": torch.empty(1)}])


def test_malformed_checkpoints_raise_value_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no Hugging Face safetensors checkpoint in"):
        fpipe.load_hf(tmp_path, [{"w": torch.empty(1)}])
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("{")
    with pytest.raises(ValueError, match=r"is not JSON"):
        fpipe.load_hf(tmp_path, [{"w": torch.empty(1)}])
    index.write_text(json.dumps({"weight_map": {"w": 3}}))
    with pytest.raises(ValueError, match=r"whose 'weight_map' maps tensor names to file names"):
        fpipe.load_hf(tmp_path, [{"w": torch.empty(1)}])
    index.write_text(json.dumps({"weight_map": {"w": "a.safetensors"}}))
    with pytest.raises(ValueError, match=r"a.safetensors is missing"):
        fpipe.load_hf(tmp_path, [{"w": torch.empty(1)}])
    (tmp_path / "a.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ValueError, match=r"a.safetensors is not a valid safetensors file"):
        fpipe.load_hf(tmp_path, [{"w": torch.empty(1)}])
    safetensors.torch.save_file({"v": torch.ones(1)}, tmp_path / "a.safetensors")
    with pytest.raises(ValueError, match=r"puts 'w' in a.safetensors, which has no tensor of that name"):
        fpipe.load_hf(tmp_path, [{"w": torch.empty(1)}])


def test_a_header_past_the_limit_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    """NOTE [header size] in fpipe/_saving/_store.py: a valid header padded with JSON spaces."""
    header = json.dumps({"w": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    header += b" " * (MAX_HEADER_BYTES + 8 - len(header))
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(ValueError, match=r"model.safetensors has a safetensors header of 16777224 bytes, more than"):
        fpipe.load_hf(tmp_path, [{"w": torch.empty(1, dtype=torch.float64)}])


def test_a_dtype_fpipe_does_not_read_is_named(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F8_E8M0", "shape": [1], "data_offsets": [0, 1]}}).encode()
    header += b" " * (-len(header) % 8)
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\x00")
    with pytest.raises(ValueError, match=r"stores 'w' as 'F8_E8M0', a dtype fpipe does not read"):
        fpipe.load_hf(tmp_path, [{"w": torch.empty(1)}])


# --- Reading a range ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(), (7,), (3, 4, 5), (2, 1, 3)])
def test_read_range_reads_exactly_the_elements_asked_for(
    tmp_path: Path, shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    tensor = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    safetensors.torch.save_file({"t": tensor}, tmp_path / "t.safetensors")
    spy = Spy(monkeypatch)
    with safetensors.safe_open(str(tmp_path / "t.safetensors"), framework="pt") as f:
        for start in range(tensor.numel()):
            for stop in range(start + 1, tensor.numel() + 1):
                spy.read.clear()
                got = read_range(f.get_slice("t"), shape, start, stop)
                assert_bitwise(got, tensor.reshape(-1)[start:stop], f"elements {start}:{stop}")
                assert spy.read == {"t": stop - start}


# --- Two processes ------------------------------------------------------------------------------


def _ranks(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Pipeline on 2 ranks, then a sharded step on a 2 x 1 mesh: each loads only its own part."""
    from torch.distributed.device_mesh import init_device_mesh

    hf = hf_example()
    batch = hf_padded_batch(hf)
    spy = Spy()
    out: dict[str, Any] = {}
    stages, meta = fpipe.split_module(hf_meta_model(hf), HF_TWO_STAGES, call=hf.CALL)
    step = fpipe.pipeline(hf.loss_fn, stages, OneFOneB(3), parallel=fpipe.Parallelism(group=dist.group.WORLD))
    mine = [t if s in step.local_stages else None for s, t in enumerate(meta)]
    out["params"] = params = fpipe.load_hf(directory, mine, parallel=step)
    out["read"] = dict(spy.read)
    out["loss"], grads = step(params, batch)
    out["grads"] = fpipe.sum_tied(grads, params=template(meta), group=dist.group.WORLD)
    # Sharded data parallel: the whole model on one pipeline rank, its parameters cut in 2.
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "pp"))
    sharded = fpipe.pipeline(hf.loss_fn, stages, OneFOneB(3), parallel=fpipe.Parallelism(mesh=mesh, shard_params=True))
    spy.read.clear()
    out["shards"] = shards = fpipe.load_hf(directory, sharded.shard(meta), parallel=sharded)
    out["shards read"] = dict(spy.read)
    out["sharded loss"], _ = sharded(shards, batch)
    try:
        fpipe.load_hf(directory, meta, parallel=sharded)
    except ValueError as error:
        out["error"] = str(error)
    return out


def test_two_ranks_load_their_own_stages_and_shards_and_train_like_the_model(hf: ModuleType, tmp_path: Path) -> None:
    model = hf_checkpoint(hf, tmp_path)
    results = run_ranks(2, _ranks, str(tmp_path), timeout=150)
    named = {n: p.detach() for n, p in model.named_parameters()}
    _, params = fpipe.split_module(model, HF_TWO_STAGES, call=hf.CALL)
    for rank, result in enumerate(results):
        expected = [{n: named[n] for n in p} if s == rank else None for s, p in enumerate(params)]
        assert_bitwise(result["params"], expected)
        assert result["read"] == {n: named[n].numel() for n in params[rank]}
    # The unsplit model's loss and gradients.
    batch = hf_padded_batch(hf)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss = hf.loss_fn(logits, batch)
    loss.backward()
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["loss"], loss.detach(), rtol=1e-10, atol=0)
        grads = result["grads"][rank]
        assert grads.keys() == params[rank].keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, dict(model.named_parameters())[name].grad, rtol=1e-10, atol=1e-12)
    # Shards: bitwise those of fpipe.shard, each element read by one rank only, and the same loss.
    for q, result in enumerate(results):
        for shards in result["shards"]:
            for name, shard in shards.items():
                flat = named[name].reshape(-1)
                size = -(-flat.numel() // 2)
                piece = flat[q * size : (q + 1) * size]
                assert_bitwise(shard, torch.cat([piece, piece.new_zeros(size - piece.numel())]))
        torch.testing.assert_close(result["sharded loss"], loss.detach(), rtol=1e-10, atol=0)
    for name, p in named.items():
        assert sum(result["shards read"][name] for result in results) == p.numel()
    assert results[0]["error"].startswith(
        "fpipe.load_hf: template[0]['model.embed_tokens.weight'] should be this rank's shard of a tensor of shape "
        "[17, 16], a 1-D tensor of 136 elements (got: shape [17, 16])."
    )


# --- With tensor parallelism (tests/saving/_tensor_parallel_saves.py; its spawns: tests/saving/conftest.py) ---


def test_load_hf_into_tensor_parallel_stages_reads_only_their_pieces(tp_saves: tuple[Path, list[Any], Any]) -> None:
    _, results, model = tp_saves
    hf = hf_example()
    results = [r["hf"] for r in results]
    named = {n: p.detach() for n, p in model.named_parameters()}
    _, params = fpipe.split_module(model, HF_TWO_STAGES, call=hf.CALL)
    for result in results:
        names = set(params[result["pp"]])
        assert result["full"].keys() == names
        for name, (tensor, placements) in result["full"].items():
            assert_bitwise(tensor, named[name])
            kind = next((v for k, v in TP_PLAN.items() if name.startswith(k.replace("*", name.split(".")[2]))), None)
            assert placements == {"colwise": "(Shard(dim=0),)", "rowwise": "(Shard(dim=1),)", None: ""}[kind], name
        # each rank read exactly the elements of its own pieces: half of each cut weight
        assert result["read"] == result["local"]
        assert sum(n for n in result["local"].values()) < sum(named[n].numel() for n in names)
