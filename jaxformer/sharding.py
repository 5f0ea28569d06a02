"""Meshes, logical-axis rules, and the shardings of parameters, optimizer state and batches.

Every parameter names its axes where it is defined (`vocab`, `embed`, `heads`, `kv`,
`mlp`, `layers`); a rules table maps those names to the mesh axes `data`, `fsdp`,
`tensor`. The default table serves every strategy; the mesh shape picks it:

    data=8                  data parallel: parameters replicated, batch split 8 ways
    fsdp=8                  FSDP / ZeRO-3: parameters and optimizer state split on `embed`,
                            gathered layer by layer by XLA; batch split 8 ways
    data=4, tensor=2        Megatron tensor parallel inside pairs of devices: QKV and FFN-in
                            split by column (heads, mlp), output and FFN-out by row, embedding
                            and logits by vocabulary
    fsdp=4, tensor=2        both
    data=2, context=4       context parallel: each row's sequence split 4 ways (activations on
                            `length`), attention by ring (or all-gather) over the `context` axis
    data=2, expert=4        expert parallel (MoE): experts' kernels split 4 ways, batch split 8 ways
    stage=2, data=4         pipeline parallel: scanned stacks split by layer over 2 stages, the batch
                            run through them in micro-batches (`jaxformer.pipeline`)

Activations are constrained with the same names (`batch` for their leading axis, `heads`
and `vocab` for attention heads and logits), so XLA's partitioner sees one consistent plan.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxformer import distributed
from jaxformer.config import ConfigError, MeshConfig

MESH_AXES = ("stage", "data", "fsdp", "expert", "tensor", "context")
"""The mesh's axes, in its order."""
LOGICAL_AXES = (
    "batch", "length", "embed", "heads", "kv", "mlp", "vocab", "layers", "expert", "expert_batch", "latent"
)  # fmt: skip
"""The names parameters and activations give their dimensions; the rules map them to mesh axes."""
BATCH = ("data", "fsdp", "expert")  # the global batch is split over every axis that is not tensor parallel

# logical axis -> mesh axis (None: replicated). Unlisted names (kv) are replicated.
# Expert parallelism (mesh.expert > 1): the experts' kernels are split by expert, and the MoE layer
# sends tokens to their experts' devices and back by an all-to-all in a shard_map (`moe.*_expert_parallel`);
# `expert_batch` places the capacity dispatch's [B, E, P, D] slots where it is left to XLA's partitioner.
# Activations' sequence axis (`length`) is on `context`. An axis of size 1 (the default for both)
# changes nothing.
EXPERT = (("expert", "expert"), ("expert_batch", ("data", "fsdp")))
# Latent attention's up-projections [C, H, K] (`model.mla`): their latent axis C is FSDP's to split (their
# input axis is not `embed`), the heads tensor parallelism's; the down-projections [D, C] split on `embed`.
LATENT = (("latent", "fsdp"),)
CP = (("length", "context"),)
# Pipeline stages (mesh.stage > 1): a scanned stack's leading `layers` axis is split over `stage`, each
# stage holding a contiguous run of layers (`jaxformer.pipeline`); without stages (`rules_for`) it is
# left out, so that the layers axis stays unnamed in specs as before.
PP = (("layers", "stage"),)
RULES = {
    "dp": (("batch", BATCH), *EXPERT, *CP, *PP),
    "fsdp": (("batch", BATCH), ("embed", "fsdp"), *LATENT, *EXPERT, *CP, *PP),
    "tp": (("batch", BATCH), ("heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor"), *EXPERT, *CP, *PP),
    "fsdp_tp": (
        ("batch", BATCH),
        ("embed", "fsdp"),
        *LATENT,
        ("heads", "tensor"),
        ("mlp", "tensor"),
        ("vocab", "tensor"),
        *EXPERT,
        *CP,
        *PP,
    ),
}
"""The named rules tables (`mesh.rules`; "default" is fsdp_tp): logical axis -> mesh axis, axes or None."""
RULES["default"] = RULES["fsdp_tp"]  # axes of size 1 make it any of the others


def rules_for(cfg: MeshConfig) -> tuple:
    """The rules table of a mesh config (a named one or the user's own), checked for conflicts
    and completed: logical axes it does not name are replicated.

    Args:
        cfg: the mesh section (rules, custom_rules).

    Returns:
        ((logical axis, mesh axes or None), ...) naming every logical axis.

    Raises:
        ConfigError: a logical axis mapped twice, or to a mesh axis that does not exist.
    """
    rules = cfg.custom_rules if cfg.custom_rules is not None else RULES[cfg.rules]
    if cfg.custom_rules is None and cfg.stage == 1:
        rules = tuple(rule for rule in rules if rule not in PP)
    seen: dict[str, object] = {}
    for logical, target in rules:
        if logical in seen and seen[logical] != target:
            raise ConfigError(f"mesh.rules: logical axis {logical!r} maps to both {seen[logical]!r} and {target!r}")
        seen[logical] = target
        for axis in (target,) if isinstance(target, str) or target is None else target:
            if axis is not None and axis not in MESH_AXES:
                raise ConfigError(f"mesh.rules: {logical!r} maps to unknown mesh axis {axis!r} (axes: {MESH_AXES})")
    return tuple(rules) + tuple((name, None) for name in LOGICAL_AXES if name not in seen)


# ----------------------------------------------------------------------------- processes and meshes


def initialize_distributed(cfg: MeshConfig) -> None:
    """`jax.distributed.initialize` for multi-host runs (no-op on one process).

    Coordinator, process count and id come from the config or the environment
    (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); with none given on a
    TPU pod or under SLURM, JAX detects them itself (`mesh.distributed=true`).

    Args:
        cfg: the mesh section (coordinator_address, num_processes, process_id, distributed).
    """
    address = cfg.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not (address or cfg.distributed):
        return
    if jax.distributed.is_initialized():
        return
    num = cfg.num_processes or _env_int("JAX_NUM_PROCESSES")
    pid = cfg.process_id if cfg.process_id is not None else _env_int("JAX_PROCESS_ID")
    # Collectives between CPU devices of different processes need gloo; accelerators ignore it.
    # (Asking for the backend here would start it, which must wait until after initialize.)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    distributed.initialize(address, num, pid)  # a lost process is one line in the others (jaxformer.distributed)


def _env_int(name: str) -> int | None:
    return int(os.environ[name]) if name in os.environ else None


def _said(name: str, size: int) -> bool:
    """Whether messages name this axis: the stage, expert and context axes only when they are used."""
    return name not in ("stage", "expert", "context") or size != 1


def axis_sizes(mesh: jax.sharding.Mesh) -> dict[str, int]:
    """{axis: size} of a mesh as logs and reports say it (the stage, expert and context axes only when used).

    Args:
        mesh: the device mesh.

    Returns:
        {axis name: size}.
    """
    return {name: size for name, size in mesh.shape.items() if _said(name, size)}


def mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[int, int, int, int, int, int]:
    """(stage, data, fsdp, expert, tensor, context) with one -1 filled from the device count.

    Args:
        cfg: the mesh section (stage, data, fsdp, expert, tensor, context).
        num_devices: the devices the mesh spans.

    Returns:
        The six axis sizes, their product `num_devices`.

    Raises:
        ConfigError: more than one -1, or sizes that do not make `num_devices` (the fields named).
    """
    sizes = [cfg.stage, cfg.data, cfg.fsdp, cfg.expert, cfg.tensor, cfg.context]
    if sizes.count(-1) > 1:
        raise ConfigError("mesh: at most one of data, fsdp, tensor, expert may be -1 (fill)")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            fixed = " x ".join(f"{n}={s}" for n, s in zip(MESH_AXES, sizes, strict=True) if s != -1 and _said(n, s))
            raise ConfigError(f"mesh: {num_devices} devices are not divisible by the fixed axes' product {fixed}")
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        names = ", ".join(f"{n}={s}" for n, s in zip(MESH_AXES, sizes, strict=True) if _said(n, s))
        raise ConfigError(f"mesh: {names} makes {math.prod(sizes)} devices, but {num_devices} are available")
    return tuple(sizes)


def check_experts(mesh: jax.sharding.Mesh, cfg: MeshConfig, num_experts: int) -> None:
    """The expert axis, as the mesh resolved it (a fill, -1, is known only with the devices), divides
    the experts: Config checks a fixed mesh.expert, this the filled one.

    Args:
        mesh: the laid mesh.
        cfg: the mesh section, as the user gave it.
        num_experts: model.moe.num_experts (0: no MoE layers, nothing to check).

    Raises:
        ConfigError: naming mesh.expert and model.moe.num_experts.
    """
    ways = mesh.shape["expert"]
    if num_experts and num_experts % ways:
        asked = f"mesh.expert={cfg.expert}" + (f" fills to {ways}" if cfg.expert == -1 else "")
        raise ConfigError(f"mesh.expert: {asked}, which does not divide model.moe.num_experts={num_experts}")


def make_mesh(cfg: MeshConfig, devices=None) -> jax.sharding.Mesh:
    """A (stage, data, fsdp, expert, tensor, context) mesh of Auto axes over `devices` (default: all, every process).

    With `dcn_data` > 1 (several slices or hosts linked by a slower network), the data axis
    is split into an outer DCN part and an inner ICI part (`mesh_utils.create_hybrid_device_mesh`).

    Args:
        cfg: the mesh section.
        devices (Sequence[jax.Device] | None): the devices, or None for all of every process.

    Returns:
        The mesh, axes named `MESH_AXES`.

    Raises:
        ConfigError: `dcn_data` does not divide the data axis (and `mesh_shape`'s errors).
    """
    devices = jax.devices() if devices is None else list(devices)
    shape = mesh_shape(cfg, len(devices))
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    if cfg.dcn_data > 1:
        from jax.experimental import mesh_utils

        at = MESH_AXES.index("data")
        if shape[at] % cfg.dcn_data:
            raise ConfigError(f"mesh.dcn_data={cfg.dcn_data} does not divide mesh data={shape[at]}")
        ici = (*shape[:at], shape[at] // cfg.dcn_data, *shape[at + 1 :])
        dcn = tuple(cfg.dcn_data if i == at else 1 for i in range(len(shape)))
        grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
        return jax.sharding.Mesh(grid, MESH_AXES, axis_types=auto)
    if devices[0].platform == "tpu":  # laid out on the torus; an axis may take part of a physical one (8 of 4x4x4)
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        return jax.sharding.Mesh(grid, MESH_AXES, axis_types=auto)
    if len(devices) == jax.device_count():
        return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)
    return jax.sharding.Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=auto)


@contextlib.contextmanager
def use(mesh: jax.sharding.Mesh, rules: tuple):
    """Mesh and rules in effect: parameters created, steps traced and constraints applied under them.

    Args:
        mesh: the device mesh.
        rules: the logical-axis rules (`rules_for`).
    """
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


# ----------------------------------------------------------------------------- shardings


def param(rngs: nnx.Rngs, initializer, shape: tuple[int, ...], names: tuple[str | None, ...]) -> nnx.Param:
    """A float32 parameter annotated with logical axis names (sharded later, not at creation).

    Args:
        rngs: the initialisation keys.
        initializer (Callable): a `jax.nn.initializers` function (key, shape, dtype) -> array.
        shape: the parameter's shape.
        names: one logical axis name (or None) per dimension.

    Returns:
        The parameter.
    """
    annotated = nnx.with_partitioning(initializer, names, eager_sharding=False)
    return nnx.Param(annotated(rngs.params(), shape, jnp.float32))


def _ways(mesh, axes) -> int:
    """How many devices a dimension on mesh axis (or axes, or None) `axes` is split over."""
    return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))


def shard_counts(names: tuple[str | None, ...]) -> tuple[int, ...]:
    """How many ways the rules and mesh in effect split each logical axis (1s outside them): what a
    traced step divides a global shape by for the part one device holds.

    Args:
        names: one logical axis name (or None) per dimension.

    Returns:
        One count per name.
    """
    spec, mesh = activation_spec(names), jax.sharding.get_abstract_mesh()
    return tuple(_ways(mesh, spec[i] if i < len(spec) else None) for i in range(len(names)))


def logical_to_spec(names: tuple[str | None, ...]) -> PartitionSpec:
    """Logical names -> PartitionSpec under the rules in effect.

    Args:
        names: one logical axis name (or None) per dimension.

    Returns:
        The PartitionSpec.
    """
    return nn.logical_to_mesh_axes(names)


def activation_spec(names: tuple[str | None, ...]) -> PartitionSpec:
    """The PartitionSpec of an activation with these logical names under the rules and mesh in
    effect; empty outside them (kernels that run per shard take it, as `constrain` would split it).

    Args:
        names: one logical axis name (or None) per dimension.

    Returns:
        The PartitionSpec.
    """
    if not nn.get_logical_axis_rules() or jax.sharding.get_abstract_mesh().empty:
        return PartitionSpec()
    return logical_to_spec(names)


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Sharding constraint by logical names; a no-op outside a mesh and rules context. A dimension
    its mesh axes do not divide (one new position a decoding step, on the context axis) is not split.

    Args:
        x: an activation.
        names: one logical axis name (or None) per dimension of x.

    Returns:
        x, constrained.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if not nn.get_logical_axis_rules() or mesh.empty:
        return x
    spec = logical_to_spec(names)
    spec = PartitionSpec(*(a if n % _ways(mesh, a) == 0 else None for n, a in zip(x.shape, spec, strict=False)))
    return jax.lax.with_sharding_constraint(x, spec)


def context_ways() -> int:
    """The size of the mesh's context axis in effect (1 outside a mesh): how many ways sequences split.

    Returns:
        The context axis's size.
    """
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or "context" not in mesh.axis_names else mesh.shape["context"]


def state_shardings(abstract_state, mesh: jax.sharding.Mesh) -> Any:
    """NamedShardings of a (TrainState or params) pytree from its variables' logical names.

    Optimizer moments carry their parameter's names, so they inherit its sharding;
    scalars (step, counts) and the RNG are replicated.

    Args:
        abstract_state (Any): the pytree's shapes (`jax.eval_shape`), its variables carrying logical names.
        mesh: the device mesh.

    Returns:
        A pytree of NamedShardings shaped like the state.
    """
    specs = nnx.get_partition_spec(abstract_state)
    specs = jax.tree.map(lambda v: v.get_value() if isinstance(v, nnx.Variable) else v, specs, is_leaf=_is_var)
    shardings = jax.tree.map(lambda p: NamedSharding(mesh, p), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    check_divisible(abstract_state, shardings)
    return shardings


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def check_divisible(abstract_state, shardings) -> None:
    """Every sharded dimension must divide by its mesh axes' size.

    Args:
        abstract_state (Any): the pytree's shapes.
        shardings (Any): its NamedShardings, leaf for leaf.

    Raises:
        ConfigError: a dimension its mesh axes do not divide (the array, dimension and axes named).
    """
    leaves = jax.tree_util.tree_leaves_with_path(abstract_state)
    for (path, leaf), sharding in zip(leaves, jax.tree.leaves(shardings), strict=True):
        mesh = sharding.mesh
        for dim, axes in zip(leaf.shape, sharding.spec, strict=False):
            axes = (axes,) if isinstance(axes, str) else axes or ()
            size = math.prod(mesh.shape[a] for a in axes)
            if dim % size:
                name = jax.tree_util.keystr(path)
                raise ConfigError(
                    f"{name} has a dimension of {dim} that mesh axes {axes} (size {size}) do not divide; "
                    "change the mesh or the model size"
                )


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    """The sharding of a batch: its leading axis split over the batch axes (data, fsdp, expert).

    Args:
        mesh: the device mesh.

    Returns:
        The NamedSharding.
    """
    return NamedSharding(mesh, PartitionSpec(BATCH))


def process_rows(global_batch_size: int, mesh: jax.sharding.Mesh) -> slice:
    """The rows of the global batch this process loads (its devices' share of the batch axes).

    Args:
        global_batch_size: the batch over all processes.
        mesh: the device mesh.

    Returns:
        This process's rows.

    Raises:
        ConfigError: the batch does not divide over the batch shards or the processes.
    """
    shards = math.prod(mesh.shape[a] for a in BATCH)
    if global_batch_size % shards:
        raise ConfigError(
            f"train.batch_size={global_batch_size} does not divide over the {shards} batch shards "
            f"(mesh data x fsdp = {mesh.shape['data']} x {mesh.shape['fsdp']}"
            + (f" x expert {mesh.shape['expert']})" if mesh.shape["expert"] > 1 else ")")
        )
    n = jax.process_count()
    if global_batch_size % n:
        raise ConfigError(f"train.batch_size={global_batch_size} does not divide over {n} processes")
    per = global_batch_size // n
    return slice(jax.process_index() * per, (jax.process_index() + 1) * per)


def global_batch(local: dict[str, np.ndarray], mesh: jax.sharding.Mesh, global_batch_size: int) -> dict:
    """Assemble this process's rows into global arrays sharded over the batch axes.

    Args:
        local: this process's rows (`process_rows`), by name.
        mesh: the device mesh.
        global_batch_size: the batch over all processes.

    Returns:
        The global arrays, by name.
    """
    sharding = batch_sharding(mesh)
    return {
        k: jax.make_array_from_process_local_data(sharding, v, (global_batch_size, *v.shape[1:]))
        for k, v in local.items()
    }
