"""Instructions per action of a tiny 4-stage x 64-microbatch 1F1B step, for ``valgrind --tool=callgrind``.

Instruction counts do not depend on what else the machine runs, so an A/B of two trees on a
shared machine is exact where wall-clock timings are noise::

    for n in 0 4; do PYTHONPATH=TREE valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.$n \
        python benchmarks/bench_instructions.py $n 2>&1 | grep Collected; done

The difference of the two totals over ``4 * 512`` is the instructions per action (two warm-up
steps run in both, so imports and first-call costs cancel).
"""

from __future__ import annotations

import sys

import torch

import fpipe
from fpipe.schedules import OneFOneB


def main(steps: int) -> None:
    torch.set_num_threads(1)
    num_stages, num_microbatches = 4, 64
    stages = [lambda p, x: torch.tanh(x @ p["w"])] * num_stages
    params = [{"w": torch.randn(4, 4)} for _ in range(num_stages)]
    step = fpipe.pipeline(lambda y, mb: (y**2).mean(), stages, OneFOneB(num_microbatches))
    batch = torch.randn(num_microbatches, 4)
    for _ in range(2 + steps):
        step(params, batch)


if __name__ == "__main__":
    main(int(sys.argv[1]))
