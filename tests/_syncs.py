"""Catching the host synchronizations fpipe makes during a step, on CPU.

On a device backend, reading a tensor's value on the host (``.item()``, ``.tolist()``,
``bool(t)``, an output whose shape depends on the data) waits for the device; so does copying
host data to it (``torch.tensor(..., device=...)``). On CPU nothing waits, but the same calls
happen: ``host_syncs`` records the ones whose innermost caller outside torch is fpipe, with that
caller and whether they ran between a step's first and last action (inside ``interpret``) and
whether they read a received message (the wire's meta and header, which a receive must read).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import fpipe

_FPIPE = os.path.dirname(fpipe.__file__) + os.sep

# Calls that read device data on the host, or copy host data to the device.
_READS = {
    getattr(torch.Tensor, name)
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")
} | {torch.tensor, torch.as_tensor, torch.frombuffer}
# fpipe's one door for host data to the device: pinned and non-blocking, so the host does not wait
# (on CUDA, benchmarks/gpu_check.sh proves it under torch.cuda.set_sync_debug_mode("error")).
_UPLOADS = {"_distributed/_wire.py:upload"}
# Reads of tensors that are on the host by construction, never a device's: the step's key, drawn
# from the default CPU generator (NOTE [randomness as data] in fpipe/_random.py).
_HOST_ONLY = {"_random.py:draw_key"}
_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "equal"}


@dataclass(frozen=True)
class Sync:
    """One synchronizing call: what, where in fpipe (``file:function``), and in which part of a step."""

    call: str
    where: str
    in_step: bool  # between the step's first and last action
    receive: bool  # reading a received message's meta or header


def _caller(call: str) -> Sync | None:
    frame = sys._getframe(2)
    where = None
    in_step = receive = False
    while frame is not None:
        file, name = frame.f_code.co_filename, frame.f_code.co_name
        if where is None and not file.startswith(os.path.dirname(torch.__file__)) and "torch/" not in file:
            if not file.startswith(_FPIPE):
                return None  # a stage, loss_fn or the test itself
            where = f"{file[len(_FPIPE) :]}:{name}"
            if where in _UPLOADS or where in _HOST_ONLY:
                return None
        if file.startswith(_FPIPE) and file.endswith("_transport.py") and name == "_read":
            receive = True
        if file.startswith(_FPIPE) and file.endswith("_run.py") and name == "interpret":
            in_step = True
        frame = frame.f_back  # type: ignore[assignment]
    return None if where is None else Sync(call, where, in_step, receive)


class _Functions(TorchFunctionMode):
    def __init__(self, found: list[Sync]) -> None:
        super().__init__()
        self.found = found

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _READS:
            sync = _caller(getattr(func, "__name__", str(func)))
            if sync is not None:
                self.found.append(sync)
        return func(*args, **(kwargs or {}))


class _Ops(TorchDispatchMode):
    def __init__(self, found: list[Sync]) -> None:
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket.__name__ in _OPS:
            sync = _caller(f"aten.{func.overloadpacket.__name__}")
            if sync is not None:
                self.found.append(sync)
        return func(*args, **(kwargs or {}))


@contextmanager
def host_syncs() -> Iterator[list[Sync]]:
    """The synchronizing calls fpipe makes inside the block (see the module docstring)."""
    found: list[Sync] = []
    with _Functions(found), _Ops(found):
        yield found
