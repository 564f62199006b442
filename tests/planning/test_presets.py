"""The published configurations the planner knows by name (fpipe/planning/_presets.py)."""

from __future__ import annotations

from fpipe.planning._cost_model import GIB, layer_parameters, model_parameters
from fpipe.planning._presets import PRESETS


def test_deepseek_v3_has_its_published_parameters() -> None:
    """671B in all, 37B active (the DeepSeek-V3 report's Table 1; the planner counts matmuls,
    the embedding and the head, not the norms: 37.55B). A dense layer is MLA (187.1M) and a
    SwiGLU of width 18432; a MoE layer MLA, a router and 257 experts of 3 x 7168 x 2048."""
    preset = PRESETS["deepseek-v3"]
    total, active = model_parameters(preset.model)
    assert round(total / 1e9) == 671 and round(active / 1e9, 2) == 37.55
    mla, expert = 187_105_280, 3 * 7168 * 2048
    assert layer_parameters(preset.model, 2) == (mla + 3 * 7168 * 18432,) * 2 + (0.0,)
    assert layer_parameters(preset.model, 3) == (
        mla + 7168 * 256 + 257 * expert,
        mla + 7168 * 256 + 9 * expert,
        256 * expert,
    )
    device = preset.device
    assert (device.flops, device.memory, device.ep_bandwidth) == (0.4 * 990e12, 80 * GIB, 50e9)
    assert (device.tp, device.dp, device.ep) == (1, 1, 1)  # the layout is the user's
