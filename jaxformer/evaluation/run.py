"""`jaxformer eval --workdir W --tasks T`: lm-evaluation-harness tasks on a jaxformer model, offline;
the harness's results JSON written, its table printed."""

from __future__ import annotations

import json
import os
import pathlib

from jaxformer.config import ConfigError
from jaxformer.evaluation import TASKS_DIR

INSTALL = "the harness is not installed: pip install -e '.[eval]' (lm-eval's core, no torch)"


class TaskError(ConfigError):
    """A task the harness cannot run as asked: unknown, its data file missing, a bad limit (a ConfigError:
    `train.evals` names tasks, and the command line answers it in one line)."""


def offline() -> None:
    """The hub stays unreached: tasks read local files (set before `datasets` is imported)."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        os.environ.setdefault(name, "1")


def task_manager(tasks: list[str], include_path: list[str] = ()) -> tuple:
    """A TaskManager that knows `tasks`: the shipped ones and `include_path`'s first (indexing the
    harness's thousands of own YAMLs costs seconds), its own only when a task is not among them.

    Args:
        tasks: task names (or glob patterns).
        include_path: directories of the user's task YAMLs.

    Returns:
        (the TaskManager, the matched task names).

    Raises:
        TaskError: a task no directory holds, or an include path that is not a directory.
    """
    from lm_eval.tasks import TaskManager

    for p in include_path:
        if not pathlib.Path(p).is_dir():
            raise TaskError(f"--include-path {p}: no such directory")
    paths = [str(TASKS_DIR), *map(str, include_path)]
    manager = TaskManager(include_path=paths, include_defaults=False)
    if not all(manager.match_tasks([t]) for t in tasks) and all(map(_in_lm_eval_files, tasks)):
        manager = TaskManager(include_path=paths)
    missing = [t for t in tasks if not manager.match_tasks([t])]
    if missing:
        shipped = sorted(TaskManager(include_path=[str(TASKS_DIR)], include_defaults=False).all_subtasks)
        raise TaskError(
            f"unknown task {missing[0]!r}: not a task of lm-eval nor of --include-path (shipped: {', '.join(shipped)})"
        )
    return manager, manager.match_tasks(list(tasks))


def _in_lm_eval_files(task: str) -> bool:
    """Whether lm-eval's own task YAMLs could name `task` (its text is in one, or it is a pattern): a cheap
    read of the files (0.5 s) before indexing them (7 s), which an unknown name need not wait for."""
    import lm_eval

    if any(c in task for c in "*?["):
        return True
    needle = task.encode()
    return any(needle in p.read_bytes() for p in (pathlib.Path(lm_eval.__file__).parent / "tasks").rglob("*.yaml"))


def check_data_files(manager, names: list[str]) -> None:
    """Each task's local data files exist (relative paths are read from the working directory, as
    `datasets` reads them).

    Args:
        manager (TaskManager): the tasks' manager.
        names: the tasks.

    Raises:
        TaskError: a data file that does not exist, naming the task, the split and the path.
    """
    from lm_eval.tasks._yaml_loader import load_yaml

    for name in names:
        entry = manager.task_index.get(name)
        if entry is None or entry.yaml_path is None:
            continue
        config = load_yaml(entry.yaml_path, resolve_func=False)
        files = (config.get("dataset_kwargs") or {}).get("data_files")
        if files is None:
            continue
        items = files.items() if isinstance(files, dict) else [("", files)]
        for split, paths in items:
            for path in [paths] if isinstance(paths, str) else paths:
                if "://" not in path and not pathlib.Path(path).exists():
                    where = f"data_files.{split}" if split else "data_files"
                    raise TaskError(
                        f"task {name!r}: its {where} {path} does not exist (relative to {pathlib.Path.cwd()})"
                    )


def check_tasks(tasks: list[str], include_path: list[str] = ()) -> list[str]:
    """The tasks found and their local files there, with the harness installed (what `train.evals` checks
    before a run starts).

    Args:
        tasks: task names.
        include_path: directories of more task YAMLs.

    Returns:
        The matched task names.

    Raises:
        TaskError: the harness not installed, an unknown task, a missing data file.
    """
    offline()
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise TaskError(INSTALL) from None
    manager, names = task_manager(list(tasks), list(include_path))
    check_data_files(manager, names)
    return names


def evaluate(
    lm, tasks: list[str], *, num_fewshot=None, limit=None, include_path: list[str] = (), log_samples: bool = False
) -> dict:
    """The harness's `simple_evaluate` on `lm` (offline), its results dict.

    Args:
        lm (JaxformerLM): the model.
        tasks: task names.
        num_fewshot (int | None): examples in the context (None: each task's own).
        limit (int | float | None): examples per task (None: all; a float < 1: that fraction).
        include_path: directories of more task YAMLs.
        log_samples: keep each example's requests and answers in the dict.

    Returns:
        The harness's results (results, configs, versions, n-shot, ...).

    Raises:
        TaskError: an unknown task, a missing data file, a limit that is not positive.
    """
    from lm_eval import evaluator

    if limit is not None and not limit > 0:
        raise TaskError(f"--limit must be > 0 (examples per task, or a fraction < 1), got {limit:g}")
    if num_fewshot is not None and num_fewshot < 0:
        raise TaskError(f"--num-fewshot must be >= 0, got {num_fewshot}")
    manager, names = task_manager(list(tasks), list(include_path))
    check_data_files(manager, names)
    return evaluator.simple_evaluate(
        model=lm, tasks=names, num_fewshot=num_fewshot, limit=limit, task_manager=manager,
        log_samples=log_samples, bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
        fewshot_random_seed=0,
    )  # fmt: skip


def main(args) -> int:
    """`jaxformer eval --tasks`: the results JSON beside the model (or at --output), the table printed.

    Args:
        args (argparse.Namespace): workdir, hf, tasks, num_fewshot, limit, include_path, batch_size, output.

    Returns:
        The exit code.

    Raises:
        TaskError: an unknown task, a missing data file, a bad limit, or the harness not installed.
    """
    tasks = [t for t in (args.tasks or "").split(",") if t]
    if not tasks:
        raise TaskError("--tasks: give task names, comma-separated")
    if args.set:
        raise TaskError(
            f"--set {args.set[0]}: with --tasks the model is evaluated as saved (--set changes `eval` alone)"
        )
    if (args.workdir is None) == (args.hf is None):
        raise TaskError("--tasks: give one of --workdir W (a jaxformer workdir) or --hf DIR (a Hugging Face model)")
    if args.limit is not None and not args.limit > 0:
        raise TaskError(f"--limit must be > 0 (examples per task, or a fraction < 1), got {args.limit:g}")
    if args.batch_size < 1:
        raise TaskError(f"--batch-size must be >= 1 (rows per forward pass), got {args.batch_size}")
    offline()
    try:
        from lm_eval.utils import handle_non_serializable, make_table

        from jaxformer.evaluation.harness import HarnessError, JaxformerLM
    except ImportError:
        raise TaskError(INSTALL) from None
    task_manager(tasks, args.include_path or [])  # before the model loads: a typo fails at once
    try:
        lm = JaxformerLM(workdir=args.workdir, hf=args.hf, batch_size=args.batch_size)
        results = evaluate(
            lm, tasks, num_fewshot=args.num_fewshot, limit=args.limit, include_path=args.include_path or []
        )
    except HarnessError as e:
        raise TaskError(str(e)) from None
    out = pathlib.Path(args.output or pathlib.Path(args.workdir or args.hf) / "lm_eval" / "results.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    print(f"results: {out}")
    return 0


def add_arguments(parser) -> None:
    """`jaxformer eval`'s harness options (the command's parser lives in the CLI; its options here).

    Args:
        parser (argparse.ArgumentParser): the `eval` subcommand's parser.
    """
    parser.add_argument(
        "--tasks", help="lm-evaluation-harness tasks, comma-separated (the shipped ones: shakespeare_cloze, "
        "instruct_exact, lohelp_en_de; lm-eval's own; or YAMLs under --include-path)",
    )  # fmt: skip
    parser.add_argument("--hf", metavar="DIR", help="with --tasks: a Hugging Face model directory instead of --workdir")
    parser.add_argument("--num-fewshot", type=int, help="with --tasks: examples in each context (default: the task's)")
    parser.add_argument("--limit", type=float, help="with --tasks: examples per task (a fraction if < 1)")
    parser.add_argument(
        "--include-path", action="append", metavar="DIR", help="with --tasks: a directory of task YAMLs (repeatable)"
    )
    parser.add_argument("--batch-size", type=int, default=16, help="with --tasks: rows per forward pass")
    parser.add_argument("--output", help="with --tasks: the results JSON (default: WORKDIR/lm_eval/results.json)")


def harness_metrics(model, tokenizer, tasks, limit: int | None = None, batch_size: int = 16) -> dict[str, float]:
    """`train.evals`: the tasks' metrics on the model as it is, flat as TASK/METRIC (the harness's filter
    name dropped: `shakespeare_cloze/acc`), to log beside the loss and for a sweep to optimise.

    Args:
        model (Transformer): the model (decoder_only or encoder_decoder).
        tokenizer (Tokenizer): its tokenizer.
        tasks (Sequence[str]): task names.
        limit: examples per task (None: all).
        batch_size: rows per forward pass.

    Returns:
        {TASK/METRIC: value}.

    Raises:
        TaskError: the harness not installed, an unknown task, a missing data file, a model it cannot serve.
    """
    offline()
    try:
        from jaxformer.evaluation.harness import HarnessError, JaxformerLM
    except ImportError:
        raise TaskError(f"train.evals: {INSTALL}") from None
    try:
        lm = JaxformerLM(model=model, tokenizer=tokenizer, batch_size=batch_size)
        results = evaluate(lm, list(tasks), limit=limit)
    except HarnessError as e:
        raise TaskError(f"train.evals: {e}") from None
    out = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            name = key.split(",")[0]
            if isinstance(value, float) and not name.endswith("_stderr"):  # (sample_len: a count, not a metric)
                out[f"{task}/{name}"] = float(value)
    return out
