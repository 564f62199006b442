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
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

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

    __slots__ = ("_root", "counted", "key", "replica", "training")

    def __init__(self, key: int, *, replica: int = 0, training: bool = True, counted: bool = False) -> None:
        self.key = key
        self.replica = replica
        self.training = training
        self.counted = counted  # a compiled step's calls count their draws, eager or not (NOTE [counted draws])
        self._root = _mix(_mix(0x243F6A8885A308D3, key), replica)

    def seed(self, stage: int, microbatch: int) -> int:
        """The seed of ``stage``'s call on ``microbatch``."""
        return (self._root + (stage << 20) + microbatch) & _MASK32

    def seeds(self, num_stages: int, num_microbatches: int) -> torch.Tensor:
        """Every call's seed, ``[stage, microbatch]`` (int64): a traced step's draws' (NOTE [counted draws])."""
        rows = [[self.seed(s, i) for i in range(num_microbatches)] for s in range(num_stages)]
        return torch.tensor(rows, dtype=torch.int64)

    def counting(self, stage: int, microbatch: int) -> CountedDraws:
        """The counted draws of ``stage``'s call on ``microbatch`` (NOTE [counted draws]): a
        compiled step's, in its graph or run eagerly."""
        return CountedDraws(torch.tensor(self.seed(stage, microbatch)))

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


# NOTE [counted draws]
# In a graph ``manual_seed`` does not trace, and Inductor draws numbers of its own. So a step with
# ``compile=`` (NOTE [the compiled step] in fpipe/_compile.py) draws from a counter-based generator
# written in torch's integer ops, as JAX splits a key, in every call: traced, or run eagerly to
# learn a row's layouts or after a warning (``Keys.counted``). Word ``e`` of the ``n``-th draw in
# stage ``s``'s call on microbatch ``i`` is a hash of (``Keys.seed(s, i)``, ``n``, ``e``). The hash
# is a bijection of [0, 2**32) whose products stay below 2**59, so no int64 overflows; floats are
# built from its words exactly (a float64 from two: 53 bits). So the draws are a function of the
# key, replica, stage and microbatch and of the order of the draws in the stage's code: not of the
# schedule, the processes, recomputation or the backend (but a normal's logarithm and cosine,
# which may differ from aten's in the last bits under Inductor). They are not an eager step's
# numbers (MT19937's). ``CountedDraws``, a torch function mode that dynamo traces, replaces the
# draws in ``COUNTED`` inside one stage call; any other draw stays in the graph, and the step
# refuses it (NOTE [random draws under compile] in fpipe/_traced.py). ``rand_like`` and
# ``randn_like`` are among those: dynamo does not hand them to a torch function mode.


def _hash(x: torch.Tensor) -> torch.Tensor:
    """A bijection of [0, 2**32) on int64 tensors: nearby inputs give unrelated outputs."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def _words(seed: torch.Tensor, draw: int, count: int, device: torch.device | None) -> torch.Tensor:
    """``count`` words of 32 random bits (int64): the ``draw``-th draw of the call seeded ``seed``."""
    base = _hash(_hash(seed ^ 0x243F6A88) ^ draw)  # (0-dim: on the CPU with words elsewhere, as a scalar)
    e = torch.arange(count, dtype=torch.int64, device=device)
    return _hash(_hash((e & _MASK32) ^ base) ^ ((e >> 32) ^ _hash(base ^ 0x85A308D3)))


def _uniform(
    seed: torch.Tensor, draw: int, count: int, dtype: torch.dtype, device: torch.device | None
) -> torch.Tensor:
    """``count`` floats in [0, 1) of ``dtype``, each a multiple of 2**-(its significand's bits)."""
    if dtype == torch.float64:
        w = _words(seed, draw, 2 * count, device).view(count, 2)
        return ((w[:, 0] >> 11) * 2**32 + w[:, 1]).to(dtype) * 2.0**-53
    bits = _SIGNIFICAND.get(dtype, 24)
    return (_words(seed, draw, count, device) >> (32 - bits)).to(dtype) * 2.0**-bits


_SIGNIFICAND = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}  # bits (``finfo`` does not trace)


def _normal(seed: torch.Tensor, draw: int, count: int, dtype: torch.dtype, device: torch.device | None) -> torch.Tensor:
    """``count`` standard normals of ``dtype`` (Box-Muller, in float32 at least)."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    u = _uniform(seed, draw, 2 * count, wide, device)
    return (torch.sqrt(-2.0 * torch.log1p(-u[:count])) * torch.cos((2 * math.pi) * u[count:])).to(dtype)


def _size(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[int, ...]:
    """The size of ``torch.rand(2, 3)``, ``torch.rand((2, 3))`` or ``torch.rand(size=...)``."""
    if "size" in kwargs:
        return tuple(kwargs["size"])
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return tuple(args[0])
    return tuple(args)


class CountedDraws(TorchFunctionMode):
    """Inside one traced stage call: the draws in ``COUNTED`` as counted words (NOTE [counted draws])."""

    def __init__(self, seed: torch.Tensor) -> None:
        super().__init__()
        self.seed = seed
        self.draws = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        counted = _COUNTED.get(func)
        subclass = bool(args) and type(args[0]) not in (torch.Tensor, torch.nn.Parameter) and torch.is_tensor(args[0])
        if counted is None or subclass or "generator" in kwargs or "out" in kwargs:
            return func(*args, **kwargs)  # (a DTensor's draws, or another's numbers: not ours to replace)
        self.draws += 1
        return counted(self, *args, **kwargs)

    def uniform(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device | None) -> torch.Tensor:
        return _uniform(self.seed, self.draws, math.prod(shape), dtype, device).view(shape)

    def normal(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device | None) -> torch.Tensor:
        return _normal(self.seed, self.draws, math.prod(shape), dtype, device).view(shape)

    def words63(self, count: int, device: torch.device | None) -> torch.Tensor:
        """``count`` words of 63 random bits."""
        w = _words(self.seed, self.draws, 2 * count, device).view(count, 2)
        return w[:, 0] * 2**31 + (w[:, 1] >> 1)


def _made(kwargs: dict[str, Any], dtype: torch.dtype | None = None) -> tuple[torch.dtype, torch.device | None]:
    """The dtype and device a factory's ``kwargs`` ask for (``None``: the default device)."""
    device = kwargs.get("device")
    return kwargs.get("dtype") or dtype or torch.get_default_dtype(), None if device is None else torch.device(device)


def _rand(mode: CountedDraws, *args: Any, **kwargs: Any) -> torch.Tensor:
    return mode.uniform(_size(args, kwargs), *_made(kwargs))


def _randn(mode: CountedDraws, *args: Any, **kwargs: Any) -> torch.Tensor:
    return mode.normal(_size(args, kwargs), *_made(kwargs))


def _randint(mode: CountedDraws, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``randint(high, size)`` or ``randint(low, high, size)``: ``low + word % (high - low)``."""
    size = kwargs.get("size", args[-1] if args else ())
    bounds = args if "size" in kwargs else args[:-1]
    low, high = kwargs.get("low", bounds[0] if len(bounds) == 2 else 0), kwargs.get("high", bounds[-1] if bounds else 0)
    shape = tuple(size)
    dtype, device = _made(kwargs, torch.int64)
    drawn: torch.Tensor = low + mode.words63(math.prod(shape), device) % (high - low)
    return drawn.view(shape).to(dtype)


def _randperm(mode: CountedDraws, n: int, **kwargs: Any) -> torch.Tensor:
    dtype, device = _made(kwargs, torch.int64)
    return torch.argsort(mode.words63(n, device), stable=True).to(dtype)


def _bernoulli(mode: CountedDraws, x: torch.Tensor, p: Any = None, **kwargs: Any) -> torch.Tensor:
    """``bernoulli(probs)``, ``bernoulli(x, p)``: ones where a uniform falls below the probability."""
    p = kwargs.get("p", p)
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    u = mode.uniform(x.shape, wide, x.device)
    return (u < (x if p is None else p)).to(x.dtype)


def _bernoulli_(mode: CountedDraws, x: torch.Tensor, p: Any = 0.5, **kwargs: Any) -> torch.Tensor:
    return x.copy_(_bernoulli(mode, x, kwargs.get("p", p)))


def _uniform_(mode: CountedDraws, x: torch.Tensor, a: float = 0.0, b: float = 1.0, **kwargs: Any) -> torch.Tensor:
    a, b = kwargs.get("from", a), kwargs.get("to", b)
    return x.copy_(a + (b - a) * mode.uniform(x.shape, x.dtype, x.device))


def _normal_(mode: CountedDraws, x: torch.Tensor, mean: float = 0.0, std: float = 1.0, **kwargs: Any) -> torch.Tensor:
    mean, std = kwargs.get("mean", mean), kwargs.get("std", std)
    return x.copy_(mean + std * mode.normal(x.shape, x.dtype, x.device))


def _dropout(
    mode: CountedDraws, x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, **kwargs: Any
) -> torch.Tensor:
    """``dropout`` (``torch.nn.functional``'s, or ``torch.dropout(x, p, train)``'s)."""
    training = kwargs.get("train", training)
    if not training or p == 0:
        return x
    if p == 1:
        keep = torch.zeros_like(x)
    else:
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        keep = (mode.uniform(x.shape, wide, x.device) < 1 - p).to(x.dtype) / (1 - p)
    return x.mul_(keep) if inplace else x * keep


_COUNTED: dict[Callable[..., Any], Callable[..., torch.Tensor]] = {
    torch.rand: _rand, torch.randn: _randn,
    torch.randint: _randint, torch.randperm: _randperm, torch.bernoulli: _bernoulli,
    torch.Tensor.bernoulli: _bernoulli, torch.Tensor.bernoulli_: _bernoulli_, torch.Tensor.uniform_: _uniform_,
    torch.Tensor.normal_: _normal_, torch.nn.functional.dropout: _dropout, torch.dropout: _dropout,
}  # fmt: skip
COUNTED = frozenset(f.__name__ for f in _COUNTED)  # the draws a traced stage call makes from counted words
