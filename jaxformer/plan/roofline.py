"""The roofline: a lower bound on a step's time from its FLOPs and the bytes it moves, per chip, and the
ceilings on tokens/s and MFU that bound implies."""

from __future__ import annotations

import math

from jaxformer import chips


def roofline(
    chip: chips.Chip, dtype: str, flops: float, model_flops: float, accessed: float, devices: int, tokens: int
) -> dict[str, float]:
    """The larger of compute time (FLOPs / the chip's dense peak in `dtype`) and memory time (bytes
    accessed / the chip's bandwidth), per device, and what follows at that bound.

    Args:
        chip: the chip (its peak FLOP/s and memory bandwidth).
        dtype: the compute dtype ("bfloat16", "float32").
        flops: XLA's FLOPs per device and step (NaN: none, a deviceless GPU compile).
        model_flops: the model's FLOPs per step, all devices (3 x forward, as MFU counts them).
        accessed: bytes accessed per device and step.
        devices: the number of devices.
        tokens: the tokens of a global batch.

    Returns:
        compute_seconds, memory_seconds, step_seconds (the bound), tokens_per_second and mfu_ceiling, as
        `Plan` names them.
    """
    peak_flops = chip.peak(dtype)
    # XLA's cost analysis counts a loop's body once (scan_layers): never below the model's own count.
    compute = max(flops if math.isfinite(flops) else 0.0, model_flops / devices) / peak_flops
    memory = accessed / chip.bandwidth
    bound = max(compute, memory)
    return dict(
        compute_seconds=compute, memory_seconds=memory, step_seconds=bound, tokens_per_second=tokens / bound,
        mfu_ceiling=model_flops / (devices * peak_flops * bound),
    )  # fmt: skip
