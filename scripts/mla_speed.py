"""`benchmark.py --mla`: one decoding step of a decoder with multi-head latent attention (`model.mla`)
against a multi-head one of the same width and heads: the cache's bytes per token and the step's time.

    python scripts/benchmark.py --mla --d-model 256 --heads 4 --layers 4 --seq 1024 --batch 8
    python scripts/benchmark.py --mla --d-model 2048 --heads 16 --layers 8 --seq 4096 --batch 32 \
        --dtype bfloat16 --mla-rank 512 --mla-rope 64     # an accelerator

Run through `scripts/benchmark.py` (its flags and model shape). Both models are decoder_only with RoPE
and no biases; the multi-head one has K = D / H, the MLA one nope_head_dim = v_head_dim = K, the latent
`--mla-rank` (C) and rope dims `--mla-rope` (R) wide, its queries projected from D (`--mla-q-rank` 0) or
through a latent of that width. Each model's cache holds `--seq` slots for `--batch` rows; a step is one
new token per row at the last slot, so it attends over the whole cache (the MLA model in the absorbed
form). The two are timed in turns, round by round (`--rounds`, `--steps` steps each), and the median
step is reported; ms per token is the step over the batch.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def _step_timer(cfg, B: int, S: int, seed: int = 0):
    """(run n steps -> seconds per step, cache bytes per token and layer, parameters) of `cfg`'s model."""
    from flax import nnx

    from jaxformer.models import build_model, count_params

    model = build_model(cfg, seed=seed)
    cache = jax.tree.map(jnp.copy, model.init_cache(B, S))  # one buffer per leaf: the step donates them
    leaves = jax.tree.leaves(cache["layers"])
    per_token = sum(a.nbytes for a in leaves) / (B * S * cfg.num_decoder_layers)
    graphdef, state = nnx.split(model)

    def step(state, cache, ids_B1, positions_B1):  # greedy: the next token feeds the next step
        logits, cache = nnx.merge(graphdef, state).decode_step(cache, ids_B1, positions_B1)
        return jnp.argmax(logits[:, -1], -1)[:, None].astype(jnp.int32), cache

    step = jax.jit(step, donate_argnums=1)  # the cache written in place
    positions = jnp.full((B, 1), S - 1, jnp.int32)  # the last slot: every step attends over the whole cache
    box = {"cache": cache, "ids": jnp.full((B, 1), 5, jnp.int32)}

    def run(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            box["ids"], box["cache"] = step(state, box["cache"], box["ids"], positions)
        box["ids"].block_until_ready()
        return (time.perf_counter() - start) / n

    run(2)  # compile and warm up
    return run, per_token, count_params(model)


def mla_speed(args, model_config) -> None:
    """The multi-head and MLA decoders of the command line's shape, one decoding step each, interleaved.

    Args:
        args (argparse.Namespace): benchmark.py's flags (d_model, heads, layers, vocab, batch, seq, dtype,
            attention, rounds, steps, mla_rank, mla_rope, mla_q_rank).
        model_config (Callable): benchmark.py's `model_config(mode, args, **changes)`.
    """
    from jaxformer import config as C

    K = args.d_model // args.heads
    common = dict(position="rope", use_bias=False, norm="rmsnorm", norm_position="pre", max_len=args.seq,
                  scan_layers=False, dropout_rate=0.0)  # fmt: skip
    mla = C.MLAConfig(kv_lora_rank=args.mla_rank, q_lora_rank=args.mla_q_rank, rope_head_dim=args.mla_rope,
                      nope_head_dim=K, v_head_dim=K)  # fmt: skip
    configs = {
        "multi-head": model_config("decoder_only", args, **common),
        "MLA": model_config("decoder_only", args, **common, mla=mla),
    }
    B, S = args.batch, args.seq
    timers = {name: _step_timer(cfg, B, S) for name, cfg in configs.items()}
    times = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, (run, _, _) in timers.items():
            times[name].append(run(args.steps))
    print(
        f"{jax.devices()[0].device_kind}: decoder_only D={args.d_model} H={args.heads} K={K} L={args.layers} "
        f"V={args.vocab}, {args.dtype}; MLA C={args.mla_rank} R={args.mla_rope} Cq={args.mla_q_rank}; "
        f"batch {B}, cache of {S} slots; median of {args.rounds} rounds x {args.steps} steps"
    )
    print(f"{'':12s} {'params':>10s} {'cache B/token/layer':>20s} {'cache MiB':>10s} {'ms/step':>9s} {'ms/token':>9s}")
    for name, (_, per_token, params) in timers.items():
        step_s = statistics.median(times[name])
        mib = per_token * B * S * args.layers / 2**20
        print(f"{name:12s} {params:10,d} {per_token:20,.0f} {mib:10.1f} {1e3 * step_s:9.3f} {1e3 * step_s / B:9.4f}")
