"""GRPO's loop: rollouts from the engine, rewards, advantages, and updates by the training step.

Each iteration t: the engine is handed the policy's current weights (`Engine.load_weights`: the
training state's arrays, nothing copied or synchronised), samples G completions for each of the step's
prompts (a prompt's first sample is admitted first, so the other G - 1 find its full pages in the
prefix cache), each request seeded by (train.seed, t, prompt, sample), so a resumed run draws the
same tokens. The rewards give group-normalised advantages; the sampled tokens' log-probabilities
under the old policy (and the reference's, with a KL penalty) are recomputed by one forward pass in
the training layout, since the engine's paged attention does not give them bitwise (its are logged
against them as `rollout/logp_gap` at temperature 1). Then `grpo.updates` steps of the training
step built by `train.make_steps` with the GRPO loss: checkpoints, resume, LoRA, sharding and
gradient accumulation as for any run.

The reference is the starting point: with LoRA the same model with its adapters at zero (the frozen
base, no second copy); without, the starting parameters, kept (only when `grpo.kl_coef` > 0).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import time
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer import functional as F
from jaxformer import sharding
from jaxformer.config import Config, EngineConfig, LoRAConfig
from jaxformer.post_train import grpo, rewards
from jaxformer.post_train.tasks import CharTokenizer

Array = jax.Array


# ----------------------------------------------------------------------------- the objective


def grpo_loss(cfg: Config):
    """The GRPO loss for `train.make_steps(..., loss=, metrics=)`.

    The batch: "inputs", "targets" [B, T] (a row is BOS, prompt, completion, shifted by one), "mask"
    [B, T] (1 where the target is a sampled token that counts), "advantages" [B], "old_logp" [B, T],
    and "ref_logp" [B, T] when `grpo.kl_coef` > 0.

    Args:
        cfg: the run's config (its `grpo` section).

    Returns:
        result (tuple[Callable, Callable]): (loss(model, batch, rng) -> (summed loss, sums), metrics(sums) -> means).
    """
    g = cfg.grpo

    def loss(model, batch, rng):
        logits_BTV = model.head(model.hidden(batch["inputs"], dropout_rng=rng))
        logp_BT = F.token_logprobs(logits_BTV, batch["targets"], g.temperature)
        per_token_BT, aux = grpo.surrogate_loss(
            logp_BT, batch["old_logp"], batch["advantages"], eps_low=g.eps_low, eps_high=g.eps_high,
            ref_logp_BT=batch.get("ref_logp"), kl_coef=g.kl_coef,
        )  # fmt: skip
        total, count = grpo.aggregate(per_token_BT, batch["mask"], g.loss_aggregation, g.max_new_tokens)
        m_BT = batch["mask"].astype(jnp.float32)
        sums = {"loss": total, "count": count, "sampled_tokens": m_BT.sum(), "kl": jnp.sum(aux["kl"] * m_BT),
                "clipped": jnp.sum(aux["clipped"] * m_BT)}  # fmt: skip
        return total, sums

    def metrics(sums):
        tokens = jnp.maximum(sums["sampled_tokens"], 1.0)
        return {"loss": sums["loss"] / jnp.maximum(sums["count"], 1.0), "kl": sums["kl"] / tokens,
                "clip_fraction": sums["clipped"] / tokens, "tokens": sums["sampled_tokens"]}  # fmt: skip

    return loss, metrics


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature"))
def _logprobs(graphdef, weights, inputs_BT, targets_BT, *, temperature):
    """The targets' log-probabilities [B, T] under the model of (graphdef, weights), training layout."""
    from jaxformer.layers import without_id_checks

    model = without_id_checks(nnx.merge(graphdef, weights))
    return F.token_logprobs(model.head(model.hidden(inputs_BT)), targets_BT, temperature)


def reference_weights(state, kept=None):
    """The reference's weights: with LoRA the state's with every adapter at zero (the frozen base, as
    it came); else `kept`, the starting parameters.

    Args:
        state (TrainState): the training state.
        kept (nnx.State | None): the starting parameters (full training).

    Returns:
        weights (nnx.State | None): for `nnx.merge(graphdef, weights)`.
    """
    if state.frozen is None:
        return kept
    return nnx.merge_state(jax.tree.map(jnp.zeros_like, state.params), state.frozen)


# ----------------------------------------------------------------------------- rollouts


def request_seed(seed: int, step: int, prompt: int, sample: int) -> int:
    """The sampling seed of one request: a function of (seed, step, prompt, sample) alone.

    Args:
        seed: the run's seed.
        step: the iteration.
        prompt: the prompt's index in the step.
        sample: the sample's index in its group.

    Returns:
        A uint32 seed.
    """
    return zlib.crc32(f"grpo/{seed}/{step}/{prompt}/{sample}".encode())


def rollout(engine, prompts: list[list[int]], group_size: int, max_new_tokens: int, temperature: float, seed: int,
            step: int) -> list[dict]:  # fmt: skip
    """G samples of each prompt from `engine`, the first of each group admitted first so the others
    share its prompt's pages.

    Args:
        engine (Engine): the engine (no requests running).
        prompts: token-id prompts (BOS first).
        group_size: G.
        max_new_tokens: tokens a sample may have (EOS included).
        temperature: the sampling temperature.
        seed: the run's seed.
        step: the iteration (with `seed`, it fixes every draw).

    Returns:
        P x G samples, prompt-major: {"tokens": sampled ids (EOS included when drawn), "text_ids": the
        ids before EOS, "logprobs": the engine's log-probabilities of "tokens" at temperature 1,
        "finish_reason"}.
    """
    from jaxformer.engine import SamplingParams

    got: dict[str, dict] = {}

    def add(i, j):
        params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, logprobs=True,
                                seed=request_seed(seed, step, i, j))  # fmt: skip
        rid = engine.add_request(prompts[i], params, request_id=f"grpo-{step}-{i}-{j}")
        got[rid] = {"ids": [], "logprobs": [], "finish_reason": None}
        return rid

    def pump():
        for ev in engine.step():
            r = got[ev.request_id]
            r["ids"] += ev.token_ids
            r["logprobs"] += ev.logprobs or []
            if ev.finished:
                r["finish_reason"] = ev.finish_reason

    firsts = [add(i, 0) for i in range(len(prompts))]
    while any(not got[r]["ids"] and got[r]["finish_reason"] is None for r in firsts):
        pump()  # until each group's first has read its prompt: its full pages are then in the prefix cache
    ids = {(i, 0): r for i, r in enumerate(firsts)}
    ids |= {(i, j): add(i, j) for i in range(len(prompts)) for j in range(1, group_size)}
    while engine.has_unfinished():
        pump()
    out = []
    for i in range(len(prompts)):
        for j in range(group_size):
            r = got[ids[i, j]]
            eos = [engine.eos_id] if r["finish_reason"] == "stop" else []
            out.append({"tokens": r["ids"] + eos, "text_ids": r["ids"], "logprobs": r["logprobs"],
                        "finish_reason": r["finish_reason"]})  # fmt: skip
    return out


def make_batch(prompts: list[list[int]], samples: list[dict], group_size: int, width: int) -> dict:
    """The update's rows: BOS, prompt and completion shifted by one into inputs and targets [B, width],
    the mask on the completion's targets.

    Args:
        prompts: the P prompts (BOS first).
        samples: P x G samples (`rollout`).
        group_size: G.
        width: T, the row's positions (`data.max_len`).

    Returns:
        {"inputs", "targets": int32 [B, T], "mask": float32 [B, T]}.

    Raises:
        ValueError: a prompt and its completion longer than `width` + 1 (naming the prompt).
    """
    B = len(samples)
    inputs, targets, mask = np.zeros((B, width), np.int32), np.zeros((B, width), np.int32), np.zeros((B, width))
    for b, s in enumerate(samples):
        prompt = prompts[b // group_size]
        row = prompt + s["tokens"]
        if len(row) - 1 > width:
            raise ValueError(f"prompt {b // group_size} ({len(prompt)} tokens) and a completion of "
                             f"{len(s['tokens'])} exceed data.max_len={width} positions")  # fmt: skip
        inputs[b, : len(row) - 1], targets[b, : len(row) - 1] = row[:-1], row[1:]
        mask[b, len(prompt) - 1 : len(row) - 1] = 1.0
    return {"inputs": inputs, "targets": targets, "mask": mask.astype(np.float32)}


def logp_gap(samples: list[dict], prompts: list[list[int]], group_size: int, logp_BT: np.ndarray) -> float:
    """The largest |engine log-probability - training layout's| over the sampled tokens (EOS aside).

    Args:
        samples: P x G samples (`rollout`).
        prompts: the P prompts.
        group_size: G.
        logp_BT: [B, T] the training layout's log-probabilities of the batch's targets (temperature 1).

    Returns:
        The largest absolute difference.
    """
    gap = 0.0
    for b, s in enumerate(samples):
        start = len(prompts[b // group_size]) - 1
        ours = logp_BT[b, start : start + len(s["logprobs"])]
        gap = max(gap, float(np.abs(np.asarray(s["logprobs"]) - ours).max(initial=0.0)))
    return gap


# ----------------------------------------------------------------------------- supervised warm-up


def sft_batch(tok: CharTokenizer, records: list[dict], width: int) -> dict:
    """Teacher-forced lm rows of (prompt, answer) records, the loss on the answer and EOS only.

    Args:
        tok: the tokenizer.
        records: {"prompt", "answer"} records.
        width: T.

    Returns:
        {"inputs", "targets", "weights"} [B, T].
    """
    B = len(records)
    inputs, targets, weights = np.zeros((B, width), np.int32), np.zeros((B, width), np.int32), np.zeros((B, width))
    for b, r in enumerate(records):
        prompt = [tok.bos_id, *tok.encode(r["prompt"])]
        row = prompt + tok.encode(r["answer"]) + [tok.eos_id]
        n = min(len(row) - 1, width)
        inputs[b, :n], targets[b, :n] = row[:n], row[1 : n + 1]
        weights[b, len(prompt) - 1 : n] = 1.0
    return {"inputs": inputs, "targets": targets, "weights": weights.astype(np.float32)}


def supervised_start(cfg: Config, workdir: pathlib.Path, mesh, task, tok, log) -> nnx.State:
    """`grpo.sft_steps` supervised steps on the task's train split (full parameters, no LoRA), saved in
    workdir/sft and restored from there on a rerun.

    Args:
        cfg: the run's config.
        workdir: the run's directory.
        mesh (jax.sharding.Mesh): the device mesh.
        task (Callable): the task.
        tok (CharTokenizer): the tokenizer.
        log (Callable): where progress lines go.

    Returns:
        The parameters it ends with.
    """
    from jaxformer.checkpoint import Checkpointer
    from jaxformer.state import init_state
    from jaxformer.train import jit_steps, make_steps

    g = cfg.grpo
    train = dataclasses.replace(
        cfg.train, steps=g.sft_steps, batch_size=g.sft_batch_size, grad_accum=1, learning_rate=g.sft_learning_rate,
        schedule="constant", warmup_steps=max(1, g.sft_steps // 10),
    )  # fmt: skip
    scfg = dataclasses.replace(cfg, lora=LoRAConfig(), grpo=dataclasses.replace(g, group_size=0), train=train)
    graphdef, state, optimizer = init_state(scfg, mesh)
    ckpt = Checkpointer(workdir / "sft", scfg)
    state = ckpt.restore_latest(state) or state
    step = jit_steps(*make_steps(graphdef, scfg, optimizer), state, mesh)[0]
    start = int(state.step)
    for t in range(start, g.sft_steps):
        records = task("train", g.sft_batch_size, seed=zlib.crc32(f"sft/{cfg.train.seed}/{t}".encode()))
        check_records(records, tok, cfg, f"grpo.task train (sft step {t})")
        batch = sharding.global_batch(sft_batch(tok, records, cfg.data.max_len), mesh, g.sft_batch_size)
        state, metrics = step(state, batch)
        if (t + 1) % cfg.train.log_every == 0 or t + 1 == g.sft_steps:
            log(f"sft step {t + 1}: loss {float(metrics['loss']):.4f}, accuracy {float(metrics['accuracy']):.3f}")
    if start < g.sft_steps:
        ckpt.save(state)
        ckpt.wait()
    ckpt.close()
    return state.params


# ----------------------------------------------------------------------------- the loop


def exact_match_rate(engine, tok: CharTokenizer, records: list[dict], max_new_tokens: int) -> float:
    """The fraction of `records` the engine answers exactly, greedily.

    Args:
        engine (Engine): the engine.
        tok: the tokenizer.
        records: {"prompt", "answer"} records.
        max_new_tokens: tokens an answer may have.

    Returns:
        The fraction.
    """
    from jaxformer.engine import SamplingParams

    prompts = [[tok.bos_id, *tok.encode(r["prompt"])] for r in records]
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_new_tokens, temperature=0.0))
    answers = [r["answer"] for r in records]
    return float(np.mean(rewards.exact_match([], [tok.decode(o.token_ids) for o in outs], answers)))


def engine_config(cfg: Config) -> EngineConfig:
    """The engine's pool for a GRPO step: every sample of the step a slot, pages of 4 positions, prompts
    prefilled in one chunk of at most the model's max_len (a wider chunk reads positions past a learned
    table's end, which made the engine emit pad ids).

    Args:
        cfg: the run's config.

    Returns:
        The engine's config.
    """
    page, slots = 4, min(cfg.train.batch_size, 64)
    per_seq = -(-cfg.model.max_len // page)
    return EngineConfig(page_size=page, num_pages=slots * per_seq + 1, max_slots=slots,
                        prefill_chunk=min(32, cfg.model.max_len), decode_steps=4)  # fmt: skip


def load_task(spec: str) -> Callable:
    """`grpo.task` loaded, each call's result checked: `task(split, count, seed=...)` -> its records.

    Args:
        spec: the task's `module:function` or `file.py:function`.

    Returns:
        The task, called as the loop calls it: a list of `count` records.

    Raises:
        RewardError: a spec that cannot be loaded; from a call, a task that raises (its error's type and
            message) or returns anything but a list of `count` records.
    """
    task = rewards.load_callable(spec, "grpo.task")

    def records(split: str, count: int, seed: int) -> list:
        try:
            out = task(split, count, seed=seed)
        except Exception as e:
            raise rewards.RewardError(f"grpo.task {spec} raised {type(e).__name__}: {e}") from e
        if not isinstance(out, (list, tuple)) or len(out) != count:
            got = f"{len(out)} records" if isinstance(out, (list, tuple)) else type(out).__name__
            raise rewards.RewardError(f"grpo.task {spec} returned {got} for ({split!r}, {count}): a list of {count}")
        return list(out)

    return records


def check_records(records: list[dict], tok: CharTokenizer, cfg: Config, where: str) -> list[list[int]]:
    """The prompts' ids (BOS first), each checked against the context before anything is sampled.

    Args:
        records: the task's records.
        tok: the tokenizer.
        cfg: the run's config.
        where: what the records are (named in errors).

    Returns:
        The prompts' ids.

    Raises:
        ValueError: a record that is not {"prompt", "answer"} strings, a character outside grpo.chars, or
            a prompt whose completion cannot fit data.max_len (naming the record).
    """
    out = []
    for i, r in enumerate(records):
        if not (isinstance(r, dict) and isinstance(r.get("prompt"), str) and isinstance(r.get("answer"), str)):
            raise ValueError(f"{where} record {i}: {r!r} is not a dict of 'prompt' and 'answer' strings")
        try:
            ids = [tok.bos_id, *tok.encode(r["prompt"])]
        except ValueError as e:
            raise ValueError(f"{where} record {i} ({r['prompt']!r}): {e} (grpo.chars)") from None
        if len(ids) - 1 + cfg.grpo.max_new_tokens > cfg.data.max_len:
            raise ValueError(
                f"{where} record {i} ({r['prompt']!r}): {len(ids) - 1} prompt tokens + grpo.max_new_tokens="
                f"{cfg.grpo.max_new_tokens} exceed data.max_len={cfg.data.max_len}"
            )
        out.append(ids)
    return out


def run(cfg: Config, workdir: str | pathlib.Path, *, quiet: bool = False) -> dict:
    """GRPO on `cfg.grpo`'s task in `workdir`, resuming from its latest checkpoint (one process).

    Args:
        cfg: the run's config (`grpo.group_size` > 0).
        workdir: the run's directory (metrics.jsonl, checkpoints; sft/ for the warm-up).
        quiet: no progress output.

    Returns:
        {"state", "graphdef", "engine", "eval": {step: exact match}, "history": per-iteration metrics,
        "preempted": whether SIGTERM or Ctrl-C stopped the run (saved) before `train.steps`}.

    Raises:
        ValueError: GRPO off, a task or reward that cannot be loaded or fails, or a prompt over the context.
    """
    if not cfg.grpo.enabled:
        raise ValueError("grpo.group_size: 0 turns GRPO off; set it (>= 2) to run GRPO")
    mesh = sharding.make_mesh(cfg.mesh)
    with sharding.use(mesh, sharding.rules_for(cfg.mesh)):
        return _run(cfg, pathlib.Path(workdir), mesh, (lambda *a: None) if quiet else print)


def _run(cfg: Config, workdir: pathlib.Path, mesh, log) -> dict:
    from jaxformer import lora, observe
    from jaxformer.checkpoint import Checkpointer
    from jaxformer.engine import Engine
    from jaxformer.models import Transformer
    from jaxformer.state import init_state, start_state, state_shardings
    from jaxformer.train import Preemption, jit_steps, make_steps

    g, tcfg = cfg.grpo, cfg.train
    tok = CharTokenizer(g.chars)
    task = load_task(g.task)
    fns = [(spec, rewards.load_callable(spec, "grpo.rewards")) for spec in g.rewards]
    P = tcfg.batch_size // g.group_size
    held_out = task("test", g.eval_prompts, seed=tcfg.seed)
    check_records(held_out, tok, cfg, "grpo.task test")  # a bad task fails before anything is written
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))

    graphdef, state, optimizer = init_state(cfg, mesh)
    ckpt = Checkpointer(workdir, cfg)
    restored = ckpt.restore_latest(state)
    kept = None
    if restored is None or (g.kl_coef and state.frozen is None):
        if g.sft_steps:
            base = nnx.merge(*nnx.split(Transformer(cfg.model, rngs=nnx.Rngs(params=tcfg.seed))))
            nnx.update(base, supervised_start(cfg, workdir, mesh, task, tok, log))
            model = lora.quantize_base(lora.add_adapters(base, cfg.lora), cfg.lora)
            fresh = start_state(cfg, nnx.state(model, nnx.Param), optimizer)
            state = jax.device_put(fresh, state_shardings(cfg, jax.eval_shape(lambda: fresh), mesh))
        kept = state.params if state.frozen is None and g.kl_coef else None
        if kept is not None:
            kept = jax.tree.map(jnp.copy, kept)  # the step donates the state's arrays
    if restored is not None:
        state = restored
        log(f"resumed from {ckpt.directory / str(int(state.step))}")
    loss, metrics_of = grpo_loss(cfg)
    train_step = jit_steps(*make_steps(graphdef, cfg, optimizer, loss=loss, metrics=metrics_of), state, mesh)[0]
    engine = Engine(nnx.merge(graphdef, state.weights), engine_config(cfg), tokenizer=tok, eos_id=tok.eos_id,
                    bos_id=tok.bos_id)  # fmt: skip
    start = int(state.step) // g.updates
    writer = observe.MetricWriter(workdir, int(state.step))
    evals, history = {}, []

    def evaluate(it):
        engine.load_weights(nnx.merge(graphdef, state.weights))
        evals[it] = exact_match_rate(engine, tok, held_out, g.max_new_tokens)
        writer.write(it * g.updates, "eval", {"exact_match": evals[it]})
        log(f"iteration {it}: held-out exact match {evals[it]:.3f} ({len(held_out)} prompts, greedy)")

    # SIGTERM or Ctrl-C stops the run at the end of the iteration, saved, as `train` does (its handler, restored after)
    preemption, preempted = Preemption(ckpt.manager).__enter__(), False
    try:  # a task or reward that fails stops the run; the checkpoints already saved are kept, whole
        if start == 0:
            evaluate(0)
        for it in range(start, tcfg.steps):
            t0 = time.perf_counter()
            records = task("train", P, seed=zlib.crc32(f"grpo/{tcfg.seed}/{it}".encode()))
            prompts = check_records(records, tok, cfg, f"grpo.task train (iteration {it})")
            engine.load_weights(nnx.merge(graphdef, state.weights))  # the policy's arrays as they are now
            samples = rollout(engine, prompts, g.group_size, g.max_new_tokens, g.temperature, tcfg.seed, it)
            t1 = time.perf_counter()
            texts = [tok.decode(s["text_ids"]) for s in samples]
            expand = lambda xs: [x for x in xs for _ in range(g.group_size)]
            reward_B, parts = rewards.score(fns, g.weights, expand([r["prompt"] for r in records]), texts,
                                            expand([r["answer"] for r in records]))  # fmt: skip
            reward_PG = reward_B.reshape(P, g.group_size)
            adv_B = np.asarray(grpo.group_advantages(jnp.asarray(reward_PG), scale=g.scale_rewards)).reshape(-1)
            keep_P = (
                np.asarray(grpo.informative_groups(jnp.asarray(reward_PG))) if g.dynamic_sampling else np.ones(P, bool)
            )
            batch = make_batch(prompts, samples, g.group_size, cfg.data.max_len)
            batch["mask"] *= np.repeat(keep_P, g.group_size)[:, None]
            batch["advantages"] = adv_B.astype(np.float32)
            weights = state.weights
            old = _logprobs(graphdef, weights, batch["inputs"], batch["targets"], temperature=g.temperature)
            batch["old_logp"] = np.asarray(old)
            if g.kl_coef:
                ref = reference_weights(state, kept)
                batch["ref_logp"] = np.asarray(_logprobs(graphdef, ref, batch["inputs"], batch["targets"],
                                                         temperature=g.temperature))  # fmt: skip
            row = {"reward": float(reward_B.mean()), **parts, "groups_kept": float(keep_P.mean()),
                   "completion_tokens": float(batch["mask"].sum() / max(keep_P.sum() * g.group_size, 1))}  # fmt: skip
            if g.temperature == 1.0:  # the engine's log-probabilities (EOS's not given) against the training layout's
                row["logp_gap"] = logp_gap(samples, prompts, g.group_size, batch["old_logp"])
            if keep_P.any():
                device_batch = sharding.global_batch(batch, mesh, tcfg.batch_size)
                for _ in range(g.updates):
                    state, metrics = train_step(state, device_batch)
                row |= {k: float(v) for k, v in metrics.items()}
            else:  # every group's rewards were equal: nothing to learn from, no step (the counter moves on)
                state = state.replace(step=state.step + g.updates)
            row |= {"rollout_s": t1 - t0, "update_s": time.perf_counter() - t1}
            history.append(row)
            writer.write(it * g.updates, "train", row)  # its first step, as `fit` logs a step
            if (it + 1) % tcfg.log_every == 0 or it + 1 == tcfg.steps:
                log(f"iteration {it + 1}: reward {row['reward']:.3f}, loss {row.get('loss', 0.0):.4f}, "
                    f"rollout {row['rollout_s']:.2f}s, update {row['update_s']:.2f}s")  # fmt: skip
            done = it + 1
            if done % tcfg.eval_every == 0 or done == tcfg.steps:
                evaluate(done)
            preempted = preemption.reached(int(state.step)) and done < tcfg.steps
            if done % cfg.checkpoint.every == 0 or done == tcfg.steps or preempted:
                ckpt.save(state)
            if preempted:  # "saved" only once it is: a save that cannot be written raises here
                ckpt.wait()
                why = preemption.requested or "preemption"  # shown even when quiet: it says how to go on
                print(f"{why}: saved step {int(state.step)} to {ckpt.directory}; rerun the same command to resume")
                break
    finally:
        preemption.__exit__()
        ckpt.wait()
        ckpt.close()
        writer.close()
    engine.load_weights(nnx.merge(graphdef, state.weights))
    return {"state": state, "graphdef": graphdef, "engine": engine, "eval": evals, "history": history,
            "preempted": preempted}  # fmt: skip
