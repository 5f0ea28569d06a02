"""The LoRA walk-through of docs/guides/fine-tuning.md, command for command: a (tiny) GPT-2 directory ->
`import-hf` with LoRA and the user's instruction JSONL in a template -> `train` -> `generate` -> `export-hf`; and the
same for a tiny T5, whose encoder reads the templated prompt and whose decoder writes the response.

The pretrained model is a random tiny GPT-2 written by `save_hf` with a byte-level BPE
`tokenizer.json`, as in test_interop_hf.py; the instruction file is written here.
"""

import functools
import json
import pathlib
import random
import shlex
import shutil
import string

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxformer as jf
from jaxformer import cli
from jaxformer.checkpoint import restore_workdir
from jaxformer.config import from_dict
from jaxformer.data.sources import CORPORA
from jaxformer.interop import hf

pytest.importorskip("tokenizers", reason="the walk-through reads the checkpoint's tokenizer.json")
from test_interop_hf import bpe_tokenizer, randomized


def instruction_records(n: int, seed: int = 0) -> list[dict]:
    """String tasks a small model learns in a few dozen steps: upper-case a word, or repeat it."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 6)))
        task = rng.choice(("Upper", "Repeat"))
        records.append({"prompt": f"{task}: {word}", "response": word.upper() if task == "Upper" else word})
    return records


def eval_loss(workdir, capsys) -> float:
    """`jaxformer eval` of the workdir's latest checkpoint: the held-out loss (response tokens only)."""
    capsys.readouterr()
    assert cli.main(["eval", "--workdir", str(workdir)]) == 0
    saved = capsys.readouterr().out.rsplit("saved to ", 1)[1].strip()
    return json.loads(open(saved).read())["report"]["test_loss"]


# A tiny random model of each family (one layer a stack: every command builds and traces it anew, and
# a second layer adds only time), its special ids, and settings its experiment lacks.
FAMILIES = {
    "gpt2": (
        jf.gpt2_small(vocab_size=300, d_model=32, num_heads=2, d_ff=64, max_len=64, num_decoder_layers=1),
        {"bos_token_id": 0, "eos_token_id": 0},
        [],
    ),
    "t5": (  # imported into the translation experiment: its noam schedule and beam search replaced
        jf.t5_small(
            vocab_size=300, d_model=32, num_heads=2, head_dim=16, d_ff=64, num_encoder_layers=1,
            num_decoder_layers=1,
        ),
        {"pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0},
        ["data.src_max_len=48", "train.schedule=constant", "train.label_smoothing=0.0"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_import_hf_lora_instruction_fine_tune_generate_export_hf(tmp_path, capsys, monkeypatch, family):
    source, workdir, out = tmp_path / family, tmp_path / "runs" / f"{family}_lora", tmp_path / f"{family}_lora"
    cfg, special, more = FAMILIES[family]
    hf.save_hf(randomized(cfg), source, extra_config=special)
    bpe_tokenizer().save(str(source / "tokenizer.json"))
    data = tmp_path / "my_instructions.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in instruction_records(400)))

    # The guide's commands, with tiny training settings.
    settings = [
        "data.source=files", f"data.files={data}", "data.format=jsonl", "data.template=alpaca", "data.max_len=63",
        "lora.rank=8", "lora.targets=q,k,v,o", "train.learning_rate=1e-2", "train.warmup_steps=5",
        "train.steps=50", "train.batch_size=16", "train.eval_every=50", "train.eval_batches=2",
        "train.log_every=25", "train.num_samples=0", "checkpoint.every=50", *more,
    ]  # fmt: skip
    sets = [a for s in settings for a in ("--set", s)]
    assert cli.main(["import-hf", str(source), "--workdir", str(workdir), *sets]) == 0
    run_cfg = from_dict(json.loads((workdir / "config.json").read_text()))
    assert run_cfg.lora.rank == 8 and run_cfg.data.template == "alpaca" and run_cfg.data.tokenizer == "hf"
    # Step 0 is the checkpoint plus fresh adapters: its weights as the base, the same logits.
    graphdef, start, _ = restore_workdir(run_cfg, workdir)
    x = [jnp.asarray(np.random.default_rng(0).integers(0, 300, (2, 12)), jnp.int32)] * (1 + (family == "t5"))
    pretrained = hf.load_hf(source)
    np.testing.assert_array_equal(nnx.merge(graphdef, start.weights)(*x), pretrained(*x))
    jax.tree.map(np.testing.assert_array_equal, start.frozen, nnx.state(pretrained, nnx.Param))
    before = eval_loss(workdir, capsys)
    assert before > 0, "the held-out split scores no response token (a window too short for the template?)"

    assert cli.main(["train", "--workdir", str(workdir)]) == 0
    trained_of = [line for line in capsys.readouterr().out.splitlines() if line.startswith("parameters: ")]
    adapters = sum(v[...].size for _, v in nnx.to_flat_state(start.params))
    total = adapters + sum(v[...].size for _, v in nnx.to_flat_state(start.frozen))
    assert trained_of == [f"parameters: {adapters:,} trained of {total:,} ({adapters / total:.4%})"]
    after = eval_loss(workdir, capsys)
    assert after < before, f"held-out response loss {before:.3f} at step 0, {after:.3f} after 50 LoRA steps"

    # GPT-2 continues the prompt written in the template; T5's encoder reads it and its decoder answers.
    command, flag = ("generate", "--prompt") if family == "gpt2" else ("translate", "--src")
    prompt = [flag, "Upper: cat", "--set", "decode.strategy=greedy", "--set", "decode.max_new_tokens=8"]
    fed, answered = [], []  # what the decoder-only model continues (or the encoder-decoder reads), and its answer

    def spy(model, tok, texts, *args, real, **kwargs):
        fed.extend(texts)
        answered.extend(out := real(model, tok, texts, *args, **kwargs))
        return out

    for name in ("continue_texts", "translate_texts"):
        monkeypatch.setattr(jf.decode, name, functools.partial(spy, real=getattr(jf.decode, name)))
    assert cli.main([command, "--workdir", str(workdir), *prompt]) == 0
    answer = capsys.readouterr().out.split("Upper: cat\n=> ", 1)[1]
    # The model's own answer, as the command prints it. (Greedy from random weights after 50 steps, what it
    # says is the seed's: GPT-2's is whitespace at one seed of the weights, words at another.)
    assert len(answered) == 1 and answered[0] != "" and answer.strip() == answered[0].strip()
    assert fed == ["### Instruction:\nUpper: cat\n\n### Response:\n"]  # written in the training data's template

    assert cli.main(["export-hf", "--workdir", str(workdir), str(out)]) == 0
    graphdef, state, _ = restore_workdir(run_cfg, workdir)
    assert int(state.step) == 50
    jax.tree.map(np.testing.assert_array_equal, state.frozen, start.frozen)  # the base never moved
    merged = jf.lora.merge(nnx.merge(graphdef, state.weights))
    exported = hf.load_hf(out)
    assert not any(True for _ in jf.lora.adapters(exported))  # a plain model: the adapters folded in
    np.testing.assert_allclose(exported(*x), merged(*x), atol=1e-5, rtol=1e-5)
    assert not np.allclose(exported(*x), pretrained(*x))


def guide_commands(body: str) -> list[list[str]]:
    """A shell block's `jaxformer` commands (continuation lines joined, comments dropped), as argv."""
    lines = body.replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True)[1:] for line in lines if line.startswith("jaxformer ")]


def test_the_walk_through_runs_as_written_offline_on_600_records(tmp_path, capsys, monkeypatch):
    """docs/guides/fine-tuning.md's walk-through on a copy of the shipped 600 instruction tasks (30 validation
    and 30 test examples, fewer than the batch of 32): the offline block makes its tiny GPT-2 and imports it,
    then the walk-through's commands run as written; only the step counts shrink (10 steps)."""
    from test_guides import ROOT, blocks

    walk, offline = (
        next(body for _, _, body in blocks(ROOT / "docs" / "guides" / "fine-tuning.md", {"bash"}) if key in body)
        for key in ("jaxformer import-hf gpt2 --workdir runs/gpt2_lora", "tiny_gpt2")
    )
    monkeypatch.chdir(tmp_path)
    shutil.copyfile(CORPORA / "instruct_tasks.jsonl", "my_instructions.jsonl")
    exec(offline.split("<<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0], {})  # the block's Python: tiny_gpt2/
    (imported,) = guide_commands(offline)
    few = ["train.steps=10", "train.eval_every=10", "train.log_every=5", "train.num_samples=0", "checkpoint.every=10"]
    assert cli.main([*imported, *(a for s in few for a in ("--set", s))]) == 0
    commands = guide_commands(walk)
    assert [c[0] for c in commands] == ["import-hf", "eval", "train", "eval", "generate", "export-hf"]
    losses = []
    for argv in commands[1:]:
        capsys.readouterr()
        assert cli.main(argv) == 0, argv
        out = capsys.readouterr().out
        if argv[0] == "eval":
            saved = pathlib.Path(out.rsplit("saved to ", 1)[1].strip())
            losses.append(json.loads(saved.read_text())["report"]["test_loss"])
    assert 0 < losses[1] < losses[0], losses  # the held-out responses' loss, before and after
    run_cfg = from_dict(json.loads(pathlib.Path("runs/gpt2_lora/config.json").read_text()))
    assert int(restore_workdir(run_cfg, "runs/gpt2_lora")[1].step) == 10
    assert not any(True for _ in jf.lora.adapters(hf.load_hf("gpt2_lora")))  # the export: a plain GPT-2
