"""fpipe composes with torch.compile: compiled stages give the eager results, shapes may change."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import fpipe
from fpipe._random import CountedDraws, Keys
from fpipe.schedules import GPipe, OneFOneB, ZeroBubbleH1, ZeroBubbleV
from tests.conformance import CONFORMANCE, Conformance
from tests.helpers import assert_bitwise, some_stage_count

pytestmark = pytest.mark.timeout(300)


def block(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return h + torch.tanh(h @ p["w1"]) @ p["w2"]


def loss_fn(y: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return y.square().mean()


def params(num_stages: int) -> list[dict[str, torch.Tensor]]:
    return [{"w1": torch.randn(16, 16) / 4, "w2": torch.randn(16, 16) / 4} for _ in range(num_stages)]


@pytest.mark.parametrize("schedule", [OneFOneB(4), ZeroBubbleH1(4)], ids=str)
def test_compiled_stages_equal_eager_stages(schedule: Any) -> None:
    """AOTAutograd (the ``aot_eager`` backend: no C++ build) compiles forward and backward."""
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager")
    eager_step = fpipe.pipeline(loss_fn, [block] * 2, schedule)
    compiled_step = fpipe.pipeline(loss_fn, [compiled] * 2, schedule)
    p = params(2)
    graphs = []
    for length in (5, 7, 9, 11):  # the sequence length changes between steps
        x = torch.randn(8, length, 16)
        loss, grads = eager_step(p, x)
        c_loss, c_grads = compiled_step(p, x)
        torch.testing.assert_close(c_loss, loss)
        torch.testing.assert_close(c_grads, grads)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    # dynamo recompiles once with a dynamic length, then never again
    assert graphs[1] == graphs[2] == graphs[3], graphs


def test_compiling_the_step_runs_it_eagerly() -> None:
    step = fpipe.pipeline(loss_fn, [block] * 2, OneFOneB(2))
    p, x = params(2), torch.randn(4, 3, 16)
    loss, grads = torch.compile(step, backend="aot_eager")(p, x)
    expected_loss, expected_grads = step(p, x)
    assert_bitwise((loss, grads), (expected_loss, expected_grads))


def test_recomputed_compiled_stages_compile_one_more_graph() -> None:
    """A recomputed forward runs without a graph: one more variant of a compiled stage function,
    not one per kind of stage input (stage 0 gets views of the batch, later stages tensors that
    require grad; dynamo guards on both). Past ``recompile_limit`` (8) variants dynamo would run
    the stage eagerly, silently."""
    graphs = []
    for recompute in (False, True):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(block, backend="aot_eager", dynamic=True)
        step = fpipe.pipeline(loss_fn, [compiled] * 3, OneFOneB(4), recompute=recompute)
        eager = fpipe.pipeline(loss_fn, [block] * 3, OneFOneB(4), recompute=recompute)
        p = params(3)
        for length in (5, 7):  # 10 examples: microbatches of 3, 3, 2, 2
            x = torch.randn(10, length, 16)
            loss, grads = step(p, x)
            expected_loss, expected_grads = eager(p, x)
            torch.testing.assert_close(loss, expected_loss)
            torch.testing.assert_close(grads, expected_grads)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs == [2, 3], graphs


# --- The compiled step: pipeline(..., compile=...) (fpipe/_compile.py) --------------------------


def first_block(p: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return block(p, batch["x"])


def target_loss(y: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((y - batch["t"]) ** 2).mean()


def dict_batch(size: int, length: int) -> dict[str, torch.Tensor]:
    return {
        "x": torch.randn(size, length, 16, dtype=torch.float64),
        "t": torch.randn(size, length, 16, dtype=torch.float64),
    }


def params64(num_stages: int) -> list[dict[str, torch.Tensor]]:
    return [{k: v.double() for k, v in p.items()} for p in params(num_stages)]


@pytest.mark.parametrize("entry", CONFORMANCE, ids=str)
def test_compiled_step_is_bitwise_the_eager_step(entry: Conformance) -> None:
    """Under ``aot_eager`` every schedule's compiled step (one graph: ``fullgraph=True``, else it
    would warn, and warnings are errors) gives the eager step's bits, split backwards included."""
    num_stages = some_stage_count(entry, 2)
    stages = [first_block] + [block] * (num_stages - 1)
    schedule = entry.make(num_stages, 3)
    counter = CompileCounter()
    compiled = fpipe.pipeline(target_loss, stages, schedule, compile=counter)
    eager = fpipe.pipeline(target_loss, stages, schedule)
    p, batch = params64(num_stages), dict_batch(5, 2)  # 5 examples: microbatches of 2, 2, 1
    assert_bitwise(compiled(p, batch), eager(p, batch))
    assert counter.frame_count == 1


def test_compiled_step_recompiles_once_for_a_new_length() -> None:
    """A changing sequence length: at most one compile with static shapes, one with a dynamic length, then none."""
    counter = CompileCounter()
    stages = [first_block, block]
    compiled = fpipe.pipeline(target_loss, stages, ZeroBubbleH1(2), compile=counter)
    eager = fpipe.pipeline(target_loss, stages, ZeroBubbleH1(2))
    p = params64(2)
    frames = []
    for length in (5, 7, 9, 5):
        batch = dict_batch(4, length)
        assert_bitwise(compiled(p, batch), eager(p, batch))
        frames.append(counter.frame_count)
    # 1, 2, 2, 2 in a fresh process; 1, 1, 1, 1 once dynamo's automatic dynamic shapes remember, for
    # this code's file and line (its profile, kept on disk too), that the length changes
    assert frames[-1] <= 2 and frames[1:] == [frames[1]] * 3, frames


def test_compiled_step_with_aux_and_token_counts() -> None:
    """``has_aux`` and ``weight_fn``: a new token count is a new weight, not a new compile."""

    def loss_aux(y: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = ((y - batch["t"]) ** 2).sum()
        return loss, {"loss": loss.detach()}

    def tokens(mb: dict[str, torch.Tensor]) -> torch.Tensor:
        return (mb["t"][..., 0] > 0).sum()

    counter = CompileCounter()
    kwargs: dict[str, Any] = {"has_aux": True, "weight_fn": tokens}
    compiled = fpipe.pipeline(loss_aux, [first_block, block], OneFOneB(4), compile=counter, **kwargs)
    eager = fpipe.pipeline(loss_aux, [first_block, block], OneFOneB(4), **kwargs)
    p = params64(2)
    for _ in range(3):
        batch = dict_batch(8, 3)
        assert_bitwise(compiled(p, batch), eager(p, batch))
    assert counter.frame_count == 1


def test_compiled_stages_nest_in_the_compiled_step() -> None:
    torch._dynamo.reset()
    compiled_block = torch.compile(block, backend="aot_eager")
    counter = CompileCounter()
    x = torch.randn(6, 4, 16)
    step = fpipe.pipeline(loss_fn, [compiled_block] * 3, OneFOneB(3), compile=counter)
    eager = fpipe.pipeline(loss_fn, [block] * 3, OneFOneB(3))
    p = params(3)
    assert_bitwise(step(p, x), eager(p, x))
    assert counter.frame_count == 1


def item_stage(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """A Python number read from the data steers Python (``.item()`` in arithmetic alone traces)."""
    return block(p, h) * (2.0 if h.abs().max().item() > 0 else 1.0)


def branch_stage(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return block(p, h) if h.sum() > 0 else -block(p, h)


@pytest.mark.parametrize("bad", [item_stage, branch_stage], ids=lambda f: f.__name__)
def test_a_stage_that_cannot_be_traced_warns_and_runs_eagerly(bad: Any) -> None:
    """The warning names the first action of the stage that breaks the graph; the step's results
    are the eager step's; the next call does not try again, and warns again."""
    stages = [block, bad, block]
    compiled = fpipe.pipeline(loss_fn, stages, OneFOneB(2), compile="aot_eager")
    eager = fpipe.pipeline(loss_fn, stages, OneFOneB(2))
    p, x = params(3), torch.randn(4, 16)
    for _ in range(2):
        with pytest.warns(UserWarning, match=r"compile: action 1F0 \(stage 1, microbatch 0\) cannot be traced"):
            result = compiled(p, x)
        assert_bitwise(result, eager(p, x))


@pytest.mark.parametrize("schedule", [OneFOneB(2), ZeroBubbleH1(2)], ids=str)
def test_compiled_step_with_recomputed_stages(schedule: Any) -> None:
    """Recomputed stages (the last one included) run their forward without a graph and replay it in
    their backward, inside the graph: the eager bits, and the step runs under ``no_grad`` too."""
    stages = [first_block] + [block] * 2
    compiled = fpipe.pipeline(target_loss, stages, schedule, recompute={1, 2}, compile="aot_eager")
    eager = fpipe.pipeline(target_loss, stages, schedule, recompute={1, 2})
    p, batch = params64(3), dict_batch(4, 2)
    with torch.no_grad():
        assert_bitwise(compiled(p, batch), eager(p, batch))


def test_compile_argument_is_checked() -> None:
    with pytest.raises(ValueError, match="compile names no backend torch"):
        fpipe.pipeline(loss_fn, [block], OneFOneB(2), compile="no-such-backend")
    with pytest.raises(TypeError, match="compile must be True, False, a backend name"):
        fpipe.pipeline(loss_fn, [block], OneFOneB(2), compile=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="compile names no backend torch"):
        fpipe.pipeline(loss_fn, [block], OneFOneB(2), compile=fpipe.Compile("no-such-backend"))
    with pytest.raises(ValueError, match=r"Compile's mode is one of Inductor's \(mode: 'fast'.*'reduce-overhead'"):
        fpipe.pipeline(loss_fn, [block], OneFOneB(2), compile=fpipe.Compile(mode="fast"))
    with pytest.raises(ValueError, match=r"backend: 'aot_eager'\)\. Pass backend='inductor'"):
        fpipe.pipeline(loss_fn, [block], OneFOneB(2), compile=fpipe.Compile("aot_eager", mode="reduce-overhead"))


def test_a_compile_value_names_the_backend() -> None:
    """``fpipe.Compile(backend)`` is the backend's name or callable, as ``compile=backend`` is."""
    counter = CompileCounter()
    stages = [first_block, block]
    compiled = fpipe.pipeline(target_loss, stages, OneFOneB(2), compile=fpipe.Compile(counter))
    p, batch = params64(2), dict_batch(4, 2)
    assert_bitwise(compiled(p, batch), fpipe.pipeline(target_loss, stages, OneFOneB(2))(p, batch))
    assert counter.frame_count == 1 and fpipe.Compile() == fpipe.Compile("inductor", None)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # Inductor's import
def test_inductor_step_is_close_to_eager_repeats_itself_and_is_one_across_schedules() -> None:
    """Inductor (``compile=True``) in float64: within 1e-12 of the eager step, the same bits run to
    run, and the same bits for GPipe, 1F1B and ZB-H1 (one program of operations up to order)."""
    stages = [first_block] + [block] * 3
    p, batch = params64(4), dict_batch(8, 3)
    expected = fpipe.pipeline(target_loss, stages, GPipe(4))(p, batch)
    results = []
    for schedule in (GPipe(4), OneFOneB(4), ZeroBubbleH1(4)):
        compiled = fpipe.pipeline(target_loss, stages, schedule, compile=True)
        results.append(compiled(p, batch))
        assert_bitwise(compiled(p, batch), results[-1])
        torch.testing.assert_close(results[-1], expected, rtol=1e-12, atol=0)
    for result in results[1:]:
        assert_bitwise(result, results[0])
    # Inductor's mode (on a CPU "reduce-overhead" captures no CUDA graph: the same program)
    moded = fpipe.pipeline(target_loss, stages, OneFOneB(4), compile=fpipe.Compile(mode="reduce-overhead"))
    torch.testing.assert_close(moded(p, batch), expected, rtol=1e-12, atol=0)


def noisy_stage(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """Dropout, and noise from ``torch.rand``: both counted in a graph."""
    return torch.nn.functional.dropout(block(p, h), 0.5) + 0.01 * torch.rand(h.shape[-1], dtype=h.dtype)


def noisy_loss(y: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((torch.nn.functional.dropout(y, 0.25) - batch["t"]) ** 2).mean()


NOISY = [first_block, noisy_stage, block, noisy_stage]


def counted_reference(
    p: list[dict[str, torch.Tensor]], batch: dict[str, torch.Tensor], key: int, num_microbatches: int
) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """The unsplit model by plain autograd, each stage call's draws counted from its seed as a
    compiled step's are (NOTE [counted draws]): the loss and the gradients."""
    seeds = Keys(key).seeds(len(NOISY), num_microbatches)
    leaves = [{k: v.detach().requires_grad_() for k, v in q.items()} for q in p]
    losses = []
    for i in range(num_microbatches):
        h: Any = {k: v.tensor_split(num_microbatches)[i] for k, v in batch.items()}
        for s, stage in enumerate(NOISY):
            with CountedDraws(seeds[s, i]):  # (the last stage's loss_fn counts on in its call)
                h = stage(leaves[s], h)
                if s == len(NOISY) - 1:
                    losses.append(noisy_loss(h, {k: v.tensor_split(num_microbatches)[i] for k, v in batch.items()}))
    loss = torch.stack(losses).mean()
    grads = torch.autograd.grad(loss, [v for q in leaves for v in q.values()])
    it = iter(grads)
    return loss.detach(), [{k: next(it) for k in q} for q in p]


def test_a_compiled_step_counts_its_draws_from_the_key_stage_and_microbatch() -> None:
    """Dropout and ``torch.rand`` in stages and in ``loss_fn`` (NOTE [counted draws]): every
    schedule, with or without recomputation, gives the same bits, within 1e-12 of the unsplit
    model drawing the same counted numbers. They are not the eager step's numbers (MT19937's),
    and a new key is new masks, not a new graph."""
    p, batch = params64(4), dict_batch(4, 3)
    counter = CompileCounter()
    results = []
    for schedule, recompute in ((GPipe(4), False), (ZeroBubbleV(4), True)):
        step = fpipe.pipeline(noisy_loss, NOISY, schedule, recompute=recompute, compile=counter)
        results.append(step(p, batch, key=5))
    for result in results[1:]:
        assert_bitwise(result, results[0])
    loss, grads = results[0]
    expected_loss, expected_grads = counted_reference(p, batch, 5, 4)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(grads, expected_grads, rtol=1e-12, atol=1e-15)
    eager_loss, _ = fpipe.pipeline(noisy_loss, NOISY, GPipe(4))(p, batch, key=5)
    assert not torch.equal(loss, eager_loss)
    frames = counter.frame_count
    other_loss, _ = step(p, batch, key=6)
    torch.testing.assert_close(other_loss, counted_reference(p, batch, 6, 4)[0], rtol=1e-12, atol=0)
    assert counter.frame_count == frames


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # Inductor's import
def test_inductor_counts_the_draws_aot_eager_counts() -> None:
    """Counted draws (NOTE [counted draws]) under Inductor: aot_eager's masks, so within 1e-12."""
    p, batch = params64(4), dict_batch(4, 3)
    noisy = fpipe.pipeline(noisy_loss, NOISY, OneFOneB(4), compile=True)(p, batch, key=3)
    reference = fpipe.pipeline(noisy_loss, NOISY, OneFOneB(4), compile="aot_eager")(p, batch, key=3)
    torch.testing.assert_close(noisy, reference, rtol=1e-12, atol=0)


def like_stage(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return block(p, h) * torch.rand_like(h)


def test_a_stage_whose_draws_a_graph_cannot_count_warns_and_runs_eagerly() -> None:
    """``rand_like`` reaches dynamo's graph as a draw of its own (NOTE [counted draws]): refused."""
    stages = [block, block, like_stage]
    compiled = fpipe.pipeline(loss_fn, stages, OneFOneB(2), compile="aot_eager")
    eager = fpipe.pipeline(loss_fn, stages, OneFOneB(2))
    p, x = params(3), torch.randn(4, 16)
    with pytest.warns(UserWarning, match=r"action 2F0 \(stage 2, microbatch 0\) draws random numbers \(rand_like\)"):
        result = compiled(p, x, key=7)
    assert_bitwise(result, eager(p, x, key=7))


@pytest.mark.parametrize(
    "precision",
    [
        fpipe.Precision(compute=torch.bfloat16),
        fpipe.Precision(compute=torch.float16, loss_scale=fpipe.LossScale(init=2.0**20)),
    ],
    ids=["bfloat16", "float16-scaled"],
)
def test_compiled_step_with_a_precision_policy(precision: fpipe.Precision) -> None:
    """Master weights cast in the graph, sums in float32, the loss scale a seed: the eager bits,
    the scale's state and skips too (2**20 overflows float16's seeds: the first step skips)."""

    def cast_block(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        return block(p, h.to(p["w1"].dtype))

    stages = [cast_block] * 2
    compiled = fpipe.pipeline(loss_fn, stages, ZeroBubbleH1(2), precision=precision, compile="aot_eager")
    eager = fpipe.pipeline(loss_fn, stages, ZeroBubbleH1(2), precision=precision)
    p = [{k: v.float() for k, v in stage.items()} for stage in params(2)]  # float32 master weights
    for _ in range(2):
        x = torch.randn(4, 16, dtype=torch.float32)
        assert_bitwise(compiled(p, x), eager(p, x))
        assert (compiled.loss_scale, compiled.last_skipped) == (eager.loss_scale, eager.last_skipped)


def test_torch_compile_of_a_compiled_step_runs_its_core() -> None:
    """``torch.compile(step)`` runs the step's own prologue eagerly and its compiled core;
    ``evaluate`` stays eager (forwards only, nothing to fuse with a backward)."""
    counter = CompileCounter()
    step = fpipe.pipeline(loss_fn, [block] * 2, OneFOneB(2), compile=counter)
    eager = fpipe.pipeline(loss_fn, [block] * 2, OneFOneB(2))
    p, x = params(2), torch.randn(4, 16)
    assert_bitwise(torch.compile(step, backend="aot_eager")(p, x), eager(p, x))
    assert counter.frame_count == 1
    assert_bitwise(step.evaluate(p, x), eager.evaluate(p, x))


def test_compiled_step_compiles_twice_for_any_batch_size() -> None:
    """New batch sizes (uneven splits, microbatches of one example): one graph for even
    microbatches and one for uneven ones, then none."""
    counter = CompileCounter()
    stages = [first_block, block]
    compiled = fpipe.pipeline(target_loss, stages, OneFOneB(4), compile=counter)
    eager = fpipe.pipeline(target_loss, stages, OneFOneB(4))
    p = params64(2)
    frames = []
    for size in (8, 7, 6, 9, 5, 4, 12):
        batch = dict_batch(size, 2)
        assert_bitwise(compiled(p, batch), eager(p, batch))
        frames.append(counter.frame_count)
    assert frames[-1] <= 2 and frames[1:] == [frames[1]] * 6, frames


def test_past_the_recompile_limit_the_step_warns_and_runs_eagerly() -> None:
    """Dynamo's recompile limit under ``fullgraph=True`` is an error, never a silent eager step."""
    step = fpipe.pipeline(loss_fn, [block] * 2, OneFOneB(2), compile="aot_eager")
    eager = fpipe.pipeline(loss_fn, [block] * 2, OneFOneB(2))
    p = params(2)
    with torch._dynamo.config.patch(recompile_limit=1):
        step(p, torch.randn(4, 16))
        x = torch.randn(4, 3, 16)  # one more dimension: a new graph
        with pytest.warns(UserWarning, match="compile: dynamo reached its recompile limit for this step"):
            result = step(p, x)
    assert_bitwise(result, eager(p, x))


def test_a_recorded_compiled_step_runs_its_actions_and_says_so() -> None:
    """``fpipe.record()`` times each action: under it the step runs eagerly, with a warning, and
    the recording holds its timeline; outside it, the step is compiled again."""
    counter = CompileCounter()
    stages = [first_block, block]
    compiled = fpipe.pipeline(target_loss, stages, OneFOneB(2), compile=counter)
    eager = fpipe.pipeline(target_loss, stages, OneFOneB(2))
    p, batch = params64(2), dict_batch(4, 2)
    with fpipe.record() as recording, pytest.warns(UserWarning, match="fpipe.record\\(\\) times each action"):
        assert_bitwise(compiled(p, batch), eager(p, batch))
    assert len(recording.timelines) == 2 and counter.frame_count == 0
    assert_bitwise(compiled(p, batch), eager(p, batch))
    assert counter.frame_count == 1
