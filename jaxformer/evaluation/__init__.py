"""Benchmarks as papers report them: jaxformer models under EleutherAI's lm-evaluation-harness.

`scoring` (log-likelihoods by a batched forward pass; no harness needed), `harness` (the harness's
model `jaxformer`; needs the `eval` extra), `run` (`jaxformer eval --tasks`), `tasks/` (task YAMLs over
files shipped with the package, read offline). `python -m jaxformer.evaluation ARGS` is the harness's
own command line (`lm_eval ARGS`) with the `jaxformer` model registered.
"""

import pathlib

TASKS_DIR = pathlib.Path(__file__).parent / "tasks"  # the shipped tasks: an `--include_path` for the harness
