"""Shared test setup: strict rank promotion, one CPU device in this process, fast compilation,
and one JAX compilation cache for the session.

Tests that need several devices run in a subprocess with XLA_FLAGS set there (added to these).
"""

import os

# The suite is compile-bound (thousands of small programs): LLVM's optimisations at level 0 halve
# its time; XLA's HLO passes are unchanged. Set before JAX starts its backend, and inherited by
# the training runs tests start as subprocesses.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    """A persistent compilation cache shared by this session's processes (pytest-xdist workers and
    the training runs tests start as subprocesses): a run resumed after a kill, a sweep trial
    retried, a worker repeating another's setup load the compiled step instead of compiling it."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if root.name.startswith("popen-gw") else root  # xdist: shared by the workers
    path = str(root / "jax-compilation-cache")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path  # inherited by subprocesses
    jax.config.update("jax_compilation_cache_dir", path)
    yield path


@pytest.fixture
def key():
    return jax.random.key(0)
