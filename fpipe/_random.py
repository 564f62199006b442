"""Randomness inside stages as data: a function of the step's key, the replica, the stage and the microbatch.

NOTE [randomness as data]
A stage that draws random numbers (dropout, noise, sampling) draws them from torch's default
generators, as plain PyTorch code does. If those generators simply ran on, each draw would
depend on the order in which the schedule runs the forwards: GPipe, 1F1B and ZB-V would give
three different losses with the same seed, and one process would differ from many. So, as a
JAX key is data, every forward (and every recomputed forward replayed in a backward) runs with
the default CPU generator, and the stage's accelerator's, seeded afresh with

    seed = (base(key, replica) + (stage << 20) + microbatch) mod 2**32,

a function of the step's ``key``, the data-parallel ``replica``, the ``stage`` and the global
``microbatch`` index, and of nothing else: not the schedule, the process count, the rank or
recomputation. Two microbatches (or stages) of one step and replica never get the same seed
(for fewer than 4096 stages and 2**20 microbatches); two steps get different ones unless their
keys collide. Only 32 bits reach the generator because torch's CPU generator (MT19937) keeps
only the low 32 bits of its seed; the CUDA generator takes the same number.

The step's key is drawn from the default CPU generator (one draw per call, ``draw_key``) unless
the caller passes ``key=``: ``torch.manual_seed(seed)`` at the start of a run fixes every step's
masks, and ``save_state``/``load_state``, which save that generator, resume them exactly.
Distributed, the ranks agree on one key in the step's handshake (that of the first stage's rank
of data-parallel replica 0 and tensor-parallel rank 0), so the masks do not depend on which
process draws. Around a step's actions the generators' states are saved and put back
(``keep_generators``), so the stages' draws never move the caller's own random stream: after a
step it has moved by the one draw of the key, whatever the stages did.

Tensor parallelism: the seed has no tensor-parallel index, so every rank of a tensor-parallel
group draws the same numbers for the same shape: a random op on a plain tensor, or on a
replicated DTensor's local piece, gives one mask on every tp rank, which keeps replicated
activations replicated. A random op on a sharded DTensor follows DTensor's own semantics: on a
device mesh without DTensor's RNG tracker (CPU) each rank draws its local piece from the seeded
generator (so the pieces' masks are the same pattern, not the unsplit tensor's mask), and where
torch keeps an offset-based tracker (CUDA) that tracker, not fpipe, decides the numbers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from typing import NamedTuple

import torch

KEY_LIMIT = 2**53  # keys travel in a float64 sum between replicas (fpipe/_distributed/_rank_step.py)
_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


class StageInfo(NamedTuple):
    """Where the stage code running now is (``fpipe.stage_info()``).

    Attributes:
        stage: the stage's index.
        microbatch: the global microbatch index (0 to ``num_microbatches - 1``).
        replica: the data-parallel replica (0 without data parallelism).
        key: the step's key (NOTE [randomness as data] in fpipe/_random.py).
        seed: what the default generators were seeded with for this call.
        training: ``False`` in a forward-only step (``step.evaluate``).
    """

    stage: int
    microbatch: int
    replica: int
    key: int
    seed: int
    training: bool


class Keys:
    """The seeds of one step's stage calls (NOTE [randomness as data])."""

    __slots__ = ("_root", "key", "replica", "training")

    def __init__(self, key: int, *, replica: int = 0, training: bool = True) -> None:
        self.key = key
        self.replica = replica
        self.training = training
        self._root = _mix(_mix(0x243F6A8885A308D3, key), replica)

    def seed(self, stage: int, microbatch: int) -> int:
        """The seed of ``stage``'s call on ``microbatch``."""
        return (self._root + (stage << 20) + microbatch) & _MASK32

    def enter(self, stage: int, microbatch: int, device: torch.device | None) -> None:
        """Seed the default generators (CPU, and ``device``'s if it is an accelerator) for
        ``stage`` on ``microbatch``, and make it what ``stage_info()`` tells."""
        seed = (self._root + (stage << 20) + microbatch) & _MASK32  # ``seed``, inlined: once per forward
        _CPU.manual_seed(seed)
        if device is not None and device.type != "cpu":
            _accelerator_generator(device).manual_seed(seed)
        _CURRENT.set((self, stage, microbatch, seed))


def stage_info() -> StageInfo:
    """Which stage, microbatch and replica the code running now computes, and the step's key.

    Call it inside a stage function (or ``loss_fn``) to derive your own randomness from data,
    e.g. a ``torch.Generator`` of your own: ``torch.Generator().manual_seed(stage_info().seed)``.
    The default generators are already seeded with ``seed`` when a stage runs (NOTE
    [randomness as data] in ``fpipe/_random.py``), so ``torch.nn.functional.dropout`` needs
    nothing of this.

    Raises:
        RuntimeError: outside a stage call of a running step.
    """
    current = _CURRENT.get()
    if current is None:
        raise RuntimeError(
            "fpipe.stage_info: no stage is running. Call it inside a stage function or loss_fn, while a step runs."
        )
    keys, stage, microbatch, seed = current
    return StageInfo(stage, microbatch, keys.replica, keys.key, seed, keys.training)


def draw_key() -> int:
    """A step's key, drawn from the default CPU generator (one draw)."""
    return int(torch.randint(0, KEY_LIMIT, (), dtype=torch.int64).item())


def check_key(key: object) -> int:
    """``key`` as a step's key.

    Raises:
        TypeError, ValueError: if it is not an int in ``[0, 2**53)``.
    """
    if isinstance(key, bool) or not isinstance(key, int):
        raise TypeError(f"fpipe.step: key must be an int (key: {key!r}). Pass e.g. key=step_number, or no key.")
    if not 0 <= key < KEY_LIMIT:
        raise ValueError(f"fpipe.step: key must be in [0, 2**53) (key: {key}). Pass a smaller non-negative int.")
    return key


@contextlib.contextmanager
def keep_generators(devices: Iterable[torch.device | None]) -> Iterator[None]:
    """Put the default generators (CPU, and those of ``devices``' accelerators) back as they were
    on exit, and leave no stage current (NOTE [randomness as data])."""
    accelerators = {d for d in devices if d is not None and d.type != "cpu"}
    states = [(g, g.get_state()) for g in [_CPU, *(_accelerator_generator(d) for d in accelerators)]]
    token = _CURRENT.set(None)
    try:
        yield
    finally:
        _CURRENT.reset(token)
        for generator, state in states:
            generator.set_state(state)


_CPU = torch.default_generator
_CURRENT: ContextVar[tuple[Keys, int, int, int] | None] = ContextVar("fpipe_stage", default=None)


def _accelerator_generator(device: torch.device) -> torch.Generator:
    module = torch.get_device_module(device.type)
    index = device.index if device.index is not None else module.current_device()
    generator: torch.Generator = module.default_generators[index]
    return generator


def _mix(h: int, x: int) -> int:
    """One round of splitmix64's finalizer over ``h ^ x``: nearby inputs give unrelated outputs."""
    z = ((h ^ x) + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
