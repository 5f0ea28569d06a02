"""One long-context training step of an experiment on this machine's first device, measured: the
compiled step's device and host bytes (XLA's memory analysis), the device's peak bytes in use after a
few steps (its allocator's statistics, where it keeps them: GPUs and TPUs), and the median step time.
One JSON line, so that runs in processes of their own can be set side by side (`scripts/gpu_check.sh`,
part `long`, runs it at a long T with and without the chunked loss and the host-offload options).

    python scripts/long_context_step.py --config experiments/gpt2_1p3b.py --set data.max_len=16384 \\
        --set model.max_len=16384 --set train.batch_size=1 --set mesh.fsdp=1 --set train.loss_chunk=0
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

from jaxformer import sharding
from jaxformer.config import apply_overrides, load_experiment
from jaxformer.state import init_state
from jaxformer.train import jit_steps, make_steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="experiments/NAME.py (an lm experiment)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override a field")
    p.add_argument("--steps", type=int, default=3, help="timed steps, after two untimed ones")
    args = p.parse_args()
    cfg = apply_overrides(load_experiment(args.config), args.set)
    B, T, V = cfg.train.batch_size, cfg.data.max_len, cfg.model.vocab_size
    ids = lambda: np.random.default_rng(0).integers(4, V, (B, T), dtype=np.int32)
    batch = {"inputs": ids(), "targets": ids(), "weights": np.ones((B, T), np.float32)}
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    with sharding.use(mesh, sharding.rules_for(cfg.mesh)):
        graphdef, state, optimizer = init_state(cfg, mesh)
        step, _ = jit_steps(*make_steps(graphdef, cfg, optimizer), state, mesh)
        batch = sharding.global_batch(batch, mesh, B)
        m = step.lower(state, batch).compile().memory_analysis()
        times = []
        for _ in range(2 + args.steps):
            start = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
    stats = jax.devices()[0].memory_stats() or {}
    print(json.dumps({
        "T": T, "batch": B, "remat": cfg.model.remat, "loss_chunk": cfg.train.loss_chunk,
        "offload_optimizer": cfg.train.offload_optimizer, "loss": float(metrics["loss"]),
        "step_s": statistics.median(times[2:]), "measured_peak_gb": stats.get("peak_bytes_in_use", 0) / 1e9,
        "compiled_device_gb": (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                               + m.temp_size_in_bytes) / 1e9,
        "compiled_host_gb": (m.host_argument_size_in_bytes + m.host_output_size_in_bytes
                             - m.host_alias_size_in_bytes + m.host_temp_size_in_bytes) / 1e9,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
