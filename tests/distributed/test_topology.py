"""Where a process sits (fpipe/_distributed/_topology.py): what ``resolve_topology`` refuses before
any group exists (the rank's device: tests/test_devices.py; meshes of many ranks:
tests/test_distributed.py, tests/tensor_parallel/test_end_to_end.py)."""

from __future__ import annotations

import pytest

from fpipe._distributed._topology import resolve_topology


def test_resolve_topology_without_a_group_or_with_two() -> None:
    assert resolve_topology(None, None) is None
    with pytest.raises(TypeError, match="pass mesh= or group=, not both"):
        resolve_topology(object(), object())
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialized"):
        resolve_topology(None, object())
