"""The pipeline's bubble measured: the training step's time over S stages of CPU devices at M micro-batches
against the same step unpipelined on the same devices (data=S, the same M micro-batches accumulated), set
beside (S - 1) / (M + S - 1).

    python scripts/pipeline_bubble.py [--stages 2] [--microbatches 2 4 8 16] [--d_model 256] [--repeats 5]

Each of the S devices runs every tick (a stand-in tick computes on values nothing reads), so over the
step a stage does M + S - 1 ticks' work where M is useful: the pipelined step does (M + S - 1) / M of the
unpipelined step's work, and 1 - t(unpipelined) / t(pipelined) measures the bubble, plus what the
pipeline adds besides (the permutes, the micro-batch buffer, the head run on every stage). Fake CPU
devices share the host's cores, so this measures the work, not idle time on a real accelerator: the
time is the process's CPU time (all its threads; other processes on a busy host do not add to it), the
best of `--repeats` steps after a warm-up. Prints one line per M.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax
from pipeline_common import random_batch  # beside this file

from jaxformer import config as C
from jaxformer import sharding
from jaxformer.pipeline import bubble_fraction
from jaxformer.state import init_state
from jaxformer.train import jit_steps, make_steps


def config(args, stages: int, microbatches: int) -> C.Config:
    model = C.tiny("decoder_only", vocab_size=64, d_model=args.d_model, num_heads=4, d_ff=4 * args.d_model,
                   dropout_rate=0.0, check_token_ids=False)  # fmt: skip
    mesh = C.MeshConfig(stage=stages, data=1) if stages > 1 else C.MeshConfig(data=args.stages)
    return C.Config(
        model=model.replace(scan_layers=True, num_decoder_layers=args.layers, max_len=args.length),
        data=C.DataConfig(max_len=args.length),
        train=C.TrainConfig(objective="lm", batch_size=args.batch, grad_accum=microbatches),
        mesh=mesh,
    )


def step_seconds(cfg: C.Config, devices, repeats: int) -> float:
    """The least CPU time of the jitted training step over `repeats` runs, after one to compile."""
    B, T = cfg.train.batch_size, cfg.data.max_len
    mesh = sharding.make_mesh(cfg.mesh, devices)
    batch = random_batch(B, T)
    with sharding.use(mesh, sharding.rules_for(cfg.mesh)):
        graphdef, state, optimizer = init_state(cfg, mesh)
        train, _ = jit_steps(*make_steps(graphdef, cfg, optimizer), state, mesh)
        batch = sharding.global_batch(batch, mesh, B)
        state, metrics = train(state, batch)
        jax.block_until_ready(metrics)
        best = float("inf")
        for _ in range(repeats):
            start = time.process_time()
            state, metrics = train(state, batch)
            jax.block_until_ready(metrics)
            best = min(best, time.process_time() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d_model", type=int, default=256)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    devices = jax.devices()[: args.stages]
    for M in args.microbatches:
        flat = step_seconds(config(args, 1, M), devices, args.repeats)
        piped = step_seconds(config(args, args.stages, M), devices, args.repeats)
        print(f"S={args.stages} M={M:3d}  unpipelined {flat * 1e3:8.1f} ms CPU  pipelined {piped * 1e3:8.1f} ms CPU  "
              f"measured {1 - flat / piped:5.2f}  (S - 1) / (M + S - 1) {bubble_fraction(args.stages, M):5.2f}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
