"""A pipeline rank's row compiled into one graph, its messages sent and received inside it
(``pipeline(..., compile=)`` over a process group).

NOTE [compiled rows]
A compiled step on pipeline rank ``r`` runs ``r``'s row as one graph (the one-process core,
NOTE [the compiled step] in fpipe/_compile.py, with a ``RowMail``): an activation or cotangent
for a stage on another rank is sent inside the graph (``_c10d_functional.isend``, one per tensor
leaf, each with a tag of its own), one from another rank received into a buffer of its known layout
(``irecv`` and ``wait_tensor``), and the last stage's rank sends the result to every other rank.
What must hold:

1. **Both sides know every message's layout before the graph runs.** The eager wire sends a
   header when a layout changes (fpipe/_distributed/_wire.py); a graph cannot. So each step's
   handshake carries every rank's *signature* (a hash of the structure, shapes, dtypes and
   ``requires_grad`` of its local stages' parameters and of its microbatches: what the messages'
   layouts follow from), and the first step with a new tuple of signatures runs eagerly,
   recording the layout of each message this rank receives; the next ones run the graph. A
   layout is *slots* (structure, dtypes, ``requires_grad``) and *shapes*, passed to the graph
   as empty tensors of shape ``(0, *shape)`` whose dims, and every dim of the microbatches, are
   marked dynamic: a new sequence length costs one eager step and no compile. (Not ints with
   ``dynamic=True``: that makes every int of the stages' code symbolic too, and an f-string of
   one does not trace.) The first compiled call of a tuple of signatures
   all-gathers every rank's hash of its slots; each tuple of hashes is a mail factory with a
   compiled core of its own (a code object of its own: no graph of other slots can match it),
   so new slots are a new graph on every rank in the same call. A graph's guards may still fail
   on one rank alone (a stage branching on a size): after its first compile a core runs under
   dynamo's stance ``fail_on_recompile``, and such a rank warns and runs the core without a
   graph for that call, sending and receiving what its graph would. A message leaf that is a
   plain value (``None``, a number, a string) is not sent: the receiver has it from the eager
   step, and the signatures hash the plain values of the parameters and microbatches it follows
   from. Any other leaf (or a container other
   than a dict, list, tuple or namedtuple) cannot be rebuilt in a graph: the rank that received
   it says so in the next handshake (``usable``), and every rank warns and runs eagerly from
   then on.
2. **Every rank runs the graph, or none does.** A rank whose row fails to trace or compile
   (a stage with data-dependent control flow, an uncounted random draw, a backend error) would
   leave its peers waiting in theirs. Each rank that traced in a call says whether it compiled
   (one all-gather, after compiling and before the graph runs: ``CompiledRun.attempt``'s
   ``agree``); unless all did, every rank warns and runs this step, and the ones after, eagerly
   (a step under ``fpipe.record()`` on any rank, a word in the handshake, runs eagerly too).
   Ranks trace in the same calls: new slots are a new mail factory and core on every rank
   (point 1). Were one rank to retrace alone (a global setting changed on it only), its
   agreement and the others' graphs would wait for each other until the timeout: a failed step,
   not a hang.
3. **Messages match whatever the order of posting.** Each tensor of each message travels under
   a tag of its own (``_tag``: kind, stage, microbatch, position), never 0, the eager wire's:
   Inductor posts receives in an order of its own (earlier, grouped). A sent activation is
   waited for when its cotangent comes back from the same peer (the peer read it then), the
   rest at the end of the graph; a wait moved to right after its send deadlocks 1F1B (each
   rank would wait for the other to read), which Inductor's peak-memory reordering did, so
   ``reorder_for_peak_memory`` is off for compiled rows. So is ``allow_buffer_reuse``: a sent
   tensor's buffer reused for a later receive before the send completed deadlocked too (the
   research, notes/compile.md). Whatever still goes wrong in a graph meets point 4's timer.
4. **A failure fails every rank, naming the culprit, never a hang.** The graph's waits have no
   timeout of fpipe's: the row runs under the failure board (``waiting``), so another rank's
   failure aborts its waits, and a timer aborts them once the pipeline's ``timeout`` has passed
   with no compile in progress on this rank (a frozen peer; the time dynamo and the backend
   take is not counted: the timer counts again from the ranks' agreement). The error is then
   ``lost``'s, as an eager wait's: the rank that died or stopped answering, or the one whose
   record stands.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from .._compile import Compile, CompiledRun
from .._errors import PipelineError
from .._pytree import PyTree, flatten, unflatten
from .._random import Keys
from .._run import Order, StepView
from .._traced import Core, Key, Losses, Mail, traced
from ._board import RAISED, waiting
from ._collectives import all_gather_ints, lost, mark_broken
from ._faults import WATCHDOG, abort_job
from ._messages import plan
from ._topology import Topology

# A tensor leaf's shape, dtype and requires_grad; or ("value", v) for a plain value (not sent: the
# receiver has it from the eager step, and a new value is a new signature: NOTE [compiled rows]).
Leaf = tuple[tuple[int, ...], torch.dtype, bool] | tuple[str, Any]
_VALUES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
Layout = tuple[Any, tuple[Leaf, ...]]  # the value's structure (``_recipe``) and its leaves
Signatures = tuple[int, ...]  # every pipeline rank's ``signature``, by rank
# A received tensor leaf in a graph: its index among the call's ``shapes``, its dtype and
# requires_grad; or ("value", v) (NOTE [compiled rows], point 1).
Slot = tuple[int, torch.dtype, bool] | tuple[str, Any]
Slots = tuple[Any, tuple[Slot, ...]]  # a received message's structure and its leaves' slots
MailFactory = Callable[[list[torch.Tensor]], Mail]

_KINDS = {"act": 1, "cot": 2, "mb": 3, "result": 4, "grad": 5, "losses": 6}
_TENSORS = 1 << 10  # the most tensors a message may have in a compiled row (``_tag``)


def layout_of(value: PyTree) -> Layout | str:
    """The layout a receiver needs to rebuild ``value``, or why it has none (a leaf that is not a tensor)."""
    leaves, spec = flatten(value)
    out: list[Leaf] = []
    for leaf in leaves:
        if type(leaf) is torch.Tensor:
            out.append((tuple(leaf.shape), leaf.dtype, leaf.requires_grad))
        elif type(leaf) in _VALUES:
            out.append(("value", leaf))
        else:
            return f"a leaf of type {type(leaf).__name__}"
    if sum(type(leaf) is torch.Tensor for leaf in leaves) > _TENSORS:
        return f"more than {_TENSORS} tensors"
    recipe = _recipe(unflatten(spec, list(range(len(leaves)))))
    return recipe if isinstance(recipe, str) else (recipe, tuple(out))


def _recipe(numbered: Any) -> Any:
    """How to build a value of builtin containers from its leaves, which ``numbered`` holds as
    their positions among the leaves; or why not (another kind of node). Dynamo traces building
    containers, not a ``PyTreeSpec`` made outside the graph (its ``unflatten``: "does not know
    how to trace"), nor flattening a constant (optree's ``DictMetaData``)."""
    kind = type(numbered)
    if kind is int:
        return numbered
    if kind is dict:
        children = [_recipe(v) for v in numbered.values()]
        why = next((c for c in children if isinstance(c, str)), None)
        return why if why is not None else ("dict", tuple(numbered), tuple(children))
    if kind in (list, tuple) or (issubclass(kind, tuple) and hasattr(kind, "_fields")):
        children = [_recipe(v) for v in numbered]
        why = next((c for c in children if isinstance(c, str)), None)
        return why if why is not None else (kind, tuple(children))
    return f"a node of type {kind.__name__}"


def _build(recipe: Any, leaves: Sequence[Any]) -> Any:
    """The value ``recipe`` (``_recipe``) describes, with ``leaves``."""
    if type(recipe) is int:
        return leaves[recipe]
    if recipe[0] == "dict":
        return {k: _build(c, leaves) for k, c in zip(recipe[1], recipe[2])}
    kind, children = recipe
    built = [_build(c, leaves) for c in children]
    return kind(built) if kind in (list, tuple) else kind(*built)


def slots_of(layouts: Mapping[Key, Layout]) -> tuple[dict[Key, Slots], list[tuple[int, ...]]]:
    """``layouts`` as slots, and the shapes those slots read (NOTE [compiled rows], point 1)."""
    slots: dict[Key, Slots] = {}
    shapes: list[tuple[int, ...]] = []
    for key in sorted(layouts):
        recipe, leaves = layouts[key]
        mine: list[Slot] = []
        for leaf in leaves:
            if len(leaf) == 2:
                mine.append(leaf)  # type: ignore[arg-type]
            else:
                shape, dtype, requires_grad = leaf
                mine.append((len(shapes), dtype, requires_grad))
                shapes.append(shape)  # type: ignore[arg-type]
        slots[key] = (recipe, tuple(mine))
    return slots, shapes


def dynamic_inputs(
    shapes: Sequence[tuple[int, ...]], microbatches: Sequence[PyTree] | None, device: torch.device
) -> list[torch.Tensor]:
    """The graph's carriers of ``shapes`` (empty tensors of shape ``(0, *shape)``), each of their
    dims and each dim of ``microbatches``' tensors marked dynamic (NOTE [compiled rows], point 1)."""
    carriers = [torch.empty((0, *shape), device=device) for shape in shapes]
    tensors = [t for mb in microbatches or () for t in flatten(mb)[0] if isinstance(t, torch.Tensor)]
    for carrier in carriers:
        for d in range(1, carrier.dim()):
            torch._dynamo.maybe_mark_dynamic(carrier, d)
    for t in tensors:
        for d in range(t.dim()):
            torch._dynamo.maybe_mark_dynamic(t, d)
    return carriers


def _digest(words: object) -> int:
    """A 63-bit hash of ``words``' text."""
    return int.from_bytes(hashlib.blake2b(str(words).encode(), digest_size=8).digest(), "little") >> 1


def signature(local_params: Sequence[PyTree], microbatches: Sequence[PyTree] | None) -> int:
    """A 63-bit hash of what this rank's message layouts follow from (NOTE [compiled rows], point 1)."""
    words: list[str] = []
    for tree in [*local_params, *(microbatches if microbatches is not None else [None, "no batch"])]:
        leaves, spec = flatten(tree)
        words.append(str(spec))
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                words.append(f"{type(leaf).__name__}{tuple(leaf.shape)}{leaf.dtype}{leaf.requires_grad}")
            else:
                words.append(f"{type(leaf).__name__}:{leaf!r:.200}")
    return _digest("\n".join(words))


@dataclass(frozen=True, eq=False)
class RowWire:
    """Where each message of a rank's row goes or comes from, and each received one's layout."""

    group: str  # the pipeline group's name
    device: torch.device
    # A message crossing ranks: (the peer's rank in the pipeline group, which the functional ops
    # take, not its global rank: a subgroup's pair is not connected otherwise; its tag).
    routes: Mapping[Key, tuple[int, int]]
    slots: Mapping[Key, Slots]  # each received message's (its shapes are the call's ``shapes``)
    result_to: tuple[int, ...]  # the pipeline ranks the last stage's rank sends the result to
    result_from: int | None  # the pipeline rank the result comes from (None: this rank makes it)
    result_tag: int
    me: int  # this rank, in the pipeline group
    # The stages on several ranks this rank holds: their holders, and the tag of their sums.
    shared: Mapping[int, tuple[tuple[int, ...], int]]
    losses_tag: int  # of the last stage's holders' losses (when it is on several ranks)


class RowMail:
    """``Mail`` for a rank's compiled row: messages to other ranks sent and received inside the
    graph, into buffers shaped as ``shapes`` (the graph's inputs: one graph for many shapes)."""

    def __init__(self, wire: RowWire, shapes: Sequence[torch.Tensor]) -> None:
        self.wire = wire
        self.shapes = shapes
        self.held: dict[Key, PyTree] = {}
        self.sends: dict[Key, list[torch.Tensor]] = {}

    def put(self, key: Key, value: PyTree) -> None:
        route = self.wire.routes.get(key)
        if route is not None:
            self.sends[key] = self._send(value, *route)
        elif key[0] != "mb":  # (a microbatch the last stage's rank holds itself)
            self.held[key] = value

    def take(self, key: Key) -> PyTree:
        if key in self.held:
            return self.held.pop(key)
        value = self._receive(self.wire.slots[key], *self.wire.routes[key])
        if key[0] == "cot":  # the peer ran this microbatch's next stage: it read our activation
            for handle in self.sends.pop(("act", key[1] - 1, key[2]), []):
                torch.ops._c10d_functional.wait_tensor(handle)
        return value

    def share(self, stage: int, partial: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        holders, tag = self.wire.shared[stage]
        parts: list[list[torch.Tensor]] = []
        for r in holders:
            if r == self.wire.me:
                parts.append(partial)
                continue
            self.sends["grad", stage, r] = self._send(partial, r, tag)
            group = self.wire.group
            received = [
                torch.ops._c10d_functional.irecv(torch.empty_like(t), r, tag + n, group) for n, t in enumerate(partial)
            ]
            parts.append([torch.ops._c10d_functional.wait_tensor(t) for t in received])
        return parts

    def gather_losses(self, losses: Losses) -> Losses | None:
        wire = self.wire
        holders = wire.shared[max(wire.shared)][0]  # (the last stage's)
        if wire.me != holders[0]:
            # Its leaves as the eager message's flatten orders them (a dict's keys sorted): dynamo
            # does not flatten a dict of int keys (optree's ``DictMetaData``).
            leaves = [losses[0][i] for i in sorted(losses[0])]
            leaves += [leaf for i in sorted(losses[1]) for leaf in flatten(losses[1][i])[0]]
            self.sends["losses", 0, 0] = self._send(leaves, holders[0], wire.losses_tag)
            return None
        merged = tuple(dict(part) for part in losses)
        for r in holders[1:]:
            theirs = self._receive(wire.slots[("losses", max(wire.shared), 0)], r, wire.losses_tag)
            for part, other in zip(merged, theirs):
                part.update(other)
        return merged  # type: ignore[return-value]

    def result(self, result: tuple[torch.Tensor, Any, Any] | None) -> tuple[torch.Tensor, Any, Any]:
        wire = self.wire
        if result is None:
            assert wire.result_from is not None
            result = self._receive(wire.slots[("result", 0, 0)], wire.result_from, wire.result_tag)
        else:
            for n, peer in enumerate(wire.result_to):
                self.sends["result", n, 0] = self._send(result, peer, wire.result_tag)
        for handles in self.sends.values():
            for handle in handles:
                torch.ops._c10d_functional.wait_tensor(handle)
        return result  # type: ignore[return-value]

    def _send(self, value: PyTree, peer: int, tag: int) -> list[torch.Tensor]:
        leaves = [leaf for leaf in flatten(value)[0] if isinstance(leaf, torch.Tensor)]
        group = self.wire.group
        return [
            torch.ops._c10d_functional.isend(leaf.detach().contiguous(), peer, tag + n, group)
            for n, leaf in enumerate(leaves)
        ]

    def _receive(self, slots: Slots, peer: int, tag: int) -> PyTree:
        recipe, leaves = slots
        out: list[Any] = []
        n = 0  # the tensor's position among the message's tensors
        for leaf in leaves:
            if len(leaf) == 2:  # a plain value: ("value", v)
                out.append(leaf[1])
                continue
            index, dtype, requires_grad = leaf
            shape = self.shapes[index].shape[1:]
            buffer = torch.empty(shape, dtype=dtype, device=self.wire.device)
            received = torch.ops._c10d_functional.irecv(buffer, peer, tag + n, self.wire.group)
            n += 1
            tensor = torch.ops._c10d_functional.wait_tensor(received)
            out.append(tensor.requires_grad_() if requires_grad else tensor)
        return _build(recipe, out)


def _tag(key: Key, num_stages: int, num_microbatches: int) -> int:
    """The tag of message ``key``'s first tensor (its ``n``-th tensor's is ``tag + n``): one per
    tensor of each message, never 0 (NOTE [compiled rows], point 3)."""
    kind, stage, microbatch = key
    return ((_KINDS[kind] * num_stages + stage) * num_microbatches + microbatch) * _TENSORS


class CompiledRows:
    """A step's compiled rows on this pipeline rank (NOTE [compiled rows]): the layouts learned per
    tuple of signatures, their mails, and the compiled core."""

    def __init__(self, option: Compile) -> None:
        self.run = CompiledRun(option)
        self._layouts: dict[Signatures, dict[Key, Layout]] = {}
        self._mails: dict[Signatures, tuple[MailFactory, list[tuple[int, ...]]]] = {}  # and its shapes
        self._factories: dict[tuple[int, ...], MailFactory] = {}  # by every rank's slots' hash
        # Per factory (``id``): its core and the core compiled (a code object of its own, so that
        # no graph of other slots can match its call), and whether a graph ran.
        self._rows: dict[int, tuple[Core, Callable[..., Any]]] = {}
        self._fitted: set[int] = set()

    @property
    def usable(self) -> bool:
        """Whether this rank may still run compiled rows (its word in the step's handshake)."""
        return self.run.failed is None

    def recorder(self, signatures: Signatures, order: Order) -> Callable[[Key, PyTree], None] | None:
        """What the eager row calls with each message it receives when it runs to learn their
        layouts (the first step of ``signatures``); ``None`` when it need not."""
        if order.forward_only or self.run.failed is not None or signatures in self._layouts:
            return None
        layouts = self._layouts[signatures] = {}

        def record(key: Key, value: PyTree) -> None:
            layout = layout_of(value)
            if isinstance(layout, str):  # every rank learns it at the next handshake (``usable``)
                self.run.fail(f"message {_describe(key)} carries {layout}, which cannot travel in a graph")
            else:
                layouts[("result", 0, 0) if key[0] == "result" else key] = layout

        return record

    def ready(self, order: Order, signatures: Signatures, every_usable: bool) -> bool:
        """Whether this call runs the compiled row; else the eager row runs (to learn the layouts,
        or for good once a row did not compile, with a warning). ``every_usable``: whether every
        rank's handshake said ``usable``."""
        if order.forward_only:
            return False
        if not every_usable:
            self.run.fail("another pipeline rank cannot compile its row (its own warning says why)")
        if self.run.failed is not None:
            self.run.warn(self.run.failed)
            return False
        return signatures in self._layouts

    def __call__(
        self,
        step: StepView,
        order: Order,
        topology: Topology,
        params: Sequence[PyTree],
        microbatches: list[PyTree] | None,
        weights: Sequence[float],
        key: int,
        signatures: Signatures,
        send_microbatches: bool,
    ) -> tuple[tuple[torch.Tensor, Any, Any], list[PyTree]] | None:
        """A ``ready`` call's ``((loss, aux, None), grads)`` from the compiled row, on the full
        ``params``; ``None`` when it did not trace or compile (warned: run the eager row).
        ``key``: the step's (its draws', NOTE [counted draws] in fpipe/_random.py)."""
        factory, shapes = self._mail(step, order, topology, signatures, send_microbatches)
        carriers = dynamic_inputs(shapes, microbatches, topology.device)
        if id(factory) not in self._rows:
            core, compiled = self.run.compile_core(step, order)
            core.mail = factory
            self._rows[id(factory)] = core, compiled
        core, compiled = self._rows[id(factory)]
        random_seeds = Keys(key, replica=topology.replica).seeds(step.num_stages, order.program.num_microbatches)
        timeout = timedelta(seconds=step.timeout)
        agreed: list[bool] = []  # (once the ranks agreed in this call)
        timer = _Timer(topology, step.timeout, lambda: traced() and not agreed)
        timer.start()

        def agree(ok: bool) -> bool:
            what = "the other pipeline ranks as they compiled their rows"
            every = all_gather_ints(topology, topology.group, [int(ok)], step.timeout, what)
            agreed.append(all(word == [1] for word in every))
            timer.start()  # (the graph starts now)
            return agreed[-1]

        def attempt(core: Callable[..., Any]) -> tuple[tuple[torch.Tensor, Any, Any], list[PyTree]] | None:
            return self.run.attempt(core, step, order, params, microbatches, weights, random_seeds, agree, carriers)

        fitted = id(factory) in self._fitted
        try:
            with waiting(topology.board):
                try:
                    # A graph compiled for these slots does not recompile on one rank alone (point 1).
                    with torch.compiler.set_stance("fail_on_recompile") if fitted else contextlib.nullcontext():
                        out = attempt(compiled)
                except (RuntimeError, torch._dynamo.exc.RecompileError) as error:
                    if not str(error).startswith(_RECOMPILE):
                        raise
                    self.run.warn(_unfit(error))
                    out = attempt(core)  # (the same operations and messages, without a graph)
        except PipelineError as error:
            mark_broken(topology, error)
            raise
        except BaseException as error:
            mark_broken(topology, error)
            if isinstance(error, RuntimeError) and _lost(error, timer.fired, topology):
                cause = RuntimeError("timed out") if timer.fired else error  # (a wait in the graph)
                raise lost(topology.board, cause, topology.rank, "its compiled row", None, timeout) from error
            # Its own (a stage's, at run time): the others learn it from the board.
            me = topology.global_ranks[topology.rank]
            what = f"failed in its compiled row ({type(error).__name__}); its own error says why"
            WATCHDOG.report(topology.board, topology.board.failure_of(me, RAISED, what))
            abort_job(topology.board)
            raise
        finally:
            timer.cancel()
        if timer.fired:  # (as the graph returned: the groups are aborted all the same)
            mark_broken(topology, RuntimeError("timed out"))
            raise lost(topology.board, RuntimeError("timed out"), topology.rank, "its compiled row", None, timeout)
        if out is not None:
            self._fitted.add(id(factory))
        return out

    def _mail(
        self, step: StepView, order: Order, topology: Topology, signatures: Signatures, send_microbatches: bool
    ) -> tuple[MailFactory, list[tuple[int, ...]]]:
        """The mail factory of ``signatures``' layouts and the shapes it reads. The factory is
        one object per tuple of every rank's slots (agreed in one all-gather, the first time a
        tuple of signatures runs compiled), which every rank's dynamo guards on: new slots on any
        rank are a new graph on every rank at once; new shapes are none (NOTE [compiled rows], point 1)."""
        known = self._mails.get(signatures)
        if known is not None:
            return known
        slots, shapes = slots_of(self._layouts[signatures])
        what = "the other pipeline ranks as they agreed on their messages' slots"
        every = all_gather_ints(topology, topology.group, [_digest((sorted(slots.items()), send_microbatches))],
                                step.timeout, what)  # fmt: skip
        agreed = tuple(word for (word,) in every)
        factory = self._factories.get(agreed)
        if factory is None:
            program, me = order.program, topology.rank
            s, m = program.num_stages, program.num_microbatches
            routes: dict[Key, tuple[int, int]] = {}
            for route in plan(program, me, send_microbatches).routes:
                for key in (*route.incoming, *route.outgoing):
                    if key[0] in ("act", "cot", "mb"):
                        routes[key] = (route.peer, _tag(key, s, m))
            holder = program.holders(s - 1)[0]
            wire = RowWire(
                group=topology.group.group_name,
                device=topology.device,
                routes=routes,
                slots=slots,
                result_to=tuple(r for r in range(program.num_ranks) if r != me) if me == holder else (),
                result_from=None if me == holder else holder,
                result_tag=_tag(("result", 0, 0), s, m),
                me=me,
                shared={
                    t: (program.holders(t), _tag(("grad", t, 0), s, m))
                    for t in program.stages_of(me)
                    if len(program.holders(t)) > 1
                },
                losses_tag=_tag(("losses", s - 1, 0), s, m),
            )
            factory = self._factories[agreed] = _factory(wire)
        self._mails[signatures] = (factory, shapes)
        return factory, shapes


def _factory(wire: RowWire) -> MailFactory:
    """The mail factory of ``wire``."""
    return lambda shapes: RowMail(wire, shapes)


# What dynamo raises at a call that its stance ``fail_on_recompile`` keeps from recompiling.
_RECOMPILE = "Detected recompile when torch.compile stance is 'fail_on_recompile'"


def _unfit(error: Exception) -> str:
    """Why this rank's graph did not fit this call (a guard failed), and what runs instead."""
    lines = [line.strip() for line in str(error).splitlines()]
    failed = [line.strip(" -").split("#")[0].strip() for line in lines if line.startswith("- ")]
    return (
        f"this pipeline rank's graph does not fit this step's shapes ({failed[0] if failed else 'a guard failed'}), "
        f"and a new graph on one rank alone would leave the others waiting: its row runs without a graph"
    )


class _Timer:
    """Aborts the job's groups on this rank once ``seconds`` have passed since ``start`` with no
    compile in progress (``compiling``), so a graph's waits end (NOTE [compiled rows], point 4);
    never once ``cancel`` has returned."""

    def __init__(self, topology: Topology, seconds: float, compiling: Callable[[], bool]) -> None:
        self._topology, self._seconds, self._compiling = topology, seconds, compiling
        self._thread: threading.Timer | None = None
        self._lock = threading.Lock()
        self._over = False
        self.fired = False

    def start(self) -> None:
        """Start counting ``seconds`` from now (again, if it was counting)."""
        with self._lock:
            self._arm()

    def cancel(self) -> None:
        with self._lock:
            self._over = True
            if self._thread is not None:
                self._thread.cancel()

    def _arm(self) -> None:
        if self._thread is not None:
            self._thread.cancel()
        self._thread = threading.Timer(self._seconds, self._fire)
        self._thread.daemon = True
        self._thread.start()

    def _fire(self) -> None:
        with self._lock:
            if self._over:
                return
            if self._compiling():  # (a compile's time is no peer's silence: count again from now)
                self._arm()
                return
            self.fired = True
            abort_job(self._topology.board)


# What a wait in a graph raises when a peer is gone or the wait was aborted (gloo: "Connection
# closed by peer", "Timed out waiting ... for recv", "pair closure"; NCCL: "remote process exited").
_LOST_WORDS = ("connection", "timed out", "timeout", "pair", "abort", "remote process exited")


def _lost(error: RuntimeError, timed_out: bool, topology: Topology) -> bool:
    """Whether ``error``, raised by a compiled row, is a wait that a lost peer, the failure board
    or the timer ended (``lost`` names who), not this rank's own error in a stage."""
    text = str(error).lower()
    return timed_out or topology.board.aborted or any(words in text for words in _LOST_WORDS)


def _describe(key: Key) -> str:
    kind, stage, microbatch = key
    words = {"act": "the activation of stage", "cot": "the cotangent of stage", "mb": "microbatch"}
    if kind == "result":
        return "the result (loss and aux)"
    if kind == "mb":
        return f"microbatch {microbatch}"
    return f"{words[kind]} {stage} for microbatch {microbatch}"
