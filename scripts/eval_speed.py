"""`benchmark.py --eval`: examples per second of lm-evaluation-harness's multiple-choice task
`shakespeare_cloze` (64 examples, 4 choices each: 256 log-likelihoods) for the model `jaxformer` on a
workdir against the harness's own `hf` model (PyTorch) on that workdir's `export-hf` directory: the
same weights, the same batch size, the same tokenizer, one process, interleaved rounds.

The model is the tiny random GPT-2 of the golden files (tests/golden/lm_eval/gpt2: 2 layers, d_model 16,
320 byte-level BPE pieces), brought in with `import-hf` and written back with `export-hf`. The
PyTorch side runs where torch, transformers and the harness's hf extra import; otherwise a line says it
was skipped. In an environment with both (the CPU build of torch, pinned; jaxformer's own packages
reachable too):

    python3 -m venv /tmp/venv-torch && /tmp/venv-torch/bin/pip install torch==2.13.0 \
        "transformers>=4.57,<4.58" "lm-eval[hf]>=0.4.13,<0.5" "huggingface-hub<1.0"
    PYTHONPATH=. /tmp/venv-torch/bin/python scripts/benchmark.py --eval --rounds 5 --batch 16
"""

from __future__ import annotations

import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
GOLDEN_GPT2 = ROOT / "tests" / "golden" / "lm_eval" / "gpt2"
TASK = "shakespeare_cloze"
MAX_LENGTH = 128  # the model's context (n_positions)


def _cli(*argv: str) -> None:
    subprocess.run([sys.executable, "-m", "jaxformer.cli", *argv], check=True, stdout=subprocess.DEVNULL)


def _hf_model(directory: pathlib.Path, batch: int):
    """The harness's `hf` model on the export, or (None, why) where torch or transformers do not import."""
    try:
        import torch
        from lm_eval.models.huggingface import HFLM
    except ImportError as e:
        return None, f"{e.name or e} does not import"
    torch.manual_seed(0)
    lm = HFLM(
        pretrained=str(directory), backend="causal", dtype="float32", device="cpu", batch_size=batch,
        max_length=MAX_LENGTH,
    )  # fmt: skip
    return lm, f"torch {torch.__version__}, {torch.get_num_threads()} threads"


def _requests() -> tuple[list, list[int]]:
    """The task's log-likelihood requests as the harness builds them (choices of an example adjacent, in
    order), and each example's right choice."""
    from lm_eval.tasks import get_task_dict

    from jaxformer.evaluation import run

    manager, names = run.task_manager([TASK])
    task = get_task_dict(names, manager)[TASK]
    task.build_all_requests(rank=0, world_size=1)
    requests = sorted(task.instances, key=lambda x: (x.doc_id, x.idx))
    gold = [task.doc_to_target(x.doc) for x in requests if x.idx == 0]
    return requests, gold


def eval_speed(args) -> None:
    """Examples per second of `shakespeare_cloze` for `jaxformer` and the harness's `hf` model, interleaved:
    the task's requests built once, then each model's `loglikelihood` over all of them, one untimed round
    (compilation) and `args.rounds` timed ones; the median printed, with the accuracy each model's answers
    give and how far apart their log-likelihoods are. (A whole `simple_evaluate` round adds the harness's
    own bookkeeping: with torch installed its environment report alone took 2.6 s a call.)

    Args:
        args (argparse.Namespace): rounds, batch (rows per forward pass, both models), peer (run the hf model).
    """
    import jax

    from jaxformer.evaluation import run
    from jaxformer.evaluation.harness import JaxformerLM

    run.offline()
    with tempfile.TemporaryDirectory() as tmp:
        workdir, exported = pathlib.Path(tmp) / "workdir", pathlib.Path(tmp) / "hf"
        _cli("import-hf", str(GOLDEN_GPT2), "--workdir", str(workdir))
        _cli("export-hf", "--workdir", str(workdir), str(exported))
        models = {"jaxformer": JaxformerLM(workdir=str(workdir), batch_size=args.batch)}
        print(f"jaxformer: jax {jax.__version__} on {jax.devices()[0].device_kind} x{jax.device_count()}")
        hf, said = _hf_model(exported, args.batch) if args.peer else (None, "--no-peer")
        if hf is None:
            print(f"hf (PyTorch): skipped, {said}")
        else:
            models["hf"] = hf
            print(f"hf: {said}")
        requests, gold = _requests()
        times, answers = {name: [] for name in models}, {}
        for r in range(args.rounds + 1):
            for name, lm in models.items():
                start = time.perf_counter()
                answers[name] = [ll for ll, _ in lm.loglikelihood(requests, disable_tqdm=True)]
                if r:
                    times[name].append(time.perf_counter() - start)
    examples = len(gold)
    print(f"{TASK}: {examples} examples, batch {args.batch}, median of {args.rounds} interleaved rounds")
    print(f"{'model':12s} {'examples/s':>10s} {'s/round':>8s} {'acc':>6s}")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        scores = np.asarray(answers[name]).reshape(examples, -1)
        accuracy = float(np.mean(scores.argmax(-1) == np.asarray(gold)))
        print(f"{name:12s} {examples / median:10.1f} {median:8.3f} {accuracy:6.3f}")
    if "hf" in answers:
        ours, theirs = np.asarray(answers["jaxformer"]), np.asarray(answers["hf"])
        print(f"log-likelihoods: largest relative difference {np.max(np.abs(ours - theirs) / np.abs(theirs)):.1e}")
