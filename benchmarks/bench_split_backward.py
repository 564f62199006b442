"""What a split backward costs: input-gradient ``I`` plus weight-gradient ``W`` against the fused ``B``.

Run::

    python benchmarks/bench_split_backward.py            # dim 512, 4 blocks, batch 16 x 128
    python benchmarks/bench_split_backward.py --quick    # tiny, for the tests
    python benchmarks/bench_split_backward.py --json out.json

Two stages of residual SwiGLU blocks run two hand-written one-rank-per-stage programs on the same
microbatches: one with fused backwards (``1B0``), one with split backwards (``1I0`` then
``1W0``). ``fpipe.record`` measures every action; the table gives the median duration of each
kind on the second stage (the first has no differentiable input, so its ``I`` is empty) and the
ratio ``(I + W) / B``. Zero-bubble schedules need it near 1: the split must not redo work.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import torch

import fpipe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # the command line, JSON output and models the benchmarks share


def program(num_microbatches: int, split: bool) -> list[list[str]]:
    backward = ["I", "W"] if split else ["B"]
    rows: list[list[str]] = [[], []]
    for i in range(num_microbatches):
        rows[0].append(f"0F{i}")
        rows[1].append(f"1F{i}")
        rows[1] += [f"1{kind}{i}" for kind in backward]
        rows[0] += [f"0{kind}{i}" for kind in backward]
    return rows


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _common.parser(__doc__).parse_args(argv)
    dim, blocks, batch, seq, steps = (16, 2, 4, 8, 2) if args.quick else (512, 4, 16, 128, 5)
    torch.manual_seed(0)
    params = _common.swiglu_params(2, blocks, dim)
    data = torch.randn(batch * 4, seq, dim)
    durations: dict[str, dict[str, list[float]]] = {}
    grads = {}
    for split in (False, True, False, True):  # A/B interleaved
        name = "split" if split else "fused"
        step = fpipe.pipeline(lambda y, b: y.square().mean(), [_common.swiglu] * 2, program(4, split))
        with fpipe.record() as recording:
            for _ in range(steps):
                _, grads[name] = step(params, data)
        for timeline in recording.timelines[1:]:  # the first step warms up
            for rank, action, start, end in timeline.intervals():
                if rank == 1:
                    durations.setdefault(name, {}).setdefault(action.kind, []).append(end - start)
    for a, b in zip(grads["fused"], grads["split"]):
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)
    median = {
        name: {kind: statistics.median(v) * 1e3 for kind, v in kinds.items()} for name, kinds in durations.items()
    }
    results = {
        "config": {"dim": dim, "blocks": blocks, "batch": batch, "seq": seq, "torch": torch.__version__},
        "ms": median,
        "ratio_split_over_fused": (median["split"]["I"] + median["split"]["W"]) / median["fused"]["B"],
        "grads_match": True,
    }
    print(f"forward          {median['fused']['F']:8.2f} ms")
    print(f"fused backward B {median['fused']['B']:8.2f} ms")
    print(f"input grad I     {median['split']['I']:8.2f} ms")
    print(f"weight grad W    {median['split']['W']:8.2f} ms")
    print(f"(I + W) / B      {results['ratio_split_over_fused']:8.3f}   (grads equal: yes)")
    _common.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
