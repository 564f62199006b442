"""What the benchmarks share: their command line, their JSON output, and the models they time.

A benchmark runs as ``python benchmarks/bench_x.py`` or is loaded from its file by
tests/test_benchmarks.py; either way it puts this folder on ``sys.path`` before ``import _common``.
Benchmarks that spawn gloo processes use ``bench_vs_torch.run_ranks``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch


def parser(doc: str, *, repeats: str | None = None) -> argparse.ArgumentParser:
    """A parser described by ``doc``'s first paragraph, with ``--quick``, ``--json PATH`` and, given
    its help text, ``--repeats N``."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few repeats (seconds)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    if repeats is not None:
        parser.add_argument("--repeats", type=int, help=repeats)
    return parser


def write_json(path: str | None, results: Any, *, indent: int = 2) -> None:
    """``results`` as JSON in ``path`` (``None``: nowhere)."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=indent)


# A residual MLP stage, ``h + tanh(h W1 + b1) W2``, reading ``batch["x"]`` first and fitting ``batch["y"]``.


def mlp_block(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return h + torch.tanh(h @ p["w1"] + p["b1"]) @ p["w2"]


def mlp_first(p: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return mlp_block(p, batch["x"])


def mse_loss(y: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((y - batch["y"]) ** 2).mean()


def mlp_params(num_stages: int, dim: int, hidden: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        {
            "w1": torch.randn(dim, hidden, generator=g) / dim**0.5,
            "b1": torch.zeros(hidden),
            "w2": torch.randn(hidden, dim, generator=g) / hidden**0.5,
        }
        for _ in range(num_stages)
    ]


# Residual SwiGLU blocks, ``len(params) // 3`` of them per stage, drawn from torch's global generator.


def swiglu(params: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    for k in range(len(params) // 3):
        x = torch.nn.functional.rms_norm(h, h.shape[-1:])
        gate, up, down = params[f"{k}.gate"], params[f"{k}.up"], params[f"{k}.down"]
        h = h + (torch.nn.functional.silu(x @ gate) * (x @ up)) @ down
    return h


def swiglu_params(num_stages: int, blocks: int, dim: int) -> list[dict[str, torch.Tensor]]:
    return [
        {
            f"{k}.{name}": torch.randn(*shape) / shape[0] ** 0.5
            for k in range(blocks)
            for name, shape in (("gate", (dim, 2 * dim)), ("up", (dim, 2 * dim)), ("down", (2 * dim, dim)))
        }
        for _ in range(num_stages)
    ]
