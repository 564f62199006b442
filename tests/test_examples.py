"""The examples run, and examples/train_llama.py learns and pipelines its model transparently."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import optree
import pytest
import torch

import fpipe
from fpipe.schedules import GPipe, Interleaved1F1B, OneFOneB
from tests.helpers import assert_bitwise

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TINY = ["--dim", "16", "--head-dim", "8", "--digits", "4", "--batch-size", "8"]


def _torchrun(nproc: int, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node nproc examples/<script> *args``, importing this
    checkout's fpipe (not an installed one); killed after 200 s."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES.parent)}
    return subprocess.run(
        [*command, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=200, check=False, env=env
    )


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"fpipe_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def llama() -> Iterator[ModuleType]:
    """The example's module, run with one thread (as main() sets) and the thread count restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is fastest, and stays fast on a busy machine
    try:
        yield _load("train_llama")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_train_llama_runs(llama: ModuleType, schedule: str, capsys: pytest.CaptureFixture[str]) -> None:
    losses = llama.main(["--steps", "3", "--schedule", schedule, "--microbatches", "3", "--quiet", *TINY])
    assert len(losses) == 3
    assert all(math.isfinite(loss) for loss in losses)
    out = capsys.readouterr().out
    assert out.startswith("3 steps in") and "rank 0 |" not in out  # --quiet: the summary only


def test_train_llama_prints_grid_and_progress(llama: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    llama.main(["--steps", "2", "--microbatches", "2", *TINY])
    out = capsys.readouterr().out
    assert "rank 3 | " in out  # the schedule's grid, one row per rank
    assert "step 2/2: loss " in out and "\r" not in out  # not a terminal: plain lines, no bar
    assert ", validation loss " in out  # step.evaluate, forward only
    assert sum(line.startswith("greedy: ") for line in out.splitlines()) == 3  # --samples 3 by default


def test_train_llama_learns(llama: ModuleType) -> None:
    losses = llama.main(["--steps", "60", "--seed", "1", "--quiet"])
    assert losses[0] > 2.5  # about ln(17): chance
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0]  # about 1.1 at this seed


@pytest.mark.parametrize(
    "schedule", [GPipe(3), OneFOneB(4), Interleaved1F1B(5, stages_per_rank=2)], ids=["gpipe", "1f1b", "interleaved"]
)
def test_train_llama_pipeline_is_transparent(llama: ModuleType, schedule: fpipe.schedules.Schedule) -> None:
    """The example's stages through the pipeline give the unsplit model's loss and gradients."""
    generator = torch.Generator().manual_seed(0)
    params = optree.tree_map(lambda t: t.double(), llama.init_params(16, generator))
    freqs_cis = llama.precompute_freqs_cis(8, 8).to(torch.complex128)
    batch = llama.get_batch(10, 4, freqs_cis, generator)  # 10 in 3, 4 or 5 microbatches: uneven

    def unsplit(params: list[Any]) -> Any:
        x = batch
        for stage, p in zip(llama.STAGES, params):
            x = stage(p, x)
        return llama.loss_fn(x, batch)

    expected_grads, expected_loss = torch.func.grad_and_value(unsplit)(params)
    step = fpipe.pipeline(llama.loss_fn, llama.STAGES, schedule, batch_dims=llama.BATCH_DIMS)
    loss, grads = step(params, batch)
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(grads, expected_grads)


@pytest.mark.timeout(240)
def test_train_llama_runs_unchanged_under_torchrun(llama: ModuleType) -> None:
    """``torchrun --nproc-per-node 2`` runs the same script: 4 stages on 2 ranks, the same losses."""
    args = [*TINY, "--steps", "3", "--quiet"]
    local = llama.main(args)
    run = _torchrun(2, "train_llama.py", *args)
    assert run.returncode == 0, run.stderr[-3000:]
    # One process runs 1F1B on 4 virtual ranks, torchrun interleaved 1F1B on 2: bitwise the same.
    assert f"loss {local[0]:.4f} -> {local[-1]:.4f}" in run.stdout, run.stdout


@pytest.mark.timeout(240)
def test_train_llama_tensor_parallel_under_torchrun(llama: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    """``torchrun --nproc-per-node 4 ... --tp 2``: pp 2 x tp 2, each stage's heads and MLP split over
    2 ranks. Every printed loss (training, validation) is within one unit of its last digit of one
    process's, and the greedy samples are the same."""
    import re

    args = [*TINY, "--steps", "3", "--samples", "2"]
    llama.main(args)
    local = capsys.readouterr().out
    run = _torchrun(4, "train_llama.py", *args, "--tp", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2-way tensor parallel" in run.stdout and "rank 1 | " in run.stdout and "rank 2 | " not in run.stdout

    def printed(out: str) -> tuple[list[float], list[str]]:
        losses = [float(x) for x in re.findall(r"(?:loss|->) (\d+\.\d+)", out)]
        return losses, [line for line in out.splitlines() if line.startswith("greedy: ")]

    (expected, samples), (losses, tp_samples) = printed(local), printed(run.stdout)
    assert len(losses) == len(expected) == 4, run.stdout  # step 3/3, the first and last, validation
    # The row-parallel products are summed in two halves plus an all-reduce: float32 rounding, far
    # below the printed digits (at these sizes, the first steps are even bitwise the same).
    assert all(abs(a - b) < 1.5e-4 for a, b in zip(losses, expected, strict=True)), (losses, expected)
    assert tp_samples == samples and len(samples) == 2, run.stdout


def test_train_llama_tp_must_divide_the_heads_and_the_processes(
    llama: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        llama.main([*TINY, "--tp", "4"])  # 2 heads of 8
    assert "--tp (4) must divide the number of heads (2 = --dim / --head-dim) and the MLP's width (48)" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        llama.main([*TINY, "--tp", "2"])  # one process, no torchrun
    assert "--tp (2) needs torchrun with a multiple of 2 processes (WORLD_SIZE: 1)" in capsys.readouterr().err


def test_train_llama_writes_a_measured_trace(llama: ModuleType, tmp_path: Path) -> None:
    import json

    trace = tmp_path / "trace.json"
    llama.main([*TINY, "--steps", "2", "--quiet", "--trace", str(trace)])
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"0F0", "3B3"} <= names, sorted(n for n in names if n)[:10]


GPT_TINY = [
    "--dim",
    "32",
    "--heads",
    "2",
    "--context",
    "16",
    "--batch-size",
    "8",
    "--corpus-bytes",
    "50000",
    "--warmup",
    "2",
]


@pytest.fixture
def gpt() -> Iterator[ModuleType]:
    threads = torch.get_num_threads()
    try:
        yield _load("train_gpt")
    finally:
        torch.set_num_threads(threads)


def test_train_gpt_learns_and_resumes_exactly(gpt: ModuleType, tmp_path: Path) -> None:
    """The loss falls on real text; a run stopped at step 6 (its last save) and resumed with
    --resume gives bitwise the losses of the run that never stopped; metrics are JSON lines."""
    import json

    args = [*GPT_TINY, "--steps", "12", "--save-every", "3", "--eval-every", "6", "--quiet"]
    whole = gpt.main([*args, "--out", str(tmp_path / "whole")])
    assert len(whole) == 12 and whole[-1] < whole[0] - 0.5
    first = gpt.main([*args, "--out", str(tmp_path / "parts"), "--stop-at", "6"])
    rest = gpt.main([*args, "--out", str(tmp_path / "parts"), "--resume"])
    assert_bitwise(first + rest, whole)
    rows = [json.loads(line) for line in (tmp_path / "parts" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert_bitwise([r["loss"] for r in rows], whole)
    assert {"lr", "grad_norm", "tokens_per_s"} <= rows[0].keys() and "val_loss" in rows[5]


@pytest.mark.timeout(240)
def test_train_gpt_runs_unchanged_under_torchrun(gpt: ModuleType, tmp_path: Path) -> None:
    """Two processes, 2 stages each (interleaved 1F1B): the same losses as one process, bitwise."""
    args = [*GPT_TINY, "--steps", "3", "--save-every", "2", "--eval-every", "3"]
    local = gpt.main([*args, "--quiet", "--out", str(tmp_path / "one")])
    run = _torchrun(2, "train_gpt.py", *args, "--out", str(tmp_path / "two"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"loss {local[0]:.3f} -> {local[-1]:.3f}" in run.stdout, run.stdout


@pytest.mark.slow  # (three 4-process torchrun runs: 30 s of the first command's 12 minutes)
@pytest.mark.timeout(240)
def test_train_gpt_tensor_parallel_under_torchrun_resumes_exactly(gpt: ModuleType, tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 4 ... --tp 2`` (pp 2 x tp 2, bf16 on float32 master weights):
    every training and validation loss within 1e-3 (relative) of one process's (measured: 4e-5, the
    row-parallel products summed in bfloat16 in two halves), and a run stopped at step 2 (saved,
    each tp rank its own pieces) and resumed with --resume gives bitwise the uninterrupted tp run's
    losses, gradient norms and validation losses."""
    import json

    args = [*GPT_TINY, "--steps", "4", "--save-every", "2", "--eval-every", "2", "--quiet"]
    local = gpt.main([*args, "--out", str(tmp_path / "one")])
    runs = [
        _torchrun(4, "train_gpt.py", *args, "--tp", "2", "--out", str(tmp_path / out), *more)
        for out, more in [("whole", []), ("parts", ["--stop-at", "2"]), ("parts", ["--resume"])]
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]

    def metrics(out: str) -> list[dict[str, float]]:
        rows = [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
        return [{k: r[k] for k in ("step", "loss", "grad_norm", "val_loss") if k in r} for r in rows]

    whole, one = metrics("whole"), metrics("one")
    assert_bitwise(metrics("parts"), whole)
    assert [r["step"] for r in whole] == [1, 2, 3, 4]
    assert_bitwise([r["loss"] for r in one], local)
    for r, expected in zip(whole, one, strict=True):
        for key in ("loss", "val_loss"):
            assert (key in r) == (key in expected), (r, expected)
            if key in r:
                assert abs(r[key] - expected[key]) <= 1e-3 * expected[key], (key, r, expected)


def test_train_gpt_tp_must_divide_the_heads_and_needs_torchrun(
    gpt: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        gpt.main([*GPT_TINY, "--tp", "3"])  # 2 heads
    assert "--tp (3) must divide --heads (2)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpt.main([*GPT_TINY, "--tp", "2"])  # one process, no torchrun
    assert "--tp (2) needs torchrun with a multiple of 2 processes (WORLD_SIZE: 1)" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["train_llama", "train_sharded", "hf_llama", "train_gpt", "train_moe", "hf_moe"])
def test_help_shows_defaults(name: str) -> None:
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    options = run.stdout.split("\noptions:\n", 1)[1].split("\n  -")[1:]  # after -h/--help
    assert options and all("(default: " in " ".join(option.split()) for option in options), run.stdout
    if name == "train_sharded":
        assert "torchrun --standalone --nproc-per-node 4" in run.stdout


@pytest.mark.parametrize(
    ("name", "missing", "extra"),
    [("hf_llama", "transformers", "hf"), ("hf_moe", "transformers", "hf"), ("train_llama", "tqdm", "examples")],
)
def test_a_missing_extra_is_one_line_naming_it(name: str, missing: str, extra: str) -> None:
    """Without the extra's package, an example says what to install, with no traceback."""
    path = str(EXAMPLES / f"{name}.py")
    hide = f"import sys, runpy; sys.modules[{missing!r}] = None; runpy.run_path({path!r}, run_name='__main__')"
    run = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 1
    assert (
        run.stderr
        == f"examples/{name}.py needs {missing}, which the {extra} extra installs: pip install -e '.[{extra}]'\n"
    )


def test_train_gpt_refuses_to_write_into_an_existing_run(
    gpt: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second run into the same --out stops before training, naming the directory and both flags;
    --overwrite starts afresh (a new metrics.jsonl), --resume goes on; --resume needs a save."""
    import json

    out = tmp_path / "run"
    args = [*GPT_TINY, "--save-every", "0", "--eval-every", "2", "--quiet", "--out", str(out), "--steps", "2"]
    with pytest.raises(SystemExit):
        gpt.main([*args, "--resume"])
    assert f"--resume: --out {out} holds no save ({out / 'save'}) to go on from" in capsys.readouterr().err
    first = gpt.main(args)
    with pytest.raises(SystemExit):
        gpt.main(args)
    assert (
        f"--out {out} already holds a run (save, metrics.jsonl): pass --resume to go on from its save, "
        "or --overwrite to start afresh (deleting save and metrics.jsonl)"
    ) in capsys.readouterr().err
    (out / "save").rename(tmp_path / "elsewhere")  # metrics.jsonl alone is a run too
    with pytest.raises(SystemExit):
        gpt.main(args)
    assert f"--out {out} already holds a run (metrics.jsonl): pass --resume" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpt.main([*args, "--resume", "--overwrite"])
    assert "not allowed with argument" in capsys.readouterr().err
    assert gpt.main([*args, "--overwrite"]) == first
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and [r["loss"] for r in rows] == first
    assert len(gpt.main([*args, "--steps", "3", "--resume"])) == 1  # step 3 (the last --steps wins)
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_train_gpt_resumed_after_a_crash_lists_each_step_once(
    gpt: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that dies at step 9 has saved step 6 and written metrics up to step 8; --resume runs
    steps 7 and 8 again, and metrics.jsonl lists every step once, with the uninterrupted run's losses."""
    import json

    args = [*GPT_TINY, "--steps", "10", "--save-every", "3", "--eval-every", "5", "--quiet"]
    whole = gpt.main([*args, "--out", str(tmp_path / "whole")])
    get_batch = gpt.get_batch

    class Killed(Exception):
        pass

    def dies_at_step_9(data: Any, batch_size: int, context: int, seed: int, index: int) -> Any:
        if index == 8:  # the batch of step 9
            raise Killed
        return get_batch(data, batch_size, context, seed, index)

    monkeypatch.setattr(gpt, "get_batch", dies_at_step_9)
    with pytest.raises(Killed):
        gpt.main([*args, "--out", str(tmp_path / "parts")])
    monkeypatch.setattr(gpt, "get_batch", get_batch)
    metrics = tmp_path / "parts" / "metrics.jsonl"
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(range(1, 9))
    with metrics.open("a") as f:
        f.write('{"step": 9, "lo')  # a line cut short by a kill
    rest = gpt.main([*args, "--out", str(tmp_path / "parts"), "--resume"])
    assert rest == whole[6:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11)) and [r["loss"] for r in rows] == whole
    assert not list((tmp_path / "parts").glob("*.partial"))


MOE_TINY = [
    *("--dim", "16", "--heads", "2", "--context", "16", "--batch-size", "8", "--microbatches", "2"),
    *("--experts", "4", "--expert-hidden", "8", "--dense-hidden", "32", "--corpus-bytes", "50000"),
    *("--warmup", "2", "--lr", "3e-2"),
]


@pytest.fixture
def moe() -> Iterator[ModuleType]:
    threads = torch.get_num_threads()
    try:
        yield _load("train_moe")
    finally:
        torch.set_num_threads(threads)


def test_train_moe_learns_and_resumes_exactly(moe: ModuleType, tmp_path: Path) -> None:
    """The MoE's loss falls on real text; a run stopped at step 4 (its last save, the selection
    biases in it) and resumed gives bitwise the uninterrupted run's losses and metrics; the bias
    update changes the run (its counts steer the routing)."""
    import json

    args = [*MOE_TINY, "--steps", "8", "--save-every", "2", "--eval-every", "4", "--quiet"]
    whole = moe.main([*args, "--out", str(tmp_path / "whole")])
    assert len(whole) == 8 and whole[-1] < whole[0] - 0.5
    first = moe.main([*args, "--out", str(tmp_path / "parts"), "--stop-at", "4"])
    rest = moe.main([*args, "--out", str(tmp_path / "parts"), "--resume"])
    assert_bitwise(first + rest, whole)

    def metrics(out: str) -> list[dict[str, float]]:
        rows = [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]

    rows = metrics("whole")
    assert_bitwise(metrics("parts"), rows)
    assert [r["step"] for r in rows] == list(range(1, 9)) and "val_ce" in rows[3]
    assert {"ce", "balance", "max_violation", "grad_norm"} <= rows[0].keys()
    # loss = ce + 1e-3 * balance, each averaged over the microbatches
    assert all(abs(r["loss"] - r["ce"] - 1e-3 * r["balance"]) < 1e-5 for r in rows)
    unbiased = moe.main([*args, "--steps", "4", "--save-every", "0", "--bias-rate", "0", "--out", str(tmp_path / "b")])
    assert unbiased[0] == whole[0] and unbiased != whole[:4]  # the first update acts from step 2's routing on


@pytest.mark.timeout(240)
def test_train_moe_on_pp_times_ep_under_torchrun(moe: ModuleType, tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 4``: pp 2 x ep 2, the experts split over the expert ranks, each
    reading half of every global batch. The same global batches and initial parameters as one
    process: every training and validation loss within float32 rounding of its own (not bitwise:
    the expert matmuls see other shapes), the experts' load alike."""
    import json

    args = [*MOE_TINY, "--steps", "3", "--save-every", "2", "--eval-every", "3"]
    moe.main([*args, "--quiet", "--out", str(tmp_path / "one")])
    run = _torchrun(4, "train_moe.py", *args, "--out", str(tmp_path / "ep"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "pp 2 x ep 2" in run.stdout and "step 3/3: loss " in run.stdout, run.stdout
    assert (tmp_path / "ep" / "save").is_dir()

    def metrics(out: str) -> list[dict[str, float]]:
        return [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]

    one, ep = metrics("one"), metrics("ep")
    assert [r["step"] for r in ep] == [1, 2, 3] and "val_ce" in ep[2]
    for r, expected in zip(ep, one, strict=True):
        for key in ("loss", "ce", "balance", "val_ce"):
            assert (key in r) == (key in expected), (r, expected)
            if key in r:
                assert abs(r[key] - expected[key]) <= 1e-5 * abs(expected[key]), (key, r, expected)
        assert abs(r["max_violation"] - expected["max_violation"]) < 1e-9, (r, expected)
