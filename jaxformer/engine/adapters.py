"""Several LoRA adapters served side by side by one engine, each request choosing its own.

The engine's model stays the base (its own adapters, if any, merged), and every kernel that some
adapter targets gets a `StackedAdapter` as its `<name>_lora`: the A and B of every adapter stacked
along a leading adapter axis, adapter 0 all zeros (the base itself), A [N, in..., R] and B [N, R, out...]
with R the largest rank (a smaller one padded with zeros, which adds exactly nothing), and an adapter
that does not target the kernel zeros there too. The compiled step binds each row's adapter index
(`bind_rows`) and each layer adds `lora.lora_update_rows`: row i gathers its own A and B. One
compiled step serves every mix of adapters, the base included.

An adapter is a model of the engine's architecture with LoRA adapters (a `jaxformer train` workdir with
`lora.rank > 0`, or a model in memory): only its A and B are read, over the engine's base, so its
config must equal the base's up to the settings that do not change the weights (`IGNORED`).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer import lora
from jaxformer.engine.requests import EngineError

Array = jax.Array

# Model settings that change how a model runs or trains, not its weights: they may differ between the base
# and an adapter's run (the engine runs the base's).
IGNORED = frozenset({
    "dropout_rate", "attention_dropout_rate", "attention_impl", "context_attention", "context_layout",
    "matmul_precision", "scan_layers", "scan_block", "remat", "check_token_ids", "dtype",
})  # fmt: skip


class AdapterRows(nnx.Variable):
    """Which adapter each row of the batch runs: [B] int32 indices into the stack, or a scalar for all rows."""


class StackedAdapter(nnx.Module):
    """Every served adapter of one kernel, stacked: A [N, in..., R], B [N, R, out...], scale [N]; adapter 0
    is zeros (the base). Called as `lora.Adapter` is (`projections.adapted`, the embedding's `lookup` and
    `attend`), each row of the batch adding its own adapter's update; no dropout (serving only).

    A and B carry the kernel's logical axis names (A its inputs', B its outputs'), the adapter and rank axes
    none: on a mesh they shard as the kernel does (`sharding.state_shardings`), as `lora.Adapter`'s do.

    Args:
        a: [N, in..., R].
        b: [N, R, out...].
        scale: [N] each adapter's alpha / rank (0 where it has no adapter).
        names: the kernel's logical axis names [in..., out...] (None: unnamed, replicated).
    """

    def __init__(self, a: Array, b: Array, scale: Array, names: tuple | None = None):
        cut = a.ndim - 2  # the kernel's input axes
        names = names or (None,) * (cut + b.ndim - 2)
        self.a = nnx.LoRAParam(a, out_sharding=(None, *names[:cut], None), eager_sharding=False)
        self.b = nnx.LoRAParam(b, out_sharding=(None, None, *names[cut:]), eager_sharding=False)
        self.scale = nnx.LoRAParam(scale)
        self.rows = AdapterRows(jnp.zeros((), jnp.int32))  # the base until `bind_rows`

    def _rows(self, batch: int) -> Array:
        return jnp.broadcast_to(self.rows[...], (batch,))

    def __call__(self, x: Array, dropout_rng: Array | None = None) -> Array:
        """The update of `x @ W`, each row its own adapter's.

        Args:
            x: [B, ..., in...] the kernel's input.
            dropout_rng: ignored (no dropout while serving).

        Returns:
            [B, ..., out...].
        """
        return lora.lora_update_rows(x, self.a[...], self.b[...], self.scale[...], self._rows(x.shape[0]))

    def lookup(self, ids: Array, dtype) -> Array:
        """An adapted embedding's update for ids [B, ...]: [B, ..., D].

        Args:
            ids: [B, ...] token ids.
            dtype (jnp.dtype): the compute dtype.

        Returns:
            [B, ..., D].
        """
        return lora.lora_lookup_rows(ids, self.a[...], self.b[...], self.scale[...], self._rows(ids.shape[0]), dtype)

    def attend(self, x: Array) -> Array:
        """A tied output projection's update: [B, ..., D] -> [B, ..., V].

        Args:
            x: [B, ..., D] hidden states.

        Returns:
            [B, ..., V].
        """
        return lora.lora_attend_rows(x, self.a[...], self.b[...], self.scale[...], self._rows(x.shape[0]))


def bind_rows(model: nnx.Module, rows: Array | int) -> nnx.Module:
    """Set which adapter each row runs in every `StackedAdapter` of `model` (in place).

    Args:
        model: the engine's model.
        rows: [B] int32 adapter indices (0: the base), or one index for every row.

    Returns:
        The same model.
    """
    for _, module in nnx.iter_modules(model):
        if isinstance(module, StackedAdapter):
            module.rows.set_value(jnp.asarray(rows, jnp.int32))
    return model


def index_of(names: tuple[str, ...], adapter: str | None) -> int:
    """An adapter's index in the stacks: 0 for None (the base), i + 1 for names[i].

    Args:
        names: the served adapters' names (what `attach` returned).
        adapter: a name, or None.

    Returns:
        The index.

    Raises:
        EngineError: a name the engine does not serve.
    """
    if adapter is not None and adapter not in names:
        served = ", ".join(map(repr, names)) or "none"
        raise EngineError(f"adapter {adapter!r} is not served by this engine (its adapters: {served})", "adapter")
    return 0 if adapter is None else names.index(adapter) + 1


def attach(model: nnx.Module, adapters: dict) -> dict[str, dict]:
    """Give the engine's model (merged, unrolled: `decode.decodable`) a `StackedAdapter` on every kernel
    some adapter targets, in place.

    Args:
        model (Transformer): the engine's model.
        adapters: name -> a model with LoRA adapters, or a workdir (str or path) of a LoRA run.

    Returns:
        name -> its A and B (`arrays_of`), in order: adapter i + 1 of the stacks is the i-th.

    Raises:
        EngineError: a name that is not a non-empty string, a workdir or model without adapters, or one
            whose config (`adapters['NAME']: model.FIELD`) or shapes differ.
    """
    found = {name: arrays_of(name, given, model.cfg) for name, given in adapters.items()}
    stack(model, found)
    return found


def arrays_of(name: str, given, mcfg) -> dict:
    """One adapter's A and B, read and checked against the served model's config.

    Args:
        name: its name (a non-empty string without surrounding spaces).
        given (Transformer | str | os.PathLike): a model with LoRA adapters, or a workdir of a LoRA run.
        mcfg (ModelConfig): the served model's config.

    Returns:
        (module path in the unrolled model, kernel name) -> (A [in..., R], B [R, out...], scale).

    Raises:
        EngineError: a bad name, a workdir or model without adapters, or one whose config differs.
    """
    if not isinstance(name, str) or not name or name.strip() != name:
        raise EngineError(f"adapters: a name must be a non-empty string without surrounding spaces, got {name!r}")
    where = f"adapters[{name!r}]"
    adapted = _load(given, where)
    _check_config(adapted.cfg, mcfg, where)
    arrays = _arrays(adapted)
    if not arrays:
        raise EngineError(f"{where}: the model has no LoRA adapters (lora.rank=0): nothing to serve beside the base")
    return arrays


def stack(model: nnx.Module, found: dict[str, dict]) -> None:
    """Replace the model's stacks (in place) by those of `found`'s adapters, in its order (adapter i + 1 of
    the stacks is the i-th); none at all where `found` is empty.

    Args:
        model (Transformer): the engine's model.
        found: name -> `arrays_of`'s.

    Raises:
        EngineError: an adapter of a kernel the model does not have, or of other shapes than another's.
    """
    names = list(found)
    modules = dict(nnx.iter_modules(model))
    for module in modules.values():
        for attr, value in list(vars(module).items()):
            if isinstance(value, StackedAdapter):
                delattr(module, attr)
    for key in sorted({k for arrays in found.values() for k in arrays}, key=str):
        path, kernel_name = key
        module = modules.get(path)
        kernel = getattr(module, kernel_name, None) if module is not None else None
        if not isinstance(kernel, nnx.Param):
            where = ".".join(map(str, (*path, kernel_name)))
            raise EngineError(f"adapters: an adapter adapts {where}, which the served model does not have")
        parts = [arrays.get(key) for arrays in found.values()]
        R = max(a.shape[-1] for a, _, _ in filter(None, parts))
        a0, b0, _ = next(filter(None, parts))
        A = np.zeros((len(parts) + 1, *a0.shape[:-1], R), np.float32)
        B = np.zeros((len(parts) + 1, R, *b0.shape[1:]), np.float32)
        scale = np.zeros(len(parts) + 1, np.float32)
        for i, part in enumerate(parts, start=1):
            if part is None:
                continue
            a, b, s = part
            if a.shape[:-1] != a0.shape[:-1] or b.shape[1:] != b0.shape[1:]:
                raise EngineError(f"adapters[{names[i - 1]!r}]: the adapter of {key} has shapes {a.shape}, {b.shape}")
            A[i, ..., : a.shape[-1]], B[i, : b.shape[0]], scale[i] = a, b, s
        axes = kernel.get_metadata().get("out_sharding")  # its logical axes: the stacks shard as it does
        stacked = StackedAdapter(jnp.asarray(A), jnp.asarray(B), jnp.asarray(scale), axes)
        setattr(module, f"{kernel_name}_lora", stacked)


class Served:
    """The engine's adapters, by name: the model of one, and adapters loaded or unloaded while it serves
    (vLLM's `/v1/load_lora_adapter`). A mixin of `Engine`, whose state it reads: `adapters` (the names, in
    the stacks' order), `_lora` (their `arrays_of`), the split model, the live requests, the prefix cache and
    the compiled steps."""

    def model_of(self, adapter: str | None):
        """`model` running one served adapter (None: the base) on every row.

        Args:
            adapter: a name of `adapters`, or None.

        Returns:
            model (Transformer): over the engine's arrays.

        Raises:
            EngineError: an adapter the engine does not serve.
        """
        return bind_rows(self.model, index_of(self.adapters, adapter))

    def load_adapter(self, name: str, adapter) -> None:
        """Serve one more adapter from the next step on, beside the running requests (theirs keep their
        places in the stacks: it is added last). The stacks change shape, so the step compiles again.

        Args:
            name: its name (a request's `adapter`).
            adapter (Transformer | str | os.PathLike | dict): a model of the engine's architecture with LoRA
                adapters, the workdir of a LoRA run, or `arrays_of`'s reading of one under this name (read off
                the engine's thread).

        Raises:
            EngineError: a name already served, or an adapter `arrays_of` refuses.
        """
        if name in self.adapters:
            raise EngineError(f"adapter {name!r} is already served: unload it first")
        arrays = adapter if isinstance(adapter, dict) else arrays_of(name, adapter, self.model.cfg)
        self._restack({**self._lora, name: arrays})

    def unload_adapter(self, name: str) -> None:
        """Stop serving an adapter; the requests of the others keep running (the stacks close up behind it).

        Args:
            name: a name of `adapters`.

        Raises:
            EngineError: a name not served, or requests of it still running or waiting.
        """
        index = index_of(self.adapters, name)
        if any(req.adapter == index for req in self._live.values()):
            raise EngineError(f"adapter {name!r} has requests running or waiting: finish or abort them first")
        for req in self._live.values():
            req.adapter -= req.adapter > index
        self._restack({k: v for k, v in self._lora.items() if k != name})

    def _restack(self, found: dict[str, dict]) -> None:
        """Serve `found`'s adapters: the stacks rebuilt over the same base arrays, the step's executables and
        the prefix cache's entries (keyed by adapter name, whose weights may now differ) forgotten."""
        model = nnx.merge(self._graphdef, self._params)
        stack(model, found)
        self._lora, self.adapters = found, tuple(found)
        self._graphdef, self._params = nnx.split(model)
        self._precast()
        self._compiled.clear()
        self._alloc.forget()


def _load(given, where: str):
    """A model with adapters: `given` itself, or the latest checkpoint of the workdir it names."""
    if isinstance(given, (str, os.PathLike)):
        from jaxformer.checkpoint import load_workdir

        try:
            return load_workdir(given)[0]
        except FileNotFoundError as e:
            raise EngineError(f"{where}: {e}") from None
    if isinstance(given, nnx.Module) and hasattr(given, "cfg"):
        return given
    raise EngineError(f"{where}: a model with LoRA adapters or a workdir, got {type(given).__name__}")


def _check_config(theirs, ours, where: str) -> None:
    for field in dataclasses.fields(ours):
        if field.name in IGNORED:
            continue
        a, b = getattr(theirs, field.name), getattr(ours, field.name)
        if a != b:
            raise EngineError(
                f"{where}: model.{field.name}={a!r} differs from the served model's {b!r}: an adapter serves "
                "only over the base it was trained on"
            )


def _arrays(model) -> dict:
    """(module path in the unrolled model, kernel name) -> (A [in..., R], B [R, out...], scale) of every adapter
    of `model`, a scanned stack's sliced per layer as `models.unrolled` numbers them."""
    cfg, out = model.cfg, {}
    for path, module in nnx.iter_modules(model):
        kernels = next((k for kind, k in lora.KERNELS.items() if isinstance(module, kind)), {})
        for name, (_, num_in) in kernels.items():
            adapter = getattr(module, f"{name}_lora", None)
            if not isinstance(adapter, lora.Adapter):
                continue
            a, b = np.asarray(adapter.a[...], np.float32), np.asarray(adapter.b[...], np.float32)
            lead = a.ndim - num_in - 1
            if "dense_layers" in path:  # a scanned stack's unrolled dense layers: layers 0..H-1
                at = path.index("dense_layers")
                path = (*path[:at], "layers", *path[at + 1 :])
            if not lead:
                out[(tuple(path), name)] = (a, b, adapter.scale)
                continue
            at, N = path.index("layers") + 1, cfg.scan_block  # (..., "layers", [j,] *rest), as models.unrolled
            H = cfg.dense_head(path[0])
            j, rest = (0, path[at:]) if N == 1 else (path[at], path[at + 1 :])
            for k in range(a.shape[0]):
                out[((*path[:at], H + k * N + j, *rest), name)] = (a[k], b[k], adapter.scale)
    return out


def parse_flags(values: list[str]) -> dict[str, str]:
    """`--lora NAME=WORKDIR` flags (repeatable) as {name: workdir}.

    Args:
        values: the flags' values.

    Returns:
        name -> workdir, in the order given.

    Raises:
        ValueError: a value without `=`, an empty name or workdir, or a name given twice.
    """
    out = {}
    for value in values:
        name, eq, workdir = value.partition("=")
        if not eq or not name.strip() or not workdir.strip():
            raise ValueError(f"--lora {value!r}: NAME=WORKDIR expected (a LoRA run's workdir, served as model NAME)")
        if name.strip() in out:
            raise ValueError(f"--lora {value!r}: the name {name.strip()!r} is given twice")
        out[name.strip()] = workdir.strip()
    return out
