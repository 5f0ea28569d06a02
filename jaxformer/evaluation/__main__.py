"""`python -m jaxformer.evaluation ARGS`: the harness's command line (`lm_eval ARGS`) with the model
`jaxformer` registered (lm-eval finds models in its own table only: the import registers ours) and
the shipped tasks' directory on its `--include_path` unless one is given."""

import sys

from jaxformer.evaluation import TASKS_DIR, harness  # noqa: F401  (harness: registers the model `jaxformer`)
from jaxformer.evaluation.run import offline


def main() -> None:
    """Hand the arguments to the harness's own command line."""
    from lm_eval.__main__ import cli_evaluate

    offline()
    if "--include_path" not in sys.argv and len(sys.argv) > 1 and sys.argv[1] not in ("ls", "validate", "-h", "--help"):
        sys.argv += ["--include_path", str(TASKS_DIR)]
    cli_evaluate()


if __name__ == "__main__":
    main()
