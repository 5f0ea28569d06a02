"""scripts/tpu_pod.sh without a cloud: its dry run prints the gcloud commands of a launch in order."""

import subprocess

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
    missing = subprocess.run(["bash", "scripts/tpu_pod.sh", *ARGS[2:]], capture_output=True, text=True)
    assert missing.returncode == 2 and "--name is required" in missing.stderr and "usage:" in missing.stderr
