"""GPipe against 1F1B on 2 stages of CPU devices, 8 micro-batches: the compiled training gradient's
temporary bytes (`compiled.memory_analysis()`), and both against one device's loss and gradients.

    python scripts/pipeline_memory.py [--d_model 64] [--length 64] [--batch 16] [--remat none]

Prints one line per schedule: temporary MiB a device, the relative error of the loss and the largest
of the gradients' against one device (float32).
"""

from __future__ import annotations

import argparse
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

import jax
from pipeline_common import loss_and_grads, worst_gradient_error  # beside this file

from jaxformer import config as C


def config(args, schedule: str | None) -> C.Config:
    model = C.tiny("decoder_only", vocab_size=64, d_model=args.d_model, num_heads=4, d_ff=4 * args.d_model,
                   dropout_rate=0.0, check_token_ids=False)  # fmt: skip
    mesh = C.MeshConfig(data=1) if schedule is None else C.MeshConfig(stage=2, data=1, schedule=schedule)
    return C.Config(
        model=model.replace(scan_layers=True, num_decoder_layers=4, remat=args.remat, max_len=args.length),
        data=C.DataConfig(max_len=args.length),
        train=C.TrainConfig(objective="lm", batch_size=args.batch, grad_accum=8),
        mesh=mesh,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d_model", type=int, default=64)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--remat", default="none", help="model.remat of the stacks (auto, none, full, ...)")
    args = parser.parse_args()
    _, ref_loss, ref_grads = loss_and_grads(config(args, None), jax.devices()[:1])
    for schedule in ("gpipe", "1f1b"):
        step, loss, grads = loss_and_grads(config(args, schedule), jax.devices()[:2])
        worst = worst_gradient_error(grads, ref_grads)
        temp = step.memory_analysis().temp_size_in_bytes / 2**20
        print(f"{schedule:6s} M=8 S=2  temporaries {temp:8.2f} MiB  loss {abs(loss - ref_loss) / abs(ref_loss):.1e}  "
              f"gradients {worst:.1e}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
