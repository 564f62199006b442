"""Where a process sits (fpipe/_distributed/_topology.py): what ``resolve_topology`` refuses before
any group exists, and the rank's device for backends beyond tests/test_devices.py's (meshes of
many ranks: tests/test_distributed.py, tests/test_tensor_parallel.py)."""

from __future__ import annotations

import pytest
import torch

from fpipe._distributed._topology import device_of, resolve_topology


@pytest.mark.parametrize(
    ("backend", "mesh_device_type"),
    [("GLOO", None), ("mpi", None), ("ucc,gloo", None)],
)
def test_a_host_backend_runs_on_the_cpu(backend: str, mesh_device_type: str | None) -> None:
    assert device_of(backend, mesh_device_type) == torch.device("cpu")


@pytest.mark.parametrize(
    ("backend", "mesh_device_type", "fragment"),
    [
        ("gloo", "xpu", "init_process_group('xccl') for a xpu mesh"),
        ("hccl", "cpu", "the mesh is on cpu but its process group's backend is hccl"),
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
