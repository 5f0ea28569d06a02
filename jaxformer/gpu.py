"""NVIDIA GPUs from any machine: XLA's own GPU compiler for H100s, H200s and A100s, without a GPU.

`pip install jaxformer[gpu-plan]` installs JAX's CUDA plugin (the compiler), ptxas and cuDNN (3.8 GB on
disk, 2.2 GB of it NVIDIA libraries). On a machine without a GPU, `jax.experimental.topologies` then
gives compile-only CUDA devices described by
a `GpuTargetConfigProto` (XLA's description of a GPU: cores, memory, compute capability, cuDNN
version; the ones shipped in `gpu_targets/`), and `jit(...).lower(...).compile()` runs XLA's GPU
compiler for them ("deviceless"): its fusions, its scheduler, cuDNN's fused attention. That is what
`jaxformer plan --target gpu-h100:1x8` reports from. Nothing is autotuned without a device.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import pathlib

from jaxformer.config import ConfigError

# Our name of a GPU -> (the chip table's name, XLA's description of it in gpu_targets/).
SPECS = {
    "h100": ("H100 SXM", "h100_sxm.txtpb"),
    "h200": ("H200", "h200.txtpb"),
    "a100-40g": ("A100 40GB", "a100_sxm_40.txtpb"),
    "a100-80g": ("A100 80GB", "a100_sxm_80.txtpb"),
}


def has_gpu_compiler() -> bool:
    """Whether JAX's CUDA plugin (the optional `gpu-plan` extra, or a CUDA install of JAX: CUDA 12's
    plugin, or CUDA 13's as jax 0.11's CUDA images have) is here."""
    return any(importlib.util.find_spec(f"jax_cuda{v}_plugin") is not None for v in (12, 13))


def nvidia_gpus_here() -> bool:
    """Whether this machine has an NVIDIA driver with a device (what the CUDA runtime would open)."""
    return os.path.exists("/proc/driver/nvidia/version") or bool(glob.glob("/dev/nvidia[0-9]*"))


def spec_text(name: str) -> str:
    """The `GpuTargetConfigProto` text of one of `SPECS` ("h100")."""
    return (pathlib.Path(__file__).parent / "gpu_targets" / SPECS[name][1]).read_text()


def topology_devices(name: str, hosts: int, per_host: int) -> list:
    """Compile-only CUDA devices: `hosts` machines of `per_host` GPUs `name` ("h100"), one device each."""
    if not has_gpu_compiler():
        raise ConfigError(
            f"--target gpu-{name}: XLA's GPU compiler is not installed: pip install 'jaxformer[gpu-plan]'"
        )
    from jax.experimental import topologies

    try:  # partitions x hosts x GPUs a host
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=spec_text(name), topology=f"1x{hosts}x{per_host}"
        )
    except Exception as e:  # the plugin's own message says what it could not read
        raise ConfigError(f"--target gpu-{name}:{hosts}x{per_host}: the CUDA plugin refuses it ({e})") from None
    return list(topology.devices)
