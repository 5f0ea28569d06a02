"""Training-step speed of each mode: tokens/s, step time, compile time, memory and MFU;
and decoding speed with and without the KV cache.

    python scripts/benchmark.py                       # CPU-sized defaults, all three modes
    python scripts/benchmark.py --d-model 1024 --layers 12 --batch 64 --seq 1024 --dtype bfloat16   # accelerator
    python scripts/benchmark.py --decode              # greedy and beam 4, batch 1 and 8, 64/256/1024 tokens
    python scripts/benchmark.py --serve --seq 64   # engine vs static generate vs torch generate, 128 requests
    python scripts/benchmark.py --grpo --serve-max-new 32   # a GRPO iteration: rollout vs update, rollout vs engine
    python scripts/benchmark.py --compare             # side by side with Hugging Face Flax and PyTorch (bench extra)
    python scripts/benchmark.py --lora 16 --modes decoder_only --d-model 512 --heads 8 --layers 6 --seq 256 --batch 8
                                                      # full fine-tuning vs LoRA rank 16 on q,k,v,o, interleaved
    python scripts/benchmark.py --loss-chunk 512 --modes decoder_only --vocab 50257   # chunked vs plain loss
    python scripts/benchmark.py --mla --seq 1024 --batch 8   # a decoding step: latent cache vs multi-head cache
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/benchmark.py --context-attention \
        ring,allgather,none --lengths 1024,2048,4096 --modes decoder_only --batch 8   # long context (8 CPU devices)
    PYTHONPATH=. python scripts/benchmark.py --eval --rounds 5   # lm-eval's jaxformer vs its hf model (torch)
    python scripts/benchmark.py --matmul-floor --vocab 8192 --modes decoder_only   # the step's products timed alone
    python scripts/benchmark.py --gpt2-vs-torch --d-model 2048 --heads 16 --layers 24 --vocab 50304 --seq 1024 \
        --attention auto --batches 8,16    # the 1.3B GPT-2 shape beside torch.compile (scripts/gpu_check.sh)

Step times are the median of `--steps` timed steps after a warm-up; memory is XLA's
own analysis of the compiled step (arguments + outputs + temporaries - donated aliases),
the same on every backend. MFU = model FLOPs (train.flops_per_example) / time / peak, with the
peak as `jaxformer train` takes it (`jaxformer.chips`): the chip's dense peak in the compute
dtype from the table, or, for a device the table lacks (a CPU), a matmul probe in that dtype.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import pathlib
import statistics
import time
import timeit

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import chips, observe, tpu
from jaxformer import config as C
from jaxformer.state import init_state
from jaxformer.train import flops_per_example, make_steps

OBJECTIVE = {"decoder_only": "lm", "encoder_decoder": "seq2seq", "encoder_only": "mlm"}


def synthetic_batch(objective: str, B: int, T: int, V: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    ids = lambda: rng.integers(4, V, (B, T), dtype=np.int32)
    batch = {"inputs": ids(), "targets": ids(), "weights": np.ones((B, T), np.float32)}
    return batch | {"src": ids(), "src_lengths": np.full(B, T, np.int32)} if objective == "seq2seq" else batch


def model_config(mode: str, args, **changes) -> C.ModelConfig:
    """The model of `mode` at the command line's shapes (F = 4 D, `--layers` per stack); `changes` on top."""
    L = args.layers
    shapes = dict(
        mode=mode, vocab_size=args.vocab, d_model=args.d_model, num_heads=args.heads, d_ff=4 * args.d_model,
        num_encoder_layers=0 if mode == "decoder_only" else L, num_decoder_layers=0 if mode == "encoder_only" else L,
        max_len=args.seq, dtype=args.dtype, scan_layers=args.scan, remat=args.remat, attention_impl=args.attention,
        check_token_ids=False,
    )  # fmt: skip
    return C.ModelConfig(**shapes | changes)


def bench_mode(mode: str, args, peak: float) -> dict:
    model = model_config(mode, args)
    objective = OBJECTIVE[mode]
    train = C.TrainConfig(objective=objective, batch_size=args.batch, steps=args.steps)
    cfg = C.Config(model=model, train=train, data=C.DataConfig(max_len=args.seq))
    graphdef, state, optimizer = init_state(cfg)
    step_fn = jax.jit(make_steps(graphdef, cfg, optimizer)[0], donate_argnums=0)
    batch = jax.device_put(synthetic_batch(objective, args.batch, args.seq, args.vocab))
    compiled, compile_s, memory_mb = _compiled(step_fn, state, batch)
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
        "memory_mb": memory_mb,
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
    model = model_config(mode, args)
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


def lora_vs_full(args) -> None:
    """The same model trained in full and with LoRA (rank `--lora` on `--lora-targets`), AdamW, in one
    process, interleaved rounds: step time of each and their ratio, the trained parameters and the
    optimizer state's bytes, and the compiled steps' FLOPs and XLA memory: a LoRA step that still
    took the base's gradients would show the full step's FLOPs."""
    from jaxformer.train import parameter_counts

    mode = args.modes.split(",")[0]
    objective = OBJECTIVE[mode]
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
    lora = C.LoRAConfig(rank=args.lora, targets=tuple(args.lora_targets.split(",")))
    runs = {"full": C.LoRAConfig(), f"lora r={args.lora}": lora}
    steps, states, info = {}, {}, {}
    for name, lora_cfg in runs.items():
        cfg = C.Config(
            model=model_config(mode, args, dropout_rate=args.dropout, **PEER_ARCH[mode]),  # GPT-2, BART, BERT
            train=C.TrainConfig(objective=objective, batch_size=args.batch, optimizer="adamw"),
            data=C.DataConfig(max_len=args.seq),
            lora=lora_cfg,
        )
        graphdef, state, optimizer = init_state(cfg)
        batch = jax.device_put(synthetic_batch(objective, args.batch, args.seq, args.vocab))
        step = jax.jit(make_steps(graphdef, cfg, optimizer)[0], donate_argnums=0)
        compiled, _, memory_mb = _compiled(step, state, batch)
        cost = compiled.cost_analysis() or {}
        cost = cost[0] if isinstance(cost, list) else cost
        temp_mb = compiled.memory_analysis().temp_size_in_bytes / 2**20
        trained, total = parameter_counts(state)
        info[name] = (trained, total, nbytes(state.opt_state), cost.get("flops", float("nan")), memory_mb, temp_mb)
        steps[name], states[name] = compiled, state
    print(
        f"lora vs full: {mode} D={args.d_model} H={args.heads} L={args.layers} V={args.vocab} T={args.seq} "
        f"B={args.batch} {args.dtype} AdamW dropout {args.dropout}; LoRA rank {args.lora} on {args.lora_targets}; "
        f"median of {args.rounds} interleaved rounds of {args.steps} steps"
    )
    print(f"{'run':10s} {'step ms':>8s} {'trained':>20s} {'opt state MB':>12s} {'GFLOP/step':>10s} "
          f"{'memory MB':>9s} {'temp MB':>8s}")  # fmt: skip
    _timed_rounds(steps, states, batch, 1, 2)  # warm-up
    step_s = _timed_rounds(steps, states, batch, args.rounds, args.steps)
    for name, (trained, total, opt_bytes, flops, memory_mb, temp_mb) in info.items():
        share = f"{trained / 1e6:.2f}M ({trained / total:.2%})"
        print(f"{name:10s} {1e3 * step_s[name]:8.1f} {share:>20s} {opt_bytes / 2**20:12.1f} {flops / 1e9:10.1f} "
              f"{memory_mb:9.1f} {temp_mb:8.1f}")  # fmt: skip
    full, low = info["full"], info[f"lora r={args.lora}"]
    print(
        f"lora / full: step time {step_s[f'lora r={args.lora}'] / step_s['full']:.2f}x, "
        f"FLOPs {low[3] / full[3]:.2f}x, optimizer state {low[2] / full[2]:.4f}x, memory {low[4] / full[4]:.2f}x"
    )


def chunked_vs_plain_loss(args) -> None:
    """The same training step with the plain loss (train.loss_chunk=0) and the chunked one (`--loss-chunk`
    tokens per chunk), in one process, interleaved rounds: step time of each and their ratio, and the
    compiled steps' temporary memory (XLA's analysis), which holds the [B, T, V] logits in the plain one."""
    mode = args.modes.split(",")[0]
    objective = OBJECTIVE[mode]
    runs = {"plain": 0, f"chunk {args.loss_chunk}": args.loss_chunk}
    steps, states, temp_mb = {}, {}, {}
    batch = jax.device_put(synthetic_batch(objective, args.batch, args.seq, args.vocab))
    for name, chunk in runs.items():
        cfg = C.Config(
            model=model_config(mode, args),
            train=C.TrainConfig(objective=objective, batch_size=args.batch, loss_chunk=chunk),
            data=C.DataConfig(max_len=args.seq),
        )
        graphdef, state, optimizer = init_state(cfg)
        compiled, _, _ = _compiled(jax.jit(make_steps(graphdef, cfg, optimizer)[0], donate_argnums=0), state, batch)
        temp_mb[name] = compiled.memory_analysis().temp_size_in_bytes / 2**20
        steps[name], states[name] = compiled, state
    print(
        f"chunked vs plain loss: {mode} D={args.d_model} H={args.heads} L={args.layers} V={args.vocab} "
        f"T={args.seq} B={args.batch} {args.dtype}; median of {args.rounds} interleaved rounds of {args.steps} steps"
    )
    _timed_rounds(steps, states, batch, 1, 2)  # warm-up
    step_s = _timed_rounds(steps, states, batch, args.rounds, args.steps)
    for name in runs:
        print(f"{name:12s} step {1e3 * step_s[name]:8.1f} ms   temp {temp_mb[name]:8.1f} MB")
    chunked = f"chunk {args.loss_chunk}"
    print(
        f"chunked / plain: step time {step_s[chunked] / step_s['plain']:.2f}x, "
        f"temporaries {temp_mb[chunked] / temp_mb['plain']:.2f}x"
    )


def decode_speed(args) -> None:
    """Decoding time of `--decode-lengths` new tokens from an 8-token prompt (or source), EOS never
    stopping a row early: greedy and beam 4 (`--decode-strategies`), at each `--decode-batches` batch
    size, with the KV cache and (at `--recompute-lengths` and `--recompute-batches`) without it.
    Per-token time = run time / new tokens; tokens/s counts the B output rows, not the beams. Weights
    are random: speed does not depend on them."""
    from jaxformer.config import DecodeConfig
    from jaxformer.decode import generate, translate
    from jaxformer.models import build_model, count_params

    lengths = [int(n) for n in args.decode_lengths.split(",")]
    recompute = {int(n) for n in args.recompute_lengths.split(",") if n}
    batches = [int(b) for b in args.decode_batches.split(",")]
    recompute_batches = {int(b) for b in args.recompute_batches.split(",") if b}
    shortest, longest = min(lengths), max(lengths)
    P = 8  # prompt / source tokens
    print(
        f"decode: D={args.d_model} H={args.heads} L={args.layers} V={args.vocab} dtype={args.dtype}, "
        f"prompt/source {P} tokens; median of up to {args.repeats} runs after a compiling one"
    )
    print(f"{'mode':16s} {'strategy':8s} {'B':>3s} {'new':>5s} {'cache':>5s} {'compile s':>9s} {'run s':>8s} "
          f"{'ms/token':>9s} {'tokens/s':>9s}")  # fmt: skip
    per_token = {}
    for mode in [m for m in args.modes.split(",") if m != "encoder_only"]:
        model = build_model(model_config(mode, args, max_len=P + longest + 1, dropout_rate=0.0))
        chip = chips.lookup(jax.devices()[0].device_kind)
        if chip is not None:  # batch 1 reads every weight once per token at best
            weight_bytes = count_params(model) * np.dtype(jnp.dtype(args.dtype)).itemsize
            print(f"{mode}: weights {weight_bytes / 1e6:.0f} MB in {args.dtype}, one read at {chip.name}'s "
                  f"{chip.bandwidth / 1e12:.3g} TB/s: {1e3 * weight_bytes / chip.bandwidth:.3f} ms")  # fmt: skip
        rng = np.random.default_rng(0)
        run = functools.partial(generate, model, eos_id=None)
        if mode == "encoder_decoder":
            run = functools.partial(translate, model, bos_id=1, eos_id=None)

        for strategy, B, N in itertools.product(args.decode_strategies.split(","), batches, lengths):
            rows = rng.integers(4, args.vocab, (B, P)).tolist()
            for use_cache in (True, False) if N in recompute and B in recompute_batches else (True,):
                settings = DecodeConfig(
                    strategy=strategy, beam_size=4, max_new_tokens=N, extra_len=N - P, use_cache=use_cache
                )
                t = time.perf_counter()
                assert run(rows, settings).tokens.shape[-1] == N  # the first call compiles
                first = time.perf_counter() - t
                times = []
                while len(times) < args.repeats and sum(times) < 20.0:  # long runs: fewer repeats
                    t = time.perf_counter()
                    run(rows, settings)
                    times.append(time.perf_counter() - t)
                run_s = statistics.median(times)
                per_token[mode, strategy, B, N, use_cache] = run_s / N
                print(
                    f"{mode:16s} {strategy:8s} {B:3d} {N:5d} {'yes' if use_cache else 'no':>5s} "
                    f"{first - run_s:9.1f} {run_s:8.2f} {1e3 * run_s / N:9.2f} {B * N / run_s:9.0f}"
                )
    for (mode, strategy, B, N, use_cache), t in per_token.items():
        if use_cache and longest == N != shortest:
            ratio = t / per_token[mode, strategy, B, shortest, True]
            print(f"{mode} {strategy} B={B}: per-token time with the cache at {N} vs {shortest} tokens: {ratio:.2f}x")
        if not use_cache:
            speedup = t / per_token[mode, strategy, B, N, True]
            print(f"{mode} {strategy} B={B}: the cache is {speedup:.1f}x faster than recomputation at {N} tokens")


PEER_ARCH = {  # jaxformer set up as each peer's architecture: same shapes, norms, positions, activation
    "decoder_only": {"norm_position": "pre", "position": "learned", "activation": "gelu"},  # GPT-2
    "encoder_decoder": {"norm_position": "post", "position": "learned", "activation": "gelu"},  # BART
    "encoder_only": {"norm_position": "post", "position": "learned", "activation": "gelu"},  # BERT
}


def moe_vs_dense(args) -> None:
    """`--moe E,K`: a dense model beside MoE models of equal *active* parameters (E experts of width
    4D/K, K per token: a token meets 4D hidden units, as in the dense FFN of width 4D; the router's
    D x E aside), with a capacity (`--capacity-factor`) and dropless, per mode of `--modes`, in one
    process, interleaved rounds: tokens/s of each and its ratio to the dense model's."""
    E, k = (int(x) for x in args.moe.split(","))
    if (4 * args.d_model) % k:
        raise SystemExit(f"--moe {args.moe}: K={k} must divide the dense width 4 x --d-model = {4 * args.d_model}")
    experts = dict(num_experts=E, experts_per_token=k, expert_d_ff=4 * args.d_model // k, router="topk_softmax")
    runs = {
        "dense": C.MoEConfig(),
        f"moe capacity {args.capacity_factor}": C.MoEConfig(capacity_factor=args.capacity_factor, **experts),
        "moe dropless": C.MoEConfig(capacity_factor=0.0, **experts),
    }
    print(
        f"moe vs dense: E={E} K={k} experts of width {4 * args.d_model // k} vs a dense FFN of {4 * args.d_model}; "
        f"D={args.d_model} H={args.heads} L={args.layers} V={args.vocab} T={args.seq} B={args.batch} {args.dtype}; "
        f"device {jax.devices()[0].device_kind}; median of {args.rounds} interleaved rounds of {args.steps} steps"
    )
    print(f"{'mode':16s} {'run':22s} {'params':>9s} {'tokens/s':>9s} {'step ms':>9s} {'vs dense':>8s}")
    for mode in args.modes.split(","):
        objective = OBJECTIVE[mode]
        batch = jax.device_put(synthetic_batch(objective, args.batch, args.seq, args.vocab))
        steps, states, params = {}, {}, {}
        for name, moe in runs.items():
            cfg = C.Config(
                model=model_config(mode, args, moe=moe),
                train=C.TrainConfig(objective=objective, batch_size=args.batch),
                data=C.DataConfig(max_len=args.seq),
            )
            graphdef, state, optimizer = init_state(cfg)
            step = jax.jit(make_steps(graphdef, cfg, optimizer)[0], donate_argnums=0)
            steps[name], states[name] = _compiled(step, state, batch)[0], state
            params[name] = sum(x.size for x in jax.tree.leaves(state.params))
        _timed_rounds(steps, states, batch, 1, 2)  # warm-up
        step_s = _timed_rounds(steps, states, batch, args.rounds, args.steps)
        for name in runs:
            tokens = args.batch * args.seq / step_s[name]
            print(f"{mode:16s} {name:22s} {params[name] / 1e6:8.2f}M {tokens:9.0f} {1e3 * step_s[name]:9.1f} "
                  f"{step_s['dense'] / step_s[name]:7.2f}x")  # fmt: skip


def context_parallel(args) -> None:
    """Long context: the training step with the sequence split over every device by ring attention and
    by all-gather attention (`mesh.context` = the device count), and without a context axis ("none":
    the same devices as data parallelism, each holding whole rows), at each of `--lengths`, in one
    process, interleaved rounds. Per device: step time and the compiled step's temporaries and
    arguments (XLA's memory analysis), each beside none's; `--steps 0` compiles and runs nothing."""
    from jaxformer import sharding
    from jaxformer.train import jit_steps

    mode, n = args.modes.split(",")[0], jax.device_count()
    objective = OBJECTIVE[mode]
    strategies = args.context_attention.split(",")
    print(
        f"context parallelism: {mode} D={args.d_model} H={args.heads} L={args.layers} V={args.vocab} B={args.batch} "
        f"{args.dtype} attention={args.attention}, {n} {jax.devices()[0].platform} devices; "
        f"median of {args.rounds} interleaved rounds of {args.steps} steps"
    )
    print(f"{'T':>6s} {'attention':10s} {'step ms':>9s} {'temp MB':>9s} {'args MB':>9s}   vs none: step, temp")
    for T in (int(x) for x in args.lengths.split(",")):
        steps, states, batches, memory = {}, {}, {}, {}
        for strategy in strategies:
            axes = C.MeshConfig(data=n) if strategy == "none" else C.MeshConfig(data=1, context=n)
            attention = "ring" if strategy == "none" else strategy
            cfg = C.Config(
                model=model_config(mode, args, max_len=T, context_attention=attention),
                train=C.TrainConfig(objective=objective, batch_size=args.batch),
                data=C.DataConfig(max_len=T), mesh=axes,
            )  # fmt: skip
            mesh = sharding.make_mesh(cfg.mesh)
            with sharding.use(mesh, sharding.rules_for(cfg.mesh)):
                graphdef, state, optimizer = init_state(cfg, mesh)
                train_step = jit_steps(*make_steps(graphdef, cfg, optimizer), state, mesh)[0]
                batch = sharding.global_batch(synthetic_batch(objective, args.batch, T, args.vocab), mesh, args.batch)
                compiled = train_step.lower(state, batch).compile()
            m = compiled.memory_analysis()
            memory[strategy] = (m.temp_size_in_bytes / 2**20, m.argument_size_in_bytes / 2**20)
            steps[strategy], states[strategy], batches[strategy] = compiled, state, batch
        times = {k: [float("nan")] for k in steps}  # --steps 0: compiled memory only, nothing run
        for r in range(args.rounds + 1 if args.steps else 0):  # round 0 warms up
            for name, fn in steps.items():
                t = time.perf_counter()
                for _ in range(args.steps):
                    states[name], out = fn(states[name], batches[name])
                jax.block_until_ready(out)
                if r:
                    times[name].append((time.perf_counter() - t) / args.steps)
        step_s = {k: statistics.median(v[1:] if args.steps else v) for k, v in times.items()}
        for name in strategies:
            (temp, argm), base = memory[name], memory.get("none")
            ratio = f"{step_s[name] / step_s['none']:5.2f}x, {temp / base[0]:5.2f}x" if base else ""
            print(f"{T:6d} {name:10s} {1e3 * step_s[name]:9.1f} {temp:9.1f} {argm:9.1f}   {ratio}")


def _timed_rounds(fns: dict, state: dict, batch, rounds: int, steps: int) -> dict:
    """Step time of each fn, median over `rounds` rounds of `steps` steps; the fns take turns each
    round so that machine noise hits them alike."""
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(steps):
                state[name], out = fn(state[name], batch)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t) / steps)
    return {k: statistics.median(v) for k, v in times.items()}


def _compiled(fn, *args) -> tuple:
    """(compiled fn, compile seconds, XLA's memory estimate in MB)."""
    t = time.perf_counter()
    compiled = fn.lower(*args).compile()
    seconds = time.perf_counter() - t
    m = compiled.memory_analysis()
    mem = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return compiled, seconds, mem / 2**20


def peer_shaped_step(mode: str, args) -> tuple:
    """jaxformer set up as `mode`'s peer architecture with AdamW, as --compare and --matmul-floor
    run it: (config, graphdef, state, optimizer, the unjitted train step, a synthetic batch)."""
    objective = OBJECTIVE[mode]
    cfg = C.Config(
        model=model_config(mode, args, dropout_rate=args.dropout, **PEER_ARCH[mode]),
        train=C.TrainConfig(objective=objective, batch_size=args.batch, optimizer="adamw"),
        data=C.DataConfig(max_len=args.seq),
    )
    graphdef, state, optimizer = init_state(cfg)
    batch = jax.device_put(synthetic_batch(objective, args.batch, args.seq, args.vocab))
    return cfg, graphdef, state, optimizer, make_steps(graphdef, cfg, optimizer)[0], batch


def matmul_floor(mode: str, args) -> None:
    """The training step's matrix products, each timed alone with the shapes and dimension numbers
    XLA compiled them with: their sum bounds what removing everything else from the step can gain."""
    import collections
    import re

    *_, state, _, train_step, batch = peer_shaped_step(mode, args)
    hlo = jax.jit(train_step).lower(state, batch).compile().as_text()
    ints = lambda text: tuple(int(d) for d in text.split(",") if d)
    shape_of = {name: ints(dims) for name, dims in re.findall(r"%(\S+) = f32\[([\d,]*)\]", hlo)}
    dots = collections.Counter()
    for lhs, rhs, numbers in re.findall(r" dot\(%(\S+), %(\S+)\), (.*?), metadata", hlo):
        dims = dict(re.findall(r"(\w+)_dims=\{([\d,]*)\}", numbers))
        axes = [ints(dims.get(k, "")) for k in ("lhs_contracting", "rhs_contracting", "lhs_batch", "rhs_batch")]
        dots[shape_of[lhs], shape_of[rhs], tuple(axes)] += 1
    total_s = total_flops = 0.0
    print(f"{mode}: each matrix product of the training step timed alone (best of 15)")
    for (lhs, rhs, (lc, rc, lb, rb)), n in dots.most_common():
        a, b = jnp.ones(lhs, jnp.float32), jnp.ones(rhs, jnp.float32)
        f = jax.jit(functools.partial(jax.lax.dot_general, dimension_numbers=((lc, rc), (lb, rb))))
        flops = 2 * f(a, b).size * math.prod(lhs[i] for i in lc)
        best = min(timeit.repeat(lambda f=f, a=a, b=b: f(a, b).block_until_ready(), number=1, repeat=15))
        total_s, total_flops = total_s + n * best, total_flops + n * flops
        rate = flops / best / 1e9
        print(f"  {n:3d} x {lhs} . {rhs} contracting {lc}, {rc}: {1e3 * best:6.2f} ms, {rate:4.0f} GFLOP/s")
    print(
        f"{mode}: matmul floor {1e3 * total_s:.0f} ms per step "
        f"({total_flops / 1e9:.1f} GFLOP, {total_flops / total_s / 1e9:.0f} GFLOP/s)"
    )


def compare(args, peak: float) -> None:
    """jaxformer vs Hugging Face Flax (same process, same XLA flags, interleaved rounds) and vs
    PyTorch (a process of its own) at the same shapes: training tokens/s, compile time, memory,
    MFU, and greedy decoding at batch 1 (decoder_only)."""
    import subprocess
    import sys

    import peers

    B, T, D = args.batch, args.seq, args.d_model
    print(
        f"compare: D={D} H={args.heads} F={4 * D} L={args.layers}/stack V={args.vocab} T={T} B={B} AdamW "
        f"dropout {args.dropout}{', jaxformer layers scanned' if args.scan else ''}; "
        f"median of {args.rounds} interleaved rounds of {args.steps} steps"
    )
    print(f"{'mode':16s} {'impl':10s} {'tokens/s':>9s} {'step ms':>8s} {'compile s':>9s} {'memory MB':>9s} {'MFU':>7s}")
    for mode in args.modes.split(","):
        objective = OBJECTIVE[mode]
        cfg, graphdef, state, optimizer, train_step, batch = peer_shaped_step(mode, args)
        ours, ours_compile, ours_mem = _compiled(jax.jit(train_step, donate_argnums=0), state, batch)
        hf_model, hf_params = peers.hf_flax(mode, args)
        hf_state = (hf_params, optimizer.init(hf_params), jax.random.key(0))
        peer_step = peers.hf_flax_train_step(mode, hf_model, optimizer)
        peer, peer_compile, peer_mem = _compiled(peer_step, hf_state, batch)
        steps = {"jaxformer": ours, "hf_flax": peer}
        states = {"jaxformer": state, "hf_flax": hf_state}
        _timed_rounds(steps, states, batch, 1, 2)  # warm-up
        step_s = _timed_rounds(steps, states, batch, args.rounds, args.steps)
        shapes = {"mode": mode, "D": D, "H": args.heads, "F": 4 * D, "L": args.layers, "V": args.vocab, "T": T,
                  "B": B, "dropout": args.dropout, "rounds": args.rounds, "steps": args.steps}  # fmt: skip
        torch_cmd = [sys.executable, str(pathlib.Path(__file__).with_name("peers.py")), "torch", json.dumps(shapes)]
        torch_out = subprocess.run(torch_cmd, capture_output=True, text=True, env={**os.environ, "USE_TORCH": "1"})
        if torch_out.returncode == 0:
            step_s["torch"] = json.loads(torch_out.stdout.splitlines()[-1])["step_s"]
        else:
            print(f"  torch peer failed: {torch_out.stderr.strip().splitlines()[-1:]}")
        flops = flops_per_example(cfg.model, objective, T, T) * B
        info = {"jaxformer": (ours_compile, ours_mem), "hf_flax": (peer_compile, peer_mem)}
        for name, t in step_s.items():
            compile_s, mem = info.get(name, (float("nan"), float("nan")))
            print(f"{mode:16s} {name:10s} {B * T / t:9.0f} {1e3 * t:8.1f} {compile_s:9.1f} {mem:9.1f} "
                  f"{observe.value('mfu', flops / t / peak):>7s}")  # fmt: skip
        ratios = ", ".join(f"{step_s[p] / step_s['jaxformer']:.2f}x {p}" for p in step_s if p != "jaxformer")
        print(f"{mode:16s} jaxformer tokens/s = {ratios}")
        if mode == "decoder_only":
            num_new = min(64, T - 8)  # an 8-token prompt: both models hold T positions
            _compare_greedy(args, graphdef, states["jaxformer"], hf_model, states["hf_flax"][0], num_new)


def _compare_greedy(args, graphdef, state, hf_model, hf_params, num_new: int = 64) -> None:
    """Greedy decoding of `num_new` tokens from an 8-token prompt at batch 1, interleaved rounds."""
    import peers
    from flax import nnx

    from jaxformer.config import DecodeConfig
    from jaxformer.decode import generate

    prompt = np.random.default_rng(0).integers(4, args.vocab, (1, 8)).astype(np.int32)
    model = nnx.merge(graphdef, state.params)
    settings = DecodeConfig(strategy="greedy", max_new_tokens=num_new)
    peer, params, ids = peers.hf_flax_greedy(hf_model, hf_params, jax.numpy.asarray(prompt), num_new)
    fns = {
        "jaxformer": lambda _, __: (None, generate(model, prompt.tolist(), settings, eos_id=None).tokens),
        "hf_flax": lambda _, __: (None, peer(params, ids)),
    }
    _timed_rounds(fns, dict.fromkeys(fns), None, 1, 1)  # compiles both
    t = _timed_rounds(fns, dict.fromkeys(fns), None, args.rounds, 3)
    print(
        f"greedy decoding, batch 1, {num_new} new tokens: jaxformer {1e3 * t['jaxformer'] / num_new:.2f} ms/token, "
        f"hf_flax {1e3 * t['hf_flax'] / num_new:.2f} ms/token: {t['hf_flax'] / t['jaxformer']:.2f}x"
    )


def gpt2_shape(D: int, H: int, L: int, V: int, T: int, attention: str = "auto", stack: str = "unrolled"):
    """The GPT-2 shape as gpt2-vs-torch runs it (no dropout, bfloat16 compute); `stack` is "unrolled"
    or "scanned", each with an optional ":REMAT"."""
    layout, _, remat = stack.partition(":")
    if layout not in ("unrolled", "scanned"):
        raise SystemExit(f"--stacks: unrolled or scanned, each with an optional :REMAT, got {stack!r}")
    return C.gpt2_small(
        vocab_size=V, d_model=D, num_heads=H, d_ff=4 * D, num_decoder_layers=L, max_len=T, dropout_rate=0.0,
        dtype="bfloat16", attention_impl=attention, scan_layers=layout == "scanned", remat=remat or "auto",
        check_token_ids=False,
    )  # fmt: skip


def gpt2_step(D: int, H: int, L: int, V: int, T: int, B: int, rounds: int, steps: int, attention: str, stack: str):
    """jaxformer's GPT-2 shape with one layer stack ("unrolled" or "scanned", ":REMAT" optional), in the
    protocol of `peers.torch_gpt2`: median step time of `rounds` rounds of `steps` steps, and the peak
    device memory (the process's: run each in a process of its own; XLA's analysis where the device
    keeps no statistics)."""
    model = gpt2_shape(D, H, L, V, T, attention, stack)
    cfg = C.Config(model=model, train=C.TrainConfig(objective="lm", batch_size=B), data=C.DataConfig(max_len=T))
    graphdef, state, optimizer = init_state(cfg)
    step = jax.jit(make_steps(graphdef, cfg, optimizer)[0], donate_argnums=0)
    batch = jax.device_put(synthetic_batch("lm", B, T, V))
    compiled, _, memory_mb = _compiled(step, state, batch)
    for _ in range(2):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(steps):
            state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append((time.perf_counter() - t) / steps)
    peak_bytes = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", memory_mb * 2**20)
    return {"step_s": statistics.median(times), "peak_memory_gb": peak_bytes / 1e9}


def gpt2_vs_torch(args) -> None:
    """GPT-2-shaped causal LM (pre-norm, learned positions, GELU, tied embeddings, no dropout, AdamW),
    bfloat16 compute over float32 weights: at each of `--batches`, jaxformer with each layer stack of
    `--stacks` beside Hugging Face PyTorch GPT-2 + torch.compile, each in a process of its own (torch
    when it and a CUDA device are there). Tokens/s, MFU against the chip's bfloat16 peak and peak device
    memory; then each scanned stack against the unrolled one at the same batch, and the best of
    jaxformer against torch's best."""
    import subprocess
    import sys

    # Each run may use 90% of the GPU, as torch may use all of it (JAX's default is 75%); this process
    # only reads the chip's name, so it must not take JAX's preallocated share of the GPU from them.
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".90"} | os.environ  # a fraction the user set wins
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    D, H, L, V, T = args.d_model, args.heads, args.layers, args.vocab, args.seq
    peak, source = chips.peak_flops("bfloat16")
    if args.scan or args.remat != "auto":
        raise SystemExit("--gpt2-vs-torch takes its layer stacks from --stacks (e.g. scanned:full), not --scan/--remat")
    stacks = args.stacks.split(",")
    for stack in stacks:
        gpt2_shape(D, H, L, V, T, stack=stack)  # a misspelt stack stops here, before any run
    print(f"GPT-2 shape D={D} H={H} L={L} V={V} T={T}, attention {args.attention}; peak {peak / 1e12:.4g} TFLOP/s "
          f"({source})")  # fmt: skip
    print(f"{'impl':36s} {'B':>3s} {'tokens/s':>9s} {'MFU':>7s} {'memory GB':>9s}")
    here = pathlib.Path(__file__)
    speed, memory = {}, {}  # (name, B) -> tokens/s, peak GB
    for B in (int(b) for b in args.batches.split(",")):
        shapes = {"D": D, "H": H, "L": L, "V": V, "T": T, "B": B, "rounds": 3, "steps": args.steps}
        runs = {f"jaxformer {stack}": [str(here), "--gpt2-step", json.dumps(
            shapes | {"attention": args.attention, "stack": stack})] for stack in stacks}  # fmt: skip
        if args.peer:
            runs["torch.compile GPT-2"] = [str(here.with_name("peers.py")), "torch_gpt2", json.dumps(shapes)]
        flops = flops_per_example(gpt2_shape(D, H, L, V, T), "lm", T, T) * B
        for name, cmd in runs.items():
            torch_on = {"USE_TORCH": "1"} if name.startswith("torch") else {}  # peers.py sets 0 otherwise
            out = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, env=env | torch_on)
            if out.returncode:  # out of memory at this batch, or no torch: say so and go on
                print(f"{name:36s} {B:3d} failed: {(out.stderr.strip().splitlines() or [''])[-1][:100]}")
                continue
            r = json.loads(out.stdout.splitlines()[-1])
            speed[name, B], memory[name, B] = B * T / r["step_s"], r["peak_memory_gb"]
            mfu = observe.value("mfu", flops / r["step_s"] / peak)
            print(f"{name:36s} {B:3d} {speed[name, B]:9.0f} {mfu:>7s} {memory[name, B]:9.1f}")
    for (name, B), tokens in speed.items():  # the scanned-layers target: within 5% of unrolled in both
        unrolled = next((k for k in speed if k[1] == B and " unrolled" in k[0]), None)
        if " scanned" in name and unrolled:
            print(f"{name} / {unrolled[0]} at B={B}: tokens/s {tokens / speed[unrolled]:.3f}x, "
                  f"memory {memory[name, B] / memory[unrolled]:.3f}x")  # fmt: skip
    best = lambda torch: max((s for (n, _), s in speed.items() if n.startswith("torch") == torch), default=0)
    if best(True) and best(False):
        print(f"jaxformer's best / torch.compile's best tokens/s: {best(False) / best(True):.3f}x")


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
    p.add_argument("--attention", default="naive", choices=["naive", "auto", "xla", "cudnn", "splash"])
    p.add_argument("--remat", default="auto", choices=["auto", "none", "full", "dots_saveable"])
    p.add_argument("--scan", action="store_true", help="scan over layers")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--checkpoint-overhead", action="store_true", help="time steps while an async save runs")
    p.add_argument("--decode", action="store_true", help="decoding speed instead of training")
    p.add_argument("--decode-lengths", default="64,256,1024", help="new tokens per run")
    p.add_argument("--recompute-lengths", default="64,256", help="lengths also run without the cache (slow)")
    p.add_argument("--decode-batches", default="1,8")
    p.add_argument("--decode-strategies", default="greedy,beam", help="decode: greedy, beam or both")
    p.add_argument("--recompute-batches", default="1", help="batch sizes also run without the cache (slow)")
    p.add_argument("--repeats", type=int, default=3, help="decode: timed runs per setting (fewer past 20 s)")
    p.add_argument("--compare", action="store_true", help="side by side with Hugging Face Flax and PyTorch")
    p.add_argument("--eval", action="store_true", help="lm-eval: jaxformer vs the hf model (torch), examples/s")
    p.add_argument("--serve", action="store_true", help="engine vs static generate vs torch on a request stream")
    p.add_argument("--serve-requests", type=int, default=128, help="serve: requests in the stream")
    p.add_argument("--serve-slots", type=int, default=32, help="serve: requests at once (engine slots, batch)")
    p.add_argument("--serve-lengths", default="uniform", choices=["uniform", "longtail"], help="serve: outputs")
    p.add_argument("--serve-max-new", type=int, default=128, help="serve: the longest output")
    p.add_argument("--serve-chunk", type=int, default=64, help="serve: prefill chunk")
    p.add_argument("--serve-steps", type=int, default=8, help="serve: the engine's decode steps a call")
    p.add_argument("--serve-speculate", type=int, default=0, metavar="K", help="serve: also the engine drafting K "
                   "tokens a step by prompt lookup (speculative decoding)")  # fmt: skip
    p.add_argument("--serve-profile", help="serve: profile one more round of each jax path into this folder")
    p.add_argument("--grpo", action="store_true", help="a GRPO iteration: rollout vs update, rollout vs engine")
    p.add_argument("--grpo-prompts", type=int, default=8, help="grpo: prompts a step")
    p.add_argument("--grpo-group", type=int, default=8, help="grpo: samples a prompt")
    p.add_argument("--matmul-floor", action="store_true", help="the training step's matrix products timed alone")
    p.add_argument("--gpt2-vs-torch", action="store_true", help="GPT-2 shape in bf16 beside torch.compile (GPU)")
    p.add_argument("--batches", default="8,16", help="gpt2-vs-torch: batch sizes")
    p.add_argument("--stacks", default="unrolled,scanned", help="gpt2-vs-torch: unrolled / scanned[:REMAT], ...")
    p.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True, help="gpt2-vs-torch, eval: run torch")
    p.add_argument("--gpt2-step", help=argparse.SUPPRESS)  # one of gpt2-vs-torch's runs, in its own process
    p.add_argument("--lora", type=int, default=0, help="full fine-tuning vs LoRA of this rank, interleaved")
    p.add_argument("--lora-targets", default="q,k,v,o", help="lora: the adapted projections")
    p.add_argument("--loss-chunk", type=int, default=0, help="plain loss vs chunks of this many tokens, interleaved")
    p.add_argument("--context-attention", help="ring,allgather,none: training step with the sequence split, by each")
    p.add_argument("--lengths", default="1024,2048,4096", help="context-attention: sequence lengths")
    p.add_argument("--rounds", type=int, default=3, help="compare, lora, loss-chunk: interleaved rounds")
    p.add_argument("--dropout", type=float, default=0.1, help="compare: residual/embedding dropout")
    p.add_argument("--moe", help="E,K: dense vs MoE (E experts, K a token) of equal active parameters, interleaved")
    p.add_argument("--capacity-factor", type=float, default=1.25, help="moe: the capacity run's factor")
    p.add_argument("--mla", action="store_true", help="a decoding step: MLA's latent cache vs a multi-head cache")
    p.add_argument("--mla-rank", type=int, default=128, help="mla: the latent's width C (kv_lora_rank)")
    p.add_argument("--mla-rope", type=int, default=32, help="mla: the decoupled rope dims R (rope_head_dim)")
    p.add_argument("--mla-q-rank", type=int, default=0, help="mla: the queries' latent width (0: from D)")
    args = p.parse_args()
    tpu.compile_only_without_chips()  # with the tpu extra on a machine without chips: no libtpu errors
    if args.checkpoint_overhead:
        checkpoint_overhead(args)
        return
    if args.decode:
        decode_speed(args)
        return
    if args.serve:
        import serve_speed  # the engine, and torch where installed: only for this run

        serve_speed.serve_speed(args)
        return
    if args.eval:
        import eval_speed  # the harness and, where installed, torch: only for this run

        eval_speed.eval_speed(args)
        return
    if args.grpo:
        import serve_speed

        serve_speed.grpo_speed(args, model_config)
        return
    if args.lora:
        lora_vs_full(args)
        return
    if args.loss_chunk:
        chunked_vs_plain_loss(args)
        return
    if args.moe:
        moe_vs_dense(args)
        return
    if args.mla:
        import mla_speed

        mla_speed.mla_speed(args, model_config)
        return
    if args.context_attention:
        context_parallel(args)
        return
    if args.gpt2_step:
        print(json.dumps(gpt2_step(**json.loads(args.gpt2_step))))
        return
    if args.gpt2_vs_torch:
        gpt2_vs_torch(args)
        return
    if args.matmul_floor:
        for mode in args.modes.split(","):
            matmul_floor(mode, args)
        return
    peak, source = chips.peak_flops(args.dtype, min_seconds=5.0)  # a CPU probe read 116-220 GFLOP/s in 0.4 s runs
    print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}; peak {peak / 1e12:.4g} TFLOP/s ({source})")
    if args.compare:
        compare(args, peak)
        return
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
            f"{r['compile_s']:9.1f} {r['memory_mb']:9.1f} {observe.value('mfu', r['mfu']):>9s}"
        )


if __name__ == "__main__":
    main()
