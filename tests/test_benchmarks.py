"""The benchmarks run end to end in quick mode (timings are never asserted on); marked bench, run by
``python -m pytest --bench -m bench``."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.bench

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str = "bench_overhead") -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_bench_overhead_quick(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    results = _load().main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    for key in ("one_stage", "four_stages"):
        row = results[key]
        assert row["grads_match"] is True
        for side in ("fpipe", "plain"):
            assert row[side]["median_s"] > 0
        assert row["ratio"] > 0
    per_action = results["per_action"]
    assert per_action["actions"] == 2 * per_action["stages"] * per_action["microbatches"]
    assert per_action["step"]["median_s"] > 0 and per_action["us_per_action"] > 0
    assert {"torch", "torch_threads"} <= results["machine"].keys()


def test_bench_overhead_per_action_ab(tmp_path: Path) -> None:
    """``--ab`` against this very checkout: one process per side, each measuring every config."""
    here = Path(__file__).resolve().parent.parent
    out = tmp_path / "ab.json"
    results = _load().main(["--quick", "--ab", str(here), "--rounds", "1", "--cpu-time", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results)) and results["clock"] == "cpu"
    assert [(row["stages"], row["microbatches"]) for row in results["ab"]] == [(1, 2), (2, 2)]
    for row in results["ab"]:
        for side in ("before", "after"):
            assert row[f"{side}_us_per_action"]["median"] > 0 and row[f"{side}_ratio"]["min"] > 0


def test_bench_split_backward_quick() -> None:
    results = _load("bench_split_backward").main(["--quick"])
    assert results["grads_match"] and set(results["ms"]["split"]) == {"F", "I", "W"}
    assert results["ratio_split_over_fused"] > 0


def test_bench_compile_quick() -> None:
    """aot_eager at a tiny size: compiled stages give the eager grads under 1F1B and ZB-H1."""
    results = _load("bench_compile").main(["--quick"])
    for name in ("OneFOneB", "ZeroBubbleH1"):
        assert results[name]["grads_match"] and results[name]["compiled_ms"] > 0


def test_bench_compile_train_gpt_quick() -> None:
    """The compiled step at (a tiny) train_gpt's model: every side timed, the losses close."""
    row = _load("bench_compile").main(["--train-gpt-only", "--quick"])["train_gpt"]
    assert row["loss_close"] and all(ms > 0 for ms in row["cpu_ms"].values()) and len(row["cpu_ms"]) == 3


def test_bench_compile_ranks_quick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 gloo processes, aot_eager at a tiny size: every side timed, the compiled rows' grads the
    eager step's, fpipe's torch's."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # its spawned ranks import it by name
    out = tmp_path / "out.json"
    results = _load("bench_compile_ranks").main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    row = results["sizes"]["tiny"]
    assert row["grads_match"] and set(row["median_ms"]) == set(row["over_fpipe_eager"])
    assert len(row["median_ms"]) == 5 and all(ms > 0 for ms in row["median_ms"].values())
    assert row["first_call_s"]["fpipe compiled rows"] > 0


def test_bench_async_save_quick(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    results = _load("bench_async_save").main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert results["async_equals_sync"] is True
    for mode in ("none", "sync", "async"):
        assert results[mode]["mean_step_s"] > 0 and results[mode]["median_plain_step_s"] > 0
    assert results["none"]["median_saving_step_s"] is None and results["async"]["median_saving_step_s"] > 0


def test_bench_evaluate_quick() -> None:
    results = _load("bench_evaluate").main(["--quick"])
    for name in ("GPipe", "OneFOneB"):
        row = results[name]
        assert row["loss_match"] and row["train_ms"] > 0 and row["evaluate_ms"] > 0
        assert 0 < row["evaluate_peak_MiB"] < row["train_peak_MiB"]  # forward only holds less


def test_bench_reduction_quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # its spawned ranks import it by name
    result = _load("bench_reduction").main(["--quick"])
    assert len(result["ranks"]) == 4
    for row in result["ranks"]:
        for mode in ("end", "overlap"):
            assert row[mode]["step_s"] > 0 and row[mode]["exposed_s"] >= 0


def test_bench_memory_quick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 gloo processes, one process and torch's pipelining: every action of every rank measured on
    each side, the same loss and grads. How many sends are still held depends on when the waiter
    threads run, so it is reported, not asserted here: test_sends.py proves the release."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # its spawned ranks import it by name
    out = tmp_path / "out.json"
    results = _load("bench_memory").main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert set(results["schedules"]) == {"1F1B", "interleaved", "ZB-V"}
    for schedule in results["schedules"].values():
        fpipe_loss = schedule["loss"]["fpipe"]
        assert all(abs(loss - fpipe_loss) <= 1e-5 * abs(fpipe_loss) for loss in schedule["loss"].values())
        assert len(schedule["ranks"]) == 2
        for row in schedule["ranks"]:
            assert row["grads_match"] and row["actions"]
            assert all(a[side] is not None for a in row["actions"] for side in ("fpipe", "one_process", "torch"))
            assert 0 < row["max_at_action"]["fpipe"] <= row["peak"]["fpipe"]
            assert isinstance(row["max_sent"], int) and row["max_sent"] >= 0


def test_bench_instructions_runs_its_steps() -> None:
    calls = []
    module = _load("bench_instructions")
    real = module.fpipe.pipeline

    def counting(*args, **kwargs):
        step = real(*args, **kwargs)
        return lambda params, batch: calls.append(step(params, batch))

    module.fpipe = type("F", (), {"pipeline": staticmethod(counting)})
    module.main(1)
    assert len(calls) == 3  # two warm-up steps and the one asked for


def test_bench_search_quick(tmp_path: Path) -> None:
    """Two gloo processes record, fit, search, tune and time the searched programs against every built-in."""
    out = tmp_path / "out.json"
    results = _load("bench_search").main(["--quick", "--repeats", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    names = set(results["programs"])
    assert {"search-looped", "search-v", "tuned", "GPipe", "OneFOneB", "ZeroBubbleV", "DualPipeV"} <= names
    assert {"fastest simulated (looped)", "fastest simulated (v)"} <= names  # what slack=0 keeps
    assert results["programs"][results["best_search"]]["searched_over_this"] == 1.0
    assert results["programs"]["tuned"]["tuned_over_this"] == 1.0
    tuning = results["tuning"]
    assert 2 <= len(tuning["tried"]) <= 5 and tuning["kept"] in tuning["tried"]
    assert set(tuning["tried"]) - {"search-looped", "search-v"}  # the best built-in is always tried
    for row in results["programs"].values():
        assert row["median_s"] > 0 and row["simulated_s"] > 0 and row["measured_over_simulated"] > 0
        assert row["simulated_without_overhead_s"] <= row["simulated_s"] and row["peak_activations"] > 0
    costs = results["raw"][0]["costs"]  # F, I, W, send, overhead, receive, B per stage
    assert all(len(c) == 7 and min(c[4:]) >= 0 for c in costs)
    assert 0 < results["recorded"]["timeline_s"] <= results["recorded"]["step_s"]
    assert results["recorded"]["simulated_s"] > 0


def test_bench_pairs_quick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pp 1 x ep 2 on 2 gloo processes: the overlapped and the sequential 1F1B step bitwise equal,
    both timed, their all-to-all waits measured, and the simulator's prediction beside them."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # its spawned ranks import it by name
    out = tmp_path / "out.json"
    results = _load("bench_pairs").main(["--quick", "--configs", "2", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    (row,) = results["pp1xep2"]
    assert row["schedule"] == "OneFOneB" and row["bitwise"] is True
    assert row["sequential_ms"] > 0 and row["overlapped_ms"] > 0 and row["ratio"] > 0
    for side in ("sequential", "overlapped"):
        assert 0 < row["a2a_share"][side] < 1 and row["cpu_ms_per_rank"][side] > 0
    assert row["predicted_ratio"] <= 1 and row["simulated_ratio"] <= 1  # one rank: pairs never wait longer
    for rank in row["ranks"]:
        assert rank["pairs_on_rank"] == 3 and len(rank["pairs"]) == 3  # Combined 1F1B's 3 pairs, recorded
        assert {"0F", "0B", "1F", "1B"} <= set(rank["a2a_s"])
