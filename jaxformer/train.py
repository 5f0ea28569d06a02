"""Training: the pure train/eval steps and the fit loop (the losses they differentiate are in `losses`,
the state and the optimizer they update are built in `state`).

`train_step(state, batch) -> (state, metrics)` and `eval_step(state, batch) -> metrics`
are pure functions of pytrees, jitted once with the state donated. The loop around
them (data, logging, evaluation, samples) runs in Python outside jit.
"""

from __future__ import annotations

import contextlib
import json
import math
import pathlib
import signal
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxformer import distributed, moe, pipeline, sharding
from jaxformer import functional as F
from jaxformer.config import Config, ConfigError, ModelConfig
from jaxformer.layers import check_batch_ids, without_id_checks
from jaxformer.losses import (  # noqa: F401  (classify_logits to loss_chunk: importable from here, as before)
    classify_logits,
    hidden_states,
    laid_out,
    loss_chunk,
    loss_sums,
    summarize,
)
from jaxformer.state import TrainState, init_state, learning_rate_schedule

Array = jax.Array


def make_steps(
    graphdef: nnx.GraphDef, cfg: Config, optimizer: optax.GradientTransformation, *, loss=None, metrics=None
):
    """Build the pure `train_step(state, batch)` and `eval_step(state, batch)` (not yet jitted).

    They do not check token ids (a host callback per step would also keep them out of JAX's
    persistent compilation cache): check host batches with `layers.check_batch_ids`, as `fit` does.
    Another objective (post-training's) brings its own `loss` and `metrics`; the step around them
    (accumulation, clipping, the optimizer, LoRA's frozen base, non-finite handling) is the same.

    Args:
        graphdef: the model's graph (`nnx.split`).
        cfg: the run's config.
        optimizer: the optax transformation.
        loss (Callable | None): (model, batch, dropout_rng) -> (summed loss, summed metrics with "count",
            what the sums are divided by); None: `loss_sums` of `cfg.train.objective`.
        metrics (Callable | None): summed metrics -> logged means; None: `summarize`.

    Returns:
        steps (tuple[Callable, Callable]): (train_step, eval_step).
    """
    tcfg = cfg.train
    schedule = learning_rate_schedule(tcfg, cfg.model.d_model)
    balance_rate = cfg.model.moe.balance_rate if cfg.model.moe.router == "sigmoid_topk" else 0.0
    with_reference = lambda state, batch: batch
    if loss is None and tcfg.objective == "preference":  # pairs against the reference (post_train.pair_loss)
        from jaxformer.post_train import pair_loss as preference

        loss = lambda model, batch, rng: preference.preference_sums(model, cfg.preference, batch, rng)
        with_reference = lambda state, batch: preference.with_reference(cfg.preference, model_of, state, batch)
    # mesh.stage > 1: the stacks run as a pipeline of grad_accum micro-batches (`jaxformer.pipeline`),
    # which replaces the accumulation loop below; without stages the context changes nothing.
    staged = cfg.mesh.stage > 1
    in_pipeline = lambda kind=cfg.mesh.schedule: (
        pipeline.schedule(tcfg.grad_accum, cfg.mesh.virtual_stages, kind) if staged else contextlib.nullcontext()
    )

    def model_of(params, frozen):  # ids are checked on the host (`check_batch_ids`): no callback in the steps
        return without_id_checks(nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, params, frozen))

    loss = loss or (lambda model, batch, rng: loss_sums(model, tcfg, batch, rng))
    metrics = metrics or summarize

    def grads_and_sums(params, frozen, batch, rng):
        def f(params):  # gradients of the trained parameters only (LoRA: the adapters; the base is a constant)
            with in_pipeline():
                return loss(model_of(params, frozen), batch, rng)

        (_, sums), grads = jax.value_and_grad(f, has_aux=True)(params)
        return grads, sums

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)  # same step, same masks
        batch, k = with_reference(state, batch), 1 if staged else tcfg.grad_accum
        if k == 1:
            grads, sums = grads_and_sums(state.params, state.frozen, batch, rng)
        else:  # k micro-batches; gradients of summed losses add up exactly to the big batch's
            micro = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)

            def body(acc, xs):
                i, mb = xs
                g, s = grads_and_sums(state.params, state.frozen, mb, jax.random.fold_in(rng, i))
                return jax.tree.map(jnp.add, acc, (g, s)), None

            zeros = jax.tree.map(
                jnp.zeros_like,
                jax.eval_shape(grads_and_sums, state.params, state.frozen, jax.tree.map(lambda x: x[0], micro), rng),
            )
            (grads, sums), _ = jax.lax.scan(body, zeros, (jnp.arange(k), micro))
        count = jnp.maximum(sums["count"], 1.0)
        finite_loss = jnp.isfinite(sums["loss"])  # a non-finite loss makes the step non-finite, whatever its grads
        grads = jax.tree.map(lambda g: jnp.where(finite_loss, g / count, jnp.nan), grads)
        opt_state = state.opt_state
        if tcfg.offload_optimizer:  # host memory to the device for the update, and back after it
            opt_state = jax.device_put(opt_state, jax.memory.Space.Device)
        updates, opt_state = optimizer.update(grads, opt_state, state.params)
        if tcfg.offload_optimizer:
            opt_state = jax.device_put(opt_state, jax.memory.Space.Host)
        params = optax.apply_updates(state.params, updates)
        grad_norm = optax.tree.norm(grads)
        if balance_rate and "moe_load" in sums:  # the routers' biases follow the step's loads, not the gradient;
            # a non-finite step (skipped by train.on_nonfinite="skip") moves them no more than the weights
            params = balance_routers(graphdef, params, sums["moe_load"], balance_rate, jnp.isfinite(grad_norm))
        means = metrics(sums) | {"grad_norm": grad_norm, "learning_rate": schedule(state.step)}
        if tcfg.on_nonfinite == "skip":  # optax.apply_if_finite kept params and optimizer state on such a step
            means["skipped_steps"] = opt_state.total_notfinite
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), means

    def eval_step(state: TrainState, batch: dict) -> dict:
        # Nothing to differentiate: 1F1B's forward is GPipe's, and its tail (the loss once more a micro-batch) unread.
        with in_pipeline("gpipe"):
            _, sums = loss(model_of(state.params, state.frozen), with_reference(state, batch), None)
        return sums

    return train_step, eval_step


def moe_rows(model: nnx.Module) -> list:
    """The model's MoE feed-forwards with their rows in the stacked MoE statistics of a forward pass
    (`moe.totals`: the encoder's layers, the decoder's, then the multi-token prediction modules').

    Args:
        model: the Transformer.

    Returns:
        [(an `moe.MoEFeedForward`, its rows: an int array)].
    """
    rows, start = [], 0
    stacks = [getattr(model, name).stack for name in ("encoder", "decoder") if hasattr(model, name)]
    stacks += [module.stack for module in getattr(model, "mtp", [])]
    for stack in stacks:
        found = stack.moe_rows()
        rows += [(ffn, start + r) for ffn, r in found]
        start += sum(len(r) for _, r in found)
    return rows


def balance_routers(
    graphdef: nnx.GraphDef, params: nnx.State, load_LE: Array, rate: float, apply: Array | bool = True
) -> nnx.State:
    """DeepSeek-V3's aux-loss-free balancing after an optimizer step: every sigmoid router's bias moves by
    `rate` towards its under-loaded experts (`moe.balance_biases`), by the loads the step counted.

    Args:
        graphdef: the model's graph (`nnx.split(model, nnx.Param)`).
        params: the parameters after the step's update.
        load_LE: [L, E] the tokens each MoE layer sent each expert in the step (all micro-batches, all shards).
        rate: `model.moe.balance_rate`.
        apply: False on a step whose update is skipped (its loads may come from NaN logits): biases kept.

    Returns:
        The parameters with the routers' biases moved.
    """
    model = nnx.merge(graphdef, params)
    for ffn, rows in moe_rows(model):
        bias = ffn.router_bias[...]
        moved = moe.balance_biases(bias, load_LE[rows].reshape(bias.shape), rate)
        ffn.router_bias[...] = jnp.where(apply, moved, bias)
    return nnx.state(model, nnx.Param)


def parameter_counts(state: TrainState) -> tuple[int, int]:
    """(trained, total): the state's trained parameters (all, or LoRA's adapters) and all of them (a
    tied embedding counts once, as the state holds it once).

    Args:
        state: the train state.

    Returns:
        (trained, total).
    """
    count = lambda params: sum(x.size for x in jax.tree.leaves(params))
    return count(state.params), count(state.weights)


def parameters_line(state: TrainState) -> str:
    """ "parameters: N trained of M (x%)", as training logs it and each sweep trial reports it.

    Args:
        state: the train state.

    Returns:
        The line.
    """
    trained, total = parameter_counts(state)
    return f"parameters: {trained:,} trained of {total:,} ({trained / total:.4%})"


def jit_steps(train_step, eval_step, state: TrainState, mesh: jax.sharding.Mesh | None):
    """jit both steps once: the state donated, and with a mesh explicit in/out shardings.

    Args:
        train_step (Callable): from `make_steps`.
        eval_step (Callable): from `make_steps`.
        state: the train state (its shardings).
        mesh: the mesh, or None (one device).

    Returns:
        steps (tuple[Callable, Callable]): the jitted (train_step, eval_step).
    """
    if mesh is None:
        return jax.jit(train_step, donate_argnums=0), jax.jit(eval_step)
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    batch_sh = sharding.batch_sharding(mesh)
    train = jax.jit(train_step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None), donate_argnums=0)
    return train, jax.jit(eval_step, in_shardings=(state_sh, batch_sh))


# ----------------------------------------------------------------------------- FLOPs


def flops_per_example(cfg: ModelConfig, objective: str, src_len: int, tgt_len: int) -> float:
    """Training FLOPs of one example: 3 x forward (backward = 2 x forward).

    Forward, per token and layer: 2 FLOPs per multiply-add of each weight matrix,
    attention projections 2 * D * (2 H K + 2 G K), feed-forward 2 * D * F * (2 or 3 if gated),
    attention scores and values 2 * 2 * H * K * context (full context for the encoder and
    cross-attention, T for decoder self-attention as it is computed unmasked); plus the
    output head 2 * D * V per predicted token. Embedding lookups and norms are ignored. Latent
    attention's self-attention (`model.mla`) counts its own kernels (2 FLOPs a weight) and scores and
    values of 2 * H * (N + R + V) * context, as training computes it (the plain form).

    Args:
        cfg: the model's config.
        objective: the training objective.
        src_len: source tokens (S).
        tgt_len: target tokens (T).

    Returns:
        FLOPs.
    """
    D, H, G, K, Fw, V = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.dim_per_head, cfg.d_ff, cfg.vocab_size
    proj = 2 * D * (2 * H * K + 2 * G * K)
    matmuls = 3 if cfg.activation in F.GATED_ACTIVATIONS else 2
    ffn = 2 * D * Fw * matmuls
    # An MoE layer: the router, and k routed experts plus the shared ones per token (what a token uses;
    # capacity slots left empty are not counted).
    m = cfg.moe
    moe_ffn = 2 * D * m.num_experts + 2 * D * (m.expert_d_ff or Fw) * matmuls * (m.experts_per_token + m.shared_experts)
    ffn_total = lambda stack, layers: sum(moe_ffn if m.is_moe_layer(stack, i) else ffn for i in range(layers))
    attn = lambda ctx: 4 * H * K * ctx
    self_proj, self_attn = proj, attn
    if cfg.mla.enabled:  # latent attention's self-attention: its projections; keys of N + R, values of Vh
        C, Cq, R, N, Vh = (getattr(cfg.mla, f) for f in ("kv_lora_rank", "q_lora_rank", "rope_head_dim",
                                                          "nope_head_dim", "v_head_dim"))  # fmt: skip
        queries = 2 * Cq * (D + H * (N + R)) if Cq else 2 * D * H * (N + R)
        self_proj = queries + 2 * D * (C + R) + 2 * C * H * (N + Vh) + 2 * H * Vh * D
        self_attn = lambda ctx: 2 * H * (N + R + Vh) * ctx
    enc_len = src_len if objective in ("seq2seq", "classify", "mlm") else 0
    L_enc, L_dec = cfg.num_encoder_layers, cfg.num_decoder_layers
    total = enc_len * (L_enc * (self_proj + self_attn(enc_len)) + ffn_total("encoder", L_enc)) if enc_len else 0.0
    if objective in ("lm", "seq2seq"):
        cross = (proj + attn(src_len)) if objective == "seq2seq" else 0
        total += tgt_len * (L_dec * (self_proj + self_attn(tgt_len) + cross) + ffn_total("decoder", L_dec))
    head_tokens = tgt_len if objective in ("lm", "seq2seq") else src_len if objective == "mlm" else 0
    total += 2 * D * V * head_tokens
    return 3.0 * total


# ----------------------------------------------------------------------------- the loop


def evaluate(eval_step, state, fetch, num_batches: int) -> dict:
    """Mean metrics over the first `num_batches` batches given by `fetch(i)`.

    Args:
        eval_step (Callable): (state, batch) -> summed metrics.
        state (TrainState): the train state.
        fetch (Callable[[int], dict]): i -> the i-th evaluation batch.
        num_batches: how many batches.

    Returns:
        Mean metrics.
    """
    totals = None
    # Over many processes, one batch's program at a time: two programs with collectives in flight at once
    # (gloo on CPU), launched in a different order by different processes, hung both for good. One process
    # keeps fetching the next batch while the last one computes.
    one_at_a_time = jax.block_until_ready if jax.process_count() > 1 else lambda x: x
    for i in range(num_batches):
        sums = one_at_a_time(eval_step(state, fetch(i)))
        totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
    return {k: float(v) for k, v in summarize(totals).items()}


def real_fraction(batch: dict) -> tuple[float, float]:
    """(real tokens, token slots) of a host batch: how much of what the step computes is not padding.

    Args:
        batch: the host batch.

    Returns:
        (real tokens, token slots).
    """
    if "src" not in batch:  # lm, mlm: every window position is text
        ids = batch["inputs"]
        return float(ids.size if "segments" not in batch else (batch["segments"] > 0).sum()), float(ids.size)
    src_real = (batch["src_segments"] > 0).sum() if "src_segments" in batch else batch["src_lengths"].sum()
    if "inputs" in batch:  # seq2seq: source and target
        return float(src_real + batch["weights"].sum()), float(batch["src"].size + batch["inputs"].size)
    return float(src_real), float(batch["src"].size)  # classification


def batch_cost(cfg: Config, batch: dict) -> tuple[float, float]:
    """(target tokens, model FLOPs) of a host batch, from its contents and actual shapes.

    Args:
        cfg: the run's config.
        batch: the host batch.

    Returns:
        (target tokens, FLOPs).
    """
    objective = cfg.train.objective
    src_len = batch["src"].shape[1] if "src" in batch else batch["inputs"].shape[-1]
    tgt_len = batch["inputs"].shape[-1] if "inputs" in batch else 0
    B = len(next(iter(batch.values())))
    if objective == "preference":  # two completions a pair, and the reference's forward (1/3 of a step) on both
        objective, B = "seq2seq" if "src" in batch else "lm", B * 2 * (4 / 3 if cfg.preference.uses_reference else 1)
    # Tokens that carry a target; for classification, the input tokens read.
    tokens = real_fraction(batch)[0] if objective == "classify" else float(batch["weights"].sum())
    return tokens, flops_per_example(cfg.model, objective, src_len, tgt_len) * B


class NonFiniteLoss(FloatingPointError):
    """A step's loss or gradient norm is NaN or inf and `train.on_nonfinite` is "stop"."""


class Preemption:
    """Whether to stop after this step: SIGTERM or Ctrl-C (SIGINT) on one process, or, on several,
    the step all processes agreed on through JAX's preemption sync (orbax `reached_preemption`).

    A Python SIGTERM handler would replace the notifier that sync relies on, and hosts
    stopping at different steps would hang in the save, so it is installed on one process only.
    A second Ctrl-C interrupts at once, without saving. A context manager (the handlers are restored
    on exit); `fit` and post-training's loop (`post_train.rl`) ask it after each step.

    Args:
        manager (orbax.checkpoint.CheckpointManager): the run's manager (its preemption sync, many processes).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, manager):
        self.manager = manager
        self.local = jax.process_count() == 1
        self.requested = None  # the name of the signal received

    def __enter__(self):
        if self.local:
            self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def _handle(self, signum, frame):
        self.requested = signal.Signals(signum).name
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def reached(self, step: int) -> bool:
        """Whether to save and stop after `step` (on every process alike).

        Args:
            step: the step just finished.

        Returns:
            True once a stop was asked for.
        """
        return self.requested is not None if self.local else self.manager.reached_preemption(step)

    def __exit__(self, *exc):
        if self.local:
            for s, handler in self.previous.items():
                signal.signal(s, handler)


def fit(
    cfg: Config,
    workdir: str | pathlib.Path,
    *,
    quiet: bool = False,
    on_eval: Callable[[int, dict], bool] | None = None,
    profile_steps: tuple[int, int] | None = None,
) -> dict:
    """Train `cfg` in `workdir` on the mesh of `cfg.mesh`, resuming from its latest checkpoint.

    `on_eval(step, eval_metrics)` is called after each evaluation; if it returns True the run
    saves a checkpoint and stops there (a sweep's pruner). `profile_steps=(A, B)` traces steps
    A..B-1 with `jax.profiler` into workdir/profile.

    Returns the final state, the last evaluation under "eval", and under "preempted" / "stopped"
    whether SIGTERM or Ctrl-C / `on_eval` stopped the run (after saving) before `train.steps`;
    "complete" when the workdir had already reached `train.steps` (nothing is trained or evaluated).
    A save that cannot be written (disk full, read-only) raises `checkpoint.CheckpointWriteError`
    naming the last complete checkpoint, which a rerun resumes from.

    Args:
        cfg: the run's config.
        workdir: the run's directory.
        quiet: no progress output.
        on_eval: called after each evaluation; True stops the run.
        profile_steps: (A, B) steps to trace, or None.

    Returns:
        "state", "eval", "preempted", "stopped", "complete" and the pieces `jaxformer eval` reuses.

    Raises:
        NonFiniteLoss: a non-finite loss with `train.on_nonfinite="stop"`.
        checkpoint.CheckpointWriteError: a checkpoint cannot be written.
        ConfigError: the config does not fit the data or the mesh, or a task of train.evals cannot run.
    """
    if cfg.train.evals:  # the tasks are found, with their files, before anything is built or written
        from jaxformer.evaluation.run import TaskError, check_tasks

        try:
            check_tasks(list(cfg.train.evals))
        except TaskError as e:
            raise ConfigError(f"train.evals: {e}") from None
    sharding.initialize_distributed(cfg.mesh)
    with distributed.watch(workdir):  # a lost process: one line and exit 4 (jaxformer.distributed)
        mesh = sharding.make_mesh(cfg.mesh)
        opened = []  # what runs in the background (the checkpoint manager's saves): shut down on an error, every
        # time, before the interpreter's exit does it (a data error once ended in a thread's traceback after its line)
        with sharding.use(mesh, sharding.rules_for(cfg.mesh)):
            try:
                return _fit(cfg, pathlib.Path(workdir), mesh, quiet or jax.process_index() != 0, on_eval,
                            profile_steps, opened)  # fmt: skip
            except BaseException:
                for thing in opened:
                    with contextlib.suppress(Exception):  # the error raised says what went wrong
                        thing.close()
                raise


def _fit(
    cfg: Config, workdir: pathlib.Path, mesh: jax.sharding.Mesh, quiet: bool, on_eval, profile_steps, opened: list
) -> dict:
    from tqdm.auto import tqdm

    from jaxformer import chips, decode, observe
    from jaxformer.checkpoint import Checkpointer, write_labels
    from jaxformer.data import build_dataset, sources

    if cfg.data.source == "files":
        sources.expand(cfg.data.files)  # a file that is not there fails before the workdir is made
    workdir.mkdir(parents=True, exist_ok=True)
    tcfg = cfg.train
    log = (lambda *a: None) if quiet else tqdm.write
    rows = sharding.process_rows(tcfg.batch_size, mesh)  # this process loads only its rows
    graphdef, state, optimizer = init_state(cfg, mesh)
    log(parameters_line(state))
    ckpt = Checkpointer(workdir, cfg)  # checks the workdir is writable before any work
    opened.append(ckpt)
    restored = ckpt.restore_latest(state)  # into the current mesh; refuses a different model
    start = 0
    if restored is not None:
        state, start = restored, int(restored.step)
        log(f"resumed from {ckpt.directory / str(start)}")
    lead = jax.process_index() == 0
    if start >= tcfg.steps:  # a finished run: nothing to train, evaluate or log again
        ckpt.close()
        return {
            "eval": {}, "state": state, "graphdef": graphdef, "data": None, "eval_step": None, "fetch_test": None,
            "preempted": False, "stopped": False, "complete": True,
        }  # fmt: skip
    env = observe.environment(mesh)
    if lead:
        (workdir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        (workdir / "environment.json").write_text(json.dumps(env, indent=2))
    if tcfg.objective == "preference":  # {prompt, chosen, rejected} records
        from jaxformer.post_train.pairs import build_pairs as build_dataset
    data = build_dataset(cfg, workdir, progress=not quiet)
    if lead and tcfg.objective == "classify":  # the class names, for a server's answers and export-hf's id2label
        write_labels(workdir, data.labels)
    train_step, eval_step = jit_steps(*make_steps(graphdef, cfg, optimizer), state, mesh)

    # grain threads read this process's rows of the coming steps while the accelerator runs.
    train_batches = data.train.stream(start, tcfg.steps, rows, prefetch=cfg.data.prefetch)

    def fetch(batches):
        return lambda step: sharding.global_batch(
            check_batch_ids(batches.get(step, rows), cfg.model), mesh, tcfg.batch_size
        )

    peak_device, peak_source = chips.peak_flops(cfg.model.dtype, tcfg.peak_flops)
    peak = peak_device * jax.device_count()
    writer = observe.MetricWriter(workdir, start) if lead else observe.NullWriter()
    profiler = observe.Profiler(workdir, profile_steps if lead else None)
    versions = ", ".join(f"{k} {env[k]}" for k in observe.PACKAGES if k != "numpy")
    log(f"{versions}; {env['devices']} x {env['device_kind']} ({env['processes']} processes), mesh {env['mesh']}")
    log(f"MFU against {peak / 1e12:.4g} TFLOP/s: {jax.device_count()} x {peak_source}")
    # A live bar on a terminal; in a log file (not a TTY) a plain line every log_every steps.
    bar = tqdm(range(start, tcfg.steps), initial=start, total=tcfg.steps, disable=True if quiet else None)
    window = {"tokens": 0.0, "flops": 0.0, "start": time.perf_counter()}
    pending, result, preempted, stopped, done = None, {}, False, False, start
    samples = tcfg.num_samples and jax.process_count() == 1 and tcfg.objective != "preference"

    def flush():
        """Log the metrics of the step before the one just dispatched (reading them waits for it)."""
        nonlocal pending, window, peak
        if pending is None:
            return
        prev_step, prev, cost = pending
        pending = None
        if prev_step != start:  # the first step's time is its compile time: the window starts after it
            window["tokens"] += cost[0]
            window["flops"] += cost[1]
        loss, grad_norm = float(prev["loss"]), float(prev["grad_norm"])
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            if tcfg.on_nonfinite == "stop":  # checked before each save: no checkpoint holds this step's update
                raise NonFiniteLoss(
                    f"training stopped at step {prev_step}: loss {loss}, gradient norm {grad_norm}; likely causes: "
                    "train.learning_rate too high (or train.warmup_steps too short), bad data (token ids, "
                    "sequences longer than the model was built for), bfloat16 overflow; "
                    "train.on_nonfinite=skip skips such steps and goes on"
                )
            log(f"step {prev_step}: loss {loss}, gradient norm {grad_norm}: skipped (train.on_nonfinite=skip)")
        if prev_step % tcfg.log_every:  # logged steps do not depend on where the run (re)started
            return
        if prev_step == start:  # the step that compiled: its time is logged above, it has no rate
            writer.write(prev_step, "train", prev)
        else:
            elapsed = time.perf_counter() - window["start"]
            if window["flops"] / elapsed > peak:  # only a probe's peak can be beaten: it was an underestimate
                peak = window["flops"] / elapsed
                log(f"the step ran at {peak / 1e12:.4g} TFLOP/s, above the {peak_source}: MFU is against that now")
            rates = {"tokens_per_s": window["tokens"] / elapsed, "mfu": window["flops"] / elapsed / peak}
            writer.write(prev_step, "train", {**prev, **rates, "step_time": elapsed / tcfg.log_every})
            window = {"tokens": 0.0, "flops": 0.0, "start": time.perf_counter()}
            bar.set_postfix_str(observe.line({"loss": loss, **rates}, ("loss", "tokens_per_s")))
            if bar.disable:
                eta = (tcfg.steps - prev_step) * elapsed / tcfg.log_every
                router = {k: float(prev[k]) for k in observe.ROUTER_SHOWN if k in prev}  # MoE layers: the router's
                said = observe.line({"loss": loss, **rates, **router}, ("loss", "tokens_per_s", "mfu", *router))
                log(f"step {prev_step}: {said}, ETA {eta:.0f}s")

    try:
        with Preemption(ckpt.manager) as preemption:
            for step in bar:
                local = check_batch_ids(next(train_batches), cfg.model)
                profiler.before(step)
                state, metrics = train_step(state, sharding.global_batch(local, mesh, tcfg.batch_size))
                profiler.after(step, metrics)
                if step == start:
                    jax.block_until_ready(metrics)
                    log(f"step {step} compiled and ran in {time.perf_counter() - window['start']:.1f}s")
                    window = {"tokens": 0.0, "flops": 0.0, "start": time.perf_counter()}
                flush()
                real, slots = real_fraction(local)  # of this process's rows; all shares are alike
                cost = [x * jax.process_count() for x in batch_cost(cfg, local)]  # tokens, FLOPs: shares are alike
                pending = (step, {**metrics, "real_fraction": real / max(slots, 1.0)}, cost)
                done = step + 1
                distributed.reached(done)
                evaluated = done % tcfg.eval_every == 0 or done == tcfg.steps
                if evaluated:
                    flush()  # a non-finite step stops the run before it is evaluated
                    n = min(tcfg.eval_batches, len(data.val))
                    result = evaluate(eval_step, state, fetch(data.val), n)
                    if tcfg.evals and jax.process_count() == 1:  # lm-eval tasks: one process reads them
                        from jaxformer.evaluation.run import harness_metrics

                        model = nnx.merge(graphdef, state.weights)
                        result |= harness_metrics(model, data.tokenizer, tcfg.evals, tcfg.evals_limit or None)
                    writer.write(done, "eval", result)
                    on = f"the validation split ({data.val.sequences(n):,} sequences)"
                    log(f"step {done}: eval on {on}: {observe.line(result, observe.shown(tcfg.objective))}")
                    if samples:
                        model = nnx.merge(graphdef, state.weights)
                        for src, out in zip(*decode.sample_texts(model, cfg, data), strict=True):
                            log(f"  > {src!r}\n  = {out!r}")
                    stopped = on_eval is not None and bool(on_eval(done, result))
                preempted = preemption.reached(done)
                if done % cfg.checkpoint.every == 0 or done == tcfg.steps or preempted or stopped:
                    flush()  # the log holds every step the checkpoint holds
                    ckpt.save(state, metrics=result if evaluated else None)
                if preempted:  # "saved" only once it is: a save that cannot be written raises here
                    ckpt.wait()
                if preempted and lead:  # shown even with --quiet: it says how to go on
                    why = preemption.requested or "preemption"
                    print(f"{why}: saved step {done} to {ckpt.directory}; rerun the same command to resume")
                if preempted or stopped:
                    break
        profiler.stop()
        flush()
    except NonFiniteLoss as e:  # saves already started finish; none holds the non-finite step
        ckpt.wait()
        kept = ckpt.manager.latest_step()
        ckpt.close()
        where = f"{ckpt.directory / str(kept)} is the last good checkpoint" if kept is not None else "no checkpoint"
        raise NonFiniteLoss(f"{e}; {where}") from None
    finally:
        profiler.stop()
        writer.close()
        train_batches.close()  # grain's prefetch threads, reading ahead of a run that stopped early or failed
    ckpt.wait()
    ckpt.close()
    return {
        "eval": result, "state": state, "graphdef": graphdef, "data": data, "eval_step": eval_step,
        "fetch_test": fetch(data.test), "preempted": preempted and done < tcfg.steps,
        "stopped": stopped and done < tcfg.steps, "complete": False,
    }  # fmt: skip
