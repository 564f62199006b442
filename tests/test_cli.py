"""The command line: ``python -m fpipe show SCHEDULE --ranks R --microbatches M``."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from textwrap import dedent

import pytest

import fpipe
from fpipe._cli import SCHEDULES, main


def show(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    status = main(["show", *args], stdout=out)
    return status, out.getvalue()


def test_show_1f1b() -> None:
    status, text = show("1f1b", "--ranks", "2", "--microbatches", "3")
    assert status == 0
    assert text == dedent("""\
        OneFOneB(num_microbatches=3): 2 ranks, 2 stages, 3 microbatches
        costs: F 1, B 2, I 1, W 1, send 0
        rank 0 | 0F0 0F1  .   .  0B0---- 0F2 0B1----  .  0B2----
        rank 1 |  .  1F0 1B0---- 1F1 1B1---- 1F2 1B2----  .   .
        F forward   B backward   I input-grad backward   W weight-grad backward   . idle
        makespan 12, bubble 25.0% (mean over ranks)
        rank 0: bubble 25.0%, peak activations 2
        rank 1: bubble 25.0%, peak activations 1
        """)


def test_show_zbv_notes_stage_units() -> None:
    status, text = show("zbv", "--ranks", "2", "--microbatches", "4")
    assert status == 0
    assert "ZeroBubbleV(num_microbatches=4): 2 ranks, 4 stages, 4 microbatches" in text
    assert "rank 0 | 0F0 0F1 0F2 3F0 3I0 3W0" in text
    assert "rank 0: bubble 4.0%, peak activations 2\n" in text  # 4 half-size chunks: 1F1B's peak of p
    assert "(peak activations in microbatches of a rank's layers: each of its 2 stages counts 1/2)" in text


def test_show_v_half_and_v_min_peaks() -> None:
    # 4 ranks: 1F1B's rank 0 holds 4 microbatches' activations, V-Half (p+2)//2 = 3, V-Min (p+4)//3 = 2.
    for name, schedule, peak in [("vhalf", "VHalf", 3), ("vmin", "VMin", 2)]:
        status, text = show(name, "--ranks", "4", "--microbatches", "8")
        assert status == 0
        assert f"{schedule}(num_microbatches=8): 4 ranks, 8 stages, 8 microbatches" in text
        peaks = [float(p) for p in re.findall(r"^rank \d: bubble .*, peak activations ([\d.]+)$", text, flags=re.M)]
        assert len(peaks) == 4 and max(peaks) == peak


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_shows(name: str) -> None:
    p, m = (3, 6) if SCHEDULES[name].allows(3, 6) else (4, 8)  # (DualPipe: p and m even)
    status, text = show(name, "--ranks", str(p), "--microbatches", str(m), "--color", "always")
    assert status == 0
    assert "\x1b[44;97m0F0\x1b[0m" in text
    assert f"rank {p - 1}: bubble" in text


def test_show_interleaved_with_a_microbatch_group() -> None:
    status, text = show("interleaved", "--ranks", "2", "--microbatches", "5", "--microbatch-group", "3")
    assert status == 0
    assert "Interleaved1F1B(num_microbatches=5, stages_per_rank=2, microbatch_group=3): 2 ranks" in text
    assert "rank 0 | 0F0 0F1 0F2 2F0 2F1 2F2" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("interleaved", "--ranks", "4", "--microbatch-group", "3"), "Use microbatch_group >= 4"),
        (("zbv", "--ranks", "2", "--microbatch-group", "3"), "--microbatch-group applies only to interleaved"),
    ],
)
def test_bad_microbatch_group(args: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", *args, "--microbatches", "8"], stdout=io.StringIO()) == 2
    assert message in capsys.readouterr().err


def test_costs_change_the_grid() -> None:
    _, text = show("gpipe", "--ranks", "2", "--microbatches", "1", "--backward", "1", "--send", "0.5")
    assert "rank 1 |  .   .   .  1F0---- 1B0----  .   .   ." in text
    assert "costs: F 1, B 1, I 1, W 1, send 0.5" in text


def test_overhead_delays_each_action() -> None:
    """NOTE [per-action overhead]: four actions in a chain, each 0.5 late."""
    _, text = show("gpipe", "--ranks", "2", "--microbatches", "1", "--backward", "1", "--overhead", "0.5")
    assert "costs: F 1, B 1, I 1, W 1, send 0, overhead 0.5" in text
    assert "makespan 6, bubble" in text


def test_no_color_by_default_off_a_terminal_and_with_no_color() -> None:
    assert "\x1b" not in show("zbh1", "--ranks", "2", "--microbatches", "2")[1]
    assert "\x1b" not in show("zbh1", "--ranks", "2", "--microbatches", "2", "--color", "always", "--no-color")[1]


def test_writes_trace_and_svg(tmp_path: Path) -> None:
    trace, picture = tmp_path / "out.json", tmp_path / "out.svg"
    status, text = show(
        "interleaved", "--ranks", "2", "--microbatches", "4", "--trace", str(trace), "--svg", str(picture)
    )
    assert status == 0
    assert f"wrote {trace} (open it in https://ui.perfetto.dev)" in text
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == 2 * 4 * 4  # 4 stages x 4 microbatches x (F, B)
    assert ET.fromstring(picture.read_text()).tag.endswith("svg")


@pytest.mark.parametrize("flag", ["--trace", "--svg"])
def test_a_path_that_cannot_be_written_is_reported(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for path in (tmp_path / "missing" / "out", tmp_path):  # no such directory; a directory
        assert show("1f1b", "--ranks", "2", "--microbatches", "2", flag, str(path))[0] == 1
        assert f"python -m fpipe show: cannot write {path}: " in capsys.readouterr().err


def test_schedule_error_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    status, text = show("zbv", "--ranks", "2", "--microbatches", "4", "--stages-per-rank", "3")
    assert status == 2
    assert text == ""
    assert "python -m fpipe show: fpipe.schedules.ZeroBubbleV: 6 stages in a V need 3 ranks" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["show", "foo", "--ranks", "2", "--microbatches", "2"], "invalid choice: 'foo'"),
        (["show", "1f1b", "--ranks", "0", "--microbatches", "2"], "expected a positive integer, got '0'"),
        (["show", "1f1b", "--ranks", "2"], "the following arguments are required: --microbatches"),
        (["show", "1f1b", "--ranks", "2", "--microbatches", "2", "--forward", "0"], None),
    ],
)
def test_bad_arguments(args: list[str], fragment: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    if fragment is None:  # a bad cost is a ScheduleError: status 2 without argparse's exit
        assert main(args, stdout=io.StringIO()) == 2
        assert "forward must be a finite positive number" in capsys.readouterr().err
        return
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.parametrize(
    "costs",
    [["--backward", "1e9"], ["--forward", "1e308", "--backward", "1e308"], ["--forward", "1e-320"], ["--send", "2000"]],
)
def test_costs_too_far_apart_to_draw_are_reported(costs: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A grid column is at least 1/8 of the shortest action: a ratio of 1e9 would be a billion columns."""
    status, text = show("1f1b", "--ranks", "2", "--microbatches", "2", *costs)
    assert (status, text) == (2, "")
    assert "costs must lie between 1e-6 and 1e6 and within a factor 1000 of each other" in capsys.readouterr().err


def test_python_dash_m() -> None:
    env = {**os.environ, "NO_COLOR": "1"}
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "fpipe", "show", "zbh1", "--ranks", "2", "--microbatches", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "rank 1 |  .  1F0 1I0 1F1 1I1 1W0 1W1" in done.stdout


def test_a_closed_pipe_is_no_traceback() -> None:
    """``python -m fpipe show ... | head -1``: the reader is gone before anything is written."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-W", "ignore", "-m", "fpipe", "show", "1f1b", "--ranks", "2", "--microbatches", "2"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write)
    assert done.returncode == 1
    assert done.stderr == ""


def run_plan(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    status = main(["plan", "--ranks", "2", "--microbatches", "4", *args], stdout=out)
    return status, out.getvalue()


def test_plan_from_measured_costs(tmp_path: Path) -> None:
    """Costs saved by save_costs: each schedule with its fastest grouping of the stages measured."""
    path = tmp_path / "costs.json"
    heavy_last = fpipe.schedules.Costs(forward=2, backward_input=2, backward_weight=2, send=0.5)
    fpipe.planning.save_costs(path, [fpipe.schedules.Costs()] * 3 + [heavy_last])
    status, text = run_plan("--costs", str(path), "--schedules", "1f1b,zbh1,zbv,interleaved")
    assert status == 0
    assert text == dedent(f"""\
        2 ranks, 4 microbatches; measured costs of 4 stages ({path})
        stage 0: F 1 s, I 1 s, W 1 s, send 0 s
        stage 1: F 1 s, I 1 s, W 1 s, send 0 s
        stage 2: F 1 s, I 1 s, W 1 s, send 0 s
        stage 3: F 2 s, I 2 s, W 2 s, send 500 ms
        schedule     stages  step    vs best  bubble  peak/rank (microbatches)
        zbv          4       36 s    1.000x   16.7%   2
        zbh1         2       37.5 s  1.042x   20.0%   2
        interleaved  4       39.5 s  1.097x   24.1%   2.5
        1f1b         2       40 s    1.111x   25.0%   2
        units per stage:
          zbv: 0 | 1 | 2 | 3
          zbh1: 0-2 | 3
          interleaved: 0 | 1 | 2 | 3
          1f1b: 0-2 | 3
        peak memory per rank (microbatches of a rank's layers), rank 0 first:
          zbv: 2 2
          zbh1: 2 2
          interleaved: 2.5 1.5
          1f1b: 2 1
        """)


def test_plan_says_which_schedules_cannot_run(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    fpipe.planning.save_costs(path, [fpipe.schedules.Costs()] * 3)
    out = io.StringIO()
    args = ["plan", "--ranks", "2", "--microbatches", "2", "--costs", str(path), "--schedules", "1f1b,zbh2,zbv"]
    assert main(args, stdout=out) == 0
    text = out.getvalue()
    assert text.startswith("2 ranks, 2 microbatches; measured costs of 3 stages")
    assert "\n1f1b " in text  # in the table
    cannot = text[text.index("cannot run:\n") :].splitlines()
    assert cannot[1].startswith(
        "  zbh2: fpipe.schedules.ZeroBubbleH2: the warm-up of 2 stages runs 2p - 1 = 3 forwards"
    )
    assert cannot[2:] == ["  zbv: needs 4 stages, has 3 units to split"]


MODEL = [
    "--layers",
    "4",
    "--hidden",
    "64",
    "--sequence",
    "32",
    "--vocabulary",
    "256",
    "--tflops",
    "1",
    "--bandwidth",
    "1",
]


def test_plan_from_a_model_marks_what_does_not_fit(tmp_path: Path) -> None:
    """The fastest that fits first; the SVG draws it."""
    picture = tmp_path / "plan.svg"
    status, text = run_plan(*MODEL, "--schedules", "1f1b,zbh1,gpipe,zbv", "--memory", "0.0021", "--svg", str(picture))
    assert status == 0
    assert "layer: F 3.408 us, I 3.67 us, W 3.146 us, send 4.096 us; head: F 1.049 us" in text
    rows = [line.split() for line in text.splitlines()[3:7]]
    assert [(row[0], row[-1]) for row in rows] == [("zbh1", "yes"), ("1f1b", "yes"), ("zbv", "no"), ("gpipe", "no")]
    assert rows[0][:5] == ["zbh1", "2", "113.4", "us", "1.000x"]
    assert float(rows[0][7].replace(",", "")) == pytest.approx(4 * 32 / 113.4e-6 / 2, rel=1e-3)  # m b s / step / p
    assert f"wrote {picture} (zbh1)" in text
    assert ET.parse(picture).getroot().tag.endswith("svg")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--tflops", "nan"], "argument --tflops: expected a finite positive number, got 'nan'"),
        (["--bandwidth", "0"], "argument --bandwidth: expected a finite positive number, got '0'"),
        (["--memory", "-1"], "argument --memory: expected a finite positive number, got '-1'"),
        (["--latency", "inf"], "argument --latency: expected a finite non-negative number, got 'inf'"),
    ],
)
def test_plan_bad_numbers(args: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        run_plan(*MODEL, *args)
    assert info.value.code == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--memory", "0.0001"], "no schedule fits in the memory of a rank (memory: 0.0001 GiB); the least any needs"),
        (["--schedules", "1f1b,foo"], "unknown schedules foo (--schedules: 1f1b,foo). Choose from gpipe, 1f1b"),
        (["--layers", "2", "--hidden", "8"], "a model needs --sequence, --vocabulary, --tflops, --bandwidth"),
    ],
)
def test_plan_errors(args: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    full = args if args[0] == "--layers" else [*MODEL, *args]
    assert run_plan(*full) == (2, "")
    assert fragment in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["--ranks", "8"],
            "python -m fpipe plan: no schedule can run: on 8 ranks each needs at least 8 stages (gpipe: 1 per rank) "
            "and there are 5 units to split (4 layers and the head). Use at most 5 ranks, or a model of at least 7 "
            "layers.",
        ),
        (
            ["--ranks", "3", "--schedules", "zbv,vhalf"],
            "python -m fpipe plan: no schedule can run: on 3 ranks each needs at least 6 stages (zbv: 2 per rank) "
            "and there are 5 units to split (4 layers and the head). Use at most 2 ranks, or a model of at least 5 "
            "layers.",
        ),
        (["--ranks", "4", "--microbatches", "2", "--schedules", "zbh2"], "no schedule can run here (zbh2: "),
    ],
)
def test_plan_with_nothing_that_can_run_exits_2_saying_what_would(
    args: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not an empty table and status 0: one line on stderr, as when nothing fits in memory."""
    out = io.StringIO()
    assert main(["plan", "--microbatches", "8", *MODEL, *args], stdout=out) == 2
    assert out.getvalue() == ""
    err = capsys.readouterr().err
    assert line in err and err.count("\n") == 1, err


def test_plan_costs_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "costs.json"
    path.write_text('{"format": "fpipe.costs", "version": 1, "stages": [{"forward": -1}]}')
    assert run_plan("--costs", str(path)) == (2, "")
    message = f"load_costs: stage 0 of {path}: fpipe.schedules.Costs: forward must be a finite positive number"
    assert message in capsys.readouterr().err
    assert run_plan("--costs", str(path), "--tflops", "1") == (2, "")
    assert "--costs gives the costs: drop the model and device options" in capsys.readouterr().err
    for option in (["--latency", "5"], ["--recompute"], ["--microbatch-size", "2"], ["--bytes-per-param", "8"]):
        assert run_plan("--costs", str(path), *option) == (2, "")  # ignored before: now refused
        assert "--costs gives the costs: drop the model and device options" in capsys.readouterr().err
    assert run_plan("--costs", str(tmp_path / "missing.json")) == (1, "")
    assert "cannot read" in capsys.readouterr().err


def test_plan_stages_per_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each schedule with each stage count it lays out; looped ones (any v >= 2) named with it."""
    path = tmp_path / "costs.json"
    fpipe.planning.save_costs(path, [fpipe.schedules.Costs()] * 4)
    status, text = run_plan(
        "--costs", str(path), "--schedules", "1f1b,interleaved,zbv,searched", "--stages-per-rank", "1,2"
    )
    assert status == 0
    table = text[: text.index("units per stage:")].splitlines()[6:]  # after 4 stage lines and the header
    names = {line.split("  ")[0] for line in table}
    assert names == {"1f1b", "interleaved v=2", "zbv", "searched v=1", "searched v=2"}
    assert run_plan("--costs", str(path), "--schedules", "1f1b,zbv", "--stages-per-rank", "4") == (2, "")
    assert "no schedule of 1f1b, zbv lays out 4 stages per rank (--stages-per-rank: 4)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_plan("--costs", str(path), "--stages-per-rank", "1,1")
    assert "expected comma-separated positive ints, each once, got '1,1'" in capsys.readouterr().err


def test_plan_tensor_and_data_parallel(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--tp and --dp: per-device figures, all-reduces in the layers and at the step's end."""
    plain_status, plain = run_plan(*MODEL, "--schedules", "1f1b")
    status, text = run_plan(*MODEL, "--schedules", "1f1b", "--tp", "2", "--dp", "4", "--tp-bandwidth", "2")
    assert plain_status == status == 0
    assert "; tp 2, dp 4 (per device: TFLOP/s, memory, tokens/s)" in text.splitlines()[0]
    assert "tokens/s/device" in text and "tokens/s/rank" in plain

    def step(output: str) -> float:
        value, unit = output.splitlines()[3].split()[2:4]
        return float(value) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[unit]

    assert step(text) > step(plain)  # half the FLOPs per device, but the all-reduces
    path = tmp_path / "costs.json"
    fpipe.planning.save_costs(path, [fpipe.schedules.Costs()] * 2)
    for option in (["--tp", "2"], ["--dp", "2"], ["--dp-bandwidth", "1"]):
        assert run_plan("--costs", str(path), *option) == (2, "")
        assert "--costs gives the costs: drop the model and device options" in capsys.readouterr().err


def test_plan_memory_with_measured_costs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With --costs, --memory is in microbatches of a rank's layers (the table's unit)."""
    path = tmp_path / "costs.json"
    fpipe.planning.save_costs(path, [fpipe.schedules.Costs()] * 2)
    status, text = run_plan("--costs", str(path), "--schedules", "gpipe,1f1b,searched", "--memory", "2")
    assert status == 0
    rows = [line.split() for line in text.splitlines()[4:7]]
    assert {(row[0], row[-1]) for row in rows} == {("1f1b", "yes"), ("searched", "yes"), ("gpipe", "no")}
    assert rows[-1][0] == "gpipe"  # what does not fit comes last
    assert run_plan("--costs", str(path), "--schedules", "gpipe,1f1b", "--memory", "0.5") == (2, "")
    err = capsys.readouterr().err
    assert "(memory: 0.5 microbatches of a rank's layers); the least any needs is 2 microbatches" in err


def test_plan_slack_keeps_the_searched_program_that_holds_least(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Costs fitted on a CPU (ms as s): the searched V wins by 0.04% holding 7.5 microbatches; with
    --slack 0.02 the searched row is ZB-V's program, holding 2."""
    path = tmp_path / "costs.json"
    Costs = fpipe.schedules.Costs
    fitted = [Costs(3.1, 0.03, 3.75), Costs(2.93, 3.4, 2.88, receive=0.22)]
    fitted += [Costs(3.16, 3.84, 2.98), Costs(7.95, 9.36, 9.12, receive=0.22)]
    fpipe.planning.save_costs(path, fitted)
    peaks = []
    for slack in ("0", "0.02"):
        out = io.StringIO()
        args = ["plan", "--ranks", "2", "--microbatches", "8", "--costs", str(path), "--schedules", "searched-v"]
        assert main([*args, "--slack", slack], stdout=out) == 0
        text = out.getvalue()
        peaks.append(text[text.index("peak memory per rank") :].splitlines()[1])
    assert peaks == ["  searched-v: 7.5 5", "  searched-v: 2 2"]
    with pytest.raises(SystemExit):
        main(["plan", "--ranks", "2", "--microbatches", "8", "--costs", str(path), "--slack", "-1"])
    assert "--slack" in capsys.readouterr().err


def test_plan_a_mixture_of_experts(capsys: pytest.CaptureFixture[str]) -> None:
    """--experts and its options make the layers after --dense-layers MoE layers; --ep shards
    their experts (NOTE [planner experts] in fpipe/planning/_cost_model.py)."""
    experts = ["--experts", "8", "--active-experts", "2", "--expert-hidden", "32", "--shared-experts", "1"]
    status, text = run_plan(*MODEL, *experts, "--dense-layers", "1", "--ep", "4", "--dp", "2", "--schedules", "1f1b")
    assert status == 0
    about, costs, header, row = text.splitlines()[:4]
    assert about.endswith(
        "8 routed experts (top-2, 1 shared, hidden 32), 1 dense layer first; 298.5K parameters, 187.9K active; "
        "tp 1, dp 2, ep 4: 16 devices (per device: TFLOP/s, memory, tokens/s)"
    )
    assert costs.startswith("dense layer: F 3.408 us, ") and "(all-to-all 12.29 us of F and of I)" in costs
    assert header.split("  ")[-2:] == ["tokens/s/device", "device-hours/1T tokens"]
    value, unit = row.split()[2:4]
    step = float(value) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[unit]
    rate, hours = (float(x.replace(",", "")) for x in row.split()[-2:])
    assert rate == pytest.approx(4 * 32 / step / 2, rel=1e-3) and hours == pytest.approx(1e12 / rate / 3600, rel=1e-3)


def test_plan_the_deepseek_v3_preset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--preset gives the model and the device; the layout is the user's, and an option given wins."""
    layout = ["plan", "--preset", "deepseek-v3", "--ranks", "2", "--microbatches", "4", "--ep", "64", "--dp", "16"]
    out = io.StringIO()
    assert main([*layout, "--schedules", "1f1b", "--memory", "1000"], stdout=out) == 0
    about, costs, header, row = out.getvalue().splitlines()[:4]
    assert about == (
        "2 ranks, 4 microbatches; 61 layers, hidden 7168, vocabulary 129280, 1 x 4096 tokens per microbatch; "
        "256 routed experts (top-8, 1 shared, hidden 2048), 3 dense layers first; 671B parameters, 37.55B active; "
        "tp 1, dp 16, ep 64: 2,048 devices (per device: TFLOP/s, memory, tokens/s)"
    )
    assert costs.startswith("dense layer: F 13.28 ms, ") and "(all-to-all 18.52 ms of F and of I)" in costs
    assert "device-hours/1T tokens" in header and row.split()[0] == "1f1b" and row.split()[-1] == "yes"
    hours = float(row.split()[-2].replace(",", ""))
    assert hours == pytest.approx(1e12 * float(row.split()[2]) * 2 / (4 * 4096) / 3600, rel=1e-3)
    faster = io.StringIO()
    assert main([*layout, "--schedules", "1f1b", "--memory", "1000", "--tflops", "792"], stdout=faster) == 0
    assert faster.getvalue().splitlines()[1].startswith("dense layer: F 6.642 ms, ")  # twice the FLOP/s
    path = tmp_path / "costs.json"
    fpipe.planning.save_costs(path, [fpipe.schedules.Costs()] * 2)
    assert run_plan("--costs", str(path), "--preset", "deepseek-v3") == (2, "")
    assert "--costs gives the costs: drop the model and device options" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["plan", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps it to the terminal
    assert info.value.code == 0 and "at 40% utilization" in help_text  # its % escaped for argparse


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--experts", "6"], "a mixture of experts needs --active-experts, --expert-hidden."),
        (
            ["--experts", "6", "--active-experts", "7", "--expert-hidden", "32"],
            "a token goes to at most every routed expert (--active-experts: 7, --experts: 6). Use --active-experts 6",
        ),
        (
            ["--experts", "6", "--active-experts", "2", "--expert-hidden", "32", "--ep", "4"],
            "the routed experts do not divide among the expert-parallel devices (--experts: 6, --ep: 4). Use an --ep "
            "that divides 6.",
        ),
        (["--ep", "2"], "--ep needs a mixture of experts (--experts N)."),
        (["--shared-experts", "1", "--ep", "2"], "--shared-experts, --ep need a mixture of experts (--experts N)."),
        (
            ["--experts", "6", "--active-experts", "2", "--expert-hidden", "32", "--dense-layers", "4"],
            "needs a MoE layer (experts.dense_layers: 4, model.layers: 4)",
        ),
    ],
)
def test_plan_experts_errors(args: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_plan(*MODEL, *args) == (2, "")
    err = capsys.readouterr().err
    assert err.startswith("python -m fpipe plan: ") and fragment in err, err
