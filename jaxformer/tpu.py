"""TPU pod slices from any machine: libtpu's compiler for a named topology, and its runtime kept
out of the way where there is no chip.

`pip install jaxformer[tpu]` installs libtpu, Google's TPU runtime and compiler. On a machine
without a TPU, `jax.experimental.topologies` still gives compile-only devices of any slice
(`v4:4x4x8`, `v5p:4x4x4`, `v5e:16x16`, `v6e:8x8`): `jit(...).lower(...).compile()` then runs the
real TPU compiler for them, which is what `jaxformer plan --target tpu-...` reports from.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import math
import os
import pathlib
import pkgutil
import re

from jaxformer.config import ConfigError


def has_libtpu() -> bool:
    """Whether libtpu (the optional `tpu` extra) is installed."""
    return importlib.util.find_spec("libtpu") is not None


def _tpu_chips_here() -> int:
    """TPU chips on this machine's PCI bus, as JAX itself counts them. That count lives in a private
    module of JAX's, which a release may move: then any device with Google's PCI vendor id counts."""
    try:
        from jax._src import hardware_utils

        return hardware_utils.num_available_tpu_chips_and_device_id()[0]
    except (ImportError, AttributeError):
        vendors = glob.glob("/sys/bus/pci/devices/*/vendor")
        return sum(pathlib.Path(v).read_text().strip() == "0x1ae0" for v in vendors)


def compile_only_without_chips() -> None:
    """With a compiler installed for chips this machine lacks (libtpu, or JAX's CUDA plugin without an
    NVIDIA GPU, as `plan --target` uses them), run JAX on the CPU.

    Left alone, JAX tries those runtimes first on every start: libtpu prints several lines of errors
    about unknown worker hostnames, the CUDA plugin a "Unable to load CUDA" traceback, before JAX
    falls back to the CPU. Topologies for compiling need only the compilers, which this leaves in
    place. A chip here, another plugin (JAX then chooses), or JAX_PLATFORMS set by the user wins;
    call before JAX starts a backend. Sets JAX_PLATFORMS too, for subprocesses.
    """
    from jaxformer import gpu

    if "JAX_PLATFORMS" in os.environ:
        return
    cuda = gpu.has_gpu_compiler()
    if (has_libtpu() and _tpu_chips_here()) or (cuda and gpu.nvidia_gpus_here()):
        return  # a chip to run on
    if not has_libtpu() and not cuda:
        return  # nothing that would try
    plugins = {e.name for e in importlib.metadata.entry_points(group="jax_plugins")}
    if spec := importlib.util.find_spec("jax_plugins"):
        plugins |= {m.name for m in pkgutil.iter_modules(spec.submodule_search_locations or [])}
    if any("cuda" not in name for name in plugins):
        return  # another plugin (ROCm, Metal): let JAX choose
    import jax

    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")


# Whether this process has loaded libtpu for compile-only devices: JAX's profiler then crashes the
# process (a segmentation fault in jax.profiler.start_trace, libtpu 0.0.52), so observe.Profiler stands down.
compile_only_loaded = False


def accelerator_type(topology: str) -> str | None:
    """Cloud TPU's name of a slice: "v4:2x2x1" -> "v4-8", "v5p:4x4x4" -> "v5p-128" (two TensorCores
    a chip, counted), "v5e:2x2" -> "v5litepod-4", "v6e:8x8" -> "v6e-64" (chips); None if unread."""
    m = re.fullmatch(r"(v\d+[a-z]*):(\d+(?:x\d+)*)", topology)
    if not m:
        return None
    version, chips = m.group(1), math.prod(int(n) for n in m.group(2).split("x"))
    if version in ("v2", "v3", "v4", "v5p"):
        return f"{version}-{2 * chips}"
    return f"v5litepod-{chips}" if version == "v5e" else f"{version}-{chips}"


def topology_devices(name: str) -> list:
    """The compile-only TPU devices of a slice, e.g. "v5e:2x2" (4 chips) or "v5p:4x4x4" (64 chips)."""
    if not has_libtpu():
        raise ConfigError(f"--target tpu-{name}: the TPU compiler is not installed: pip install 'jaxformer[tpu]'")
    from jax.experimental import topologies

    if not _tpu_chips_here():  # compiling only: no chip to guard, no pod to find
        global compile_only_loaded
        compile_only_loaded = True
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # else one process at a time, by a lock file
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # else libtpu logs errors looking for workers
        if kind := accelerator_type(name):  # else libtpu warns it "could not determine TPU accelerator type"
            os.environ.setdefault("TPU_ACCELERATOR_TYPE", kind)
    try:  # one device per chip, as JAX runs chips of two TensorCores (v4, v5p): "megacore"
        return list(topologies.get_topology_desc(name, "tpu", chip_config_name="megacore").devices)
    except Exception:  # chips of one core (v5e, v6e) have no megacore configuration
        pass
    try:
        return list(topologies.get_topology_desc(name, "tpu").devices)
    except Exception as e:  # libtpu's own message says what it expected
        raise ConfigError(f"--target tpu-{name}: libtpu does not know this topology ({e})") from None
