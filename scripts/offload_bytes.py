"""Where a compiled training step keeps its bytes, device or host, for each remat policy and
optimizer placement: XLA's memory analysis of one decoder-only step (scanned layers, bfloat16), compiled
for a TPU slice or GPUs without using them (`jaxformer plan`'s targets). The figures of
docs/guides/long-context.md ("Host offload"):

    python scripts/offload_bytes.py --target tpu-v5e:2x2 --layers 8 --d-model 512 --seq 2048 \\
        --runs full,offload_inputs,full+optimizer,dots_saveable,offload_dots
    JAX_PLATFORMS=cpu python scripts/offload_bytes.py --target gpu-h100:1x4 --layers 2 --d-model 256 --seq 1024 \\
        --runs dots_saveable,offload_dots,full,offload_inputs,full+optimizer

A run is a `model.remat` choice, with "+optimizer" for `train.offload_optimizer`. Batch 8 over a data axis
of all the devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from jaxformer import sharding
from jaxformer.config import Config, DataConfig, MeshConfig, TrainConfig, tiny
from jaxformer.plan import Compiled, lower_train_step, parse_target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="tpu-v5e:2x2", help="a `jaxformer plan --target` (TPU slice or gpu-GPU:1xN)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--runs", default="full,offload_inputs,full+optimizer")
    args = p.parse_args()
    target, D, T = parse_target(args.target), args.d_model, args.seq
    model = tiny(
        "decoder_only", vocab_size=128, d_model=D, num_heads=D // 128, d_ff=4 * D, max_len=T, dtype="bfloat16",
        attention_impl="auto", num_encoder_layers=0, num_decoder_layers=args.layers, scan_layers=True,
    )  # fmt: skip
    base = Config(model=model, data=DataConfig(max_len=T), train=TrainConfig(objective="lm", batch_size=8))
    base = dataclasses.replace(base, mesh=MeshConfig(data=-1))
    mesh = sharding.make_mesh(base.mesh, target.devices())
    print(f"{args.target}, decoder-only L={args.layers} D={D} T={T}, batch 8 over data={mesh.size}; MB per device")
    heads = ("arguments", "temporaries", "XLA peak", "host args", "host temps")
    print(f"{'run':24s} " + " ".join(f"{h:>12s}" for h in heads))
    for run in args.runs.split(","):
        remat, _, optimizer = run.partition("+")
        train = dataclasses.replace(base.train, offload_optimizer=optimizer == "optimizer")
        cfg = dataclasses.replace(base, model=base.model.replace(remat=remat), train=train)
        start = time.perf_counter()
        c = Compiled.of(lower_train_step(cfg, mesh, 8)[0])
        mb = lambda b: f"{b / 1e6:.1f}"
        figures = (c.arguments, c.temporaries, c.compiler_peak, c.host_arguments, c.host_temporaries)
        took = time.perf_counter() - start
        print(f"{run:24s} " + " ".join(f"{mb(b):>12s}" for b in figures) + f"   ({took:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
