"""The planner's cost model: a transformer on a device as the costs and bytes of its layers and head.

NOTE [planner cost model]
    For a decoder-only transformer with ``L`` layers of ``P`` matmul parameters each (default
    ``12 h^2``: ``4 h^2`` attention, ``8 h^2`` an MLP of width ``4h``), hidden size ``h``,
    vocabulary ``V``, and a microbatch of ``b`` sequences of ``s`` tokens (``t = b s``), in
    FLOPs per microbatch (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
    on GPU Clusters", section 5.1: ``24 b s h^2 + 4 b s^2 h`` forward for ``P = 12 h^2``)::

        layer  F = 2 P t + 4 b s^2 h      (2 FLOPs per parameter and token; QK^T and AV)
               I = 2 P t + 8 b s^2 h      (the input gradients: one matmul each, both operands of
                                           the attention products)
               W = 2 P t                  (the weight gradients: one matmul each)
        head   F = I = W = 2 h V t        (on the last stage; the embedding, on the first, is a
                                           lookup: no FLOPs, only parameters)

    so ``I ~ W ~ F`` and ``B = I + W ~ 2F``. A duration is FLOPs over the device's achieved
    FLOP/s; a message carries one activation, ``t h`` values of 2 bytes: ``2 t h / bandwidth +
    latency``. Memory per rank is its parameters' ``bytes_per_param`` (16: bf16 weights and
    gradients, fp32 master weights and Adam's two moments, Rajbhandari et al. 2020) plus its
    activations at their peak, ``34 s b h`` bytes per layer and microbatch (Korthikanti et al.
    2022, "Reducing Activation Recomputation in Large Transformer Models", eq. 2 without the
    ``5 a s / h`` term that flash attention does not store; no tensor or sequence parallelism)
    and ``4 s b V`` for the head's fp32 logits. With full recomputation a layer keeps only its
    input, ``2 s b h`` bytes, and its input-gradient pass reruns the forward first: ``I += F``.

    Tensor parallelism over ``n = tp`` devices (Megatron-LM's, with sequence parallelism, as
    Korthikanti et al. and torchtitan run it): a pipeline rank is ``n`` devices, each with the
    device's FLOP/s and memory. Each computes ``1/n`` of the FLOPs, holds ``1/n`` of the
    parameters and of the activations (``34 s b h / n`` per layer), and sends its ``1/n`` of a
    message over its own link. Each layer's forward runs two all-reduces of the activation
    (``2 t h`` bytes; as all-gathers and reduce-scatters with sequence parallelism, the same
    bytes), and its input-gradient pass two more; the head's forward one all-gather and its
    input gradients one reduce-scatter. A ring all-reduce of ``x`` bytes over ``n`` devices takes
    ``2 (n-1)/n x / tp_bandwidth + latency`` (an all-gather or reduce-scatter half the bytes).
    They are not overlapped with compute (no async tensor parallelism): they add to ``F`` and
    ``I``.

    Data parallelism over ``d = dp`` replicas: after a rank's last action its gradients, 4 bytes
    per parameter (reduced in fp32), are all-reduced across the replicas, ``2 (d-1)/d x /
    dp_bandwidth``. A rank starts its reduction when its own last action ends, so the reduction
    overlaps the other ranks' drain of the pipeline, not the rank's own compute (as Megatron-LM
    and torchtitan reduce a pipeline stage's gradients once, after its last microbatch): the
    step is ``max over ranks r of (end of r's last action + r's reduction)``. ZeRO or FSDP move
    the same bytes (a reduce-scatter, then an all-gather); what they save in memory is
    ``bytes_per_param``'s to say.

    Nothing else: no kernel launch or allocator effects, no overlap of messages with compute
    beyond what ``simulate`` models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..schedules import Costs

GIB = 2.0**30


@dataclass(frozen=True)
class Unit:
    """What a split may not cut: a layer (with the embedding on the first) or the head.

    Attributes:
        name: for the table, e.g. ``"layer 3"`` or ``"head"``.
        costs: its per-microbatch durations and the latency of the message it sends.
        activation_bytes: what one microbatch leaves alive in it until its backward (``None``
            for measured costs).
        param_bytes: its parameters with their gradients and optimizer state (``None`` when
            measured).
        reduce_seconds: the data-parallel all-reduce of its gradients after the step's last
            action on its rank (NOTE [planner cost model]; 0 without data parallelism).
    """

    name: str
    costs: Costs
    activation_bytes: float | None = None
    param_bytes: float | None = None
    reduce_seconds: float = 0.0


@dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer's shape (NOTE [planner cost model]).

    Attributes:
        layers: transformer layers.
        hidden: hidden size ``h``.
        sequence: tokens per sequence ``s``.
        vocabulary: vocabulary size ``V``.
        microbatch_size: sequences per microbatch ``b``.
        layer_params: matmul parameters per layer (default ``12 h^2``).
        recompute: whether each layer's backward recomputes its forward (full activation
            checkpointing): ``I`` gains an ``F`` and a layer keeps only its input, ``2 s b h`` bytes.
    """

    layers: int
    hidden: int
    sequence: int
    vocabulary: int
    microbatch_size: int
    layer_params: float | None = None
    recompute: bool = False


@dataclass(frozen=True)
class Device:
    """What one device can do, and how a pipeline rank's devices are grouped.

    Attributes:
        flops: achieved FLOP/s of a device (peak times the utilization expected).
        bandwidth: bytes per second between neighbouring ranks (per device).
        latency: seconds per message or collective on top of its size over the bandwidth.
        memory: bytes per device for parameters, optimizer state and activations (``None``: no limit).
        bytes_per_param: bytes each parameter costs with its gradient and optimizer state.
        tp: tensor-parallel devices per pipeline rank (NOTE [planner cost model]).
        dp: data-parallel replicas of the pipeline.
        tp_bandwidth: bytes per second of the tensor-parallel all-reduces (``None``: ``bandwidth``).
        dp_bandwidth: bytes per second of the data-parallel all-reduce (``None``: ``bandwidth``).
    """

    flops: float
    bandwidth: float
    latency: float = 0.0
    memory: float | None = None
    bytes_per_param: float = 16.0
    tp: int = 1
    dp: int = 1
    tp_bandwidth: float | None = None
    dp_bandwidth: float | None = None


GRADIENT_BYTES = 4.0  # per parameter in the data-parallel reduction (fp32)


def all_reduce_seconds(size: float, devices: int, bandwidth: float, latency: float) -> float:
    """A ring all-reduce of ``size`` bytes over ``devices``: ``2 (n-1)/n size / bandwidth + latency``
    (0 on one device)."""
    return 0.0 if devices == 1 else 2.0 * (devices - 1) / devices * size / bandwidth + latency


def transformer_units(model: Transformer, device: Device) -> list[Unit]:
    """The layers and the head of ``model`` on ``device`` (NOTE [planner cost model]): per pipeline
    rank, ``device.tp`` devices; bytes per device."""
    h, s, b, vocabulary = model.hidden, model.sequence, model.microbatch_size, model.vocabulary
    t = b * s
    n = device.tp
    flops = device.flops * n
    params = 12.0 * h * h if model.layer_params is None else model.layer_params
    send = 2.0 * t * h / n / device.bandwidth + device.latency
    tp_bandwidth = device.bandwidth if device.tp_bandwidth is None else device.tp_bandwidth
    dp_bandwidth = device.bandwidth if device.dp_bandwidth is None else device.dp_bandwidth
    tp_all_reduce = all_reduce_seconds(2.0 * t * h, n, tp_bandwidth, device.latency)
    tp_gather = 0.0 if n == 1 else (n - 1) / n * 2.0 * t * h / tp_bandwidth + device.latency
    forward = (2 * params * t + 4 * b * s * s * h) / flops
    layer = Costs(
        forward=forward + 2 * tp_all_reduce,
        backward_input=(2 * params * t + 8 * b * s * s * h) / flops
        + (forward + 2 * tp_all_reduce if model.recompute else 0.0)
        + 2 * tp_all_reduce,
        backward_weight=2 * params * t / flops,
        send=send,
    )
    head = 2.0 * h * vocabulary * t / flops
    embedding = h * vocabulary / n  # parameters per device

    def reduce(count: float) -> float:
        return all_reduce_seconds(GRADIENT_BYTES * count, device.dp, dp_bandwidth, 0.0)

    units = [
        Unit(
            f"layer {i}",
            layer,
            (2.0 if model.recompute else 34.0) * s * b * h / n,
            (params / n + (embedding if i == 0 else 0)) * device.bytes_per_param,
            reduce(params / n + (embedding if i == 0 else 0)),
        )
        for i in range(model.layers)
    ]
    units.append(
        Unit(
            "head",
            Costs(forward=head + tp_gather, backward_input=head + tp_gather, backward_weight=head, send=send),
            4.0 * s * b * vocabulary / n,
            embedding * device.bytes_per_param,
            reduce(embedding),
        )
    )
    return units


def measured_units(costs: Sequence[Costs]) -> list[Unit]:
    """Measured per-stage costs (``fpipe.planning.load_costs``) as units a split may regroup."""
    return [Unit(f"stage {s}", c) for s, c in enumerate(costs)]


def tokens_per_step(model: Transformer, num_microbatches: int) -> float:
    """Tokens one step of the pipeline trains on."""
    return float(model.microbatch_size * model.sequence * num_microbatches)
