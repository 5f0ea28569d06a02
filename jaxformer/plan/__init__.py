"""Plan before you launch: compile the training step ahead of time for the configured mesh and
report, per device, what it holds and whether it fits.

Nothing is allocated: the state is abstract (shapes, dtypes and shardings), and `jit(...).lower(...)
.compile()` runs XLA's real partitioner and scheduler for the mesh. Two kinds of devices:

- a TPU slice (`--target tpu-v5p:4x4x4`, any topology libtpu names): with `jaxformer[tpu]` installed,
  libtpu's compile-only devices of that slice, on any machine; the TPU compiler itself decides the
  buffers, so the bytes are the slice's own.
- NVIDIA GPUs (`--target gpu-h100:1x8`, hosts x GPUs a host; gpu-h200, gpu-a100-40g, gpu-a100-80g):
  with `jaxformer[gpu-plan]` installed, XLA's GPU compiler for compile-only CUDA devices of XLA's
  description of that GPU, on any machine (`jaxformer.gpu`); cuDNN's fused attention is in the step.
  That compiler gives no cost analysis without a device: the FLOPs are the model's, and the bytes
  accessed are counted from the compiled program (`bytes_moved`: each op's operands read and result
  written once, a loop's body once a trip).
- fake CPU devices (`--devices 64`, or a GPU target without the GPU compiler: N of them with the
  chip's memory and peak from the chip table). XLA's CPU compiler decides the buffers; a GPU's
  compiler fuses and schedules differently, so read those figures as the program's shape, not a
  promise to the byte.

With a chip (a target, or a table entry for the devices), the plan adds a roofline lower bound on
the step time (the larger of FLOPs / peak and bytes accessed / memory bandwidth, both per chip from
the compiler's cost analysis, or the model's FLOPs and the bytes counted from the compiled program
where it gives none), the tokens/s it implies and the MFU it leaves as a ceiling.

The figures of each compiled step are kept on disk (`cache_dir()`): the TPU compiler takes from
half a minute to two minutes per step of a real model, and the same plan again reads them back.

    jaxformer plan --config experiments/paper_base_en_de.py --target tpu-v4:4x4x8
    jaxformer plan --config experiments/gpt2_1p3b.py --target gpu-h100:1x8
    jaxformer plan --config experiments/paper_base_en_de.py --devices 8 --set mesh.fsdp=8 --device-memory 80GB
"""

from jaxformer.plan.compile import Compiled, abstract_batch, cache_dir, lower_train_step, with_shardings
from jaxformer.plan.hlo import (
    COLLECTIVES,
    DTYPE_BYTES,
    HLO_INSTRUCTION,
    HLO_PLUMBING,
    HLO_SLICING,
    KERNEL_CALL,
    bytes_moved,
    collective_bytes,
    cudnn_calls,
    hlo_ops,
    kernel_calls,
    parse_hlo,
    shape_bytes,
)
from jaxformer.plan.planner import plan
from jaxformer.plan.report import Plan
from jaxformer.plan.roofline import roofline
from jaxformer.plan.search import _largest_batch as _largest_batch  # the search's own tests call it
from jaxformer.plan.search import _refused_bytes as _refused_bytes
from jaxformer.plan.targets import Target, parse_bytes, parse_target

__all__ = [
    "COLLECTIVES",
    "DTYPE_BYTES",
    "HLO_INSTRUCTION",
    "HLO_PLUMBING",
    "HLO_SLICING",
    "KERNEL_CALL",
    "Compiled",
    "Plan",
    "Target",
    "abstract_batch",
    "bytes_moved",
    "cache_dir",
    "collective_bytes",
    "cudnn_calls",
    "hlo_ops",
    "kernel_calls",
    "lower_train_step",
    "parse_bytes",
    "parse_hlo",
    "parse_target",
    "plan",
    "roofline",
    "shape_bytes",
    "with_shardings",
]
