"""The step's sends threads (``fpipe._distributed._sends``), on 2 gloo ranks: sent tensors let go
once their sends have completed (NOTE [sends released]), waited for by the step's own threads,
which end with the step, failed or not."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

import fpipe
from fpipe._distributed import _transport
from fpipe.schedules import GPipe, Interleaved1F1B, OneFOneB
from tests._multiprocess import run_ranks
from tests.distributed._faults import SLACK, wait_for

# -- Sent tensors let go on 2 gloo ranks (NOTE [sends released]) ----------------------------------

WIDTH = 1 << 14  # float64 leaves of 128 KiB: they travel from their own storage (INLINE_LIMIT)
M = 8
RELEASE = 10.0  # seconds a completed send's thread may take to let go of it (NOTE [sends released])
_SENT: dict[int, StorageWeakRef] = {}  # microbatch -> the storage of its stage-0 output's ``big`` leaf, on rank 0
_ALIVE: dict[int, list[int]] = {}  # microbatch -> the earlier ``big`` leaves alive when its forward ran


def _first(p, mb):
    i = int(mb["id"])
    deadline = time.monotonic() + RELEASE  # (activation i - 2's send has completed: below)
    while any(not ref.expired() for j, ref in _SENT.items() if j < i - 1) and time.monotonic() < deadline:
        time.sleep(0.001)
    _ALIVE[i] = sorted(j for j, ref in _SENT.items() if not ref.expired())
    big = torch.full((WIDTH,), float(i + 1), dtype=torch.float64)  # no graph: the pullback does not keep it
    _SENT[i] = StorageWeakRef(big.untyped_storage())  # (the wire sends a view of it)
    return {"h": mb["x"] @ p["w"], "big": big}


def _second(p, x):
    return (x["h"] * p["v"]).sum(-1) + x["big"].mean()


def _loss(y, mb):
    return ((y - mb["t"]) ** 2).mean()


def _released(rank, world):
    """1F1B, 8 microbatches: on rank 0, which sent ``big`` leaves are still alive at each forward
    of stage 0; on rank 1, the bytes its transport holds as each cotangent is sent."""
    g = torch.Generator().manual_seed(0)
    params = [
        {"w": torch.randn(8, WIDTH, generator=g, dtype=torch.float64)},
        {"v": torch.randn(WIDTH, generator=g, dtype=torch.float64)},
    ]
    batch = {
        "x": torch.randn(M, 8, generator=g, dtype=torch.float64),
        "id": torch.arange(M),
        "t": torch.zeros(M, dtype=torch.float64),
    }
    step = fpipe.pipeline(_loss, [_first, _second], OneFOneB(M), parallel=fpipe.Parallelism(group=dist.group.WORLD))
    held: list[int] = []
    send_cotangent = _transport.DistributedTransport.send_cotangent

    def recording(self, stage, microbatch, value):
        deadline = time.monotonic() + RELEASE  # (cotangent i - 2's send has completed: below)
        while self.held() >= 2 * WIDTH * 8 and time.monotonic() < deadline:
            time.sleep(0.001)
        held.append(self.held())  # before this send: what the earlier sends still hold
        send_cotangent(self, stage, microbatch, value)

    _transport.DistributedTransport.send_cotangent = recording  # (this process only: it is the rank's own)
    params = [p if s in step.local_stages else None for s, p in enumerate(params)]
    out = []
    for _ in range(2):
        _SENT.clear()
        _ALIVE.clear()
        held.clear()
        step(params, batch if rank == 0 else None)
        out.append(
            {"alive": dict(_ALIVE), "after": [j for j, ref in _SENT.items() if not ref.expired()], "held": list(held)}
        )
    return out


@pytest.mark.timeout(120)
def test_sent_tensors_are_let_go_once_the_peer_has_read_them():
    """At 0F_j, rank 0 has run 0B_{j-2}, whose cotangent rank 1 sent after 1F_{j-2} read activation
    j - 2, so every send of activation j - 2 or earlier has completed and, within ``RELEASE``
    seconds (the sends thread's turn), nothing may hold its tensors (a stage output's leaf with no
    graph, which no pullback keeps either). Likewise rank 1, as it sends cotangent i, has read
    activation i, sent after 0B_{i-2} read cotangent i - 2: it may hold cotangent i - 1 alone.
    Twice, so the second step starts with every layout known."""
    results = run_ranks(2, _released, timeout=100)
    cotangent = WIDTH * 8  # bytes of one cotangent's large leaf
    for first, second in zip(*results):
        assert first["after"] == [] and second["alive"] == {}
        for j in range(M):
            assert set(first["alive"][j]) <= {j - 1}, (j, first["alive"][j])
        assert first["held"] == [] and len(second["held"]) == M
        assert all(held < 2 * cotangent for held in second["held"]), second["held"]


# -- Every send let go once it has completed, the last ones too (NOTE [sends released]) -------------


def _scaled(p, x):
    return torch.tanh((x["x"] if isinstance(x, dict) else x) * p)


def _mean_square(y, mb):
    return (y**2).mean()


def _every_send(rank, world):
    """For GPipe, 1F1B and interleaved 1F1B, two steps each: as ``close`` begins (after the step's
    last action and the result), how long until no tensor this rank sent is referenced any more
    (20 s at most), which bytes are left then and what the transport says it holds; after each
    step, the fpipe-sends threads alive and whether the thread count is back to the first step's."""
    sent: list[tuple[StorageWeakRef, int]] = []
    isend, close = dist.isend, _transport.DistributedTransport.close

    def recording_isend(tensor, *args, **kwargs):
        sent.append((StorageWeakRef(tensor.untyped_storage()), tensor.numel() * tensor.element_size()))
        return isend(tensor, *args, **kwargs)

    def closing(self):
        start = time.monotonic()
        while any(not ref.expired() for ref, _ in sent) and time.monotonic() < start + 20:
            time.sleep(0.001)
        seconds, left = time.monotonic() - start, [n for ref, n in sent if not ref.expired()]
        out[-1].update(sent=len(sent), seconds=seconds, left=left, held=self.held())
        close(self)

    dist.isend, _transport.DistributedTransport.close = recording_isend, closing  # (this process only)
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(M, WIDTH, generator=g, dtype=torch.float64)}  # 128 KiB per microbatch
    baseline, out = None, []
    for schedule, num_stages in [(GPipe(M), 2), (OneFOneB(M), 2), (Interleaved1F1B(M), 4)]:
        parallel = fpipe.Parallelism(group=dist.group.WORLD)
        step = fpipe.pipeline(_mean_square, [_scaled] * num_stages, schedule, parallel=parallel)
        params = [torch.randn(WIDTH, generator=g, dtype=torch.float64) for _ in range(num_stages)]
        params = [p if s in step.local_stages else None for s, p in enumerate(params)]
        for _ in range(2):
            sent.clear()
            out.append({"schedule": type(schedule).__name__})
            step(params, batch)  # (on both ranks: no microbatch sends, views of the caller's batch)
            baseline = threading.active_count() if baseline is None else baseline
            threads = [t.name for t in threading.enumerate() if t.name == "fpipe-sends"]
            out[-1].update(threads=threads, count=threading.active_count() == baseline)
    return out


@pytest.mark.timeout(180)
def test_every_sent_tensor_is_let_go_soon_after_the_last_action():
    """The sends of a step's last actions (GPipe's last rank's cotangents, 1F1B's and interleaved
    1F1B's last two, the result) are let go by the step's own threads as their sends complete: as
    ``close`` begins, every tensor a rank sent in the step is let go while ``close`` waits, where a
    transport that kept them until after the closing all-gather would have the test wait its 20 s
    and find them (how long it took is a matter of load, so it is not asserted). The threads end
    with the step: none is left after it."""
    for rank, steps in enumerate(run_ranks(2, _every_send, timeout=150)):
        assert len(steps) == 6
        for checked in steps:
            assert checked["sent"] > 0 and checked["left"] == [] and checked["held"] == 0, (rank, checked)
            assert checked["threads"] == [] and checked["count"], (rank, checked)


def _faulty_gpipe(rank, world, fault, timeout, directory):
    """GPipe on 2 gloo ranks after a healthy step: rank 0 ``fault``s (SIGKILL, SIGSTOP, or raises)
    in its first backward, having read one cotangent (and posted the next one's receive), so rank
    1's later cotangents and its result wait in rank 1's sends thread. The survivor returns its
    seconds, error type and message, the bytes its transport held as ``close`` began, and the
    threads alive that were not before the step: as it ended, and once the victim has exited
    (a victim that raised waits for the survivor's step to end first)."""
    armed, held = [False], []

    def stage(p, x):
        y = torch.tanh(x @ p)
        if y.requires_grad:
            y.register_hook(lambda g: hit())
        return y

    def hit():
        if armed[0] and rank == 0:
            armed[0] = False
            if fault == "raise":
                raise RuntimeError("the victim's own error")
            os.kill(os.getpid(), fault)

    close = _transport.DistributedTransport.close

    def closing(self):
        held.append(self.held())
        close(self)

    _transport.DistributedTransport.close = closing  # (this process only)
    options = {} if timeout is None else {"timeout": timeout}
    parallel = fpipe.Parallelism(group=dist.group.WORLD, **options)
    step = fpipe.pipeline(_mean_square, [stage] * 2, GPipe(4), parallel=parallel)
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(3, 3, generator=g, dtype=torch.float64) if s == rank else None for s in range(2)]
    batch = torch.randn(8, 3, generator=g, dtype=torch.float64) if rank == 0 else None
    step(params, batch)
    before = set(threading.enumerate())
    armed[0], start = True, time.monotonic()
    try:
        step(params, batch)
        kind, message = "no error", ""
    except (fpipe.PipelineError, RuntimeError) as error:  # (RuntimeError: the victim's own)
        kind, message = type(error).__name__, str(error)
    seconds = time.monotonic() - start
    new = [t.name for t in threading.enumerate() if t not in before]
    (directory / f"done{rank}").touch()
    if rank == 0:
        wait_for(directory / "done1")
    deadline = time.monotonic() + 20  # (the victim, done, exits meanwhile)
    while any(t not in before for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    later = [t.name for t in threading.enumerate() if t not in before]
    return seconds, kind, message, held[-1] if held else None, new, later


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("fault", "timeout", "kind", "because"),
    [
        (signal.SIGKILL, None, "PipelineError", "because rank 0 died"),
        (signal.SIGSTOP, 4, "PipelineTimeoutError", "because rank 0 stopped answering"),
        ("raise", None, "PipelineError", "because rank 0 failed in backward of stage 0 on microbatch 0 (0B0)"),
    ],
)
def test_a_send_left_waiting_on_a_failed_peer_fails_the_step_fast_and_ends_its_thread(
    fault, timeout, kind, because, tmp_path
):
    """Killed or frozen, rank 0 never reads rank 1's last cotangents: rank 1's sends thread waits
    on them until the closed connection or the step's own failure (which aborts the job's groups)
    ends the wait, and rank 1 raises the usual error (naming rank 0, which hosts the store here:
    NOTE [the store's host]) within the fault tests' bounds, its thread ended. Raised, rank 0
    stays alive and reads no more: rank 1 fails as fast, not after the 300 s default, and leaves
    its thread waiting (the group stays open for the other ranks) until rank 0 exits."""
    results = run_ranks(2, _faulty_gpipe, fault, timeout, tmp_path, timeout=100, may_die=frozenset({0}))
    seconds, raised, message, held, new, later = results[1]
    assert raised == kind and because in message, (raised, message)
    assert seconds < (SLACK if timeout is None else timeout + SLACK), seconds
    assert later == [] and (new == [] if fault != "raise" else new == ["fpipe-sends"]), (new, later)
    if fault != signal.SIGKILL:  # (killed, rank 0 may have failed the thread's waits before)
        assert held > 0  # the thread held sends as rank 1's close began
