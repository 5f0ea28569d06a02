"""Waiting on the processes tests start: a hang guard, not a time budget.

A test waits as long as its process works: on a busy machine a run of one minute takes ten, and a
fixed limit sized for an idle one fails there saying nothing about the code. Only a process that has
not finished after HANG_GUARD_S is taken for hung: it is killed, and the test fails saying that it
timed out, after how long, and what the process had printed by then.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest

from jaxformer.gpu import nvidia_gpus_here

HANG_GUARD_S = 1800  # 30 min: hung, not slow (the longest of these runs takes ~1 min of CPU)


def cpu_env(**extra: str) -> dict[str, str]:
    """os.environ for a process that runs JAX on the CPU only, compiling with XLA:CPU's elemental
    emitters as the test session does (tests/conftest.py: its MLIR fusion emitters take ~2.5x the
    CPU time to compile a small model). Never for a process that loads libtpu (`plan --target tpu-*`),
    whose XLA aborts on the flag, nor where an NVIDIA GPU is (its CUDA plugin reads XLA_FLAGS too and
    aborts on the flag; conftest leaves it out there). The flag is named once, also where XLA_FLAGS
    already names it: the compilation cache's key holds XLA_FLAGS as written. `extra`: more variables;
    an XLA_FLAGS among them is added to these."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    emitters = "--xla_cpu_use_fusion_emitters=false"
    flags = " ".join(flags if nvidia_gpus_here() or emitters in flags else [*flags, emitters])
    if "XLA_FLAGS" in extra:
        flags = f"{flags} {extra.pop('XLA_FLAGS')}"
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, **extra)


def sharded_worker(*args, devices: int = 8) -> subprocess.Popen:
    """tests/sharded_worker.py `args` in a process of its own, on `devices` CPU devices (the count is
    fixed when JAX starts), its output piped: collect it with `communicate`."""
    env = cpu_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    worker = pathlib.Path(__file__).with_name("sharded_worker.py")
    command = [sys.executable, str(worker), *map(str, args)]
    return subprocess.Popen(command, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def hung(what: str, stdout="", stderr="") -> None:
    """Fail the test: `what` did not finish within the hang guard; the output it wrote until then."""
    out, err = _text(stdout)[-4000:], _text(stderr)[-4000:]
    pytest.fail(
        f"timed out after {HANG_GUARD_S} s (the hang guard of tests/processes.py), the process killed: {what}\n"
        f"--- its stdout so far (the end) ---\n{out}\n--- its stderr so far (the end) ---\n{err}",
        pytrace=False,
    )


def run(command: list, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True, **kwargs), under the hang guard."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=HANG_GUARD_S, **kwargs)
    except subprocess.TimeoutExpired as e:  # run() has killed it
        hung(" ".join(map(str, command))[:300], e.stdout, e.stderr)


def communicate(proc: subprocess.Popen, what: str) -> tuple[str, str]:
    """proc.communicate() under the hang guard: (stdout, stderr)."""
    try:
        return proc.communicate(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        hung(what, out, err)


def wait(proc: subprocess.Popen, what: str, log: pathlib.Path | None = None) -> int:
    """proc.wait() under the hang guard, for a process whose output goes to `log` (shown if it hangs)."""
    try:
        return proc.wait(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        hung(what, log.read_text() if log and log.is_file() else "")


def wait_until(condition, proc: subprocess.Popen, what: str, poll: float = 0.01) -> None:
    """Poll `condition()` while `proc` runs, under the hang guard; `proc` must not exit first (a failure
    with its output). On timeout, `proc` (its output piped) is killed and its output shown."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"exited ({proc.returncode}) before {what}:\n{_text(out)[-3000:]}\n{_text(err)[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            hung(f"waiting for {what}", out, err)
        time.sleep(poll)
