"""Preference tuning (jaxformer.post_train): the DPO family's losses and metrics equal Hugging Face TRL's on
the same log-probabilities (tests/golden/dpo, made by scripts/make_dpo_golden.py), completion-only
log-probs equal each completion scored alone, pairs are read and laid out as documented, and the train
step's reference is the starting model: with LoRA the base without its adapters, held once."""

import json
import pathlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxformer as jf
from jaxformer.config import Config, DataConfig, LoRAConfig, PreferenceConfig, TrainConfig
from jaxformer.data import ByteTokenizer, templates
from jaxformer.post_train import pair_loss, pairs
from jaxformer.post_train import preference as P
from jaxformer.state import init_state
from jaxformer.train import make_steps, summarize

GOLDEN = np.load(pathlib.Path(__file__).parent / "golden" / "dpo" / "trl.npz")
B = len(GOLDEN["token_logps"]) // 2  # pairs; rows 0..B-1 chosen, B..2B-1 rejected
TOL = {"rtol": 1e-5, "atol": 1e-6}


def golden_logps():
    """Per-sequence sums, token counts and means of the golden per-token log-probs: (chosen, rejected) each."""
    mask = jnp.asarray(GOLDEN["completion_mask"][:, 1:], jnp.float32)  # TRL's shifted completion mask
    sums, counts = P.sequence_logprobs(jnp.asarray(GOLDEN["token_logps"], jnp.float32), mask)
    ref, _ = P.sequence_logprobs(jnp.asarray(GOLDEN["ref_token_logps"], jnp.float32), mask)
    split = lambda x: (x[:B], x[B:])
    return split(sums), split(ref), split(counts), split(sums / counts)


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_dpo_and_ipo_equal_trls_dpo_trainer(loss):
    """TRL's DPOTrainer computed the batch's loss and its logged metrics from the same per-token log-probs."""
    (c, r), (rc, rr), tokens, _ = golden_logps()
    per_pair = P.preference_loss(loss, c, r, rc, rr, beta=float(GOLDEN["beta"]), tokens=tokens)
    for name in ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                 "logps/chosen", "logps/rejected"):  # fmt: skip
        np.testing.assert_allclose(per_pair[name].mean(), GOLDEN[f"{loss}/{name}"], **TOL, err_msg=name)


def test_cdpo_simpo_and_orpo_equal_trls_per_pair():
    """Label-smoothed DPO and SimPO (TRL's CPOTrainer.cpo_loss), ORPO's odds-ratio term (ORPOTrainer)."""
    (c, r), (rc, rr), _, (cm, rm) = golden_logps()
    beta, eps, gamma = (float(GOLDEN[k]) for k in ("beta", "label_smoothing", "simpo_gamma"))
    got = {
        "cdpo": P.dpo_sigmoid_loss(c, r, rc, rr, beta, eps),
        "simpo": P.simpo_loss(cm, rm, beta, gamma),
        "simpo_smoothed": P.simpo_loss(cm, rm, beta, gamma, eps),
    }
    for name, (losses, chosen, rejected) in got.items():
        np.testing.assert_allclose(losses, GOLDEN[f"{name}/losses"], **TOL, err_msg=name)
        np.testing.assert_allclose(chosen, GOLDEN[f"{name}/rewards_chosen"], **TOL, err_msg=name)
        np.testing.assert_allclose(rejected, GOLDEN[f"{name}/rewards_rejected"], **TOL, err_msg=name)
    losses, chosen, rejected, ratio, log_odds = P.orpo_loss(cm, rm, beta)
    np.testing.assert_allclose(-losses, GOLDEN["orpo/losses"], **TOL)  # TRL returns beta * ratio and subtracts it
    np.testing.assert_allclose(chosen, GOLDEN["orpo/rewards_chosen"], **TOL)
    np.testing.assert_allclose(rejected, GOLDEN["orpo/rewards_rejected"], **TOL)
    np.testing.assert_allclose(ratio.mean(), GOLDEN["orpo/log_odds_ratio"], **TOL)
    np.testing.assert_allclose(log_odds.mean(), GOLDEN["orpo/log_odds_chosen"], **TOL)
    full = P.preference_loss("orpo", cm, rm, beta=beta, chosen_nll=-cm)
    np.testing.assert_allclose(full["loss"], -cm + losses, **TOL)  # ORPO's loss: the SFT NLL plus the odds term


def test_completion_logprobs_equal_trls_get_batch_logps():
    """Token log-probs from logits, summed and averaged over the completion (labels -100 on the prompt)."""
    logits, ids, mask = (jnp.asarray(GOLDEN[k]) for k in ("logits", "ids", "completion_mask"))
    logp = jf.functional.token_logprobs(logits[:, :-1], ids[:, 1:])  # position t predicts token t + 1
    sums, counts = P.sequence_logprobs(logp, mask[:, 1:].astype(jnp.float32))
    np.testing.assert_allclose(sums, GOLDEN["batch_logps/sum"], **TOL)
    np.testing.assert_allclose(sums / counts, GOLDEN["batch_logps/mean"], **TOL)


# ----------------------------------------------------------------------------- the model's log-probs

V = 32
TOK = types.SimpleNamespace(pad_id=0, bos_id=1, eos_id=2)
PROMPTS = [np.array([5, 6, 7]), np.array([8, 9])]
COMPLETIONS = [(np.array([10, 11, 2]), np.array([12, 2])), (np.array([13, 2]), np.array([14, 15, 16, 2]))]


@pytest.mark.parametrize("mode", ["decoder_only", "encoder_decoder"])
def test_pair_logprobs_are_each_completion_scored_alone(mode):
    """Padded [B, 2, T] rows give each completion's log-prob as the model scores it alone, unpadded:
    prompt masked, padding (decoder_only: right of the row; encoder_decoder: the source's) inert."""
    model = jf.build_model(jf.tiny(mode, vocab_size=V, max_len=16))
    S = 6 if mode == "encoder_decoder" else 0
    prompts = [np.append(p, TOK.eos_id) for p in PROMPTS] if S else PROMPTS  # the source ends in EOS
    batch = pairs.PreferencePairs(prompts, COMPLETIONS, 8, S, TOK).take(np.arange(2))

    def alone(model, prompt, completion):
        if S:  # the decoder reads BOS + the completion, the encoder the prompt alone
            logits = model(jnp.asarray(prompt)[None], jnp.asarray(np.append(TOK.bos_id, completion[:-1]))[None])
            return jax.nn.log_softmax(logits[0].astype(jnp.float32))[np.arange(len(completion)), completion]
        # prompt + completion; position t predicts token t + 1; the completion's from len(prompt) - 1
        row = np.concatenate([prompt, completion])
        logits = model(jnp.asarray(row[:-1])[None])[0].astype(jnp.float32)
        return jax.nn.log_softmax(logits)[np.arange(len(prompt) - 1, len(row) - 1), completion]

    @nnx.jit
    def score(model, batch):  # one compile: the padded pairs and each completion scored alone
        alones = [[alone(model, p, c).sum() for c in pair] for p, pair in zip(prompts, COMPLETIONS, strict=True)]
        return pair_loss.pair_logprobs(model, batch, None), alones

    (sums, counts), alones = score(model, {k: jnp.asarray(v) for k, v in batch.items()})
    for b, pair in enumerate(COMPLETIONS):
        for j, completion in enumerate(pair):
            np.testing.assert_allclose(sums[b, j], alones[b][j], rtol=1e-5, err_msg=f"pair {b}, completion {j}")
            assert counts[b, j] == len(completion)


# ----------------------------------------------------------------------------- the train step


def run_config(**preference) -> Config:
    """A tiny decoder-only preference run (its data is never read here: steps take batches given)."""
    lora = preference.pop("lora", 0)
    return Config(
        model=jf.tiny("decoder_only", vocab_size=V, max_len=16, num_decoder_layers=1),
        data=DataConfig(source="files", files=("pairs.jsonl",), tokenizer="byte", max_len=8),
        train=TrainConfig(
            objective="preference", batch_size=2, learning_rate=1e-2, warmup_steps=0, schedule="constant", num_samples=0
        ),
        lora=LoRAConfig(rank=lora, targets=("q", "v", "wo")) if lora else LoRAConfig(),
        preference=PreferenceConfig(**preference),
    )


@pytest.fixture(scope="module")
def batch():
    return {k: jnp.asarray(v) for k, v in pairs.PreferencePairs(PROMPTS, COMPLETIONS, 8, 0, TOK).take([0, 1]).items()}


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


@pytest.fixture(scope="module")
def lora_run(batch):
    """The LoRA run's state, its jitted steps, and the compiled step's memory with the reference as the base
    without adapters (this module's way) and as a stored copy of the weights (what it avoids)."""
    cfg = run_config(lora=4, beta=0.5)
    graphdef, state, optimizer = init_state(cfg)
    train_step, eval_step = make_steps(graphdef, cfg, optimizer)
    copied = state.replace(reference=state.weights)  # a second copy of every weight, as a full run keeps it
    memory = {
        name: jax.jit(train_step, donate_argnums=0).lower(s, batch).compile().memory_analysis()
        for name, s in (("adapters off", state), ("copy", copied))
    }
    return state, jax.jit(train_step, donate_argnums=0), jax.jit(eval_step), memory


def test_lora_reference_is_the_base_held_once(lora_run, batch):
    """The compiled LoRA step reads the base once: its arguments are the state and the batch, and a stored
    reference adds exactly one more copy of the weights; its scratch memory is no larger without that copy."""
    state, _, _, memory = lora_run
    mine, copy = memory["adapters off"], memory["copy"]
    assert mine.argument_size_in_bytes == nbytes(state) + nbytes(batch)
    assert copy.argument_size_in_bytes - mine.argument_size_in_bytes == nbytes(state.weights)
    assert mine.temp_size_in_bytes <= copy.temp_size_in_bytes


def test_lora_run_starts_at_its_reference_and_learns_the_pairs(lora_run, batch):
    """Step 0: the policy is the reference (B = 0), every reward 0 and DPO's loss log 2; then the adapters
    learn to rank both pairs, and the base (the reference) never moves."""
    state, train_step, eval_step, _ = lora_run
    start = {k: float(v) for k, v in summarize(eval_step(state, batch)).items()}
    assert start["loss"] == pytest.approx(np.log(2), abs=1e-6)
    assert start["rewards/chosen"] == start["rewards/rejected"] == start["rewards/accuracies"] == 0
    assert start["pairs"] == 2
    base = jax.tree.map(np.asarray, state.frozen)
    for _ in range(10):
        state, metrics = train_step(state, batch)
    assert float(metrics["loss"]) < start["loss"] and float(metrics["rewards/accuracies"]) == 1.0
    assert float(metrics["rewards/margins"]) > 0
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, base, jax.tree.map(np.asarray, state.frozen))))


def test_full_run_keeps_a_frozen_copy_and_simpo_keeps_none(batch):
    """Without LoRA the state holds the starting weights as its reference (not optimised, its own buffers);
    SimPO and ORPO read no reference, so their state holds none."""
    cfg = run_config(loss="ipo")
    graphdef, state, optimizer = init_state(cfg)
    start = jax.tree.map(np.asarray, state.params)
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, start, jax.tree.map(np.asarray, state.reference))))
    train_step = jax.jit(make_steps(graphdef, cfg, optimizer)[0], donate_argnums=0)
    state, metrics = train_step(state, batch)
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), start, jax.tree.map(np.asarray, state.params))
    assert any(jax.tree.leaves(moved)) and np.isfinite(float(metrics["loss"]))
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, start, jax.tree.map(np.asarray, state.reference))))
    assert init_state(run_config(loss="simpo"))[1].reference is None
    assert init_state(run_config(loss="orpo"))[1].reference is None


# ----------------------------------------------------------------------------- data


def test_records_plain_and_conversational_are_read_as_documented(tmp_path):
    """Plain records written in the template and TRL's conversational form give the same texts; the
    batch weights exactly the completion (EOS included) of each row."""
    path = tmp_path / "pairs.jsonl"
    system = {"role": "system", "content": "Be brief."}
    rows = [
        {"prompt": "Upper: ab", "chosen": "AB", "rejected": "BA"},
        {"prompt": [system, {"role": "user", "content": "Upper: cd"}],
         "chosen": [{"role": "assistant", "content": "CD"}], "rejected": [{"role": "assistant", "content": "DC"}]},
        {"prompt": "Sort: ba", "chosen": "ab", "rejected": "ba"},
    ]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = Config(
        model=jf.tiny("decoder_only", vocab_size=260, max_len=160),
        data=DataConfig(source="files", files=(str(path),), template="chatml", tokenizer="byte", max_len=128),
        train=TrainConfig(objective="preference", batch_size=1, num_samples=0),
    )
    records = pairs.read_pairs(cfg)
    chatml = templates.get("chatml")
    assert records[0][1:] == (chatml.prompt("Upper: ab"), "AB<|im_end|>", "BA<|im_end|>")
    assert records[1][1] == chatml.conversation([system, {"role": "user", "content": "Upper: cd"}])
    assert records[1][2:] == ("CD<|im_end|>", "DC<|im_end|>") and records[0][0].endswith("pairs.jsonl:1")
    tok = ByteTokenizer()
    prompts, completions = pairs.tokenize(cfg, tok, records)
    batch = pairs.PreferencePairs(prompts, completions, 128, 0, tok).take(np.arange(3))
    for b, (_, prompt, *texts) in enumerate(records):
        for j, text in enumerate(texts):
            kept = batch["targets"][b, j][batch["weights"][b, j] == 1]
            assert tok.decode(kept) == text and kept[-1] == tok.eos_id  # the completion and its EOS, nothing else
            assert tok.decode(batch["inputs"][b, j][: len(tok.encode(prompt))]) == prompt


def test_a_state_saved_before_the_reference_field_still_restores(tmp_path):
    """A checkpoint whose tree has no `reference` entry (as every one saved before it existed) restores into
    a state without a reference, array for array, instead of being set aside as unreadable."""
    import dataclasses

    import orbax.checkpoint as ocp

    from jaxformer.checkpoint import Checkpointer

    cfg = Config(
        model=jf.tiny("decoder_only", vocab_size=V, max_len=16, num_decoder_layers=1), data=DataConfig(max_len=8)
    )
    _, state, _ = init_state(cfg)
    old = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "reference"}
    ckpt = Checkpointer(tmp_path, cfg)
    meta = {"config": cfg.to_dict(), "data": {"step": 0, "seed": 0}}
    ckpt.manager.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave(old), meta=ocp.args.JsonSave(meta)))
    ckpt.wait()
    restored = ckpt.restore_latest(state)
    ckpt.close()
    assert restored is not None and restored.reference is None
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, jax.tree.map(np.asarray, state), restored)))


# ----------------------------------------------------------------------------- exact resume


def dpo_tiny(steps=4):
    """experiments/dpo_tiny.py shrunk: 4 steps of 4 pairs from its first 96 records, saved every 2 steps."""
    from jaxformer.config import apply_overrides, load_experiment

    sets = [
        f"train.steps={steps}", "train.batch_size=4", "train.log_every=1", "train.eval_every=4", "train.eval_batches=1",
        "train.warmup_steps=1", "train.peak_flops=1e13", "checkpoint.every=2", "data.max_examples=96",
        "model.d_model=16", "model.num_heads=2", "model.d_ff=32", "model.num_decoder_layers=1",
    ]  # fmt: skip
    return apply_overrides(load_experiment("experiments/dpo_tiny.py"), sets)


def dpo_log(workdir) -> list[dict]:
    """metrics.jsonl's records, timings aside."""
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(r).items() if k not in {"tokens_per_s", "mfu", "step_time"}} for r in lines]


def test_a_dpo_run_stopped_by_sigterm_resumes_to_the_uninterrupted_run(tmp_path, monkeypatch):
    """`fit` with the preference objective, sent SIGTERM while its third step of 4 runs, saves step 3 and stops; the
    rerun ends with the uninterrupted run's state (parameters, the reference's copy, Adam's moments) bit for
    bit and its metrics.jsonl, timings aside: the pairs of a step are a function of (seed, step)."""
    import os
    import signal

    from jaxformer import distributed
    from jaxformer.train import fit

    whole = fit(dpo_tiny(), tmp_path / "whole", quiet=True)["state"]
    reached = distributed.reached

    def signalled(step):  # called once a step has been dispatched, with the steps started so far
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        reached(step)

    monkeypatch.setattr(distributed, "reached", signalled)
    caught = []  # a loop that did not take the signal must not end the test session with it
    previous = signal.signal(signal.SIGTERM, lambda *a: caught.append(a))
    try:
        stopped = fit(dpo_tiny(), tmp_path / "resumed", quiet=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not caught and stopped["preempted"] and int(stopped["state"].step) == 3
    assert sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir()) == ["2", "3"]
    monkeypatch.setattr(distributed, "reached", reached)
    resumed = fit(dpo_tiny(), tmp_path / "resumed", quiet=True)["state"]
    assert int(resumed.step) == int(whole.step) == 4
    assert resumed.reference is not None
    for a, b in ((whole.params, resumed.params), (whole.reference, resumed.reference),
                 (whole.opt_state, resumed.opt_state)):  # fmt: skip
        jax.tree.map(np.testing.assert_array_equal, a, b)
    assert dpo_log(tmp_path / "resumed") == dpo_log(tmp_path / "whole")
    assert [r["step"] for r in dpo_log(tmp_path / "whole")] == [0, 1, 2, 3, 4], "train 0-3, the evaluation at 4"
