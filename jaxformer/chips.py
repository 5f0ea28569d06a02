"""Hardware facts in one table: peak FLOP/s per compute dtype and memory per chip, each with its source.

Read by MFU (the denominator: the chip's dense peak in the step's compute dtype, times the device
count), the planner (memory per device) and the benchmarks. A device JAX names that is not in the
table (a CPU, a new chip) gets its peak from a matmul probe in the compute dtype on that device;
`train.peak_flops` overrides both.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import time

import jax
import jax.numpy as jnp

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator: dense (no sparsity) peak FLOP/s and memory."""

    name: str
    bfloat16: float  # bfloat16 inputs, float32 accumulation
    float32: float | None  # float32 matmuls at JAX's default precision (TF32 on NVIDIA); None: not published
    memory_bytes: float
    bandwidth: float  # memory bytes/s: a batch-1 decoding step reads every weight once at best
    source: str

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for matmuls in `dtype` ("bfloat16" or "float32"; float16 runs at the bfloat16 rate)."""
        if dtype == "float32" and self.float32 is not None:
            return self.float32
        return self.bfloat16


_NVIDIA = "NVIDIA datasheet"
_TPU = "Google Cloud TPU documentation, system architecture"

# (pattern searched in jax.Device.device_kind, chip); first match wins, so the specific names come first.
CHIPS: tuple[tuple[str, Chip], ...] = (
    (r"H100.*PCIe", Chip("H100 PCIe", 756e12, 378e12, 80e9, 2e12, f"{_NVIDIA} (H100 PCIe)")),
    (r"H100 NVL", Chip("H100 NVL", 835e12, 418e12, 94e9, 3.9e12, f"{_NVIDIA} (H100 NVL)")),
    (r"H100", Chip("H100 SXM", 989e12, 494.7e12, 80e9, 3.35e12, f"{_NVIDIA} (H100 SXM5)")),
    (r"GH200", Chip("GH200", 989e12, 494.7e12, 96e9, 4e12, f"{_NVIDIA} (GH200)")),
    (r"H200", Chip("H200", 989e12, 494.7e12, 141e9, 4.8e12, f"{_NVIDIA} (H200 SXM)")),
    (r"A100.*80GB", Chip("A100 80GB", 312e12, 156e12, 80e9, 2.039e12, f"{_NVIDIA} (A100)")),
    (r"A100", Chip("A100 40GB", 312e12, 156e12, 40e9, 1.555e12, f"{_NVIDIA} (A100)")),
    (r"L4\b", Chip("L4", 121e12, 60e12, 24e9, 3e11, f"{_NVIDIA} (L4)")),
    (r"TPU v4", Chip("TPU v4", 275e12, None, 32 * GiB, 1.2e12, f"{_TPU} (v4)")),
    (r"TPU v5 ?lite|TPU v5e", Chip("TPU v5e", 197e12, None, 16 * GiB, 8.19e11, f"{_TPU} (v5e)")),
    (r"TPU v5p|TPU v5$", Chip("TPU v5p", 459e12, None, 95 * GiB, 2.765e12, f"{_TPU} (v5p)")),
    (r"TPU v6 ?lite|TPU v6e", Chip("TPU v6e", 918e12, None, 32 * GiB, 1.64e12, f"{_TPU} (v6e Trillium)")),
)

# Links a chip's collectives run on, bytes/s one way a chip: (within a host or slice, across hosts,
# source). NVIDIA: NVLink 4 (900 GB/s both ways) in a host, one 400 Gb/s NIC a GPU between hosts
# (DGX H100/H200); A100: NVLink 3 (600 GB/s), one 200 Gb/s NIC a GPU. TPU: the slice's ICI a chip
# (v5p 4,800 Gbps, v5e 1,600, v6e 3,200, v4 2,400), no hosts' network inside a slice.
LINKS: dict[str, tuple[float, float, str]] = {
    "H100 SXM": (450e9, 50e9, f"{_NVIDIA} (H100 SXM5, DGX H100)"),
    "H200": (450e9, 50e9, f"{_NVIDIA} (H200 SXM, DGX H200)"),
    "A100 80GB": (300e9, 25e9, f"{_NVIDIA} (A100, DGX A100)"),
    "A100 40GB": (300e9, 25e9, f"{_NVIDIA} (A100, DGX A100)"),
    "TPU v4": (300e9, 300e9, f"{_TPU} (v4)"),
    "TPU v5e": (200e9, 200e9, f"{_TPU} (v5e)"),
    "TPU v5p": (600e9, 600e9, f"{_TPU} (v5p)"),
    "TPU v6e": (400e9, 400e9, f"{_TPU} (v6e Trillium)"),
}


def lookup(device_kind: str) -> Chip | None:
    """The table's chip for a `jax.Device.device_kind` (e.g. "NVIDIA H100 80GB HBM3"), or None."""
    return next((chip for pattern, chip in CHIPS if re.search(pattern, device_kind)), None)


def measure_peak_flops(dtype: str = "float32", n: int = 2048, repeats: int = 5, min_seconds: float = 0.0) -> float:
    """FLOP/s of an n x n matmul in `dtype` on the default device: the best of `repeats` timed runs, or
    of as many as fill `min_seconds` (a probe of achievable peak; the best, since a shared machine
    only ever slows a run down, and a CPU may take a while to reach its full clock)."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    best, start, runs = math.inf, time.perf_counter(), 0
    while runs < repeats or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best, runs = min(best, time.perf_counter() - t0), runs + 1
    return 2 * n**3 / best


def peak_flops(dtype: str, override: float = 0.0, min_seconds: float = 0.0) -> tuple[float, str]:
    """(peak FLOP/s of one device for matmuls in `dtype`, where the number comes from).

    `override` (train.peak_flops) if set; else the table's entry for this device; else a matmul
    probe in `dtype` on it (CPUs and chips the table does not know), measured once per process
    unless `min_seconds` asks for a longer one.
    """
    if override:
        return override, "train.peak_flops"
    kind = jax.devices()[0].device_kind
    chip = lookup(kind)
    if chip is not None:
        return chip.peak(dtype), f"{chip.name} {dtype} dense peak, {chip.source}"
    probe = _probe(kind, dtype) if not min_seconds else measure_peak_flops(dtype, min_seconds=min_seconds)
    return probe, f"{dtype} matmul probe on {kind}"


@functools.cache
def _probe(device_kind: str, dtype: str) -> float:
    """The probe, once per process and device kind: every training run in a process (a sweep's trials,
    a notebook's runs) shares it instead of spending ~1 s of CPU on six 2048^3 matmuls each."""
    return measure_peak_flops(dtype)


def device_memory_bytes() -> float | None:
    """Memory of one device: the table's, or what the runtime reports (None on CPU)."""
    device = jax.devices()[0]
    chip = lookup(device.device_kind)
    if chip is not None:
        return chip.memory_bytes
    stats = device.memory_stats() or {}
    return stats.get("bytes_limit")
