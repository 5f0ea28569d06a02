"""LoRA (Hu et al., 2021): low-rank adapters on the projections, the trainable/frozen partition, merge.

A projection `y = x @ W` gains `(x @ A) @ B * alpha / R`, with A [in..., R] random and B [R, out...]
zero, so an adapted model starts as exactly its base. Adapters are `nnx.LoRAParam`s added to a built
model (`add_adapters`) beside the kernel they adapt (`q_lora` beside `q`), with their own RNG stream:
the base parameters are the same with LoRA on or off, and pretrained ones get fresh adapters.
The layers add `adapter(x)` where one exists; `merge` folds the adapters into the kernels.

With `lora.base="int8"` (QLoRA-style), `quantize_base` stores every projection kernel of the base as
int8 beside a `<name>_scale` (`QuantScale`, float32 per output channel; the maths is `jaxformer.quant`),
and the layers dequantize where they read it. The embedding and the output head stay in the compute
dtype: the embedding is read a row per token (nothing to gain in the step), the head sets the logits'
precision (as bitsandbytes and PEFT keep `lm_head` unquantized), and together they are ~4% of a 7B Llama.
"""

from __future__ import annotations

import math
import zlib

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer import functional as F
from jaxformer import quant
from jaxformer.config import LORA_MODEL_TARGETS, ConfigError, LoRAConfig, ModelConfig, check_lora_fits
from jaxformer.layers import Embed, FeedForward, MultiHeadAttention
from jaxformer.models import LMHead
from jaxformer.moe import MoEFeedForward

Array = jax.Array

# Per module kind: the kernels that may be adapted, with (the kernel's rank, its input axes).
KERNELS = {
    MultiHeadAttention: {"q": (3, 1), "k": (3, 1), "v": (3, 1), "o": (3, 2)},  # [D,H,K], [D,G,K], [H,K,D]
    FeedForward: {"wi": (2, 1), "wi_gate": (2, 1), "wo": (2, 1)},  # [D,F], [F,D]
    Embed: {"embedding": (2, 1)},  # [V,D]: A [V,R] is looked up by id
    LMHead: {"kernel": (2, 1)},  # [D,V] (an untied output projection)
}
KERNEL_OF = {"embed": "embedding", "head": "kernel"}  # a target named otherwise than its kernel
FROZEN = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))  # the base: every parameter but the adapters


class QuantScale(nnx.Param):
    """The float32 per-output-channel scale of an int8 kernel of the frozen base (`quantize_base`):
    a parameter of the base (it is in `FROZEN`), never trained."""


# ----------------------------------------------------------------------------- pure maths


def lora_update(x: Array, a: Array, b: Array, scale: float) -> Array:
    """The adapter's addition to `x @ W` for a kernel W [in..., out...]: (x @ A) @ B * scale.

    x [..., in...] contracts its last `a.ndim - 1` axes with A [in..., R]; B is [R, out...].
    Two thin matmuls: the [in, out] product A @ B is never formed.

    Args:
        x: [..., in...] the kernel's input.
        a: A [in..., R].
        b: B [R, out...].
        scale: alpha / rank.

    Returns:
        [..., out...], x's dtype.
    """
    h = jnp.tensordot(x, a.astype(x.dtype), axes=a.ndim - 1)  # [..., R]
    return jnp.tensordot(h, b.astype(x.dtype), axes=1) * jnp.asarray(scale, x.dtype)  # [..., out...]


def lora_update_rows(x: Array, a: Array, b: Array, scale: Array, rows: Array) -> Array:
    """Several adapters of one kernel at once: row i of the batch adds its own adapter's update,
    (x[i] @ A[rows[i]]) @ B[rows[i]] * scale[rows[i]] (`lora_update` per row; an adapter of zeros
    adds nothing, so the base model is one of them).

    Args:
        x: [B, ..., in...] the kernel's input, batch first.
        a: A of every adapter [N, in..., R] (a smaller rank padded with zeros: exact).
        b: B of every adapter [N, R, out...].
        scale: [N] each adapter's alpha / rank.
        rows: [B] int, the adapter of each row (in [0, N)).

    Returns:
        [B, ..., out...], x's dtype.
    """
    gather = lambda t: jnp.take(t, rows, axis=0)  # [B, ...]: each row's own A, B and scale
    return jax.vmap(lora_update)(x, gather(a), gather(b), gather(scale))


def lora_lookup_rows(ids: Array, a: Array, b: Array, scale: Array, rows: Array, dtype) -> Array:
    """An adapted embedding's update for several adapters: row i's ids look up A[rows[i]], then
    @ B[rows[i]] * scale[rows[i]].

    Args:
        ids: [B, ...] token ids, batch first.
        a: [N, V, R] every adapter's A.
        b: [N, R, D] every adapter's B.
        scale: [N] each adapter's alpha / rank.
        rows: [B] int, the adapter of each row.
        dtype (jnp.dtype): the compute dtype.

    Returns:
        [B, ..., D] in `dtype`.
    """

    def one(ids, a, b, s):
        h = jnp.take(a, ids, axis=0).astype(dtype)  # [..., R]
        return jnp.tensordot(h, b.astype(dtype), axes=1) * s.astype(dtype)

    return jax.vmap(one)(ids, *(jnp.take(t, rows, axis=0) for t in (a, b, scale)))


def lora_attend_rows(x: Array, a: Array, b: Array, scale: Array, rows: Array) -> Array:
    """A tied output projection's update for several adapters: row i's x @ (A @ B * scale)^T of
    adapter rows[i], two thin matmuls.

    Args:
        x: [B, ..., D] hidden states, batch first.
        a: [N, V, R] every adapter's A.
        b: [N, R, D] every adapter's B.
        scale: [N] each adapter's alpha / rank.
        rows: [B] int, the adapter of each row.

    Returns:
        [B, ..., V] logits update, x's dtype.
    """

    def one(x, a, b, s):
        h = jnp.tensordot(x, b.astype(x.dtype), axes=[[-1], [1]])  # [..., R]
        return jnp.tensordot(h, a.astype(x.dtype), axes=[[-1], [1]]) * s.astype(x.dtype)

    return jax.vmap(one)(x, *(jnp.take(t, rows, axis=0) for t in (a, b, scale)))


def lora_kernel(a: Array, b: Array, scale: float) -> Array:
    """The update A @ B * scale as a kernel [in..., out...] (what `merge` adds to W).

    Args:
        a: A [in..., R].
        b: B [R, out...].
        scale: alpha / rank.

    Returns:
        [in..., out...].
    """
    return jnp.tensordot(a, b, axes=1) * scale


# ----------------------------------------------------------------------------- the module


class Adapter(nnx.Module):
    """A [lead..., in..., R] and B [lead..., R, out...] of one kernel; `lead` is the scanned stack's
    layers axis when there is one. They carry the kernel's logical axis names, so they shard as it does.

    Args:
        kernel: the adapted kernel [lead..., in..., out...] (its shape and logical names).
        rank_of_kernel: how many leading (layers) axes it has.
        num_in: how many input axes follow them.
        cfg: the LoRA section (rank R, alpha, dropout).
        keys: [lead...] PRNG keys for A's initialisation, one per layer of a scanned stack (a scalar
            key otherwise).
    """

    def __init__(self, kernel: nnx.Param, rank_of_kernel: int, num_in: int, cfg: LoRAConfig, keys: Array):
        shape = kernel.shape
        names = tuple(kernel.get_metadata().get("out_sharding") or (None,) * len(shape))
        lead = len(shape) - rank_of_kernel
        cut = lead + num_in
        self.scale = cfg.alpha / cfg.rank
        self.dropout = cfg.dropout
        fan_in = math.prod(shape[lead:cut])
        # Kaiming-normal A (gain 1): x @ A keeps the input's scale whatever the rank; B = 0: a no-op start.
        draw = jax.vmap(lambda k: jax.random.normal(k, (*shape[lead:cut], cfg.rank), jnp.float32))
        a = draw(keys.reshape(-1)).reshape(*shape[:cut], cfg.rank) * fan_in**-0.5
        b = jnp.zeros((*shape[:lead], cfg.rank, *shape[cut:]), jnp.float32)
        self.a = nnx.LoRAParam(a, out_sharding=(*names[:cut], None), eager_sharding=False)
        self.b = nnx.LoRAParam(b, out_sharding=(*names[:lead], None, *names[cut:]), eager_sharding=False)

    def __call__(self, x: Array, dropout_rng: Array | None = None) -> Array:
        """The update of `x @ W`: dropout(x) @ A @ B * alpha / R.

        Args:
            x: [..., in...] the adapted projection's input.
            dropout_rng: the dropout key on x while training, or None for no dropout.

        Returns:
            [..., out...] the update to add to `x @ W`.
        """
        x = F.dropout(x, self.dropout, dropout_rng)
        return lora_update(x, self.a[...], self.b[...], self.scale)

    def lookup(self, ids: Array, dtype) -> Array:
        """An embedding's update for token ids [...]: rows of A @ B * scale, [..., D] (no dropout on ids).

        Args:
            ids: token ids [...].
            dtype (jnp.dtype): the compute dtype.

        Returns:
            [..., D].
        """
        rows = jnp.take(self.a[...], ids, axis=0).astype(dtype)  # [..., R]
        return jnp.tensordot(rows, self.b[...].astype(dtype), axes=1) * jnp.asarray(self.scale, dtype)

    def attend(self, x: Array) -> Array:
        """A tied output projection's update, x @ (A @ B * scale)^T: [..., D] -> [..., V], two thin matmuls.

        Args:
            x: [..., D] hidden states.

        Returns:
            [..., V] logits update.
        """
        h = jnp.tensordot(x, self.b[...].astype(x.dtype), axes=[[-1], [1]])  # [..., R]
        return jnp.tensordot(h, self.a[...].astype(x.dtype), axes=[[-1], [1]]) * jnp.asarray(self.scale, x.dtype)


def _stack_of(path: tuple) -> str:
    """encoder, decoder or cross: where a module sits in the Transformer."""
    if "cross_attn" in path:
        return "cross"
    return "encoder" if "encoder" in path else "decoder"


def add_adapters(model: nnx.Module, cfg: LoRAConfig) -> nnx.Module:
    """`model` with an `Adapter` beside each kernel `cfg` targets (in place; nothing when LoRA is off).

    A's keys come from `cfg.seed` and the adapter's place (layer i of a scanned stack draws as the
    unrolled stack's layer i does), never from the model's stream.

    Args:
        model: a model built by `models.build_model`.
        cfg: the LoRA section (rank, targets, stacks, seed).

    Returns:
        The same model.

    Raises:
        ConfigError: feed-forward targets (wi, wi_gate, wo) in a stack with MoE layers; stacks or targets
            that would adapt nothing in this model, or a rank above a projection's width (as Config
            refuses them: `config.check_lora_fits`).
    """
    if not cfg.enabled:
        return model
    ffn = [t for t in cfg.targets if t in KERNELS[FeedForward]]
    if ffn and (stacks := _moe_stacks(model) & set(cfg.stacks)):  # Config refuses this too; models built in code
        where, which = " and ".join(sorted(stacks)), ", ".join(map(repr, ffn))
        raise ConfigError(
            f"lora.targets: {which} would adapt the MoE layers of the {where} (model.moe), whose expert kernels "
            "take no adapters: adapt the attention projections (q, k, v, o)"
        )
    if isinstance(model_cfg := getattr(model, "cfg", None), ModelConfig):  # a model of models.build_model
        check_lora_fits(cfg, model_cfg)
    root = jax.random.key(cfg.seed)
    for path, module in list(nnx.iter_modules(model)):
        kernels = next((k for kind, k in KERNELS.items() if isinstance(module, kind)), None)
        if kernels is None:
            continue
        for target in cfg.targets:
            if target not in LORA_MODEL_TARGETS and _stack_of(path) not in cfg.stacks:
                continue
            name = KERNEL_OF.get(target, target)
            if name in kernels and hasattr(module, name):
                kernel = getattr(module, name)
                scanned = kernel.ndim > kernels[name][0]  # a leading layers axis
                places = [(*path, name)]
                if scanned:  # keyed as unrolled layer i: (..., "layers", [j,] *rest), blocks of N, holds i = b * N + j
                    at, N = path.index("layers") + 1, model.cfg.scan_block
                    j, rest = (0, path[at:]) if N == 1 else (path[at], path[at + 1 :])
                    places = [(*path[:at], b * N + j, *rest, name) for b in range(kernel.shape[0])]
                keys = jnp.stack([jax.random.fold_in(root, hash_path(p)) for p in places])
                setattr(module, f"{name}_lora", Adapter(kernel, *kernels[name], cfg, keys))
    return model


def _moe_stacks(model: nnx.Module) -> set[str]:
    """The stacks (encoder, decoder) holding MoE layers, whose expert kernels are stacked [E, ...]."""
    return {_stack_of(path) for path, m in nnx.iter_modules(model) if isinstance(m, MoEFeedForward)}


def hash_path(path: tuple) -> int:
    """A stable 31-bit number for a module path (Python's `hash` of strings changes per process).

    Args:
        path: a module path (strings and ints).

    Returns:
        An int in [0, 2^31).
    """
    return zlib.crc32("/".join(map(str, path)).encode()) & 0x7FFFFFFF


def adapters(model: nnx.Module):
    """(module, kernel name, Adapter) for every adapter in `model`.

    Args:
        model: a model.

    Returns:
        items (Iterator[tuple]): an iterator of (module, kernel name, `Adapter`).
    """
    for _, module in nnx.iter_modules(model):
        for kind, kernels in KERNELS.items():
            if isinstance(module, kind):
                for name in kernels:
                    if isinstance(adapter := getattr(module, f"{name}_lora", None), Adapter):
                        yield module, name, adapter


def kernels(model: nnx.Module):
    """(module, kernel name, the number of its input axes, its leading (layers) axes) for every projection
    of the layer stacks (attention and feed-forward; not the embedding or the output head).

    Args:
        model: a model.

    Returns:
        items (Iterator[tuple]): an iterator of (module, kernel name, number of input axes, number of leading axes).
    """
    for _, module in nnx.iter_modules(model):
        for kind, names in KERNELS.items():
            if isinstance(module, kind) and kind in (MultiHeadAttention, FeedForward):
                for name, (rank, num_in) in names.items():
                    if isinstance(kernel := getattr(module, name, None), nnx.Param):
                        yield module, name, num_in, kernel.ndim - rank


def quantized(model: nnx.Module):
    """(module, kernel name) for every kernel stored in int8 (`quantize_base`).

    Args:
        model: a model.

    Returns:
        items (Iterator[tuple]): an iterator of (module, kernel name).
    """
    return [(m, name) for m, name, _, _ in kernels(model) if isinstance(getattr(m, f"{name}_scale", None), QuantScale)]


def quantize_base(model: nnx.Module, cfg: LoRAConfig) -> nnx.Module:
    """`model` with every projection kernel (attention q, k, v, o; feed-forward wi, wi_gate, wo; of every
    stack, adapted or not) stored in int8 beside a `QuantScale`, in place; nothing unless `cfg.base` is
    "int8". The scale [lead..., 1 (in axes), out...] carries the kernel's names with None on its input
    axes, so it shards as the kernel's output channels do.

    Args:
        model: a model.
        cfg: the LoRA section (its `base`).

    Returns:
        The same model.

    Raises:
        ConfigError: "int8" for a model with MoE layers (their expert kernels have no int8 path).
    """
    if cfg.base != "int8":
        return model
    if stacks := _moe_stacks(model):  # their float kernels would stay float, silently
        raise ConfigError(
            f"lora.base: 'int8' cannot store the MoE layers' expert kernels (model.moe, in the "
            f"{' and '.join(sorted(stacks))}): use lora.base='compute'"
        )
    for module, name, num_in, lead in list(kernels(model)):
        kernel = getattr(module, name)
        if hasattr(module, f"{name}_scale"):
            continue
        in_axes = tuple(range(lead, lead + num_in))
        q, scale = quant.quantize(kernel[...], in_axes)
        names = tuple(kernel.get_metadata().get("out_sharding") or (None,) * kernel.ndim)
        kernel.set_value(q)
        names = tuple(None if i in in_axes else n for i, n in enumerate(names))
        setattr(module, f"{name}_scale", QuantScale(scale, out_sharding=names, eager_sharding=False))
    return model


def merge(model: nnx.Module) -> nnx.Module:
    """`model` with every adapter folded into its kernel (W + A @ B * scale, kept in W's dtype) and
    removed, and every int8 kernel dequantized (to float32), in place: a plain model for export and
    inference, as fast as the base.

    Args:
        model: a model with adapters (or int8 kernels).

    Returns:
        The same model.
    """
    for module, name in quantized(model):
        kernel = getattr(module, name)
        kernel.set_value(quant.dequantize(kernel[...], getattr(module, f"{name}_scale")[...], jnp.float32))
        delattr(module, f"{name}_scale")
    for module, name, adapter in list(adapters(model)):
        kernel = getattr(module, name)
        a, b = adapter.a[...], adapter.b[...]
        update = lora_kernel
        for _ in range(a.ndim + b.ndim - 2 - kernel.ndim):  # vmap over the leading (layers) axes
            update = jax.vmap(update, in_axes=(0, 0, None))
        w = kernel[...]
        kernel[...] = (w.astype(jnp.float32) + update(a, b, adapter.scale)).astype(w.dtype)
        delattr(module, f"{name}_lora")
    return model


def partition(params: nnx.State, dtype) -> tuple[nnx.State, nnx.State]:
    """(trainable adapters, frozen base in `dtype`) of a model's parameters: the base is only read,
    so it is kept in the compute dtype, with no float32 master copy; int8 kernels and their float32
    scales (`quantize_base`) stay as they are.

    Args:
        params: the model's parameters (`nnx.state(model, nnx.Param)`).
        dtype (jnp.dtype): the compute dtype the frozen base is kept in.

    Returns:
        (trainable, frozen) states.
    """
    trainable, frozen = nnx.split_state(params, nnx.LoRAParam, ...)
    floating = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    scales = lambda v: isinstance(v, QuantScale)
    return trainable, jax.tree.map(lambda x: x if scales(x) else floating(x), frozen, is_leaf=scales)
