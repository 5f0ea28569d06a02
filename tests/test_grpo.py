"""GRPO: the maths against a NumPy transcription of the papers' formulas, the rewards, and one tiny
run (rollout from the engine + update) that checks the engine reads the updated weights, that a
rollout is a function of (seed, step), and that a resumed run (extended, or stopped by SIGTERM) ends
with the same parameters and log as an uninterrupted one."""

import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxformer.config import Config, DataConfig, GRPOConfig, ModelConfig, TrainConfig
from jaxformer.post_train import grpo, rewards, rl

# ----------------------------------------------------------------------------- the formulas, by hand


def np_objective(logp, old, ref, mask, rewards_PG, *, eps_low, eps_high, beta, how, scale, max_len=None):
    """The objective J (to be maximised) as the papers write it, one sample and one token at a time.

    GRPO (Shao et al. 2024, eq. 3): J = 1/G sum_i 1/|o_i| sum_t [min(r A, clip(r, 1-e, 1+e) A) - beta D],
    A_i = (R_i - mean(R)) / std(R) over the group, D = ref/pi - log(ref/pi) - 1. DAPO (Yu et al. 2025,
    eq. 8): 1 / sum_i |o_i| sum_i sum_t [...], clip(r, 1 - e_low, 1 + e_high). Dr. GRPO (Liu et al. 2025):
    A_i = R_i - mean(R), and 1 / (G L) sum_i sum_t [...] with L a constant.
    """
    P, G = rewards_PG.shape
    total, normaliser = 0.0, 0.0
    for p in range(P):
        R = rewards_PG[p]
        for i in range(G):
            A = R[i] - R.mean()
            if scale:
                A = A / (np.std(R, ddof=1) + 1e-4)
            b = p * G + i
            n_tokens = int(mask[b].sum())
            seq = 0.0
            for t in range(logp.shape[1]):
                if not mask[b, t]:
                    continue
                r = np.exp(logp[b, t] - old[b, t])
                term = min(r * A, np.clip(r, 1 - eps_low, 1 + eps_high) * A)
                q = np.exp(ref[b, t] - logp[b, t])
                term -= beta * (q - np.log(q) - 1)
                seq += term
            if how == "sequence":
                total += seq / n_tokens
                normaliser += 1
            elif how == "token":
                total += seq
                normaliser += n_tokens
            else:
                total += seq
                normaliser += max_len
    return total / normaliser


@pytest.fixture(scope="module")
def fixed():
    """P = 2 prompts, G = 4 samples, T = 6 positions; ragged masks, ratios inside and outside the clip."""
    rng = np.random.default_rng(0)
    B, T = 8, 6
    logp = -rng.uniform(0.1, 3.0, (B, T))
    old = logp + rng.normal(0, 0.4, (B, T))  # ratios from ~0.3 to ~3: both clips bite
    ref = logp + rng.normal(0, 0.3, (B, T))
    lengths = np.array([6, 3, 1, 5, 2, 6, 4, 3])
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float64)
    rewards_PG = np.array([[1.0, 0.0, 0.5, 0.0], [0.2, 0.9, 0.9, 0.1]])
    return logp, old, ref, mask, rewards_PG


@pytest.mark.parametrize(
    "how, scale, eps_low, eps_high, beta",
    [
        ("sequence", True, 0.2, 0.2, 0.04),  # GRPO as the paper has it
        ("token", True, 0.2, 0.28, 0.0),  # DAPO: token-level, clip-higher, no KL
        ("constant", False, 0.2, 0.2, 0.0),  # Dr. GRPO
        ("sequence", False, 0.1, 0.3, 0.1),
    ],
)
def test_loss_equals_the_papers_formula(fixed, how, scale, eps_low, eps_high, beta):
    logp, old, ref, mask, rewards_PG = fixed
    adv_B = grpo.group_advantages(jnp.asarray(rewards_PG), scale=scale).reshape(-1)
    per_token, _ = grpo.surrogate_loss(
        jnp.asarray(logp, jnp.float32), jnp.asarray(old, jnp.float32), adv_B, eps_low=eps_low, eps_high=eps_high,
        ref_logp_BT=jnp.asarray(ref, jnp.float32), kl_coef=beta,
    )  # fmt: skip
    total, count = grpo.aggregate(per_token, jnp.asarray(mask), how, max_len=6)
    want = np_objective(logp, old, ref, mask, rewards_PG, eps_low=eps_low, eps_high=eps_high, beta=beta, how=how,
                        scale=scale, max_len=6)  # fmt: skip
    np.testing.assert_allclose(-float(total / count), want, rtol=1e-5)


def test_aggregations_add_over_micro_batches(fixed):
    """The sums and counts of two halves add up to the whole's (gradient accumulation stays exact)."""
    logp, old, _, mask, rewards_PG = fixed
    adv = grpo.group_advantages(jnp.asarray(rewards_PG)).reshape(-1)
    loss, _ = grpo.surrogate_loss(jnp.asarray(logp), jnp.asarray(old), adv)
    for how in grpo.AGGREGATIONS:
        whole = grpo.aggregate(loss, jnp.asarray(mask), how, 6)
        halves = [grpo.aggregate(loss[s], jnp.asarray(mask[s]), how, 6) for s in (slice(0, 4), slice(4, 8))]
        np.testing.assert_allclose([sum(h[0] for h in halves), sum(h[1] for h in halves)], whole, rtol=1e-6)


def test_advantages_and_dynamic_sampling():
    r = np.array([[1.0, 1.0, 1.0], [0.0, 1.0, 2.0], [3.0, 3.0, 2.0]])
    adv = np.asarray(grpo.group_advantages(jnp.asarray(r)))
    np.testing.assert_allclose(adv[0], 0.0)  # equal rewards: no signal, and no NaN
    np.testing.assert_allclose(adv[1], [-1 / 1.0001, 0.0, 1 / 1.0001], rtol=1e-6)  # std (ddof 1) = 1
    np.testing.assert_allclose(
        np.asarray(grpo.group_advantages(jnp.asarray(r), scale=False))[2], [1 / 3, 1 / 3, -2 / 3], rtol=1e-6
    )
    np.testing.assert_array_equal(grpo.informative_groups(jnp.asarray(r)), [False, True, True])


def test_gradient_of_the_surrogate_at_the_old_policy():
    """At pi = pi_old the clip is inactive: d loss / d logp = -A per token (the policy gradient)."""
    logp = jnp.log(jnp.array([[0.5, 0.25], [0.1, 0.9]]))
    adv = jnp.array([2.0, -1.0])
    g = jax.grad(lambda lp: jnp.sum(grpo.surrogate_loss(lp, logp, adv)[0]))(logp)
    np.testing.assert_allclose(g, [[-2.0, -2.0], [1.0, 1.0]], rtol=1e-6)


def test_rewards():
    answers = ["12", "7", "-3", "5"]
    outs = [" 12 ", "7x", "the answer is -3", "\\boxed{5.0} then 9"]
    assert rewards.exact_match([], outs, answers) == [1.0, 0.0, 0.0, 0.0]
    assert rewards.format_check([], outs, answers) == [1.0, 0.0, 0.0, 0.0]
    assert rewards.math_answer([], outs, answers) == [1.0, 1.0, 1.0, 1.0]  # "7x": its last number is 7
    fns = [("a:exact_match", rewards.exact_match), ("a:math_answer", rewards.math_answer)]
    total, parts = rewards.score(fns, (1.0, 0.5), [""] * 4, outs, answers)
    np.testing.assert_allclose(total, [1.5, 0.5, 0.5, 0.5])
    assert parts == {"reward/exact_match": 0.25, "reward/math_answer": 1.0}


# ----------------------------------------------------------------------------- one tiny run


def ones(prompts, completions, answers):
    """A dense reward for a model that knows nothing yet: the share of '1' characters."""
    return [c.count("1") / max(len(c), 1) for c in completions]


def tiny_config(steps=1, **grpo_fields):
    return Config(
        model=ModelConfig(
            mode="decoder_only",
            vocab_size=17,
            d_model=16,
            num_heads=2,
            d_ff=32,
            num_encoder_layers=0,
            num_decoder_layers=1,
            max_len=12,
            position="rope",
            dropout_rate=0.0,
        ),
        data=DataConfig(max_len=12),
        train=TrainConfig(
            objective="lm",
            steps=steps,
            batch_size=8,
            learning_rate=3e-2,
            schedule="constant",
            warmup_steps=0,
            eval_every=100,
            log_every=100,
        ),
        grpo=GRPOConfig(group_size=4, rewards=(f"{__file__}:ones",), max_new_tokens=4, eval_prompts=2, **grpo_fields),
    )


@pytest.fixture(scope="module")
def one_run(tmp_path_factory):
    """An engine over the initial weights, its rollout of step 0, then one GRPO iteration's result."""
    cfg = tiny_config(kl_coef=0.1)
    out = rl.run(cfg, tmp_path_factory.mktemp("grpo"), quiet=True)
    return cfg, out


def test_the_engine_samples_from_the_updated_weights(one_run):
    cfg, out = one_run
    engine, graphdef, state = out["engine"], out["graphdef"], out["state"]
    assert int(state.step) == 1 and out["history"][0]["tokens"] > 0
    tok = rl.CharTokenizer(cfg.grpo.chars)
    prompts = [[1, *tok.encode("12+7=")], [1, *tok.encode("3+40=")]]
    after = rl.rollout(engine, prompts, 4, 4, 1.0, seed=0, step=0)
    # The engine's log-probabilities are the updated model's (the training layout's, to float32 noise) ...
    batch = rl.make_batch(prompts, after, 4, cfg.data.max_len)
    ours = np.asarray(rl._logprobs(graphdef, state.weights, batch["inputs"], batch["targets"], temperature=1.0))
    assert rl.logp_gap(after, prompts, 4, ours) < 1e-5
    # ... and differ from the initial model's by far more: the update moved them.
    from jaxformer.state import init_state

    initial = init_state(cfg)[1]
    before = np.asarray(rl._logprobs(graphdef, initial.weights, batch["inputs"], batch["targets"], temperature=1.0))
    assert rl.logp_gap(after, prompts, 4, before) > 1e-2
    # A rollout is a function of (seed, step): again the same tokens, another step other ones.
    again = rl.rollout(engine, prompts, 4, 4, 1.0, seed=0, step=0)
    other = rl.rollout(engine, prompts, 4, 4, 1.0, seed=0, step=1)
    assert [s["tokens"] for s in again] == [s["tokens"] for s in after]
    assert [s["tokens"] for s in other] != [s["tokens"] for s in after]
    assert engine.stats()["prefix_hits"] > 0  # a group's later samples found its first one's prompt pages


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Two iterations at once (a KL penalty: the reference is rebuilt on resume): the resume tests' reference."""
    workdir = tmp_path_factory.mktemp("whole")
    return workdir, rl.run(tiny_config(steps=2, kl_coef=0.1), workdir, quiet=True)["state"]


def log_of(workdir) -> list[dict]:
    """metrics.jsonl's records, timings (rollout_s, update_s) aside."""
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.endswith("_s")} for line in lines]


def assert_same_bits(a, b) -> None:
    pure = lambda t: nnx.to_pure_dict(t) if isinstance(t, nnx.State) else t
    for x, y in zip(jax.tree.leaves(pure(a)), jax.tree.leaves(pure(b)), strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_resumed_run_ends_with_the_same_parameters(tmp_path, uninterrupted):
    """Two iterations at once, or one and a rerun of the same command to two: the same bits, the same log."""
    whole_dir, whole = uninterrupted
    rl.run(tiny_config(steps=1, kl_coef=0.1), tmp_path / "resumed", quiet=True)
    resumed = rl.run(tiny_config(steps=2, kl_coef=0.1), tmp_path / "resumed", quiet=True)["state"]
    logs = [log_of(whole_dir), log_of(tmp_path / "resumed")]
    train = [[r for r in log if r["split"] == "train"] for log in logs]
    assert train[0] == train[1] and len(train[0]) == 2  # the same records, timings aside
    # (the stopped run's final evaluation, at step 1, stays beside the uninterrupted run's)
    assert all(r in logs[1] for r in logs[0] if r["split"] == "eval")
    assert_same_bits(whole.params, resumed.params)


def test_sigterm_mid_iteration_saves_at_its_end_and_the_rerun_is_the_uninterrupted_run(
    tmp_path, uninterrupted, monkeypatch, capsys
):
    """`jaxformer grpo` sent SIGTERM during iteration 0's rollout finishes the iteration, saves step 1,
    says how to go on and exits 3, as `train` does; the same command again ends with the uninterrupted
    run's parameters and optimizer state, bit for bit, and its metrics.jsonl, timings aside."""
    from jaxformer import cli
    from jaxformer.checkpoint import EXIT_PREEMPTED, Checkpointer
    from jaxformer.state import init_state

    whole_dir, whole = uninterrupted
    cfg = tiny_config(steps=2, kl_coef=0.1)
    workdir = tmp_path / "stopped"
    workdir.mkdir()
    (workdir / "config.json").write_text(json.dumps(cfg.to_dict()))  # the command's config: no --config
    rollout = rl.rollout

    def signalled(*args):
        if args[-1] == 0:  # the step: mid-iteration 0, before its update
            os.kill(os.getpid(), signal.SIGTERM)
        return rollout(*args)

    monkeypatch.setattr(rl, "rollout", signalled)
    caught = []  # a loop that did not take the signal must not end the test session with it
    previous = signal.signal(signal.SIGTERM, lambda *a: caught.append(a))
    try:
        code = cli.main(["grpo", "--workdir", str(workdir), "--quiet"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    out = capsys.readouterr().out
    assert not caught and code == EXIT_PREEMPTED, out
    assert f"SIGTERM: saved step 1 to {workdir / 'checkpoints'}; rerun the same command to resume" in out
    assert sorted(os.listdir(workdir / "checkpoints")) == ["1"]
    assert [r["step"] for r in log_of(workdir) if r["split"] == "train"] == [0], "the log stops where the save does"

    monkeypatch.setattr(rl, "rollout", rollout)
    assert cli.main(["grpo", "--workdir", str(workdir), "--quiet"]) == 0
    assert log_of(workdir) == log_of(whole_dir)  # evaluations at 0 and 2, train records of 0 and 1
    ckpt = Checkpointer(workdir, cfg, read_only=True)
    resumed = ckpt.restore_latest(init_state(cfg)[1])
    ckpt.close()
    assert int(resumed.step) == int(whole.step) == 2
    assert_same_bits(whole.params, resumed.params)
    assert_same_bits(whole.opt_state, resumed.opt_state)
