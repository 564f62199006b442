"""The planner's cost model (NOTE [planner cost model] in fpipe/planning/_cost_model.py) with its
formulas written out: a transformer's layers and head on a device, with tensor and data parallelism."""

from __future__ import annotations

from fpipe.planning import Device, Transformer
from fpipe.planning._cost_model import transformer_units
from fpipe.schedules import Costs

MODEL = Transformer(layers=2, hidden=4, sequence=8, vocabulary=16, microbatch_size=2)
DEVICE = Device(flops=2.0, bandwidth=4.0, latency=0.5, bytes_per_param=16.0)


def test_transformer_units_follow_the_formulas() -> None:
    """h = 4, s = 8, b = 2 (t = 16 tokens), V = 16, P = 12 h^2 = 192, at 2 FLOP/s and 4 B/s."""
    layer0, layer1, head = transformer_units(MODEL, DEVICE)
    t, h, s, b, vocabulary, params = 16, 4, 8, 2, 16, 192
    assert layer0.costs == Costs(
        forward=(2 * params * t + 4 * b * s * s * h) / 2,  # 6144 + 2048 FLOPs
        backward_input=(2 * params * t + 8 * b * s * s * h) / 2,
        backward_weight=2 * params * t / 2,
        send=2 * t * h / 4 + 0.5,  # t h values of 2 bytes over 4 B/s, plus the latency
    )
    assert layer1.costs == layer0.costs
    assert head.costs == Costs(forward=2048 / 2, backward_input=2048 / 2, backward_weight=2048 / 2, send=32.5)
    assert (layer0.activation_bytes, head.activation_bytes) == (34 * s * b * h, 4 * s * b * vocabulary)
    embedding = h * vocabulary * 16
    assert (layer0.param_bytes, layer1.param_bytes, head.param_bytes) == (
        params * 16 + embedding,
        params * 16,
        embedding,
    )
    bigger = transformer_units(Transformer(2, 4, 8, 16, 2, layer_params=1000.0), DEVICE)
    assert bigger[0].costs.backward_weight == 2 * 1000 * t / 2
    recomputed, _, _ = transformer_units(Transformer(2, 4, 8, 16, 2, recompute=True), DEVICE)
    assert recomputed.costs.backward_input == layer0.costs.backward_input + layer0.costs.forward
    assert recomputed.activation_bytes == 2 * s * b * h


def test_tensor_parallelism_divides_the_work_and_adds_its_all_reduces() -> None:
    """tp = 2 devices per rank at 2 FLOP/s each, all-reduces at 8 B/s: a layer's F and I gain two
    all-reduces of t h values of 2 bytes, 2 (n-1)/n x / 8 + latency each; the head one all-gather
    in F and one reduce-scatter in I; compute, bytes and messages per device are halved."""
    tp = Device(flops=2.0, bandwidth=4.0, latency=0.5, tp=2, tp_bandwidth=8.0)
    layer, _, head = transformer_units(MODEL, tp)
    plain, _, plain_head = transformer_units(MODEL, DEVICE)
    t, h = 16, 4
    all_reduce = 2 * (1 / 2) * (2 * t * h) / 8 + 0.5  # 8.5
    assert layer.costs == Costs(
        forward=plain.costs.forward / 2 + 2 * all_reduce,
        backward_input=plain.costs.backward_input / 2 + 2 * all_reduce,
        backward_weight=plain.costs.backward_weight / 2,
        send=2 * t * h / 2 / 4 + 0.5,
    )
    gather = (1 / 2) * (2 * t * h) / 8 + 0.5
    assert (head.costs.forward, head.costs.backward_input) == (plain_head.costs.forward / 2 + gather,) * 2
    assert head.costs.backward_weight == plain_head.costs.backward_weight / 2
    assert (layer.activation_bytes, layer.param_bytes) == (plain.activation_bytes / 2, plain.param_bytes / 2)  # type: ignore[operator]
    assert layer.reduce_seconds == head.reduce_seconds == 0.0  # no data parallelism


def test_data_parallel_reduction_of_each_parameter() -> None:
    """dp = 4 replicas at 8 B/s: 4 bytes per parameter, 2 (d-1)/d of them over the bandwidth."""
    layer0, layer1, head = transformer_units(MODEL, Device(flops=2.0, bandwidth=4.0, dp=4, dp_bandwidth=8.0))
    embedding, params = 4 * 16, 192
    assert layer0.reduce_seconds == 2 * (3 / 4) * 4 * (params + embedding) / 8
    assert (layer1.reduce_seconds, head.reduce_seconds) == (
        2 * (3 / 4) * 4 * params / 8,
        2 * (3 / 4) * 4 * embedding / 8,
    )
    assert layer0.costs == transformer_units(MODEL, Device(flops=2.0, bandwidth=4.0))[0].costs  # the step's end only
