"""Checkpoints with orbax-checkpoint: periodic async saves, exact resume, fallback, export.

A checkpoint `WORKDIR/checkpoints/<step>/` holds two items:
  state  the TrainState pytree (step, params, optimizer state, RNG), arrays restored
         straight into the shardings of the state you restore into (any mesh);
  meta   JSON: the resolved config and the data position (batches are a function of
         the step, so the position is the step and the seed).
orbax writes each step into a temporary directory and renames it when complete, so an
interrupted or failed save is never listed as a checkpoint; the next training run removes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import pathlib
import re
import shutil
import sys
import tempfile
import traceback

import jax
import orbax.checkpoint as ocp
from flax import nnx

from jaxformer.config import Config, ConfigError, from_dict, read_config
from jaxformer.data import HF_DIR
from jaxformer.state import init_state

log = logging.getLogger("jaxformer.checkpoint")


class _ReadOnlyIsExpected(logging.Filter):
    """orbax warns about every read-only manager it opens; eval, generate and export open one on
    purpose (a training run may be writing beside them), so the warning is noise to them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("Given directory is read only", "CheckpointManagerOptions.read_only"))


# What a failed file operation says: an OSError's errno, or tensorstore's `[os_error_code='28']`.
_OS_ERROR_CODE = re.compile(r"os_error_code='(\d+)'")


def write_failure(error: BaseException | None) -> int | None:
    """The errno of the failed file operation behind `error` (through its causes), else None.

    orbax raises it as an OSError from its own writes, and as tensorstore's ValueError
    (`RESOURCE_EXHAUSTED: ... No space left on device [os_error_code='28']`) from the arrays'.

    Args:
        error: the exception, or None.

    Returns:
        The errno, or None.
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno:
            return error.errno
        if found := _OS_ERROR_CODE.search(str(error)):
            return int(found.group(1))
        error = error.__cause__ or error.__context__
    return None


class _ReportedByTheWait(logging.Filter):
    """orbax logs a failed write, traceback and all, from each thread it passes through, and asyncio
    the same error again for each of orbax's gathered writes it collects (hundreds of lines in all);
    `Checkpointer` reports it once, in one line, when the save's wait raises it. A failed restore's
    abandoned reads end the same way, as asyncio's "exception was never retrieved" (whether they do
    depends on when the garbage collector finds them); the restore has already fallen back or said
    why. Dropped: those records alone (a tensorstore or orbax error), every other passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None:
            return True
        frames = [record.pathname] + [f.f_code.co_filename for f, _ in traceback.walk_tb(error.__traceback__)]
        from_orbax = any(f"{os.sep}orbax{os.sep}" in path for path in frames)
        if record.name == "asyncio" and "exception was never retrieved" in record.getMessage():
            return not (from_orbax or write_failure(error) is not None or "tensorstore_spec" in str(error))
        return write_failure(error) is None or not from_orbax


logging.getLogger("absl").addFilter(_ReadOnlyIsExpected())  # orbax logs through absl's logger
for _logger in ("absl", "asyncio"):
    logging.getLogger(_logger).addFilter(_ReportedByTheWait())

# Exit code of a run that saved a checkpoint on SIGTERM and stopped: rerun the same command to resume.
EXIT_PREEMPTED = 3

# Why a save could not be written, and what lets a rerun write it; other errnos are named by os.strerror.
_WRITE_FAILURES = {
    errno.ENOSPC: ("the disk is full", "free space"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space"),
    errno.EFBIG: ("a file exceeds the size limit", "raise the limit"),
    errno.EROFS: ("the filesystem is read-only", "make it writable"),
    errno.EACCES: ("permission is denied", "make it writable"),
    errno.EPERM: ("permission is denied", "make it writable"),
}


class CheckpointWriteError(OSError):
    """A save could not be written (disk full, quota, read-only, permission). The checkpoints saved
    before it are intact, and the half-written one is never taken for a checkpoint: a rerun with
    room resumes from the last complete one (and removes the partial files)."""


# Model fields that do not change the parameters' shapes or layout: a run may resume with them changed.
RUNTIME_MODEL_FIELDS = {"dtype", "attention_impl", "remat", "check_token_ids", "dropout_rate", "attention_dropout_rate"}
# Of model.moe: how tokens are routed and weighed, not which parameters there are.
RUNTIME_MOE_FIELDS = {
    "router", "capacity_factor", "expert_capacity", "router_noise", "z_loss_weight", "aux_loss_weight",
    "normalize_topk", "routed_scaling", "num_groups", "groups_per_token", "balance_rate",
}  # fmt: skip


def model_layout(model) -> dict:
    """The model fields that shape the parameters, model.moe's spelled `moe.FIELD`.

    Args:
        model (ModelConfig): the model section.

    Returns:
        field -> value.
    """
    fields = dataclasses.asdict(model)
    moe = fields.pop("moe")
    fields |= {f"moe.{k}": v for k, v in moe.items() if k not in RUNTIME_MOE_FIELDS}
    # the sigmoid router has a parameter more (its balance bias); the softmax routers share their parameters
    fields["moe.router"] = moe["router"] if moe["router"] == "sigmoid_topk" else "softmax_topk or topk_softmax"
    return {k: v for k, v in fields.items() if k not in RUNTIME_MODEL_FIELDS}


class Checkpointer:
    """The run's CheckpointManager: save every `checkpoint.every` steps, keep the last
    `checkpoint.keep` (and the best by `checkpoint.best_metric` when set).

    `read_only=True` (eval, generate, translate, export) changes nothing on disk: no directory
    is created and a damaged checkpoint is skipped, not set aside.

    Args:
        workdir: the run's directory (checkpoints in WORKDIR/checkpoints).
        cfg: the run's config (its `checkpoint` section).
        read_only: change nothing on disk.

    Raises:
        FileNotFoundError: read_only and no checkpoint in the workdir.
        OSError: the checkpoint directory cannot be written.
    """

    def __init__(self, workdir: str | pathlib.Path, cfg: Config, *, read_only: bool = False):
        _quiet_abandoned_io()  # before orbax's first read or write (a test runner may have replaced the hook)
        self.cfg = cfg
        self.read_only = read_only
        self.saving = None  # the step of the save in flight
        self.directory = (pathlib.Path(workdir) / "checkpoints").absolute()
        if read_only:
            if not self.directory.is_dir():
                raise FileNotFoundError(f"{self.directory} holds no checkpoint: train first")
            options = ocp.CheckpointManagerOptions(read_only=True, create=False)
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))
            return
        c = cfg.checkpoint
        policies = [ocp.checkpoint_managers.LatestN(n=c.keep)]
        if c.best_metric:
            policies.append(
                ocp.checkpoint_managers.BestN(
                    get_metric_fn=lambda m: m[c.best_metric],
                    reverse=c.best_mode == "min",
                    n=1,
                    keep_checkpoints_without_metrics=False,
                )
            )
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
            enable_async_checkpointing=c.async_save,
            create=True,
            cleanup_tmp_directories=True,  # a save that failed or was killed leaves its partial files
        )
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))
            with tempfile.TemporaryFile(dir=self.directory):  # fail now, not at the first save after training
                pass
        except OSError as e:
            raise OSError(f"cannot write checkpoints to {self.directory}: {e.strerror or e}") from None

    def save(self, state, *, metrics: dict | None = None) -> None:
        """Start saving `state` (asynchronously unless configured otherwise), once the save before
        it has finished. CheckpointWriteError if this save or that one cannot be written.

        Args:
            state (TrainState): the train state.
            metrics: the evaluation metrics (for `checkpoint.best_metric`), or None.

        Raises:
            CheckpointWriteError: this save or the one before it cannot be written.
        """
        step = int(state.step)
        self.wait()  # orbax would wait for it inside its save, reporting its failure as this one's
        meta = {"config": self.cfg.to_dict(), "data": {"step": step, "seed": self.cfg.train.seed}}
        self.saving = step
        with self._write_failures_of(step):
            self.manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                metrics=metrics,
                force=True,
            )

    def wait(self) -> None:
        """Wait for the save in flight; CheckpointWriteError if it could not be written.

        Raises:
            CheckpointWriteError: the save cannot be written.
        """
        step, self.saving = self.saving, None
        with self._write_failures_of(step):
            self.manager.wait_until_finished()

    @contextlib.contextmanager
    def _write_failures_of(self, step: int | None):
        """Turn a failed write of step `step`'s save into one CheckpointWriteError saying why, which
        checkpoint is the last complete one, and what to do; any other error passes unchanged."""
        try:
            yield
        except Exception as e:
            code = write_failure(e)
            if code is None:
                raise
            why, remedy = _WRITE_FAILURES.get(code, ("a write failed", "fix that"))
            try:
                kept = sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit())
            except OSError:  # not even listable: say nothing of what it holds
                kept = None
            rerun = f"{remedy} and rerun the same command"
            if kept:
                last = f"step {kept[-1]} ({self.directory / str(kept[-1])}) is the last complete checkpoint and is "
                last += f"intact; {rerun} to resume from it"
            else:
                last = f"no checkpoint was written yet; {rerun}" if kept == [] else f"earlier ones are intact; {rerun}"
            saving = "a checkpoint" if step is None else f"the checkpoint of step {step}"
            error = CheckpointWriteError(
                f"cannot save {saving} to {self.directory}: {why} ({os.strerror(code)}); {last}"
            )
            error.errno = code
            raise error from e

    def close(self) -> None:
        """Wait for the save in flight and for the manager's sweep of a killed save's files, then release
        the manager. orbax's own `close` does not wait for that sweep (a thread it starts when the manager
        is made, awaited only by the first save): a run that fails before its first save, on a data error,
        would leave it to the interpreter's exit, which breaks it with a traceback after the error's line."""
        sweep = getattr(self.manager, "_maybe_await_cleanup_tmp_directory", None)
        if sweep is not None:
            sweep()
        self.manager.close()

    def restore_latest(self, like):
        """Restore the newest checkpoint that reads back, into the structure and shardings of `like`.

        A checkpoint that fails to restore is moved to `corrupt-<step>` (never deleted)
        with a warning, and the previous one is tried. Returns None if there is none.

        Args:
            like (TrainState): a state of the same structure, its arrays (or abstract arrays) sharded as wanted.

        Returns:
            state (TrainState | None): the restored state, or None.
        """
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
                saved = saved_config(meta, step)
            except Exception as e:  # unreadable or malformed metadata: a damaged checkpoint
                self._set_aside(step, e)
                continue
            check_compatible(saved, self.cfg, self.directory / str(step))
            try:
                item = _as_saved(abstract, self.directory / str(step) / "state" / "_METADATA")
                restored = self.manager.restore(
                    step, args=ocp.args.Composite(state=ocp.args.StandardRestore(item), meta=ocp.args.JsonRestore())
                )
            except Exception as e:
                self._set_aside(step, e)
                continue
            state = restored["state"]
            return state if item is abstract else like.replace(**state)
        return None

    def _set_aside(self, step: int, error: Exception) -> None:
        src = self.directory / str(step)
        reason = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"
        if self.read_only:  # a reader never moves what a training run may be writing beside it
            log.warning("checkpoint %s cannot be restored (%s); trying the previous one", src, error)
            print(f"warning: checkpoint {src} cannot be restored ({reason}); skipped, trying the previous one")
            return
        dst = self.directory / f"corrupt-{step}"
        log.warning("checkpoint %s cannot be restored (%s); moved to %s, trying the previous one", src, error, dst)
        print(f"warning: checkpoint {src} cannot be restored ({reason}); moved to {dst}")
        src.rename(dst)
        self.manager.reload()


def _as_saved(abstract, metadata: pathlib.Path):
    """`abstract` as the checkpoint's tree: a state saved before `TrainState.reference` existed has no
    such entry (orbax's tree metadata names every field, None ones too), and is read as a dict of the
    other fields (the reference, None, is not read)."""
    if abstract.reference is not None:
        return abstract
    try:
        saved = json.loads(metadata.read_text())["tree_metadata"]
    except (OSError, ValueError, KeyError):  # another layout: restored as it is, or set aside as unreadable
        return abstract
    if any(key.startswith("('reference'") for key in saved):
        return abstract
    return {f.name: getattr(abstract, f.name) for f in dataclasses.fields(abstract) if f.name != "reference"}


def _quiet_abandoned_io() -> None:
    """A restore that fails stops at its first damaged array, a save at its first failed write;
    tensorstore still finishes the reads and writes orbax abandoned and calls back into the event
    loop orbax has closed, and Python prints "RuntimeError: Event loop is closed" with a traceback
    for each (dozens, from tensorstore's threads, while orbax is still inside the failing call: the
    hook must be in place before the first read or write). The write coroutines orbax abandoned are
    collected at interpreter shutdown, each printing an ImportError ("Python is likely shutting
    down"). Nothing is lost: drop exactly these two, pass every other on."""
    previous = sys.unraisablehook
    if getattr(previous, "quiets_abandoned_io", False):
        return

    # Bound now: by the time the shutdown ones arrive, this module's globals may be cleared.
    def hook(unraisable, previous=previous, finalizing=sys.is_finalizing, orbax=f"{os.sep}orbax{os.sep}"):
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            return
        if finalizing() and isinstance(error, ImportError):  # orbax's abandoned coroutines, collected at exit
            tb = error.__traceback__
            while tb is not None:
                if orbax in tb.tb_frame.f_code.co_filename:
                    return
                tb = tb.tb_next
        previous(unraisable)

    hook.quiets_abandoned_io = True
    sys.unraisablehook = hook


def saved_config(meta, step: int) -> Config:
    """The config in a checkpoint's metadata; ValueError if the metadata is not what `save` writes.

    Args:
        meta (dict): the checkpoint's metadata.
        step: its step.

    Returns:
        The Config.

    Raises:
        ValueError: the metadata holds no valid config, or a data position of another step.
    """
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
        raise ValueError("its metadata holds no config")
    data = meta.get("data")
    if not isinstance(data, dict) or data.get("step") != step or not isinstance(data.get("seed"), int):
        raise ValueError(f"its metadata's data position is {data!r}, not that of step {step}")
    try:
        return from_dict(meta["config"])
    except (ValueError, TypeError, AttributeError) as e:  # ConfigError is a ValueError
        raise ValueError(f"its metadata's config is invalid: {e}") from None


def optimizer_layout(train) -> dict:
    """The train fields that shape the optimizer state (a different one cannot restore).

    Args:
        train (TrainConfig): the train section.

    Returns:
        field -> value.
    """
    return {"optimizer": train.optimizer, "on_nonfinite": train.on_nonfinite, "clip_norm > 0": train.clip_norm > 0}


def lora_layout(lora) -> dict:
    """The lora fields that shape the state (alpha, dropout and seed only change numbers; base stores
    the frozen kernels in int8 with their scales, in the checkpoint).

    Args:
        lora (LoRAConfig): the lora section.

    Returns:
        field -> value.
    """
    if not lora.enabled:
        return {"rank": 0}
    return {"rank": lora.rank, "targets": lora.targets, "stacks": lora.stacks, "base": lora.base}


def check_compatible(saved: Config, current: Config, where) -> None:
    """Refuse to resume when the model's shapes or the optimizer state's layout differ from the
    checkpoint's, listing the fields (rather than set the checkpoint aside as unreadable).

    Args:
        saved: the checkpoint's config.
        current: the run's config.
        where (str | pathlib.Path): the checkpoint, for the message.

    Raises:
        ConfigError: the shapes or layouts differ, listing the fields.
    """
    a, b = model_layout(saved.model), model_layout(current.model)
    diff = [f"model.{k}: checkpoint {a[k]!r}, config {b[k]!r}" for k in a if a[k] != b[k]]
    a, b = optimizer_layout(saved.train), optimizer_layout(current.train)
    diff += [f"train.{k}: checkpoint {a[k]!r}, config {b[k]!r}" for k in a if a[k] != b[k]]
    a, b = lora_layout(saved.lora), lora_layout(current.lora)
    lora_diff = [f"lora.{k}: checkpoint {a.get(k)!r}, config {b.get(k)!r}" for k in {**a, **b} if a.get(k) != b.get(k)]
    if diff or lora_diff:
        # The adapters are made with the run's first state: pretrained weights get them at import.
        hint = "\n(LoRA is set when a run starts: pass the lora fields to import-hf, or train in a new workdir)"
        raise ConfigError(
            f"cannot resume from {where}: the model or optimizer differs from the checkpoint's:\n  "
            + "\n  ".join(diff + lora_diff)
            + (hint if lora_diff else "")
        )


def start_workdir(workdir: str | pathlib.Path, cfg: Config, state) -> None:
    """Make `workdir` a training workdir that resumes from `state` (its step's checkpoint and
    config.json), as `train` leaves one: what `import-hf` writes for pretrained weights.

    Args:
        workdir: the new workdir.
        cfg: the run's config.
        state (TrainState): the state to resume from.
    """
    ckpt = Checkpointer(workdir, cfg)
    ckpt.save(state)
    ckpt.wait()
    ckpt.close()
    (pathlib.Path(workdir) / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))


# ----------------------------------------------------------------------------- class names

LABELS_FILE = "labels.json"  # WORKDIR/labels.json: a classifier's class names, by index (written by training)


def write_labels(workdir: str | pathlib.Path, labels) -> None:
    """Keep a classifier's class names in its workdir (`class_labels` reads them back).

    Args:
        workdir: the training workdir.
        labels (Sequence[str]): the class names, by index (the data's label set).
    """
    (pathlib.Path(workdir) / LABELS_FILE).write_text(json.dumps(list(labels)) + "\n")


def class_labels(workdir: str | pathlib.Path, num_classes: int) -> tuple[str, ...]:
    """A classifier's class names, by index: those its training kept (`write_labels`), else an imported
    model's `id2label` (WORKDIR/hf/config.json; not where the import gave it a new head of another size),
    else Hugging Face's defaults (`LABEL_0`, ...); a class past the names found is named by the default too.

    Args:
        workdir: a training workdir or an exported directory.
        num_classes: the model's classes (model.num_classes).

    Returns:
        num_classes names.
    """
    workdir, found = pathlib.Path(workdir), []
    if (workdir / LABELS_FILE).is_file():
        found = [str(x) for x in json.loads((workdir / LABELS_FILE).read_text())]
    elif (workdir / HF_DIR / "config.json").is_file():
        id2label = json.loads((workdir / HF_DIR / "config.json").read_text()).get("id2label") or {}
        if len(id2label) == num_classes:
            found = [str(id2label.get(str(c), f"LABEL_{c}")) for c in range(num_classes)]
    return tuple(found[:num_classes]) + tuple(f"LABEL_{c}" for c in range(len(found), num_classes))


# ----------------------------------------------------------------------------- export


def restore_workdir(cfg, workdir: str | pathlib.Path):
    """(graphdef, state, optimizer) of the latest checkpoint in a training workdir.

    Args:
        cfg (Config): the run's config.
        workdir: the training workdir.

    Returns:
        restored (tuple): (graphdef, TrainState, optax optimizer).

    Raises:
        FileNotFoundError: the workdir holds no checkpoint.
    """
    graphdef, state, optimizer = init_state(cfg)
    ckpt = Checkpointer(workdir, cfg, read_only=True)  # a training run may be writing there
    state = ckpt.restore_latest(state)
    ckpt.close()
    if state is None:
        raise FileNotFoundError(f"{pathlib.Path(workdir) / 'checkpoints'} holds no checkpoint: train first")
    return graphdef, state, optimizer


def load_workdir(workdir: str | pathlib.Path):
    """The model of a training workdir (its latest checkpoint's weights) or of a directory `export`
    wrote, with the run's config: what serving and evaluation read.

    Args:
        workdir: a training workdir or an exported directory.

    Returns:
        loaded (tuple): (Transformer, Config).

    Raises:
        FileNotFoundError: no config.json there, or no checkpoint.
    """
    workdir = pathlib.Path(workdir)
    if not (workdir / "config.json").is_file():
        raise FileNotFoundError(f"{workdir / 'config.json'} does not exist: is {workdir} a jaxformer workdir?")
    run = read_config(workdir / "config.json")
    if (workdir / "checkpoints").is_dir():
        graphdef, state, _ = restore_workdir(run, workdir)
        return nnx.merge(graphdef, state.weights), run
    return load_model(workdir), run


def export(workdir: str | pathlib.Path, out: str | pathlib.Path) -> pathlib.Path:
    """Write the latest checkpoint's parameters (no optimizer state) and config to `out`.

    Args:
        workdir: the training workdir.
        out: the directory to write.

    Returns:
        `out`.

    Raises:
        FileNotFoundError: no config.json or no checkpoint in the workdir.
    """
    workdir, out = pathlib.Path(workdir), pathlib.Path(out).absolute()
    config_file = workdir / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} does not exist: is {workdir} a training workdir?")
    cfg = read_config(config_file)
    graphdef, restored, _ = restore_workdir(cfg, workdir)
    params = restored.params
    if restored.frozen is not None:  # LoRA: the adapters folded into the base, float32 as `load_model` reads
        from jaxformer import lora

        merged = nnx.state(lora.merge(nnx.merge(graphdef, restored.weights)), nnx.Param)
        params = jax.tree.map(lambda x: x.astype("float32"), merged)
    out.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(out / "params", params, force=True)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    for extra in ("tokenizer.model", "tokenizer.vocab", LABELS_FILE):
        if (workdir / extra).is_file():
            (out / extra).write_bytes((workdir / extra).read_bytes())
    if (workdir / HF_DIR).is_dir():  # an imported model's tokenizer (data.tokenizer="hf")
        shutil.copytree(workdir / HF_DIR, out / HF_DIR, dirs_exist_ok=True)
    return out


def load_model(directory: str | pathlib.Path):
    """A ready `Transformer` from an exported directory (see `export`), for use in any JAX code.

    Args:
        directory: a directory `export` wrote.

    Returns:
        model (Transformer): the model.

    Raises:
        FileNotFoundError: the directory, its config.json or its parameters are missing.
    """
    from jaxformer.models import Transformer

    directory = pathlib.Path(directory).absolute()
    if (directory / "checkpoints").is_dir():
        raise FileNotFoundError(
            f"{directory} is a training workdir: export it first (jaxformer export --workdir {directory} --out DIR)"
        )
    written_by_export = "load_model reads what `jaxformer export` wrote"
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory / 'config.json'} does not exist: {written_by_export}")
    cfg = read_config(directory / "config.json")
    if not (directory / "params").is_dir():
        raise FileNotFoundError(f"{directory / 'params'} does not exist: {written_by_export}")
    _quiet_abandoned_io()
    abstract = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
    graphdef, abstract_params = nnx.split(abstract, nnx.Param)
    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(directory / "params", jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_params))
    return nnx.merge(graphdef, params)
