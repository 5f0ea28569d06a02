"""Context parallelism (jaxformer/ring.py) against one device's attention, on 8 CPU devices.

Ring and all-gather attention over 2, 4 and 8 devices, with the sequence laid out contiguously,
zig-zag or striped, equal `functional.dot_product_attention` on the whole sequence (outputs and the
gradients of q, k and v, float32) for causal and bidirectional self-attention and cross-attention,
with padded keys and packed segments. The cases run in one process of their own (8 devices must
be set before JAX starts), which prints the largest errors as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# (name, strategy, ring size, layout, causal, T, S, lengths, segments, data-parallel ways): cross-
# attention when T != S; with data ways, the batch is split over a data axis beside the ring.
CASES = [
    ("ring2 causal packed", "ring", 2, "contiguous", True, 32, 32, True, True, 1),
    ("ring4 causal packed zigzag", "ring", 4, "zigzag", True, 32, 32, True, True, 1),
    ("ring8 causal packed zigzag", "ring", 8, "zigzag", True, 32, 32, True, True, 1),
    ("ring8 causal striped", "ring", 8, "striped", True, 32, 32, False, False, 1),
    ("ring4 bidirectional padded", "ring", 4, "contiguous", False, 32, 32, True, False, 1),
    ("ring8 cross padded", "ring", 8, "contiguous", False, 16, 32, True, False, 1),
    ("allgather4 causal packed zigzag", "allgather", 4, "zigzag", True, 32, 32, True, True, 1),
    ("allgather8 cross padded", "allgather", 8, "contiguous", False, 16, 32, True, False, 1),
    ("ring4 x data2 causal packed zigzag", "ring", 4, "zigzag", True, 32, 32, True, True, 2),
]


def case_errors(seed, strategy, n, layout, causal, T, S, lengths, segments, data) -> dict:
    """The largest differences from one device's attention, of the outputs and of the gradients."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxformer import functional as F
    from jaxformer import ring

    B, H, G, K = 2, 4, 2, 8
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((data, n), ("data", "context"), axis_types=auto, devices=jax.devices()[: data * n])
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (B, T, H, K))
    k, v = jax.random.normal(kk, (B, S, G, K)), jax.random.normal(kv, (B, S, G, K))
    kv_lengths = jnp.array([S, S - 5]) if lengths else None
    # two documents a row, the second ending early: trailing keys and queries are padding (segment 0)
    seg = lambda L: jnp.stack([jnp.where(jnp.arange(L) < L // 3, 1, 2), jnp.where(jnp.arange(L) < L - 6, 1, 0)])
    q_seg, kv_seg = (seg(T), seg(S)) if segments else (None, None)
    q_order, kv_order = ring.layout_order(T, n, layout), ring.layout_order(S, n, layout)
    lay = lambda x, order: None if x is None else x[:, order]

    def ours(q, k, v):
        o = ring.context_attention(
            q[:, q_order], k[:, kv_order], v[:, kv_order], mesh=mesh, strategy=strategy, causal=causal,
            q_index_BT=jnp.broadcast_to(jnp.asarray(q_order), (B, T)),
            kv_index_BS=jnp.broadcast_to(jnp.asarray(kv_order), (B, S)),
            q_segments_BT=lay(q_seg, q_order), kv_segments_BS=lay(kv_seg, kv_order), kv_lengths_B=kv_lengths,
            spec_BTHK=("data",),
        )  # fmt: skip
        return o[:, np.argsort(q_order)]

    def reference(q, k, v):
        mask = F.Mask(causal=causal, kv_lengths=kv_lengths, q_segments=q_seg, kv_segments=kv_seg)
        return F.dot_product_attention(q, k, v, mask=mask)

    cotangent = jnp.cos(jnp.arange(K))  # a loss whose gradient is not O itself
    loss = lambda f: lambda *a: jnp.sum(f(*a) * cotangent)
    o1, o2 = jax.jit(ours)(q, k, v), jax.jit(reference)(q, k, v)
    g1 = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v)
    g2 = jax.jit(jax.grad(loss(reference), argnums=(0, 1, 2)))(q, k, v)
    return {
        "out": float(jnp.abs(o1 - o2).max()),
        "grad": max(float(jnp.abs(a - b).max()) for a, b in zip(g1, g2, strict=True)),
        "grad_scale": max(float(jnp.abs(b).max()) for b in g2),
    }


def run_cases() -> dict:
    import jax
    import jax.numpy as jnp

    from jaxformer import ring

    out = {name: case_errors(i, *case) for i, (name, *case) in enumerate(CASES)}
    mesh = jax.make_mesh((4,), ("context",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    x = jnp.zeros((1, 30, 2, 8))
    try:
        ring.context_attention(x, x, x, mesh=mesh)
    except ValueError as e:
        out["indivisible"] = str(e)
    return out


@pytest.fixture(scope="module")
def errors() -> dict:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_context_parallel_attention_equals_one_device(errors, case):
    assert errors[case]["out"] <= 1e-5, errors[case]
    assert errors[case]["grad"] <= 1e-5 * max(1.0, errors[case]["grad_scale"]), errors[case]


def test_a_sequence_the_context_axis_does_not_divide_is_refused(errors):
    assert errors["indivisible"] == "queries: length 30 is not divisible by the context axis (context=4)"


if __name__ == "__main__":
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    print(json.dumps(run_cases()))
