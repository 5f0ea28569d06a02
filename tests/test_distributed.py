"""jaxformer.distributed without processes: the line a survivor prints and the checkpoint it names."""

from jaxformer import distributed


def test_the_lost_line_names_the_process_the_step_and_the_newest_complete_checkpoint(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for name in ("5", "10", "15.orbax-checkpoint-tmp-1234", "corrupt-3"):  # a save in progress, a damaged one
        (checkpoints / name).mkdir(parents=True)
    line = distributed.lost_message(1, 0, 2, 17, tmp_path)
    assert line == (
        "error: lost process 1 of 2 (it ended without a word: killed or crashed); process 0 had reached step 17; "
        f"the last complete checkpoint is {checkpoints / '10'}; restart all processes with the same command "
        "to resume (exit code 4)"
    )
    assert "\n" not in line and distributed.EXIT_PEER_LOST == 4
    early = distributed.lost_message(0, 3, 4, None, tmp_path / "new")
    assert "lost process 0 of 4" in early and "process 3 had reached no step" in early
    assert "no checkpoint is complete yet" in early
