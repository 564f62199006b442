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

    Experts (``Transformer.experts``, NOTE [planner experts]) make some layers mixtures of
    experts, sharded over ``ep`` expert-parallel devices that are also data-parallel for the
    rest of the model.

    Nothing else: no kernel launch or allocator effects, no overlap of messages with compute
    beyond what ``simulate`` models.

NOTE [planner experts]
    A mixture-of-experts layer (DeepSeek-V3's, Dai et al. 2024 "DeepSeekMoE") has, besides its
    attention (``attention_params``, default ``4 h^2``), a router of ``h E`` parameters for ``E``
    routed experts and ``E + S`` gated MLPs (SwiGLU: ``3 h e`` parameters for an expert hidden
    size ``e``), ``S`` of them shared; each token goes to the shared ones and its top ``k``
    routed ones. Its FLOPs are the dense layer's formulas with the ACTIVE parameters,
    ``P = attention_params + h E + (k + S) 3 h e`` (a token meets only those; routing is assumed
    balanced). Its memory is the TOTAL parameters a device holds: everything but the routed
    experts, and ``E / ep`` of those (each of the ``ep`` expert-parallel devices holds its own
    experts). Activations stay the dense layer's ``34 s b h`` bytes (not the experts' own).

    The ``ep`` devices are data-parallel for everything else: each trains on its own
    microbatches, so a device's compute, messages and tokens are those of one pipeline, and the
    dense gradients are reduced over ``dp ep`` replicas, the routed experts' over ``dp``. Each
    MoE layer sends each of its tokens to ``k`` experts and takes them back: a dispatch and a
    combine all-to-all in ``F``, the same two (their gradients) in ``I``, each carrying
    ``t / tp k h`` values of 2 bytes of which ``(ep-1)/ep`` leave the device::

        all-to-all = (ep-1)/ep 2 t k h / tp / ep_bandwidth + latency      (0 for ep = 1)
        F += 2 all-to-all          I += 2 all-to-all (4 with recomputation, which reruns F)

    They are not hidden behind compute (DualPipe overlaps them, Liu et al. 2024 "DeepSeek-V3
    Technical Report" section 3.2.1): ``Unit.all_to_all`` keeps the seconds of ``F`` and of ``I``
    that they are, so that a model of overlap can move them out of ``F`` and ``I`` into a
    per-stage communication cost that a pair of ``F`` and ``B`` hides.
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
        all_to_all: the seconds of its ``F``, and of its ``I`` (twice that with recomputation),
            that are the expert all-to-alls (dispatch and combine), included in ``costs`` (NOTE
            [planner experts]; 0 for a dense layer, the head, or one expert-parallel device).
    """

    name: str
    costs: Costs
    activation_bytes: float | None = None
    param_bytes: float | None = None
    reduce_seconds: float = 0.0
    all_to_all: float = 0.0


@dataclass(frozen=True)
class Experts:
    """The mixture-of-experts layers of a transformer (NOTE [planner experts]).

    Attributes:
        routed: routed experts per MoE layer ``E``.
        active: routed experts each token goes to (top-k) ``k``.
        hidden: each expert's hidden size ``e``: a gated MLP of ``3 h e`` parameters.
        shared: experts every token goes to besides its routed ones ``S``.
        dense_layers: the first layers that are dense, with ``Transformer.layer_params``
            (DeepSeek-V3's first 3); the others are MoE layers.
        attention_params: a MoE layer's matmul parameters besides its router and experts
            (default ``4 h^2``, the default dense layer's attention).

    Example:
        >>> from fpipe.planning import Experts
        >>> Experts(routed=256, active=8, hidden=2048, shared=1, dense_layers=3)  # DeepSeek-V3's
        Experts(routed=256, active=8, hidden=2048, shared=1, dense_layers=3, attention_params=None)
    """

    routed: int
    active: int
    hidden: int
    shared: int = 0
    dense_layers: int = 0
    attention_params: float | None = None

    def __post_init__(self) -> None:
        for name, least in (("routed", 1), ("active", 1), ("hidden", 1), ("shared", 0), ("dense_layers", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(
                    f"fpipe.planning.Experts: {name} must be an int of at least {least} ({name}: {value!r})."
                )
        if self.active > self.routed:
            raise ValueError(
                f"fpipe.planning.Experts: a token goes to at most every routed expert (active: {self.active}, "
                f"routed: {self.routed}). Use active <= {self.routed}, or more routed experts."
            )
        if self.attention_params is not None and not self.attention_params > 0:
            raise ValueError(
                f"fpipe.planning.Experts: attention_params must be positive (attention_params: "
                f"{self.attention_params!r})."
            )


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
        experts: its mixture-of-experts layers (NOTE [planner experts]), or ``None``: every
            layer dense.
    """

    layers: int
    hidden: int
    sequence: int
    vocabulary: int
    microbatch_size: int
    layer_params: float | None = None
    recompute: bool = False
    experts: Experts | None = None


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
        ep: expert-parallel devices, each with its own data and ``1/ep`` of each MoE layer's
            routed experts (NOTE [planner experts]); ``1`` without experts.
        ep_bandwidth: bytes per second a device's all-to-all sends at (``None``: ``bandwidth``).
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
    ep: int = 1
    ep_bandwidth: float | None = None


GRADIENT_BYTES = 4.0  # per parameter in the data-parallel reduction (fp32)


def all_reduce_seconds(size: float, devices: int, bandwidth: float, latency: float) -> float:
    """A ring all-reduce of ``size`` bytes over ``devices``: ``2 (n-1)/n size / bandwidth + latency``
    (0 on one device)."""
    return 0.0 if devices == 1 else 2.0 * (devices - 1) / devices * size / bandwidth + latency


def layer_parameters(model: Transformer, i: int) -> tuple[float, float, float]:
    """Layer ``i``'s matmul parameters as ``(total, active, routed)``: all of them, those a token
    meets, and its routed experts' (NOTE [planner experts]; a dense layer's are all active and
    none routed)."""
    h, experts = model.hidden, model.experts
    if experts is None or i < experts.dense_layers:
        dense = 12.0 * h * h if model.layer_params is None else model.layer_params
        return dense, dense, 0.0
    expert = 3.0 * h * experts.hidden
    attention = 4.0 * h * h if experts.attention_params is None else experts.attention_params
    rest = attention + h * experts.routed + experts.shared * expert
    return rest + experts.routed * expert, rest + experts.active * expert, experts.routed * expert


def model_parameters(model: Transformer) -> tuple[float, float]:
    """The model's parameters, ``(total, active)``: its layers' matmuls, the embedding and the
    head (``h V`` each, untied), as the cost model counts them."""
    layers = [layer_parameters(model, i) for i in range(model.layers)]
    embeddings = 2.0 * model.hidden * model.vocabulary
    return sum(t for t, _, _ in layers) + embeddings, sum(a for _, a, _ in layers) + embeddings


def _checked(model: Transformer, device: Device) -> None:
    """Experts that a model's layers and the device's ``ep`` can hold (NOTE [planner experts])."""
    experts = model.experts
    if experts is None:
        if device.ep != 1:
            raise ValueError(
                f"fpipe.planning: expert parallelism needs a model with experts (device.ep: {device.ep}, "
                "model.experts: None). Give Transformer(..., experts=Experts(...)), or ep=1."
            )
        return
    if experts.dense_layers >= model.layers:
        raise ValueError(
            f"fpipe.planning: a model with experts needs a MoE layer (experts.dense_layers: {experts.dense_layers}, "
            f"model.layers: {model.layers}). Use fewer dense layers, or experts=None for a dense model."
        )
    if experts.routed % device.ep:
        divisors = [d for d in range(1, experts.routed + 1) if experts.routed % d == 0]
        shown = ", ".join(map(str, divisors[:8])) + (", ..." if len(divisors) > 8 else "")
        raise ValueError(
            f"fpipe.planning: the routed experts do not divide among the expert-parallel devices "
            f"(experts.routed: {experts.routed}, device.ep: {device.ep}). Use an ep that divides "
            f"{experts.routed} ({shown})."
        )


def transformer_units(model: Transformer, device: Device) -> list[Unit]:
    """The layers and the head of ``model`` on ``device`` (NOTE [planner cost model], NOTE [planner
    experts]): per pipeline rank, ``device.tp`` devices; bytes per device.

    Raises:
        ValueError: for experts the device cannot hold (``routed`` not a multiple of ``ep``),
            ``ep`` above 1 without experts, or no MoE layer."""
    _checked(model, device)
    h, s, b, vocabulary = model.hidden, model.sequence, model.microbatch_size, model.vocabulary
    t = b * s
    n = device.tp
    flops = device.flops * n
    send = 2.0 * t * h / n / device.bandwidth + device.latency
    tp_bandwidth = device.bandwidth if device.tp_bandwidth is None else device.tp_bandwidth
    dp_bandwidth = device.bandwidth if device.dp_bandwidth is None else device.dp_bandwidth
    tp_all_reduce = all_reduce_seconds(2.0 * t * h, n, tp_bandwidth, device.latency)
    tp_gather = 0.0 if n == 1 else (n - 1) / n * 2.0 * t * h / tp_bandwidth + device.latency
    all_to_all = 0.0
    if model.experts is not None and device.ep > 1:
        ep, ep_bandwidth = device.ep, device.bandwidth if device.ep_bandwidth is None else device.ep_bandwidth
        one = (ep - 1) / ep * 2.0 * t * model.experts.active * h / n / ep_bandwidth + device.latency
        all_to_all = 2 * one  # a dispatch and a combine

    def layer_costs(params: float, exchange: float) -> Costs:
        forward = (2 * params * t + 4 * b * s * s * h) / flops
        return Costs(
            forward=forward + 2 * tp_all_reduce + exchange,
            backward_input=(2 * params * t + 8 * b * s * s * h) / flops
            + (forward + 2 * tp_all_reduce + exchange if model.recompute else 0.0)
            + 2 * tp_all_reduce
            + exchange,
            backward_weight=2 * params * t / flops,
            send=send,
        )

    head = 2.0 * h * vocabulary * t / flops
    embedding = h * vocabulary / n  # parameters per device

    def reduce(count: float, routed: float = 0.0) -> float:
        """The gradients of ``count`` parameters per device, data-parallel over ``dp ep`` replicas,
        and of ``routed`` expert parameters per device, over ``dp``."""
        dense = all_reduce_seconds(GRADIENT_BYTES * count, device.dp * device.ep, dp_bandwidth, 0.0)
        return dense + all_reduce_seconds(GRADIENT_BYTES * routed, device.dp, dp_bandwidth, 0.0) if routed else dense

    units = []
    for i in range(model.layers):
        total, active, routed = layer_parameters(model, i)
        exchange = all_to_all if routed else 0.0
        held = (total - routed) / n + (embedding if i == 0 else 0)  # per device, replicated over ep
        experts = routed / device.ep / n  # per device, this device's experts
        units.append(
            Unit(
                f"layer {i}",
                layer_costs(active, exchange),
                (2.0 if model.recompute else 34.0) * s * b * h / n,
                (held + experts) * device.bytes_per_param,
                reduce(held, experts),
                exchange,
            )
        )
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
