"""A sweep's worker: it takes trials from the queue and trains them, its heartbeat telling the others
it lives; and the workers of one machine, one per accelerator group (`local_devices`, `pin`)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys
import threading
import time

from jaxformer.config import Config, ConfigError, require, with_values
from jaxformer.sweep.spec import Sweep
from jaxformer.sweep.study import _counts, _done, _storage, _suggest, _take_queued_trial, open_study


@contextlib.contextmanager
def _heartbeat(storage, trial_id: int, interval: float):
    """Record the trial's heartbeat every `interval` seconds while the block runs."""
    stop = threading.Event()

    def beat():
        while True:
            try:
                storage.record_heartbeat(trial_id)
            except ConnectionError:
                return  # the trial's next report meets the lost database too, and stops the worker
            if stop.wait(interval):
                return

    thread = threading.Thread(target=beat, name=f"heartbeat-{trial_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def work(sweep: Sweep, base: Config, workdir: pathlib.Path, url: str, name: str, worker: int = 0, shared=False):
    """Take trials from the sweep's queue and train them until the queue is empty and no trial
    runs anywhere (a dead worker's trial comes back to the queue). `worker` numbers this machine's
    processes; a `shared` storage may have workers on other machines too.

    Args:
        sweep: the sweep.
        base: its base config.
        workdir: the sweep's directory.
        url: the storage URL.
        name: the study's name.
        worker: this worker's number on this machine.
        shared (bool): the storage is shared with other machines.

    Raises:
        SystemExit: code 0 when a trial was preempted (SIGTERM) after saving: the worker stops and
            another resumes the trial.
    """
    import optuna

    from jaxformer.observe import curve, read_metrics
    from jaxformer.train import fit, parameters_line

    storage = _storage(url, sweep)
    study = open_study(sweep, name, url, worker=(worker, os.getpid()) if shared else (worker,), storage=storage)
    study_id = storage.get_study_id_from_name(name)
    tag = f"[worker {worker}] " if worker else ""
    RUNNING = optuna.trial.TrialState.RUNNING

    def train(trial) -> tuple[optuna.trial.TrialState | None, float | None]:
        values = {k: _suggest(trial, k, d) for k, d in sweep.space.items()}
        # A retried trial inherits the user attributes, so it trains on in the dead trial's workdir.
        trial_dir = workdir / trial.user_attrs.get("workdir", f"trial-{trial.number:03d}")
        trial.set_user_attr("workdir", trial_dir.name)
        shown = ", ".join(f"{k}={v}" for k, v in values.items())
        c = _counts(study, sweep, study.get_trials(deepcopy=False))
        print(f"{tag}trial {trial.number} ({trial_dir.name}): {shown}   [{_done(c)} of {c['trials']} done]", flush=True)
        given_up = []

        def on_eval(step: int, metrics: dict) -> bool:
            try:
                trial.report(metrics[sweep.metric], step)
            except optuna.exceptions.UpdateFinishedTrialError:
                given_up.append(step)  # failed as dead while the database was away: its retry trains it
                return True
            return trial.should_prune()

        try:
            result = fit(with_values(base, values), trial_dir, quiet=True, on_eval=on_eval)
        except FloatingPointError as e:
            print(f"{tag}trial {trial.number}: failed ({e})", flush=True)
            return optuna.trial.TrialState.FAIL, None
        if given_up:
            print(f"{tag}trial {trial.number}: failed as dead while the database was away; its retry goes on")
            return None, None
        if result.get("preempted"):  # SIGTERM: saved; left running, so the heartbeat hands it on
            print(f"{tag}trial {trial.number}: preempted after saving; a worker resumes it from its checkpoint")
            raise SystemExit(0)
        value = result["eval"].get(sweep.metric)
        if value is None:  # its worker died after the last step: the log holds the last evaluation
            value = curve(read_metrics(trial_dir), "eval", sweep.metric)[1][-1]
        if result["stopped"]:
            print(f"{tag}trial {trial.number}: pruned ({sweep.metric} {value:.4g})", flush=True)
            return optuna.trial.TrialState.PRUNED, None
        # Training's own "parameters:" line, which a quiet trial does not print: a LoRA rank tells here.
        counted = f"; {parameters_line(result['state'])}" if result.get("state") is not None else ""
        print(f"{tag}trial {trial.number}: {sweep.metric} {value:.4g}{counted}", flush=True)
        return optuna.trial.TrialState.COMPLETE, value

    waiting_said = False
    while True:
        optuna.storages.fail_stale_trials(study)  # a dead worker's trial: failed, and queued again
        trial_id = _take_queued_trial(storage, study_id, url)
        if trial_id is None:
            running = study.get_trials(deepcopy=False, states=(RUNNING,))
            if not running:
                return
            if not waiting_said:
                print(f"{tag}{len(running)} trial(s) running: waiting for them (a dead worker's trial "
                      f"is retried within {3 * sweep.heartbeat} s)", flush=True)  # fmt: skip
                waiting_said = True
            time.sleep(min(sweep.heartbeat, 5))
            continue
        waiting_said = False
        trial = optuna.Trial(study, trial_id)
        with _heartbeat(storage, trial_id, sweep.heartbeat):
            try:
                state, value = train(trial)
            except SystemExit:
                raise
            except BaseException:
                study.tell(trial, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
                raise
        if state is not None:
            study.tell(trial, value, state=state, skip_if_finished=True)


def local_devices() -> tuple[str, list[str]]:
    """This machine's accelerator platform and device (GPU) or chip (TPU) ids as the pinning
    variables name them, asked of JAX in a child process (so this one holds no accelerator).

    Returns:
        (platform, ids).
    """
    probe = (
        "import jax; ds = jax.local_devices(); chips = {tuple(getattr(d, 'coords', None) or (d.id,)) for d in ds}; "
        "print(ds[0].platform, len(chips) if ds[0].platform == 'tpu' else len(ds))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    platform, n = out[-2], int(out[-1])
    visible = {"gpu": "CUDA_VISIBLE_DEVICES", "tpu": "TPU_VISIBLE_CHIPS"}.get(platform)
    already = os.environ.get(visible or "", "")  # already narrowed: pin within what this process may use
    ids = already.split(",")[:n] if already else [str(i) for i in range(n)]
    return platform, ids


TPU_CHIP_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1"}  # chips of one worker, as a TPU host lays them out


def pin(platform: str, ids: list[str], per_trial: int) -> list[dict[str, str]]:
    """The environment of each worker of one machine: one worker per `per_trial` devices, each
    seeing only its own (devices left over are idle). CPU: one worker, nothing pinned.

    Args:
        platform: "cpu", "gpu" or "tpu".
        ids: the device ids.
        per_trial: devices per trial.

    Returns:
        One environment (variable -> value) per worker.

    Raises:
        ConfigError: more devices per trial than the machine has, or a platform with no pinning.
    """
    if platform == "cpu":
        return [{}]
    require(
        per_trial <= len(ids), "devices", f"a trial asks for {per_trial}, this machine has {len(ids)} {platform}(s)"
    )
    groups = [ids[i : i + per_trial] for i in range(0, len(ids) - per_trial + 1, per_trial)]
    if platform == "gpu":
        return [{"CUDA_VISIBLE_DEVICES": ",".join(g)} for g in groups]
    if platform == "tpu":
        if len(groups) == 1 and per_trial == len(ids):
            return [{}]  # the whole host: nothing to narrow
        require(per_trial in TPU_CHIP_BOUNDS, "devices", f"{per_trial} TPU chips per trial: use 1, 2, 4 or all")
        envs = []
        for i, g in enumerate(groups):  # a TPU runtime per worker, each with its own port
            port = str(8476 + i)
            envs.append({
                "TPU_VISIBLE_CHIPS": ",".join(g), "TPU_VISIBLE_DEVICES": ",".join(g),
                "TPU_CHIPS_PER_PROCESS_BOUNDS": TPU_CHIP_BOUNDS[per_trial], "TPU_PROCESS_BOUNDS": "1,1,1",
                "TPU_PROCESS_PORT": port, "TPU_PROCESS_ADDRESSES": f"localhost:{port}",
                "TPU_MESH_CONTROLLER_ADDRESS": f"localhost:{port}", "TPU_MESH_CONTROLLER_PORT": port,
            })  # fmt: skip
        return envs
    raise ConfigError(f"--workers auto: no pinning known for platform {platform!r}")
