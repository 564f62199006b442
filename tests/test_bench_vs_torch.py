"""The benchmark against torch.distributed.pipelining runs end to end in quick mode, on 2 gloo
processes, and fpipe's grads match torch's (timings are never asserted on); marked bench, run by
``python -m pytest --bench -m bench``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_vs_torch.py"


def test_bench_vs_torch_quick(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    # A subprocess, as the benchmark is run: its ranks are spawned processes that import it by path.
    proc = subprocess.run(
        [sys.executable, str(BENCHMARK), "--quick", "--record-steps", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())
    assert "| schedule | mb | fpipe ms | torch ms |" in proc.stdout

    rows = results["configs"]
    assert [(r["schedule"], r["microbatches"]) for r in rows] == [("gpipe", 4), ("gpipe", 8), ("1f1b", 4), ("1f1b", 8)]
    for row in rows:
        assert row["grads_match"] is True, row["grads"]["mismatches"]
        assert row["grads"]["mismatches"] == []
        assert len(row["grads"]["max_abs_diff"]) == 2
        assert all(m > 0 for m in row["grads"]["max_abs"])  # the comparison is not between zeros
        assert row["loss_match"] is True
        for side in ("fpipe", "torch"):
            assert row[side]["median_s"] > 0
            assert len(row[side]["per_rank_median_s"]) == 2
            assert len(row["peak_bytes"][side]) == 2 and all(b > 0 for b in row["peak_bytes"][side])
        assert row["ratio"] > 0
        paired = row["paired_ratio"]
        assert 0 < paired["q1"] <= paired["median"] <= paired["q3"] and paired["of_minimums"] > 0
        bubble = row["bubble"]
        assert bubble["steps"] == 1
        for key in ("recorded", "estimated", "simulated", "textbook"):
            assert len(bubble[key]) == 2 and all(0 <= f < 1 for f in bubble[key]), (key, bubble[key])
        assert {"rank0.F", "rank0.B", "rank1.F", "rank1.B"} <= bubble["cost_s"].keys()
        assert len(bubble["fitted"]) == len(bubble["fitted_error"]) == len(bubble["fitted_costs_s"]) == 2
        assert all(0 <= f < 1 for f in bubble["fitted"]) and all(e >= 0 for e in bubble["fitted_error"])
        assert len(bubble["replayed"]) == len(bubble["replayed_error"]) == 2
        assert all(0 <= f < 1 for f in bubble["replayed"]) and all(e >= 0 for e in bubble["replayed_error"])
        assert len(bubble["step_s"]) == 1
        b = row["bound"]
        assert len(bubble["critical_path_s"]) == 1 and b["critical_path_s"] == bubble["critical_path_s"][0] > 0
        # A step takes at least its critical path (0.9: clocks of two processes, started apart).
        assert b["step_over_critical_path"] > 0.9 and b["floor"] > 0

    per_action = results["per_action"]
    assert [(r["schedule"], r["actions_per_rank"]) for r in per_action] == [("gpipe", 32), ("1f1b", 32)]
    for row in per_action:
        assert row["fpipe"]["us_per_action"] > 0 and row["torch"]["us_per_action"] > 0
    assert "fpipe us/action" in proc.stdout and "| fitted |" in proc.stdout and "floor for fpipe/torch" in proc.stdout

    assert results["config"]["quick"] is True and results["config"]["ranks"] == 2
    assert {"torch", "python", "cpus"} <= results["machine"].keys()
    assert len(results["maxrss_kib"]) == 2


def test_bench_receives_quick(tmp_path: Path) -> None:
    """Receives posted ahead against posted when needed (NOTE [receives ahead]), in quick mode."""
    out = tmp_path / "out.json"
    script = BENCHMARK.parent / "bench_receives.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", "--json", str(out)], capture_output=True, text=True, timeout=150
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["schedule"], r["microbatches"]) for r in rows] == [("gpipe", 8), ("1f1b", 8), ("1f1b", 4)]
    for row in rows:
        assert row["median_s"]["ahead"] > 0 and row["median_s"]["needed"] > 0
        assert 0 < row["paired"]["q1"] <= row["paired"]["median"] <= row["paired"]["q3"]
    assert "| schedule | mb | ahead ms | needed ms |" in proc.stdout
