"""The training state and its construction: the `TrainState` pytree, the optimizer built from config,
and the initial state (random or from given parameters), created sharded when a mesh is given.

Its own module so that `train` (the steps and the loop) and `checkpoint` (which restores into a state
of the right shape) both build on it, and neither on the other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from jaxformer import lora, sharding
from jaxformer.config import Config, TrainConfig
from jaxformer.models import Transformer

Array = jax.Array


@struct.dataclass
class TrainState:
    """Everything a step reads and writes: a plain pytree."""

    step: Array  # int32 scalar
    params: nnx.State  # the trained parameters: all of them, or the LoRA adapters alone
    opt_state: optax.OptState  # of `params` only
    rng: Array  # root key as raw uint32 key data (checkpointable); step t's dropout key is fold_in(rng, t)
    frozen: nnx.State | None = None  # LoRA: the base parameters, in the compute dtype (or int8), never updated
    # Preference tuning without LoRA: the starting parameters, the reference the losses compare with (never
    # updated); with LoRA the reference is the base without its adapters, nothing is copied.
    reference: nnx.State | None = None

    @property
    def weights(self) -> nnx.State:
        """Every parameter of the model (`nnx.merge(graphdef, state.weights)`), trained and frozen."""
        return self.params if self.frozen is None else nnx.merge_state(self.params, self.frozen)


# ----------------------------------------------------------------------------- optimizer


def learning_rate_schedule(cfg: TrainConfig, d_model: int) -> optax.Schedule:
    """The learning rate at each step, by `cfg.schedule`.

    noam: lr * D^-0.5 * min(t^-0.5, t * warmup^-1.5) (paper, t counted from 1); cosine: linear warmup
    to lr then cosine decay to 0 at `steps`; constant (with warmup).

    Args:
        cfg: the train section (schedule, learning_rate, warmup_steps, steps).
        d_model: D, which noam scales by.

    Returns:
        step -> learning rate.
    """
    if cfg.schedule == "noam":
        w = max(cfg.warmup_steps, 1)
        rsqrt = lambda t: cfg.learning_rate * d_model**-0.5 * jnp.minimum((t + 1.0) ** -0.5, (t + 1.0) * w**-1.5)
        return rsqrt
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, cfg.learning_rate, cfg.warmup_steps, max(cfg.steps, cfg.warmup_steps + 1)
        )
    warm = optax.linear_schedule(0.0, cfg.learning_rate, max(cfg.warmup_steps, 1))
    return optax.join_schedules([warm, optax.constant_schedule(cfg.learning_rate)], [cfg.warmup_steps])


def decay_mask(params: nnx.State) -> Any:
    """AdamW's weight-decay mask: True for weight matrices; False for norms' scales and all biases.

    Args:
        params: the trained parameters.

    Returns:
        A pytree of booleans shaped like `params`.
    """

    def keep(path, _):
        name = str(path[-2].key if path and hasattr(path[-1], "name") else path[-1])
        return not (name.endswith("bias") or name == "scale")

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(cfg: TrainConfig, d_model: int) -> optax.GradientTransformation:
    """Clip by global norm, then Adam (paper: b1=0.9, b2=0.98, eps=1e-9) or AdamW with a decay mask;
    with `on_nonfinite="skip"`, a non-finite update is dropped.

    Args:
        cfg: the train section (optimizer, b1, b2, eps, weight_decay, clip_norm, schedule).
        d_model: D, for the noam schedule.

    Returns:
        The optax transformation.
    """
    schedule = learning_rate_schedule(cfg, d_model)
    if cfg.optimizer == "adam":
        opt = optax.adam(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    else:
        opt = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask)
    opt = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), opt) if cfg.clip_norm else opt
    if cfg.on_nonfinite == "skip":  # a non-finite update is dropped; the count lives in the (checkpointed) state
        opt = optax.apply_if_finite(opt, max_consecutive_errors=jnp.iinfo(jnp.int32).max)
    return opt


# ----------------------------------------------------------------------------- initial state


def state_factory(cfg: Config) -> tuple[nnx.GraphDef, Callable[[], TrainState], optax.GradientTransformation]:
    """(graphdef, create, optimizer): `create()` builds the initial TrainState of `cfg`; nothing is
    allocated until it runs (`jax.eval_shape(create)` gives its shapes, as the planner uses them).

    Args:
        cfg: the run's config.

    Returns:
        (graphdef, create, optimizer).
    """
    optimizer = make_optimizer(cfg.train, cfg.model.d_model)

    def build(seed: int) -> Transformer:  # the base, its adapters, its int8 kernels (lora.base="int8")
        model = lora.add_adapters(Transformer(cfg.model, rngs=nnx.Rngs(params=seed)), cfg.lora)
        return lora.quantize_base(model, cfg.lora)

    def create() -> TrainState:
        return start_state(cfg, nnx.state(build(cfg.train.seed), nnx.Param), optimizer)

    graphdef, _ = nnx.split(nnx.eval_shape(lambda: build(0)), nnx.Param)
    return graphdef, create, optimizer


def start_state(cfg: Config, params: nnx.State, optimizer: optax.GradientTransformation) -> TrainState:
    """Step 0 from `params` (random, or pretrained ones being fine-tuned): a fresh optimizer state.

    With LoRA, `params` holds the adapters too (`lora.add_adapters`): they alone train and have an
    optimizer state; the rest becomes `frozen`, in the compute dtype (its kernels in int8 when `params`
    comes from a model through `lora.quantize_base`). Preference tuning with a reference and without
    LoRA keeps a copy of `params` as the `reference`.

    Args:
        cfg: the run's config (train.seed, lora, model.dtype).
        params: the model's parameters.
        optimizer: the optimizer (`make_optimizer`).

    Returns:
        The TrainState at step 0.
    """
    rng = jax.random.key_data(jax.random.key(cfg.train.seed))
    frozen = reference = None
    if cfg.lora.enabled:
        params, frozen = lora.partition(params, cfg.model.dtype)
    elif cfg.train.objective == "preference" and cfg.preference.uses_reference:  # its own buffers (donation)
        reference = jax.tree.map(jnp.copy, params)
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), rng, frozen, reference)


def init_state(
    cfg: Config, mesh: jax.sharding.Mesh | None = None
) -> tuple[nnx.GraphDef, TrainState, optax.GradientTransformation]:
    """(graphdef, TrainState, optimizer) for `cfg`.

    With a mesh (and the rules in effect, see `sharding.use`), parameters and optimizer
    state are created already sharded: the initialiser is jitted with the shardings the
    logical axis names give as `out_shardings`, so no array is ever whole on one device.

    Args:
        cfg: the run's config.
        mesh: the device mesh, or None for unsharded arrays.

    Returns:
        (graphdef, state, optimizer).
    """
    graphdef, create, optimizer = state_factory(cfg)
    if mesh is None:
        return graphdef, create(), optimizer
    shardings = state_shardings(cfg, jax.eval_shape(create), mesh)
    return graphdef, jax.jit(create, out_shardings=shardings)(), optimizer


def state_shardings(cfg: Config, abstract_state: TrainState, mesh: jax.sharding.Mesh) -> TrainState:
    """The NamedShardings of `cfg`'s state on `mesh` (`sharding.state_shardings`), the optimizer state's
    in host memory with `train.offload_optimizer`.

    Args:
        cfg: the run's config (train.offload_optimizer).
        abstract_state: the state's shapes (`jax.eval_shape`).
        mesh: the device mesh.

    Returns:
        A TrainState of NamedShardings.

    Raises:
        ConfigError: `mesh.expert` does not divide `model.moe.num_experts` once the mesh is laid.
    """
    sharding.check_experts(mesh, cfg.mesh, cfg.model.moe.num_experts)
    shardings = sharding.state_shardings(abstract_state, mesh)
    if not cfg.train.offload_optimizer:
        return shardings
    on_host = jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), shardings.opt_state)
    return shardings.replace(opt_state=on_host)
