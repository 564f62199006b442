"""The overhead benchmark runs end to end in quick mode (timings are never asserted on)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_overhead.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_overhead", BENCHMARK)
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


def test_bench_split_backward_quick() -> None:
    """The split-backward benchmark runs at a tiny size; its numbers are reported, never asserted."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_split_backward.py"
    spec = importlib.util.spec_from_file_location("bench_split_backward", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.main(["--quick"])
    assert results["grads_match"] and set(results["ms"]["split"]) == {"F", "I", "W"}
    assert results["ratio_split_over_fused"] > 0


def test_bench_compile_quick() -> None:
    """The torch.compile benchmark runs (aot_eager, tiny) and checks grads; times are not asserted."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_compile.py"
    spec = importlib.util.spec_from_file_location("bench_compile", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.main(["--quick"])
    for name in ("OneFOneB", "ZeroBubbleH1"):
        assert results[name]["grads_match"] and results[name]["compiled_ms"] > 0
