"""The list-scheduling policies search tries (fpipe/planning/_policies.py): the grid, likeliest
first; memory held as used with several stages per rank under a limit, and there, on small
problems, the reserving grid after it."""

from __future__ import annotations

from dataclasses import replace

from fpipe.planning._arguments import checked_problem
from fpipe.planning._list_schedule import Policy
from fpipe.planning._policies import LOCAL_ACTIONS, policies
from fpipe.schedules import Costs


def test_one_stage_per_rank_tries_the_grid_reserving_split_backwards_first() -> None:
    tried = list(policies(checked_problem(4, 8, Costs(), "looped", 1, 4, None)))
    assert tried[0] == Policy(split=True, extra=None) and all(p.reserve for p in tried)
    assert len(tried) == len(set(tried)) == 15  # the deep-first-or-not choice only with several stages per rank
    assert [p.split for p in tried].index(False) == 12  # fused backwards last: they win only where B < I + W


def test_several_stages_per_rank_under_a_limit_hold_memory_as_used() -> None:
    big = checked_problem(4, 16, Costs(), "v", 2, 3, None)  # 8 stages x 16 microbatches x 3 > LOCAL_ACTIONS
    assert big.num_stages * big.num_microbatches * 3 > LOCAL_ACTIONS
    unreserved = list(policies(big))
    assert len(unreserved) == 16 and not any(p.reserve for p in unreserved)
    small = checked_problem(2, 4, Costs(), "looped", 2, 2, None)  # small: the reserving grid follows
    tried = list(policies(small))
    assert tried[:16] == unreserved and tried[16:] == [replace(p, reserve=True) for p in unreserved]
    assert all(p.reserve for p in policies(checked_problem(4, 8, Costs(), "looped", 2, None, None)))  # no limit
