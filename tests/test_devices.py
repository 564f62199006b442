"""A rank's device (NOTE [the rank's device] in fpipe/_distributed/_topology.py) and the errors
for stages placed elsewhere. CUDA itself is exercised by benchmarks/gpu_check.sh."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fpipe._distributed._runtime import check_devices
from fpipe._distributed._topology import device_of


def test_the_device_follows_the_backend_or_the_mesh() -> None:
    assert device_of("gloo", None) == torch.device("cpu")
    assert device_of("gloo", "cpu") == torch.device("cpu")
    assert device_of("cpu:gloo,cuda:nccl", "cpu") == torch.device("cpu")


@pytest.mark.parametrize(
    ("backend", "mesh", "fragment"),
    [
        ("gloo", "cuda", "the mesh is on cuda but its process group's backend is gloo"),
        ("nccl", "cpu", "init_process_group('gloo') for a cpu mesh"),
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
