"""The launchers. scripts/tpu_pod.sh without a cloud: its dry run prints the gcloud commands of a launch in
order. scripts/launch_local_two_process.sh for real: a process killed mid-run, the survivor's one line, the
restart of both and a run that ends as if it had never been interrupted."""

import dataclasses
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import processes
import pytest

ARGS = [
    "--name", "pod1", "--zone", "us-east5-a", "--type", "v5p-128", "--config", "experiments/gpt2_1p3b.py",
    "--workdir", "/mnt/shared/runs/gpt2", "--set", "train.steps=10",
]  # fmt: skip


def test_tpu_pod_dry_run_prints_the_launch_and_missing_arguments_are_named():
    out = subprocess.run(["bash", "scripts/tpu_pod.sh", *ARGS, "--dry-run"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    commands = [line[2:] for line in out.stdout.splitlines() if line.startswith("+ ")]
    gcloud = [c for c in commands if c.startswith("gcloud")]
    assert gcloud[0].startswith("gcloud compute tpus queued-resources create pod1 --node-id pod1 --zone us-east5-a")
    assert "--accelerator-type v5p-128" in gcloud[0]
    assert [c.split()[4] for c in gcloud[1:]] == ["scp", "ssh", "ssh", "scp"]  # copy, install, train, logs back
    copy, install, train, logs = gcloud[1:]
    assert all("--worker=all" in c for c in (copy, install, train)) and "--worker=0" in logs
    assert "jaxformer\\ train\\ --config\\ experiments/gpt2_1p3b.py" in train
    assert "mesh.distributed=true" in train and "train.steps=10" in train and "pipefail" in train
    again = subprocess.run(["bash", "scripts/tpu_pod.sh", *ARGS, "--restarts", "2", "--dry-run"], capture_output=True)
    assert again.returncode == 0 and again.stdout.decode() == out.stdout  # a dry run succeeds: nothing to rerun
    missing = subprocess.run(["bash", "scripts/tpu_pod.sh", *ARGS[2:]], capture_output=True, text=True)
    assert missing.returncode == 2 and "--name is required" in missing.stderr and "usage:" in missing.stderr


# ----------------------------------------------------------------------------- two local processes

TINY = [
    "train.steps=12",
    "train.batch_size=16",
    "checkpoint.every=4",
    "train.log_every=1",  # every step's loss and gradient norm in the log that the runs compare
    "train.eval_every=6",
    "train.num_samples=0",
    "train.peak_flops=1e13",  # no matmul probe
    "model.num_encoder_layers=1",
    "model.num_decoder_layers=1",
]
TIMING = {"tokens_per_s", "mfu", "step_time"}


def launch(workdir, log, restarts):
    """scripts/launch_local_two_process.sh on copy_task, both processes' output in `log`."""
    env = processes.cpu_env(PYTHON=sys.executable, RESTARTS=str(restarts), PORT=str(free_port()))
    sets = [x for o in TINY for x in ("--set", o)]
    command = ["bash", "scripts/launch_local_two_process.sh", "experiments/copy_task.py", str(workdir), *sets]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def finish(proc, log: pathlib.Path) -> int:
    return processes.wait(proc, "scripts/launch_local_two_process.sh", log)


def logged(workdir) -> list[dict]:
    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def final_params(workdir):
    """The latest checkpoint's parameters and optimizer state, restored onto this process's one device."""
    from jaxformer.checkpoint import Checkpointer
    from jaxformer.config import MeshConfig, from_dict
    from jaxformer.state import init_state

    cfg = dataclasses.replace(from_dict(json.loads((workdir / "config.json").read_text())), mesh=MeshConfig())
    ckpt = Checkpointer(workdir, cfg, read_only=True)
    state = ckpt.restore_latest(init_state(cfg)[1])
    ckpt.close()
    return state


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    with open(workdir.parent / "uninterrupted.log", "w") as log:
        status = finish(launch(workdir, log, restarts=0), workdir.parent / "uninterrupted.log")
    assert status == 0, (workdir.parent / "uninterrupted.log").read_text()[-3000:]
    return workdir


def test_a_lost_process_is_one_line_in_the_survivor_and_the_launcher_restarts_both_to_the_same_end(
    tmp_path, uninterrupted
):
    """Process 1 killed mid-run: process 0 says so in one line (no stack) and exits 4 at once; the
    launcher starts both again and the run resumes from the last checkpoint to the very state and
    log of a run that was never interrupted."""
    out = tmp_path / "launch.log"
    workdir = tmp_path / "run"
    with open(out, "w") as log:
        proc = launch(workdir, log, restarts=2)
        try:
            pid = None
            while pid is None or not (workdir / "checkpoints" / "4").is_dir():  # a checkpoint, then the kill
                assert proc.poll() is None, out.read_text()[-3000:]
                found = re.search(r"start 0: .*process 1 is pid (\d+)", out.read_text())
                pid = pid or (found and int(found.group(1)))
                time.sleep(0.05)
            os.kill(pid, signal.SIGKILL)
        finally:
            status = finish(proc, out)
    text = out.read_text()
    assert status == 0, text[-3000:]
    assert "a process exited with" in text and "restarting both (1 of 2)" in text and "start 2" not in text
    assert "Traceback" not in text and "Check failure" not in text
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    assert errors[0].startswith("error: lost process 1 of 2 (it ended without a word: killed or crashed)")
    saved = re.search(r"the last complete checkpoint is (\S+);", errors[0])
    assert saved and int(pathlib.Path(saved.group(1)).name) >= 4 and "(exit code 4)" in errors[0]
    assert f"resumed from {workdir / 'checkpoints' / pathlib.Path(saved.group(1)).name}" in text
    assert logged(workdir) == logged(uninterrupted)
    resumed, reference = final_params(workdir), final_params(uninterrupted)
    assert int(resumed.step) == int(reference.step) == 12
    jax.tree.map(np.testing.assert_array_equal, resumed.params, reference.params)
    jax.tree.map(np.testing.assert_array_equal, resumed.opt_state, reference.opt_state)
