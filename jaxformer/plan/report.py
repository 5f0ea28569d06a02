"""What a plan reports (`Plan`): per-device bytes of the compiled training step, the roofline's
figures, the largest batch that fits, and the table `jaxformer plan` prints."""

from __future__ import annotations

import dataclasses
import math

from jaxformer import observe


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per-device bytes of one compiled training step, and what follows for a device memory.

    Attributes:
        devices: the number of devices planned for.
        mesh: the mesh's axis sizes, by name.
        batch_size: the global batch the figures are for.
        parameters: this device's shards of the trained parameters (LoRA: the adapters)
        optimizer_state: this device's shards of the optimizer state, bytes.
        gradients: the parameters' size: float32 gradients, sharded alike
        activations: XLA's temporaries less the gradients: activations kept for the backward pass, workspace
        arguments: XLA's memory analysis of the compiled step, per device
        outputs: the step's outputs, bytes per device.
        aliased: outputs written into donated arguments
        temporaries: XLA's temporaries, bytes per device.
        code: the compiled program, bytes.
        peak: arguments + outputs - aliased + temporaries + code
        flops_per_device: XLA's cost analysis of the partitioned step (NaN: none, a deviceless GPU compile)
        model_flops: the model's FLOPs per step, all devices (3 x forward, as MFU counts them)
        device_memory: the memory of one device, bytes (None: not known).
        fits: whether the peak fits in device_memory (None: not known).
        largest_batch: the largest batch (a multiple of the batch shards) that fits
        refused_batch: the smallest batch the search found not to fit (None: none tried)
        target: "tpu-v5p:4x4x4", "gpu-h100x8"; None: this process's devices
        chip: the chip table's name, when the devices are a chip it knows
        eval_peak: the evaluation step's peak bytes per device, same batch
        bytes_accessed: per device and step, XLA's cost analysis (else counted from the compiled program)
        tokens_per_step: predicted (target) tokens of a global batch
        compute_seconds: flops_per_device / the chip's dense peak in the compute dtype
        memory_seconds: bytes_accessed / the chip's memory bandwidth
        step_seconds: roofline lower bound: the larger of the two
        tokens_per_second: at that bound: an upper bound
        mfu_ceiling: model FLOPs / (devices x peak x step_seconds)
        compile_seconds: all compiles of this plan (train, eval, the batches tried)
        cached_steps: steps whose figures were read from the plan cache, not compiled
        requested_batch: the configured batch; batch_size differs when it did not compile
        over_memory: the TPU compiler's refusal of the configured batch
        attention_kernels: fused attention kernels in the training step: splash (TPU), cuDNN's (GPU)
        frozen: LoRA: this device's shards of the frozen base, in the compute dtype (or int8)
        frozen_storage: LoRA: how the frozen base is stored ("bfloat16"; "int8 + float32 scales")
        collectives: {kind: (bytes, ops)} per device of the step's collectives (MoE under expert
            parallelism; None: not counted)
        optimizer_on_host: train.offload_optimizer: the optimizer state waits in host memory
        host_arguments: the compiled step's arguments in host memory, bytes per device (offloaded state)
        host_outputs: its outputs in host memory, bytes per device
        host_temporaries: its temporaries in host memory, bytes per device (offloaded activations)
    """

    devices: int
    mesh: dict
    batch_size: int
    parameters: int  # this device's shards of the trained parameters (LoRA: the adapters)
    optimizer_state: int
    gradients: int  # the parameters' size: float32 gradients, sharded alike
    activations: int  # XLA's temporaries less the gradients: activations kept for the backward pass, workspace
    arguments: int  # XLA's memory analysis of the compiled step, per device
    outputs: int
    aliased: int  # outputs written into donated arguments
    temporaries: int
    code: int
    peak: int  # arguments + outputs - aliased + temporaries + code
    flops_per_device: float  # XLA's cost analysis of the partitioned step (NaN: none, a deviceless GPU compile)
    model_flops: float  # the model's FLOPs per step, all devices (3 x forward, as MFU counts them)
    device_memory: float | None = None
    fits: bool | None = None
    largest_batch: int | None = None  # the largest batch (a multiple of the batch shards) that fits
    refused_batch: int | None = None  # the smallest batch the search found not to fit (None: none tried)
    target: str | None = None  # "tpu-v5p:4x4x4", "gpu-h100x8"; None: this process's devices
    chip: str | None = None  # the chip table's name, when the devices are a chip it knows
    eval_peak: int | None = None  # the evaluation step's peak bytes per device, same batch
    bytes_accessed: float | None = None  # per device and step, XLA's cost analysis (else counted from the program)
    tokens_per_step: int = 0  # predicted (target) tokens of a global batch
    compute_seconds: float | None = None  # flops_per_device / the chip's dense peak in the compute dtype
    memory_seconds: float | None = None  # bytes_accessed / the chip's memory bandwidth
    step_seconds: float | None = None  # roofline lower bound: the larger of the two
    tokens_per_second: float | None = None  # at that bound: an upper bound
    mfu_ceiling: float | None = None  # model FLOPs / (devices x peak x step_seconds)
    compile_seconds: float = 0.0  # all compiles of this plan (train, eval, the batches tried)
    cached_steps: int = 0  # steps whose figures were read from the plan cache, not compiled
    requested_batch: int | None = None  # the configured batch; batch_size differs when it did not compile
    over_memory: str | None = None  # the TPU compiler's refusal of the configured batch
    attention_kernels: int = 0  # fused attention kernels in the training step: splash (TPU), cuDNN's (GPU)
    # MoE under expert parallelism (mesh.expert > 1): the training step's collectives, {kind: (bytes per
    # device, ops)} from the compiled program (a loop's body once), the all-to-all among them carrying
    # tokens to their experts and back where the compiler chose it; None: not counted
    collectives: dict | None = None
    frozen: int = 0  # LoRA: this device's shards of the frozen base, in the compute dtype (or int8)
    frozen_storage: str = ""  # LoRA: how the frozen base is stored ("bfloat16"; "int8 + float32 scales")
    optimizer_on_host: bool = False  # train.offload_optimizer: the optimizer state waits in host memory
    host_arguments: int = 0  # the compiled step's bytes in host memory, per device (offloaded state, activations)
    host_outputs: int = 0
    host_temporaries: int = 0

    def as_dict(self) -> dict:
        """The plan's fields, a figure nobody gave (NaN: XLA's FLOPs from a deviceless GPU compile) as None.

        Returns:
            field -> value.
        """
        nan = lambda v: isinstance(v, float) and math.isnan(v)
        return {k: None if nan(v) else v for k, v in dataclasses.asdict(self).items()}

    def table(self) -> str:
        """The plan as the table `jaxformer plan` prints: each figure per device, with its share of memory.

        Returns:
            The table, one string of lines.
        """
        gb = lambda b: f"{b / 1e9:9.3f} GB"
        share = lambda b: f"   {100 * b / self.device_memory:5.1f}% of memory" if self.device_memory else ""
        mesh = " ".join(f"{k}={v}" for k, v in self.mesh.items())
        where = f"{self.target} ({self.chip}): " if self.target else ""
        lines = []
        if self.over_memory:
            lines.append(f"batch {self.requested_batch} does NOT fit: {self.over_memory}")
            lines.append(f"shown: the largest batch that fits, {self.batch_size}")
        lines += [
            f"{where}mesh {mesh} over {self.devices} devices, global batch {self.batch_size}; per device:",
            *(
                [f"  frozen base        {gb(self.frozen)}   (LoRA: not trained, {self.frozen_storage})"]
                if self.frozen
                else []
            ),
            f"  {'adapters' if self.frozen else 'parameters':19}{gb(self.parameters)}",
            f"  optimizer state    {gb(self.optimizer_state)}{'   (in host memory)' if self.optimizer_on_host else ''}",
            f"  gradients          {gb(self.gradients)}   (the parameters' size)",
            f"  activations        {gb(self.activations)}   (XLA's temporaries less the gradients)",
            f"  compiled step      arguments {self.arguments / 1e9:.3f} GB, outputs {self.outputs / 1e9:.3f} GB "
            f"(aliased to donated arguments {self.aliased / 1e9:.3f} GB), temporaries {self.temporaries / 1e9:.3f} GB, "
            f"code {self.code / 1e9:.3f} GB",
            f"  peak               {gb(self.peak)}{share(self.peak)}",
        ]
        if self.host_arguments or self.host_outputs or self.host_temporaries:
            lines.append(
                f"  host memory        arguments {self.host_arguments / 1e9:.3f} GB, outputs "
                f"{self.host_outputs / 1e9:.3f} GB, temporaries {self.host_temporaries / 1e9:.3f} GB (not in the "
                "device's peak, which is at least the compiler's own estimate with offload)"
            )
        if self.eval_peak is not None:
            lines.append(f"  eval step peak     {gb(self.eval_peak)}{share(self.eval_peak)}")
        if self.attention_kernels:
            tpu = (self.chip or "").startswith("TPU")
            kind = "splash kernels" if tpu else "cuDNN fused attention"
            lines.append(f"  attention          {kind}: {self.attention_kernels} {'Pallas' if tpu else 'custom'} calls")
        if self.collectives is not None:
            moved = ", ".join(f"{kind} {b / 1e9:.4f} GB ({n} ops)" for kind, (b, n) in self.collectives.items() if n)
            lines.append(f"  collectives        per step: {moved or 'none'} (a loop's body once)")
        n, fmt = self.devices, lambda x: observe.value("flops", x)
        flops = lambda per_device: f"{fmt(per_device)} per device, {fmt(per_device * n)} in all"
        costed = math.isfinite(self.flops_per_device)
        xla = f"XLA's {flops(self.flops_per_device)}" if costed else "XLA's: none (no cost analysis without a GPU)"
        lines.append(f"FLOPs per step: {xla}; the model's {flops(self.model_flops / n)}")
        if self.step_seconds is not None:
            ceilings = {"tokens_per_s": self.tokens_per_second, "mfu": self.mfu_ceiling}
            accessed = "accessed" if costed else "moved, counted from the compiled program"
            lines.append(
                f"roofline: step >= {self.step_seconds * 1e3:.2f} ms (compute {self.compute_seconds * 1e3:.2f} ms, "
                f"memory {self.memory_seconds * 1e3:.2f} ms for {self.bytes_accessed / 1e9:.3f} GB {accessed}); "
                f"ceilings: {observe.line(ceilings, ('tokens_per_s', 'mfu'))}"
            )
        if self.device_memory is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"device memory {self.device_memory / 1e9:.3f} GB: batch {self.requested_batch} {verdict}")
            largest = {None: "not searched (--no-largest)", 0: "none: even the smallest batch does not fit"}
            found = largest.get(self.largest_batch, self.largest_batch)
            bound = f" (batch {self.refused_batch} does not)" if self.largest_batch and self.refused_batch else ""
            lines.append(f"largest global batch that fits: {found}{bound}")
        cached = f"; {self.cached_steps} steps read from the plan cache" if self.cached_steps else ""
        lines.append(f"compiled in {self.compile_seconds:.1f} s{cached}")
        return "\n".join(lines)
