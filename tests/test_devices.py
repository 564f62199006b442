"""A rank's device (NOTE [the rank's device] in fpipe/_distributed/_topology.py) and the errors
for stages placed elsewhere. CUDA itself is exercised by benchmarks/gpu_check.sh."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import fpipe
from fpipe._distributed import _topology
from fpipe._distributed._collectives import DEVICE_TYPE_WORDS, device_type_words, mixed_device_types
from fpipe._distributed._rank_step import check_devices
from fpipe._distributed._topology import device_of
from fpipe.schedules import GPipe
from tests._multiprocess import run_ranks


def test_the_device_follows_the_backend_or_the_mesh() -> None:
    assert device_of("gloo", None) == torch.device("cpu")
    assert device_of("gloo", "cpu") == torch.device("cpu")
    assert device_of("cpu:gloo,cuda:nccl", "cpu") == torch.device("cpu")
    assert device_of("GLOO", None) == device_of("mpi", None) == torch.device("cpu")  # any host backend


@pytest.mark.parametrize(
    ("backend", "mesh", "fragment"),
    [
        ("gloo", "cuda", "the mesh is on cuda but its process group's backend is gloo"),
        ("nccl", "cpu", "init_process_group('gloo') for a cpu mesh"),
        ("gloo", "xpu", "init_process_group('xccl') for a xpu mesh"),
        ("hccl", "cpu", "the mesh is on cpu but its process group's backend is hccl"),
    ],
)
def test_a_mesh_and_backend_on_different_device_types_fail(backend: str, mesh: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        device_of(backend, mesh)


def test_stage_params_on_another_device_than_the_rank_fail() -> None:
    spec: Any = SimpleNamespace(local_stages=(1, 3), rank=1)
    params = [None, {"w": torch.zeros(2)}, None, {"w": torch.zeros(2)}]
    check_devices(spec, params, torch.device("cpu"))
    fragment = r"stage 1's parameters are on cpu but rank 1 runs on cuda:0 \(params\[1\]\['w'\]"
    with pytest.raises(ValueError, match=fragment):
        check_devices(spec, params, torch.device("cuda", 0))
    check_devices(spec, [None, {"w": torch.empty(2, device="meta")}, None, None], torch.device("cuda", 0))


def test_device_types_travel_as_words_and_a_mix_is_named_by_rank() -> None:
    cpu, cuda = device_type_words(torch.device("cpu")), device_type_words(torch.device("cuda", 3))
    assert cpu != cuda and cuda == device_type_words(torch.device("cuda", 0))  # the type, not the index
    assert len(cpu) == DEVICE_TYPE_WORDS and mixed_device_types([cpu, cpu]) is None
    error = mixed_device_types([cpu, cuda, cpu, device_type_words(torch.device("meta"))])
    assert error is not None
    assert "different device types (cpu: ranks [0, 2]; cuda: ranks [1]; meta: ranks [3])" in str(error)


def _ranks_on_two_device_types(rank: int, world: int) -> str:
    """Rank 1 runs on another device type than rank 0: as if it had built its mesh with another
    ``device_type`` (no second device type exists here, so ``device_of`` says so; the handshake
    runs on the host, which gloo serves, so it reaches both ranks all the same)."""
    claimed = torch.device("cpu") if rank == 0 else torch.device("meta")
    with mock.patch.object(_topology, "device_of", lambda backend, mesh_device_type: claimed):
        step = fpipe.pipeline(
            lambda y, mb: y.sum(),
            [lambda p, x: x * p] * 2,
            GPipe(2),
            parallel=fpipe.Parallelism(group=dist.group.WORLD, timeout=20),
        )
    assert step.topology is not None and step.topology.device == claimed
    params = [torch.ones(1) if s == rank else None for s in range(2)]
    with pytest.raises(ValueError) as info:
        step(params, torch.ones(2, 1) if rank == 0 else None)
    return str(info.value)


def test_ranks_on_different_device_types_fail_on_every_rank() -> None:
    for message in run_ranks(2, _ranks_on_two_device_types, timeout=60):
        assert "fpipe.step: the pipeline ranks run on different device types (cpu: ranks [0]; meta: ranks [1])" in (
            message
        )
