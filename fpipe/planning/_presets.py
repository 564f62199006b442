"""Published configurations by name, for ``python -m fpipe plan --preset`` (notes/planner.md
compares the plans with the published runs)."""

from __future__ import annotations

from dataclasses import dataclass

from ._cost_model import GIB, Device, Experts, Transformer

# DeepSeek-V3's attention (MLA, hidden 7168, 128 heads): queries through a rank-1536 latent
# to 128 x (128 + 64) dims, keys and values through a rank-512 latent (plus a 64-dim shared
# rotary key) to 128 x (128 + 128), the output from 128 x 128.
_MLA = 7168 * 1536 + 1536 * 128 * 192 + 7168 * (512 + 64) + 512 * 128 * 256 + 128 * 128 * 7168
_DENSE_MLP = 3 * 7168 * 18432  # the first 3 layers' SwiGLU of width 18432


# ZeRO-1 as DeepSeek-V3 trains (section 3.3): bf16 weights and fp32 gradients per device, fp32
# master weights and bf16 Adam moments (8 bytes) sharded over the data-parallel replicas: 128 for
# the dense weights at PP16 x EP64 on 2048 GPUs (6.06 bytes), 2 for the routed experts (10 bytes),
# which are 43% of a device's parameters there: about 8 on average.
BYTES_PER_PARAM = 8.0


@dataclass(frozen=True)
class Preset:
    """A published model on the devices it was trained on.

    Attributes:
        about: where the figures come from, and what is assumed.
        model: its shape.
        device: one device (``tp``, ``dp``, ``ep`` 1: the layout is the planner's to be told).
    """

    about: str
    model: Transformer
    device: Device


PRESETS = {
    "deepseek-v3": Preset(
        about="DeepSeek-V3 (arXiv:2412.19437, Table 1 and sections 3.1-3.3) on H800s: 671B parameters, 37B "
        "active; 990 TFLOP/s bf16 dense peak at 40% utilization, 80 GiB, NVLink 160 GB/s, InfiniBand 50 GB/s, "
        "8 bytes per parameter (ZeRO-1)",
        model=Transformer(
            layers=61,
            hidden=7168,
            sequence=4096,
            vocabulary=129280,
            microbatch_size=1,
            layer_params=float(_MLA + _DENSE_MLP),
            experts=Experts(routed=256, active=8, hidden=2048, shared=1, dense_layers=3, attention_params=float(_MLA)),
        ),
        device=Device(
            flops=0.4 * 990e12,
            bandwidth=50e9,
            latency=10e-6,
            memory=80 * GIB,
            bytes_per_param=BYTES_PER_PARAM,
            tp_bandwidth=160e9,
            dp_bandwidth=50e9,
            ep_bandwidth=50e9,
        ),
    ),
}
