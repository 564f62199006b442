"""Overlapped pairs (NOTE [overlapped pairs] in fpipe/_pairs.py): two actions of a rank interleaved
at their stages' communication points, bitwise equal to the same program run in sequence, and to
the unsplit model within float tolerance."""

from __future__ import annotations

import os
import signal
import threading
import warnings

import optree
import pytest
import torch

import fpipe
from fpipe._executor import SendsInOrder
from fpipe._pairs import SideFailed, communication_point, run_pair
from fpipe.schedules import Action, DualPipeV, OneFOneB, Overlapped, Program, ScheduleError, ZeroBubbleH1, validate
from fpipe.schedules._registry import BUILTINS
from tests._multiprocess import run_ranks
from tests.conformance import built
from tests.distributed._faults import SLACK, timed_failure
from tests.helpers import MOE_EXPERTS, assert_bitwise, moe_batch, moe_loss, moe_params, moe_reference, moe_stages

pytestmark = pytest.mark.timeout(240)


def test_the_sides_alternate_at_their_points_and_each_draws_its_own_numbers():
    """Side 0 runs to its first point, then side 1 to its first, and so on; a side that ends lets
    the other run to its end. Each side's draws are those it makes alone."""
    trace = []

    def side(name, points, seed):
        def run():
            torch.manual_seed(seed)
            for k in range(points + 1):
                trace.append((name, k, torch.rand(2)))
                if k < points:
                    communication_point()

        return run

    assert run_pair(side("a", 2, 1), side("b", 3, 2)) == (2, 3)
    assert [(n, k) for n, k, _ in trace] == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2), ("b", 3)]
    for name, points, seed in (("a", 2, 1), ("b", 3, 2)):
        torch.manual_seed(seed)
        alone = [torch.rand(2) for _ in range(points + 1)]
        assert_bitwise([x for n, _, x in trace if n == name], alone, name)


def test_a_point_on_a_thread_working_for_a_side_switches_for_it():
    """NOTE [points on other threads]: side 1 waits for a helper thread that reaches two points, as
    an accelerator's autograd thread runs a backward for the side that asked: the sides still
    alternate at those points."""
    trace = []

    def side_0():
        for k in range(3):
            trace.append(("a", k))
            if k < 2:
                communication_point()

    def side_1():
        def helper():
            for k in range(3):
                trace.append(("b", k))
                if k < 2:
                    communication_point()

        worker = threading.Thread(target=helper)
        worker.start()
        worker.join()

    assert run_pair(side_0, side_1) == (2, 2)
    assert trace == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    communication_point()  # the pair has ended: nothing to switch


def test_a_point_outside_a_pair_does_nothing_and_a_failing_side_lets_the_other_finish():
    communication_point()
    done = []

    def fails():
        communication_point()
        raise ValueError("side 0 broke")

    def finishes():
        communication_point()
        communication_point()
        done.append(True)

    with pytest.raises(SideFailed) as caught:
        run_pair(fails, finishes)
    assert caught.value.side == 0 and isinstance(caught.value.__cause__, ValueError) and done == [True]


def test_pairs_of_stages_without_points_run_in_sequence_in_one_process():
    """In one process no stage communicates: an overlapped schedule runs its actions in sequence,
    bitwise equal to the schedule without pairs, and does not warn."""
    full = moe_params()
    fns, per = moe_stages(2, True)
    results = []
    for schedule in (OneFOneB(4), Overlapped(OneFOneB(4))):
        step = fpipe.pipeline(moe_loss, fns, schedule, has_aux=True)
        results.append(step([full[:per], full[per:]], moe_batch()))
    assert_bitwise(results[1], results[0])


def _local_copy(t):
    return (t.to_local() if hasattr(t, "to_local") else t).clone()


def _overlapped_ranks(rank, world, dims, shape, cases, recompute, dropout, strict=True):
    """For each ``(schedule, num_stages)`` of ``cases``: the step's loss and this rank's gradients
    (expert pieces local) without and with pairs; with ``strict``, warnings are errors (a pair
    that ran in sequence)."""
    from torch.distributed.device_mesh import init_device_mesh

    if strict:
        warnings.simplefilter("error")
    torch.set_default_dtype(torch.float64)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
    ep = mesh.get_coordinate()[dims.index("ep")] if "ep" in dims else 0
    out = []
    for schedule, num_stages in cases:
        fns, per = moe_stages(num_stages, True, dropout)
        got = []
        for s in (schedule, Overlapped(schedule)):
            step = fpipe.pipeline(
                moe_loss,
                fns,
                s,
                has_aux=True,
                recompute=recompute,
                parallel=fpipe.Parallelism(mesh=mesh, timeout=60),
            )
            full = moe_params()
            if "ep" in dims:
                full = [fpipe.moe.distribute_experts(p, mesh["ep"]) for p in full]
            ps = [full[i * per : (i + 1) * per] if i in step.local_stages else None for i in range(num_stages)]
            (loss, counts), grads = step(ps, moe_batch(ep) if 0 in step.local_stages else None, key=7)
            local = [optree.tree_map(_local_copy, grads[i]) for i in step.local_stages]
            got.append((loss.clone(), counts.clone(), local, bool(step.program.pairs)))
        out.append((str(schedule), ep, got))
    return out


def test_overlapped_pairs_with_recompute_and_dropout_are_bitwise_the_sequential_program():
    """pp 2 x ep 2 on 4 gloo ranks, ``recompute=True`` and dropout: 1F1B (Combined 1F1B), ZB-H1
    (pairs with I) and DualPipeV, each with and without pairs: loss, counts and every gradient
    bitwise equal (the same key: the same draws)."""
    cases = [(OneFOneB(4), 2), (ZeroBubbleH1(4), 2), (DualPipeV(4), 4)]
    results = run_ranks(4, _overlapped_ranks, ("pp", "ep"), (2, 2), cases, True, 0.25, timeout=200)
    for per_rank in results:
        for name, ep, ((a_loss, a_counts, a_grads, _), (b_loss, b_counts, b_grads, paired)) in per_rank:
            assert paired, name
            assert_bitwise((b_loss, b_counts, b_grads), (a_loss, a_counts, a_grads), f"{name}, ep {ep}")


def test_experts_only_pairs_on_one_pipeline_rank():
    """pp 1 x ep 2 (both stages on one rank, looped 1F1B): Combined 1F1B with experts only."""
    results = run_ranks(2, _overlapped_ranks, ("pp", "ep"), (1, 2), [(OneFOneB(4), 2)], False, 0.0, timeout=120)
    loss, grads, _ = moe_reference(moe_params(), 2, True)
    for per_rank in results:
        for name, ep, ((a_loss, _, a_grads, _), (b_loss, _, b_grads, paired)) in per_rank:
            assert paired
            assert_bitwise((b_loss, b_grads), (a_loss, a_grads), f"{name}, ep {ep}")
            torch.testing.assert_close(b_loss, loss, rtol=1e-12, atol=0)
            block = slice(ep * MOE_EXPERTS // 2, (ep + 1) * MOE_EXPERTS // 2)
            flat = [g for stage in b_grads for g in stage]
            for got, want in zip(flat, grads):
                want = {k: (v[block] if k in ("w1", "w2", "w3") else v) for k, v in want.items()}
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_pairs_without_points_on_a_pipeline_alone_run_in_sequence_and_say_so():
    """pp 2 without experts: the stages have no communication points, so the pairs run in
    sequence, bitwise as without pairs, and the step warns that nothing could overlap."""
    results = run_ranks(2, _recorded, timeout=120)
    for per_rank, _ in results:
        for name, _, ((a_loss, _, a_grads, _), (b_loss, _, b_grads, paired)) in per_rank:
            assert paired
            assert_bitwise((b_loss, b_grads), (a_loss, a_grads), name)
    said = [m for _, messages in results for m in messages]  # by rank 0, which holds the pairs
    assert any("ran in sequence: its stages have no communication points" in m for m in said), said


def _recorded(rank, world):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _overlapped_ranks(rank, world, ("pp",), (2,), [(OneFOneB(4), 2)], False, 0.0, strict=False)
    return got, [str(w.message) for w in caught]


@pytest.mark.parametrize(("sig", "timeout"), [(signal.SIGKILL, None), (signal.SIGSTOP, 4)], ids=["killed", "frozen"])
def test_a_rank_lost_while_a_pair_is_in_flight_fails_every_survivor_fast(sig, timeout):
    """pp 2 x ep 2, Combined 1F1B: global rank 1 (pp 0, ep 1) dies or freezes in the forward half
    of its pair ``0F2&0B1``, after that half's first all-to-alls (the backward half is then
    paused mid-backward); every survivor raises fpipe's error naming it, nothing hangs."""
    results = run_ranks(4, _lost_in_a_pair, sig, timeout, timeout=90, may_die=frozenset({1}))
    limit = SLACK if timeout is None else timeout + SLACK
    for rank, result in enumerate(results):
        if rank == 1:
            continue
        seconds, kind, message = result
        assert seconds < limit, (rank, seconds, message)
        words = "died" if sig == signal.SIGKILL else "stopped answering"
        assert f"rank 1 (pp 0, ep 1) {words}" in message, (rank, kind, message)


def _lost_in_a_pair(rank, world, sig, timeout):
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_default_dtype(torch.float64)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    fns, per = moe_stages(2, True)
    armed = [False]

    def first(p, x):  # stage 0: the victim stops before its second layer of microbatch 2
        if armed[0] and rank == 1 and fpipe.stage_info().microbatch == 2:
            act = fns[0](p[:1], x)
            os.kill(os.getpid(), sig)
            return fns[1](p[1:], act)
        return fns[0](p, x)

    options = {} if timeout is None else {"timeout": timeout}
    parallel = fpipe.Parallelism(mesh=mesh, **options)
    step = fpipe.pipeline(moe_loss, [first, fns[1]], Overlapped(OneFOneB(4)), has_aux=True, parallel=parallel)
    full = [fpipe.moe.distribute_experts(p, mesh["ep"]) for p in moe_params()]
    ps = [full[s * per : (s + 1) * per] if s in step.local_stages else None for s in range(2)]
    b = moe_batch(mesh.get_coordinate()[1]) if step.rank == 0 else None
    step(ps, b)
    armed[0] = True
    return timed_failure(step, ps, b)


def test_every_built_in_schedule_overlapped_on_pp_times_ep_is_bitwise_its_sequential_program():
    """Every built-in of the registry at its own stages per rank (2 or 4 stages), pp 2 x ep 2:
    with its pairs (``Overlapped``), bitwise the same program without them, and the loss equal to
    the unsplit model's."""
    cases = [(built(b)(2 * b.stages_per_rank, 4), 2 * b.stages_per_rank) for b in BUILTINS]
    results = run_ranks(4, _overlapped_ranks, ("pp", "ep"), (2, 2), cases, False, 0.0, timeout=300)
    loss, _, _ = moe_reference(moe_params(), 2, True)
    for per_rank in results:
        for name, ep, ((a_loss, a_counts, a_grads, _), (b_loss, b_counts, b_grads, _)) in per_rank:
            assert_bitwise((b_loss, b_counts, b_grads), (a_loss, a_counts, a_grads), f"{name}, ep {ep}")
            torch.testing.assert_close(b_loss, loss, rtol=1e-12, atol=0)


def test_the_second_half_sends_after_the_first_whichever_ends_first():
    """A second half that ends first (here: it has no point) holds its sends until the first half
    has ended, so a peer gets this rank's messages in the program's order."""
    sent = []

    class Recorder:
        def send_activation(self, stage, microbatch, value):
            sent.append(("activation", stage, microbatch))

        def send_cotangent(self, stage, microbatch, value):
            sent.append(("cotangent", stage, microbatch))

    in_order = SendsInOrder(Recorder())

    def first():
        communication_point()  # the second half runs to its end here
        in_order.send_activation(0, 3, None)
        in_order.first_done = True

    run_pair(first, lambda: in_order.send_cotangent(3, 1, None))
    assert sent == [("activation", 0, 3)]
    in_order.release()
    assert sent == [("activation", 0, 3), ("cotangent", 3, 1)]


def test_stage_0s_forward_is_never_a_second_half():
    with pytest.raises(ScheduleError, match="stage 0's forward second"):
        validate(Program.from_lists([["0F0", "0B0&0F1", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]))
    assert all(b != Action(0, "F", b.microbatch) for _, b in Overlapped(DualPipeV(8)).program(8).pairs)
