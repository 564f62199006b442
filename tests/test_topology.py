"""Where a process sits (fpipe/_distributed/_topology.py): the rank's device from the backend or
the mesh, and what ``resolve_topology`` refuses before any group exists (meshes of many ranks:
tests/test_distributed.py, tests/test_tensor_parallel.py)."""

from __future__ import annotations

import pytest
import torch

from fpipe._distributed._topology import device_of, resolve_topology


@pytest.mark.parametrize(
    ("backend", "mesh_device_type"),
    [("gloo", None), ("GLOO", None), ("gloo", "cpu"), ("cpu:gloo,cuda:nccl", "cpu"), ("mpi", None)],
)
def test_a_host_backend_or_mesh_runs_on_the_cpu(backend: str, mesh_device_type: str | None) -> None:
    assert device_of(backend, mesh_device_type) == torch.device("cpu")


@pytest.mark.parametrize(
    ("backend", "mesh_device_type", "fragment"),
    [
        ("gloo", "cuda", "the mesh is on cuda but its process group's backend is gloo"),
        ("nccl", "cpu", "init_process_group('gloo') for a cpu mesh"),
        ("gloo", "xpu", "init_process_group('xccl') for a xpu mesh"),
    ],
)
def test_a_mesh_and_a_backend_of_different_devices_fail(backend: str, mesh_device_type: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        device_of(backend, mesh_device_type)


def test_resolve_topology_without_a_group_or_with_two() -> None:
    assert resolve_topology(None, None) is None
    with pytest.raises(TypeError, match="pass mesh= or group=, not both"):
        resolve_topology(object(), object())
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialized"):
        resolve_topology(None, object())
