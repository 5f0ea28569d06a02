r"""The Shakespeare language model's learning rate, dropout and width, by random search.

    jaxformer sweep experiments/sweeps/lm_shakespeare.py --workdir sweeps/lm_shakespeare --workers 2
    # many machines, one sweep: a PostgreSQL database as the storage, the same command on each
    jaxformer sweep experiments/sweeps/lm_shakespeare.py --workdir sweeps/lm_shakespeare \
        --storage postgresql://USER:PASSWORD@HOST/DB

Trials run half of the main job's steps and are judged by validation perplexity.
Time: each trial 400 steps, half of the main job's 800 (which take 8-10 minutes on 2 CPU cores; a
trial's time not measured); output: the study's table (`--status`), no samples.
"""

from jaxformer.sweep import Choice, Range, Sweep


def get_sweep() -> Sweep:
    return Sweep(
        base="lm_shakespeare",
        space={
            "train.learning_rate": Range(3e-4, 3e-3, log=True),
            "model.dropout_rate": Choice(0.0, 0.1, 0.2),
            "model.d_model": Choice(128, 192, 256),
        },
        fixed={"train.steps": 400, "train.eval_every": 100, "train.num_samples": 0},
        strategy="random",
        trials=12,
        metric="perplexity",
    )
