"""Shared test setup: strict rank promotion, one CPU device in this process, fast compilation,
float32 matmuls at full precision on every backend, no GPU memory preallocation, and one JAX
compilation cache for the session.

Tests that need several devices run in a subprocess with XLA_FLAGS set there (added to these).
"""

import os

# The suite is compile-bound (thousands of small programs): LLVM's optimisations at level 0 halve
# its time; XLA's HLO passes are unchanged. Set before JAX starts its backend, and inherited by
# the training runs tests start as subprocesses.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
# Tests compare float32 results with references at ~1e-5: pin full-precision matmuls, which GPUs (TF32)
# and TPUs (bfloat16 passes) do not use by default. Inherited by the runs tests start as subprocesses.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# Parallel test workers share one accelerator: none may take 75% of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
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
