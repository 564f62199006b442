"""The planner's cost model (NOTE [planner cost model] in fpipe/planning/_cost_model.py) with its
formulas written out: a transformer's layers and head on a device, with tensor and data parallelism,
and its experts (NOTE [planner experts])."""

from __future__ import annotations

import pytest

from fpipe.planning import Device, Experts, Transformer
from fpipe.planning._cost_model import layer_parameters, model_parameters, transformer_units
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


# A tiny mixture of experts (NOTE [planner experts]): h = 4, 3 layers, the first dense; 4 routed
# experts of hidden 2 (3 h e = 24 parameters each), top-2, 1 shared; attention 4 h^2 = 64.
EXPERTS = Experts(routed=4, active=2, hidden=2, shared=1, dense_layers=1)
MOE = Transformer(layers=3, hidden=4, sequence=8, vocabulary=16, microbatch_size=2, experts=EXPERTS)


def test_active_and_total_parameters_of_a_mixture_of_experts() -> None:
    """A MoE layer: attention 64 + router h E = 16 + shared 24 = 104 beside its routed experts
    (4 x 24 = 96): 200 in all, 104 + 2 x 24 = 152 active. The model: one dense layer (12 h^2 =
    192), two MoE layers, an embedding and a head of h V = 64 each."""
    assert layer_parameters(MOE, 0) == (192.0, 192.0, 0.0)
    assert layer_parameters(MOE, 1) == layer_parameters(MOE, 2) == (200.0, 152.0, 96.0)
    assert model_parameters(MOE) == (192 + 2 * 200 + 2 * 64, 192 + 2 * 152 + 2 * 64)
    assert model_parameters(MODEL) == (2 * 192 + 2 * 64,) * 2  # dense: every parameter active
    wide = Transformer(3, 4, 8, 16, 2, experts=Experts(4, 2, 2, attention_params=10.0))
    assert layer_parameters(wide, 0) == (10 + 16 + 96, 10 + 16 + 48, 96)  # no dense layer, no shared expert


def test_one_expert_parallel_device_is_the_dense_model_of_the_active_parameters() -> None:
    """ep = 1: a MoE layer computes as a dense layer of its 152 active parameters, and sends
    nothing more; only its memory (all 200 parameters) differs."""
    moe = transformer_units(MOE, DEVICE)
    dense = transformer_units(Transformer(3, 4, 8, 16, 2, layer_params=152.0), DEVICE)
    assert [u.costs for u in moe[1:]] == [u.costs for u in dense[1:]]
    assert moe[0].costs == transformer_units(MODEL, DEVICE)[0].costs  # the dense layer: 12 h^2
    assert all(u.all_to_all == 0.0 for u in moe)
    assert (moe[1].param_bytes, dense[1].param_bytes) == (200 * 16, 152 * 16)


def test_all_to_all_is_added_to_forward_and_input_gradients() -> None:
    """ep = 4 at 8 B/s: a dispatch and a combine of t k h = 16 x 2 x 4 values of 2 bytes, 3/4 of
    them leaving the device, 3/4 x 256 / 8 + 0.5 = 24.5 s each, in F and in I; W unchanged.
    The bytes scale with top-k and (ep-1)/ep; recomputation reruns the forward's two."""
    ep1 = transformer_units(MOE, DEVICE)
    ep4 = transformer_units(MOE, Device(flops=2.0, bandwidth=4.0, latency=0.5, ep=4, ep_bandwidth=8.0))
    one = 3 / 4 * 2 * 16 * 2 * 4 / 8 + 0.5
    assert ep4[1].all_to_all == 2 * one == 49.0
    assert ep4[1].costs == Costs(
        forward=ep1[1].costs.forward + 49.0,
        backward_input=ep1[1].costs.backward_input + 49.0,
        backward_weight=ep1[1].costs.backward_weight,
        send=ep1[1].costs.send,
    )
    assert ep4[0].costs == ep1[0].costs and ep4[-1].costs == ep1[-1].costs  # the dense layer, the head
    assert (ep4[0].all_to_all, ep4[-1].all_to_all) == (0.0, 0.0)

    def exchanged(experts: Experts, ep: int, tp: int = 1) -> float:
        model = Transformer(3, 4, 8, 16, 2, experts=experts)
        return transformer_units(model, Device(flops=2.0, bandwidth=8.0, ep=ep, tp=tp))[1].all_to_all

    assert exchanged(EXPERTS, 2) == 2 * (1 / 2 * 256 / 8) == 32.0
    assert exchanged(Experts(4, 4, 2, 1, 1), 2) == 2 * exchanged(EXPERTS, 2)  # top-4: twice the tokens
    assert exchanged(EXPERTS, 4) == 2 * (3 / 4 * 256 / 8)
    assert exchanged(EXPERTS, 4, tp=2) == exchanged(EXPERTS, 4) / 2  # each device sends its 1/tp
    recomputed = transformer_units(
        Transformer(3, 4, 8, 16, 2, recompute=True, experts=EXPERTS), Device(flops=2.0, bandwidth=4.0, ep=2)
    )[1]
    exchange = 2 * (1 / 2 * 256 / 4)
    assert recomputed.all_to_all == exchange == 64.0  # I: its own two and the recomputed forward's (in F)
    assert recomputed.costs.backward_input == (2 * 152 * 16 + 8 * 2 * 64 * 4) / 2 + recomputed.costs.forward + exchange


def test_memory_and_gradient_reduction_divide_the_routed_experts() -> None:
    """Per device: all but the routed experts (104), and 96 / ep of them; the dense gradients
    reduced over dp ep replicas, the experts' over dp."""
    for ep in (1, 2, 4):
        units = transformer_units(MOE, Device(flops=2.0, bandwidth=4.0, ep=ep))
        assert units[1].param_bytes == (104 + 96 / ep) * 16
        assert units[0].param_bytes == (192 + 64) * 16  # the dense layer with the embedding
    units = transformer_units(MOE, Device(flops=2.0, bandwidth=4.0, dp=2, ep=4, dp_bandwidth=8.0))
    assert units[1].reduce_seconds == 2 * (7 / 8) * 4 * 104 / 8 + 2 * (1 / 2) * 4 * 24 / 8
    assert units[0].reduce_seconds == 2 * (7 / 8) * 4 * (192 + 64) / 8


def test_experts_that_cannot_be_planned_are_refused() -> None:
    with pytest.raises(
        ValueError, match=r"Experts: a token goes to at most every routed expert \(active: 5, routed: 4\)"
    ):
        Experts(routed=4, active=5, hidden=2)
    with pytest.raises(ValueError, match=r"Experts: routed must be an int of at least 1 \(routed: 0\)"):
        Experts(routed=0, active=1, hidden=2)
    with pytest.raises(ValueError, match=r"Experts: attention_params must be positive \(attention_params: -1"):
        Experts(routed=4, active=1, hidden=2, attention_params=-1.0)
    with pytest.raises(
        ValueError,
        match=r"the routed experts do not divide among the expert-parallel devices \(experts.routed: 4, "
        r"device.ep: 3\)\. Use an ep that divides 4 \(1, 2, 4\)\.",
    ):
        transformer_units(MOE, Device(flops=2.0, bandwidth=4.0, ep=3))
    with pytest.raises(ValueError, match=r"expert parallelism needs a model with experts \(device.ep: 2"):
        transformer_units(MODEL, Device(flops=2.0, bandwidth=4.0, ep=2))
    with pytest.raises(ValueError, match=r"needs a MoE layer \(experts.dense_layers: 3, model.layers: 3\)"):
        transformer_units(Transformer(3, 4, 8, 16, 2, experts=Experts(4, 2, 2, dense_layers=3)), DEVICE)
