"""The cost of the wire's header decision per message: ``Encoder.encode`` on CPU.

Run::

    python benchmarks/bench_wire_header.py                        # the current fpipe/_distributed/_wire.py
    git show <commit>:fpipe/_distributed/_wire.py > /tmp/old_wire.py           # an earlier one (e.g. with pickle)
    python benchmarks/bench_wire_header.py --old /tmp/old_wire.py  # both, side by side

A message's layout is compared to its channel's last one on every send (NOTE [header] in
fpipe/_distributed/_wire.py); a header is written only when it changed. This measures, per ``encode`` of a
pytree like a stage boundary's (a hidden state, positions, a complex rotary table, a tag string
and a float), the time when the layout is unchanged (the steady state: no header) and when every
message changes it (alternating sequence lengths: a header each time), the receiver's reading of
one header (``Decoder.large_leaves``), and the header's size.
Median of ``--repeats`` rounds of ``--number`` each, in this process's CPU time (the machine may be
shared), the modules' rounds interleaved (its load drifts).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import fpipe._distributed._wire


def _load(path: str) -> ModuleType:
    """A ``_wire`` module from ``path``, importing the rest of fpipe as it is now."""
    spec = importlib.util.spec_from_file_location("fpipe._wire_old", path, submodule_search_locations=None)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "fpipe"
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _tree(seq: int) -> dict[str, Any]:
    return {
        "h": torch.randn(2, seq, 8),
        "pos": torch.arange(seq),
        "freqs": torch.randn(seq, 4, dtype=torch.complex64),
        "tag": "batch",
        "scale": 0.5,
    }


def _round(wire: ModuleType, trees: list[dict[str, Any]], number: int) -> float:
    """Seconds per ``encode`` on a channel that has sent ``trees[0]``, cycling through ``trees``."""
    encoder, cpu = wire.Encoder(), torch.device("cpu")
    encoder.encode(trees[0], cpu)
    start = time.process_time()
    for i in range(number):
        encoder.encode(trees[i % len(trees)], cpu)
    return (time.process_time() - start) / number


def _read(wire: ModuleType, trees: list[dict[str, Any]], number: int) -> float:
    """Seconds per reading of the header of ``trees[0]`` by a receiver."""
    cpu = torch.device("cpu")
    first, header, *_ = wire.Encoder().encode(trees[0], cpu)
    meta = wire.meta_of(first)
    start = time.process_time()
    for _ in range(number):
        decoder = wire.Decoder()
        decoder.opened(meta, cpu)
        decoder.large_leaves(header, cpu)
    return (time.process_time() - start) / number


def measure(wires: dict[str, ModuleType], number: int, repeats: int) -> dict[str, dict[str, float]]:
    """Per module: median microseconds per ``encode``, unchanged and changed, and the header's bytes."""
    cases = {"unchanged_us": [_tree(16)], "changed_us": [_tree(16), _tree(17)], "read_header_us": [_tree(16)]}
    rounds: dict[tuple[str, str], list[float]] = {(name, case): [] for name in wires for case in cases}
    for _ in range(repeats):
        for (name, case), times in rounds.items():
            timer = _read if case == "read_header_us" else _round
            times.append(timer(wires[name], cases[case], number))
    cpu = torch.device("cpu")
    return {
        name: {
            **{case: 1e6 * statistics.median(rounds[name, case]) for case in cases},
            "header_bytes": wire.Encoder().encode(cases["unchanged_us"][0], cpu)[1].numel(),
        }
        for name, wire in wires.items()
    }


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", help="another fpipe/_distributed/_wire.py to measure side by side")
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    wires = {"new": fpipe._distributed._wire, **({"old": _load(args.old)} if args.old else {})}
    results = measure(wires, args.number, args.repeats)
    print(f"{'':>4} {'unchanged (us)':>15} {'changed (us)':>13} {'read header (us)':>17} {'header (bytes)':>15}")
    for name, r in results.items():
        print(
            f"{name:>4} {r['unchanged_us']:15.1f} {r['changed_us']:13.1f} {r['read_header_us']:17.1f} "
            f"{r['header_bytes']:15.0f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
