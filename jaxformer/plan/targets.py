"""What a plan is for: a TPU slice's or GPU hosts' compile-only devices, or fake CPUs (`--target`),
and a device's memory as `--device-memory` gives it."""

from __future__ import annotations

import dataclasses
import re

from jaxformer import chips
from jaxformer.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Target:
    """What to plan for: `count` devices of `chip`: a TPU slice's or GPU hosts' compile-only devices,
    or fake CPUs.

    Attributes:
        name: as given: "tpu-v5p:4x4x4", "gpu-h100:2x8"
        chip: the chip's row of the chip table (memory, peak, bandwidth).
        count: the number of devices.
        topology: the libtpu topology of a TPU target ("v5p:4x4x4")
        gpu: the GPU XLA's GPU compiler compiles for (a key of gpu.SPECS: "h100")
        hosts: a GPU target's machines, count // hosts GPUs each
        note: why a GPU target is planned on fake CPUs
    """

    name: str  # as given: "tpu-v5p:4x4x4", "gpu-h100:2x8"
    chip: chips.Chip
    count: int
    topology: str | None = None  # the libtpu topology of a TPU target ("v5p:4x4x4")
    gpu: str | None = None  # the GPU XLA's GPU compiler compiles for (a key of gpu.SPECS: "h100")
    hosts: int = 1  # a GPU target's machines, count // hosts GPUs each
    note: str | None = None  # why a GPU target is planned on fake CPUs

    @property
    def fake_cpus(self) -> bool:
        """Planned on this process's own CPU devices, `count` of them."""
        return self.topology is None and self.gpu is None

    def devices(self) -> list | None:
        """The compile-only devices of the TPU slice or GPU hosts (None: this process's own, fake CPUs).

        Returns:
            devices (list | None): the compile-only devices, or None.
        """
        from jaxformer import gpu, tpu

        if self.gpu:
            return gpu.topology_devices(self.gpu, self.hosts, self.count // self.hosts)
        return tpu.topology_devices(self.topology) if self.topology else None


def _gpu_target(name: str, chip: chips.Chip, hosts: int, per_host: int) -> Target:
    """XLA's GPU compiler for `chip` where it is installed and describes it; else fake CPUs, saying why."""
    from jaxformer import gpu

    count = hosts * per_host
    key = next((k for k, (chip_name, _) in gpu.SPECS.items() if chip_name == chip.name), None)
    if key is not None and gpu.has_gpu_compiler():
        return Target(name, chip, count, gpu=key, hosts=hosts)
    why = (
        "XLA's GPU compiler is not installed (pip install 'jaxformer[gpu-plan]')"
        if key is not None
        else f"no description of the {chip.name} for XLA's GPU compiler (it has {', '.join(gpu.SPECS)})"
    )
    note = f"{name}: {why}: planning on {count} fake CPU devices with the {chip.name}'s memory, by the CPU compiler"
    return Target(name, chip, count, hosts=hosts, note=note)


def parse_target(name: str) -> Target:
    """ "tpu-v4:4x4x8" (any topology libtpu names: v4, v5e, v5p, v6e), "gpu-h100:4x8" (4 hosts of 8
    GPUs: h100, h200, a100-40g, a100-80g), or "gpu-CHIPxN" (N GPUs of one host, any GPU of the chip table).

    Args:
        name: the target, as `--target` takes it.

    Returns:
        The `Target`.

    Raises:
        ConfigError: an unknown chip or topology, named.
    """
    if name.startswith("tpu-"):
        from jaxformer import tpu

        topology = name[len("tpu-") :]
        devices = tpu.topology_devices(topology)
        chip = chips.lookup(devices[0].device_kind)
        if chip is None:
            raise ConfigError(f"--target {name}: the chip table has no entry for {devices[0].device_kind!r}")
        return Target(name, chip, len(devices), topology)
    if m := re.fullmatch(r"gpu-([\w-]+):(\d+)x(\d+)", name, re.IGNORECASE):
        from jaxformer import gpu

        hosts, per_host = int(m.group(2)), int(m.group(3))
        if m.group(1).lower() not in gpu.SPECS or not hosts or not per_host:
            raise ConfigError(
                f"--target {name!r}: say gpu-GPU:HOSTSxGPUS (gpu-h100:1x8) with GPU one of {list(gpu.SPECS)}"
            )
        chip = next(c for _, c in chips.CHIPS if c.name == gpu.SPECS[m.group(1).lower()][0])
        return _gpu_target(name, chip, hosts, per_host)
    m = re.fullmatch(r"gpu-(.+)x(\d+)", name, re.IGNORECASE)
    chip = chips.lookup(m.group(1).upper()) if m else None
    if chip is None or chip.name.startswith("TPU") or not int(m.group(2)):
        known = ", ".join(c.name for _, c in chips.CHIPS if not c.name.startswith("TPU"))
        raise ConfigError(
            f"--target {name!r}: say tpu-TOPOLOGY (tpu-v5p:4x4x4), gpu-GPU:HOSTSxGPUS (gpu-h100:1x8) or gpu-CHIPxN "
            f"(gpu-h100x8); GPUs known: {known}"
        )
    return _gpu_target(name, chip, 1, int(m.group(2)))


def parse_bytes(text: str) -> float:
    """ "80GB", "80 GiB", "16G", "1.5e10" -> bytes (GB = 1e9, GiB = 2**30).

    Args:
        text: a size.

    Returns:
        Bytes.

    Raises:
        ConfigError: not a size.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\s*(?:([kmgt])(i?)b?|b?)\s*", text, re.IGNORECASE)
    if not m:
        raise ConfigError(f"--device-memory: cannot read {text!r} as a size (e.g. 80GB, 16GiB)")
    unit = m.group(2)
    scale = 1 if not unit else (1024 if m.group(3) else 1000) ** ("KMGT".index(unit.upper()) + 1)
    return float(m.group(1)) * scale
