"""scripts/gpu_check.sh's `quick` and `serve` parts without a GPU: the whole path at toy shapes
(QUICK_SHAPE=tiny, SERVE_SHAPE), one table row per measurement, a step stopped at its cap with its
children, the carried wheels' install refusing what would break it, and the serve profile's summary of
a GPU's trace."""

import json
import pathlib
import subprocess
import sys

import processes
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_quick  # noqa: E402

ROWS = ["device", "jaxformer", "torch.compile GPT2LMHeadModel", "cuDNN ring blocks", "decode B=1", "decode B=32"]


def gpu_check(out, *parts, **env):
    """scripts/gpu_check.sh on the CPU, its processes compiling with the elemental emitters as the suite's
    do (processes.cpu_env): with XLA:CPU's default emitters the quick part's decode and training steps
    took twice the CPU time to compile (33 s against 23 s of CPU for the quick part in all)."""
    env = processes.cpu_env(PYTHON=sys.executable, **env)
    return subprocess.run(["bash", "scripts/gpu_check.sh", str(out), *parts], cwd=ROOT, env=env, capture_output=True,
                          text=True)  # fmt: skip


def test_quick_part_at_toy_shapes_prints_one_table_with_every_row(tmp_path):
    out = gpu_check(tmp_path, "quick", QUICK_SHAPE="tiny", WHEELS="")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    table = (tmp_path / "quick.md").read_text()
    assert table in out.stdout  # printed as written
    lines = table.splitlines()
    assert lines[0].startswith("| check | setting | tokens/s | MFU | peak memory | ms/token | result |")
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in lines[2:]}
    assert list(rows) == ROWS
    assert float(rows["jaxformer"][2]) > 0 and rows["jaxformer"][3].endswith("%") and rows["jaxformer"][6] == "ok"
    assert float(rows["decode B=1"][5]) > 0 and float(rows["decode B=32"][5]) > 0
    # no GPU here: the cuDNN test is skipped by its own reason, torch.compile's run is not started
    assert "skipped" in rows["cuDNN ring blocks"][6] and rows["torch.compile GPT2LMHeadModel"][6].startswith("skipped")
    figures = json.loads((tmp_path / "quick.json").read_text())
    jf = figures["jaxformer"]  # tokens/s is B * T / step time, at the tiny shape's B=4, T=64
    assert jf["tokens_per_s"] == pytest.approx(4 * 64 / jf["step_s"])
    assert jf["mfu"] == pytest.approx(
        figures["device"]["flops_per_example"] * 4 / jf["step_s"] / figures["device"]["peak_flops"]
    )
    assert (tmp_path / "quick.log").read_text().count("== quick ") >= 8  # each step's start and end


@pytest.mark.parametrize(
    "name, value",
    [("QUICK_SHAPE", "huge"), ("QUICK_BATCH", "0"), ("QUICK_BATCH", "8x"), ("QUICK_BUDGET_S", "soon"),
     ("QUICK_STACK", "scanned:sometimes"), ("QUICK_STACK", "looped"), ("QUICK_ATTENTION", "flash")],
)  # fmt: skip
def test_a_wrong_setting_is_named_before_anything_runs(name, value):
    with pytest.raises(SystemExit, match=f"^gpu_quick: {name} must be .*got '{value}'$"):
        gpu_quick.settings({name: value})


def test_the_default_settings_are_the_1p3b_shape_scanned_with_cudnn_at_batch_16():
    assert gpu_quick.settings({}) == ("1p3b", 16, "scanned", "cudnn", 420.0)
    assert gpu_quick.stack_text("scanned") == "scanned, remat auto (dots_saveable)"
    assert gpu_quick.stack_text("unrolled") == "unrolled, remat auto (none)"


def test_a_step_past_its_cap_is_stopped_with_the_processes_it_started(tmp_path):
    pid_file = tmp_path / "child"
    r = gpu_quick.run_step("sleepy", ["sh", "-c", f"echo started; sleep 60 & echo $! > {pid_file}; wait"], cap=2)
    assert r["timed_out"] and "started" in r["output"]
    child = int(pid_file.read_text())
    status = pathlib.Path(f"/proc/{child}/status")
    assert not status.exists() or "zombie" in status.read_text()  # killed with its group, not left running
    assert gpu_quick.why_not(r).startswith("stopped at its cap")


def test_carried_wheels_two_versions_of_one_package_or_an_empty_folder_are_refused_before_any_install(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    empty = gpu_check(tmp_path / "out", "quick", WHEELS=str(wheels))
    assert empty.returncode == 2 and "holds no .whl files" in empty.stderr
    for name in ("optax-0.2.8-py3-none-any.whl", "optax-0.2.7-py3-none-any.whl", "flax-0.12.8-py3-none-any.whl"):
        (wheels / name).write_bytes(b"")
    dupes = gpu_check(tmp_path / "out", "quick", WHEELS=str(wheels))
    assert dupes.returncode == 2 and "two versions of one package" in dupes.stderr and "(optax)" in dupes.stderr
    assert not (tmp_path / "out" / "wheels.log").exists()  # refused before pip ran


def test_carried_wheels_that_do_not_import_are_set_aside_for_the_machine_s_own(tmp_path):
    """As flax 0.12.8's wheel on jax 0.11.2's CUDA image, whose own flax runs: the check goes on with those."""
    import zipfile

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    info = "flax-99.0.dist-info"
    files = {
        "flax/__init__.py": 'raise AttributeError("a flax made for another jax")\n',
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: flax\nVersion: 99.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(wheels / "flax-99.0-py3-none-any.whl", "w") as whl:
        for name, text in files.items():
            whl.writestr(name, text)
    out = gpu_check(tmp_path / "out", "device", WHEELS=str(wheels), WHEEL_SITE=str(tmp_path / "site"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert (tmp_path / "site" / "flax" / "__init__.py").exists()  # installed, then set aside
    assert "do not import here (AttributeError: a flax made for another jax)" in out.stdout
    assert "the machine's own flax, optax and orbax do: using those" in out.stdout
    assert "== device failed" not in out.stdout


def test_serve_parts_at_toy_shapes_run_the_engine_and_profile_one_round_of_each_path(tmp_path):
    """`serve` at a toy shape on the CPU: the benchmark's table, then one profiled round of the engine and
    of static `generate` (summarised: here no device track), then the same benchmark with XLA's GPU
    command buffers switched off (a flag XLA:CPU ignores), each with its own log; then `serve_pages` with
    the one attention setting given (its GPU pair, the paged kernel and cuDNN's gather, needs a GPU); then
    `serve_spec`, the engine beside the same engine drafting by prompt lookup."""
    shape = "--d-model 32 --heads 2 --layers 1 --vocab 64 --seq 8 --serve-requests 4 --serve-max-new 8 --serve-slots 2"
    pages = {"SERVE_PAGES_SHAPE": f"{shape} --rounds 1", "SERVE_PAGES_ATTENTION": "auto"}
    pages |= {"SERVE_SPEC_SHAPE": f"{shape} --rounds 1"}
    out = gpu_check(tmp_path, "serve", "serve_pages", "serve_spec", SERVE_SHAPE=f"{shape} --rounds 1", WHEELS="",
                    **pages)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    profiled = (tmp_path / "serve.log").read_text()
    assert "engine / static generate:" in profiled
    assert profiled.count("no device track in the trace (a CPU run)") == 2  # the engine's round, static's
    assert list((tmp_path / "serve_profile").rglob("perfetto_trace.json.gz"))
    plain = (tmp_path / "serve_without_cuda_graphs.log").read_text()
    assert "engine / static generate:" in plain and "device track" not in plain
    assert "== serve_without_cuda_graphs: " in out.stdout and "failed" not in out.stdout
    assert "== serve_pages_auto: " in out.stdout and "serve_pages_cudnn" not in out.stdout
    assert "engine / static generate:" in (tmp_path / "serve_pages_auto.log").read_text()
    spec = (tmp_path / "serve_spec.log").read_text()
    assert "engine / engine, prompt lookup of 4:" in spec and "drafted tokens taken" in spec


def test_trace_summary_reads_a_gpu_track_as_the_profiler_writes_it(tmp_path):
    """`--serve-profile`'s summary of a Perfetto trace with a GPU's track, made here as JAX's profiler
    writes one (process and thread names in metadata events, kernels as complete events in microseconds
    on the GPU's stream lines): the time some kernel ran is the union of the kernels' intervals
    (overlapping streams counted once), the host's events and the GPU's module line are not kernels, and
    the kernels are ranked by their total time."""
    import gzip

    import serve_speed

    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "Stream #8(MemcpyD2D)"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 9, "args": {"name": "XLA Modules"}},
        {"ph": "X", "pid": 1, "tid": 9, "name": "jit__forward", "ts": 0.0, "dur": 1000.0},  # not a kernel
        {"ph": "X", "pid": 1, "tid": 7, "name": "gemm", "ts": 0.0, "dur": 400.0},
        {"ph": "X", "pid": 1, "tid": 8, "name": "gather", "ts": 300.0, "dur": 200.0},  # overlaps: 100 us
        {"ph": "X", "pid": 1, "tid": 7, "name": "gemm", "ts": 900.0, "dur": 100.0},
        {"ph": "X", "pid": 2, "tid": 1, "name": "PjitFunction", "ts": 0.0, "dur": 5000.0},  # the host's
    ]
    path = tmp_path / "plugins" / "profile" / "run" / "perfetto_trace.json.gz"
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    summary = serve_speed.trace_summary(str(tmp_path), wall_s=0.002)
    assert summary.startswith("wall 2 ms, a device kernel running 0.6 ms (30%), 3 kernels;"), summary
    assert summary.index("gemm 0.5 ms") < summary.index("gather 0.2 ms"), summary
    assert "PjitFunction" not in summary and "jit__forward" not in summary
    assert serve_speed.trace_summary(str(tmp_path / "none"), 1.0) == "no trace written"
