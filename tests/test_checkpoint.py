"""Checkpoint settings and errors that need no training run (runs killed, resumed and damaged: test_faults.py)."""

import json

import pytest

from jaxformer import cli
from jaxformer.config import ConfigError, apply_overrides, from_dict


def test_unwritable_workdir_is_a_clear_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    rc = cli.main(["train", "--config", "experiments/copy_task.py", "--workdir", str(blocker / "run"), "--quiet"])
    assert rc == 2
    assert str(blocker) in capsys.readouterr().err


def test_config_overrides_reach_the_checkpoint_section():
    from jaxformer.config import load_experiment

    cfg = apply_overrides(load_experiment("experiments/copy_task.py"), ["checkpoint.keep=5"])
    assert from_dict(json.loads(json.dumps(cfg.to_dict()))).checkpoint.keep == 5
    with pytest.raises(ConfigError, match=r"checkpoint\.best_metric"):
        apply_overrides(cfg, ["checkpoint.best_metric=bleu"])


def test_the_closed_loop_messages_are_quiet_from_the_first_read_or_write(tmp_path, monkeypatch):
    """tensorstore prints them while the failing restore or save is still inside orbax: the hook that
    drops them is in place once a Checkpointer exists, not only once a checkpoint has been set aside."""
    import sys

    from jaxformer.checkpoint import Checkpointer
    from jaxformer.config import load_experiment

    cfg = load_experiment("experiments/copy_task.py")
    for read_only in (False, True):
        monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
        Checkpointer(tmp_path, cfg, read_only=read_only).close()
        assert getattr(sys.unraisablehook, "quiets_abandoned_io", False), f"read_only={read_only}"


def test_abandoned_orbax_io_is_not_logged_by_asyncio_and_other_errors_are(caplog):
    """asyncio's "exception was never retrieved" for the writes a failed save abandoned (tensorstore's
    ValueError, no Python frame) and the reads a failed restore abandoned is dropped, whenever the
    garbage collector finds them; an unrelated task's failure is still logged."""
    import logging

    import jaxformer.checkpoint  # noqa: F401  (installs the filter)

    write = ValueError("RESOURCE_EXHAUSTED: Failed to write 873218 bytes: No space left on device [os_error_code='28']")
    read = ValueError('OUT_OF_RANGE: Error opening "zarr" driver [tensorstore_spec=\'{"driver":"zarr"}\']')
    other = RuntimeError("a task of the user's own")
    logger = logging.getLogger("asyncio")
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        for what, error in (("Future", write), ("Task", read), ("Task", other)):
            logger.error(f"{what} exception was never retrieved\nfuture: <{what} finished>", exc_info=error)
    assert [r.exc_info[1] for r in caplog.records] == [other]
