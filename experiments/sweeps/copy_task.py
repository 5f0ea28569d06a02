"""Learning rate, warmup and width of the copy task, by TPE: a sweep that finishes in minutes on a CPU.

    jaxformer sweep experiments/sweeps/copy_task.py --workdir sweeps/copy_task [--workers 2]

Each trial trains the copy task for 200 steps (a few seconds each after compiling) and is
judged by its eval loss; the median pruner stops trials behind the others at step 100.
Time: minutes on 2 CPU cores for the whole sweep; output: the study's table (`--status`), no text.
"""

from jaxformer.sweep import Choice, Range, Sweep


def get_sweep() -> Sweep:
    return Sweep(
        base="copy_task",
        space={
            "train.learning_rate": Range(3e-4, 1e-2, log=True),
            "train.warmup_steps": Choice(10, 50, 100),
            "model.d_model": Choice(32, 64),
        },
        fixed={"train.steps": 200, "train.eval_every": 100, "train.num_samples": 0},
        strategy="tpe",
        trials=8,
        metric="loss",
    )
