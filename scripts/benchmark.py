"""Training-step speed of each mode: tokens/s, step time, compile time, memory and MFU.

    python scripts/benchmark.py                       # CPU-sized defaults, all three modes
    python scripts/benchmark.py --d-model 1024 --layers 12 --batch 64 --seq 1024 --dtype bfloat16   # accelerator

Step times are the median of `--steps` timed steps after a warm-up; memory is XLA's
own analysis of the compiled step (arguments + outputs + temporaries - donated aliases),
the same on every backend. MFU = model FLOPs (train.flops_per_example) / time / peak,
with the peak measured by a float32 matmul probe on the same device in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from jaxformer import config as C
from jaxformer.train import flops_per_example, init_state, make_steps, measure_peak_flops

OBJECTIVE = {"decoder_only": "lm", "encoder_decoder": "seq2seq", "encoder_only": "mlm"}


def synthetic_batch(objective: str, B: int, T: int, V: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    ids = lambda: rng.integers(4, V, (B, T), dtype=np.int32)
    batch = {"inputs": ids(), "targets": ids(), "weights": np.ones((B, T), np.float32)}
    return batch | {"src": ids()} if objective == "seq2seq" else batch


def bench_mode(mode: str, args, peak: float) -> dict:
    L = args.layers
    model = C.ModelConfig(
        mode=mode, vocab_size=args.vocab, d_model=args.d_model, num_heads=args.heads, d_ff=4 * args.d_model,
        num_encoder_layers=0 if mode == "decoder_only" else L, num_decoder_layers=0 if mode == "encoder_only" else L,
        max_len=args.seq, dtype=args.dtype, scan_layers=args.scan, remat=args.remat,
        attention_impl=args.attention, check_token_ids=False,
    )  # fmt: skip
    objective = OBJECTIVE[mode]
    train = C.TrainConfig(objective=objective, batch_size=args.batch, steps=args.steps)
    cfg = C.Config(model=model, train=train, data=C.DataConfig(max_len=args.seq))
    graphdef, state, optimizer = init_state(cfg)
    step_fn = jax.jit(make_steps(graphdef, cfg, optimizer)[0], donate_argnums=0)
    batch = jax.device_put(synthetic_batch(objective, args.batch, args.seq, args.vocab))
    t0 = time.perf_counter()
    compiled = step_fn.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    mem_bytes = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    for _ in range(2):  # warm-up
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    flops = flops_per_example(model, objective, args.seq, args.seq) * args.batch
    return {
        "mode": mode,
        "tokens_per_s": args.batch * args.seq / step_s,
        "step_ms": 1e3 * step_s,
        "compile_s": compile_s,
        "memory_mb": mem_bytes / 2**20,
        "mfu": flops / step_s / peak,
        "params_m": sum(x.size for x in jax.tree.leaves(state.params)) / 1e6,
    }


def checkpoint_overhead(args, rounds: int = 6, steps: int = 5) -> None:
    """Step time with an async checkpoint save started before the first of `steps` steps vs without,
    interleaved round by round in one process so machine noise hits both alike."""
    import tempfile

    from jaxformer.checkpoint import Checkpointer

    mode = args.modes.split(",")[0]
    objective = OBJECTIVE[mode]
    model = C.ModelConfig(
        mode=mode, vocab_size=args.vocab, d_model=args.d_model, num_heads=args.heads, d_ff=4 * args.d_model,
        num_encoder_layers=0 if mode == "decoder_only" else args.layers,
        num_decoder_layers=0 if mode == "encoder_only" else args.layers, max_len=args.seq, check_token_ids=False,
    )  # fmt: skip
    cfg = C.Config(
        model=model,
        train=C.TrainConfig(objective=objective, batch_size=args.batch),
        data=C.DataConfig(max_len=args.seq),
    )
    graphdef, state, optimizer = init_state(cfg)
    step_fn = jax.jit(make_steps(graphdef, cfg, optimizer)[0], donate_argnums=0)
    batch = jax.device_put(synthetic_batch(objective, args.batch, args.seq, args.vocab))
    state, m = step_fn(state, batch)
    jax.block_until_ready(m)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Checkpointer(tmp, cfg)
        timings = {"no save": [], "async save": []}
        for r in range(2 * rounds):
            kind = "async save" if r % 2 else "no save"
            t = time.perf_counter()
            if kind == "async save":
                ckpt.save(state)
            for _ in range(steps):
                state, m = step_fn(state, batch)
            jax.block_until_ready(m)
            timings[kind].append((time.perf_counter() - t) / steps)
            ckpt.wait()  # the next round starts with no save in flight
        ckpt.close()
    plain, saving = statistics.median(timings["no save"]), statistics.median(timings["async save"])
    params_mb = sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20
    print(
        f"checkpoint ({params_mb:.1f} MB of state): step {1e3 * plain:.1f} ms without a save, "
        f"{1e3 * saving:.1f} ms per step over {steps} steps after starting one: overhead {saving / plain - 1:+.1%}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="decoder_only,encoder_decoder,encoder_only")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--attention", default="naive", choices=["naive", "auto", "xla", "cudnn"])
    p.add_argument("--remat", default="none", choices=["none", "full", "dots_saveable"])
    p.add_argument("--scan", action="store_true", help="scan over layers")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--checkpoint-overhead", action="store_true", help="time steps while an async save runs")
    args = p.parse_args()
    if args.checkpoint_overhead:
        checkpoint_overhead(args)
        return
    peak = measure_peak_flops()
    print(
        f"device: {jax.devices()[0].device_kind} x{jax.device_count()}; matmul peak {peak / 1e9:.1f} GFLOP/s (float32)"
    )
    print(
        f"config: D={args.d_model} H={args.heads} L={args.layers} V={args.vocab} B={args.batch} T={args.seq} "
        f"dtype={args.dtype} attention={args.attention} remat={args.remat} scan={args.scan}"
    )
    columns = ("params", "tokens/s", "step ms", "compile s", "memory MB", "MFU")
    print(f"{'mode':16s} " + " ".join(f"{c:>9s}" for c in columns))
    for mode in args.modes.split(","):
        r = bench_mode(mode, args, peak)
        print(
            f"{r['mode']:16s} {r['params_m']:8.1f}M {r['tokens_per_s']:9.0f} {r['step_ms']:9.1f} "
            f"{r['compile_s']:9.1f} {r['memory_mb']:9.1f} {r['mfu']:9.2f}"
        )


if __name__ == "__main__":
    main()
