"""`benchmark.py --serve` and `--grpo`: the inference engine under a stream of requests against the
static `generate` path and transformers' PyTorch `generate` on the same weights, and a GRPO iteration's
time split into rollout and update. Run through `scripts/benchmark.py` (its flags and model shape); the
PyTorch side only where torch imports.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import config as C


def serve_lengths(args) -> tuple[list[list[int]], list[int]]:
    """The stream of `--serve-requests` requests: prompts of 8 to `--seq` tokens, uniform, and outputs of
    8 to `--serve-max-new` tokens, uniform (`--serve-lengths uniform`) or log-uniform (`longtail`: many
    short answers, a few long ones, as chat outputs run); random ids, seeded."""
    rng = np.random.default_rng(0)
    n, max_new = args.serve_requests, args.serve_max_new
    prompts = [rng.integers(4, args.vocab, int(p)).tolist() for p in rng.integers(8, args.seq + 1, n)]
    if args.serve_lengths == "uniform":
        outs = rng.integers(8, max_new + 1, n)
    else:
        outs = np.exp(rng.uniform(np.log(8), np.log(max_new + 1), n)).astype(int)
    return prompts, [int(o) for o in outs]


def _percentiles(xs: list[float]) -> str:
    if not xs:
        return f"{'-':>8s} {'-':>8s}"
    return f"{1e3 * np.percentile(xs, 50):8.1f} {1e3 * np.percentile(xs, 90):8.1f}"


def serve_speed(args) -> None:
    """A stream of `--serve-requests` requests of mixed prompt and output lengths (`serve_lengths`), all
    there at the start, at most `--serve-slots` at once, on one GPT-2-shaped decoder_only model (random
    weights, EOS never ending a request early), three ways, interleaved round by round:

    - the engine: continuous batching over the paged KV cache, `--serve-slots` slots, the requests
      streamed (time to first token and inter-token latency from the events of each `step`);
    - static `generate`: the requests in batches of `--serve-slots` as they come, each batch padded to
      its longest prompt and run to its longest output, as a user of `decode.generate` would batch them;
    - Hugging Face transformers' PyTorch `generate` on the same weights (exported by
      `interop.save_hf`), batched the same way, greedy, left-padded (when torch is importable).

    Tokens/s counts each request's own new tokens only. Time to first token: from the start to the
    request's first token (a batch path returns every token of a batch when the batch ends). Inter-token
    latency: per request, (time of its last token - time of its first) / (tokens - 1). Throughput is the
    median over rounds; latencies are pooled over rounds."""
    import tempfile

    from jaxformer.config import DecodeConfig, EngineConfig
    from jaxformer.decode import generate
    from jaxformer.engine import Engine, SamplingParams
    from jaxformer.interop.hf import save_hf
    from jaxformer.models import build_model

    slots, max_new = args.serve_slots, args.serve_max_new
    prompts, outs = serve_lengths(args)
    width = 1 << (args.seq - 1).bit_length()  # generate pads prompts to a power of two
    mcfg = C.gpt2_small(
        vocab_size=args.vocab, d_model=args.d_model, num_heads=args.heads, d_ff=4 * args.d_model,
        num_decoder_layers=args.layers, max_len=width + max_new, dropout_rate=0.0, dtype=args.dtype,
        check_token_ids=False, scan_layers=args.scan, attention_impl=args.attention,
    )  # fmt: skip
    model = build_model(mcfg)
    page = 16
    per_seq = -(-(args.seq + max_new) // page)
    cfg = EngineConfig(
        page_size=page, num_pages=slots * per_seq + 1, max_slots=slots, prefill_chunk=args.serve_chunk,
        decode_steps=args.serve_steps, prefix_sharing=False,
    )  # fmt: skip
    engine = Engine(model, cfg, eos_id=None)
    # --serve-speculate K: the same engine drafting K tokens a step by prompt lookup (`engine.speculate`).
    drafting = Engine(model, dataclasses.replace(cfg, speculative_tokens=args.serve_speculate), eos_id=None)
    batches = [range(i, min(i + slots, len(prompts))) for i in range(0, len(prompts), slots)]
    total = sum(outs)

    def engine_run(engine=engine):
        t0, first, last = time.perf_counter(), {}, {}
        for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
            engine.add_request(p, SamplingParams(max_tokens=o), f"r{i}")
        while engine.has_unfinished():
            events = engine.step()
            now = time.perf_counter() - t0
            for e in events:
                if e.token_ids:
                    first.setdefault(e.request_id, now)
                    last[e.request_id] = now
        end = time.perf_counter() - t0
        itl = [(last[f"r{i}"] - first[f"r{i}"]) / (o - 1) for i, o in enumerate(outs) if o > 1]
        return end, list(first.values()), itl

    def static_run():
        t0, ttft = time.perf_counter(), []
        for b in batches:
            settings = DecodeConfig(strategy="greedy", max_new_tokens=max(outs[i] for i in b))
            np.asarray(generate(model, [prompts[i] for i in b], settings, eos_id=None).tokens)
            ttft += [time.perf_counter() - t0] * len(b)
        return time.perf_counter() - t0, ttft, []

    runs = {f"engine ({slots} slots, {args.serve_steps} steps a call)": engine_run, "static generate": static_run}
    if args.serve_speculate:
        runs[f"engine, prompt lookup of {args.serve_speculate}"] = lambda: engine_run(drafting)
    torch_run = _torch_serve(model, prompts, outs, batches, tempfile.mkdtemp(), save_hf, args.dtype)
    if torch_run is not None:
        runs["transformers torch generate"] = torch_run
    kv_bytes = (
        2 * mcfg.num_decoder_layers * mcfg.kv_heads * mcfg.dim_per_head * np.dtype(jnp.dtype(mcfg.dtype)).itemsize
    )
    print(
        f"serve: GPT-2 shape D={args.d_model} H={args.heads} L={args.layers} V={args.vocab} {args.dtype}; "
        f"{len(prompts)} requests, {slots} at once; prompts 8-{args.seq}, outputs 8-{max_new} {args.serve_lengths} "
        f"({total} new tokens in all); page {page}, chunk {args.serve_chunk}; the paged cache holds "
        f"{kv_bytes} bytes per token ({kv_bytes * page} a page); {jax.devices()[0].device_kind}, "
        f"{os.cpu_count()} cores"
    )
    t0 = time.perf_counter()
    shapes = engine.warmup()  # every shape of the engine's step, as `serve --warmup` does
    shapes += drafting.warmup() if args.serve_speculate else 0
    print(f"engine warm-up: {shapes} shapes compiled in {time.perf_counter() - t0:.1f} s", flush=True)
    for name, fn in runs.items():
        t0 = time.perf_counter()
        fn()  # compiles the static path's shapes (and any the warm-up missed)
        print(f"{name}: first round (compiling) {time.perf_counter() - t0:.1f} s", flush=True)
    times, ttft, itl = ({name: [] for name in runs} for _ in range(3))
    for _ in range(args.rounds):
        for name, fn in runs.items():
            t, first, gaps = fn()
            times[name].append(t)
            ttft[name] += first
            itl[name] += gaps
    rate = {name: total / statistics.median(ts) for name, ts in times.items()}
    print(f"{'':38s} {'s':>7s} {'tokens/s':>9s} {'TTFT p50':>8s} {'p90 ms':>8s} {'ITL p50':>8s} {'p90 ms':>8s}")
    for name in runs:
        print(
            f"{name:38s} {statistics.median(times[name]):7.2f} {rate[name]:9.0f} "
            f"{_percentiles(ttft[name])} {_percentiles(itl[name])}"
        )
    names = list(runs)
    for other in names[1:]:
        print(f"engine / {other}: {rate[names[0]] / rate[other]:.2f}x tokens/s")
    if args.serve_speculate:
        s = drafting.stats()
        print(f"prompt lookup: {s['draft_accepted']} of {s['drafted']} drafted tokens taken "
              f"({s['draft_accepted'] / max(s['drafted'], 1):.0%})")  # fmt: skip
    if args.serve_profile:  # one more round of each jax path under the profiler: where a round's time goes
        for name, fn in list(runs.items())[:2]:
            directory = os.path.join(args.serve_profile, name.split()[0])
            t0 = time.perf_counter()
            with jax.profiler.trace(directory, create_perfetto_trace=True):
                fn()
            print(f"{name}: {trace_summary(directory, time.perf_counter() - t0)}")


def trace_summary(directory: str, wall_s: float, top: int = 8) -> str:
    """What a profiled round's device did (`jax.profiler.trace`'s Perfetto trace under `directory`): the
    time some kernel ran on a device stream (the union of their intervals) against the round's wall
    time, the kernels launched, and the `top` kernels by their total time. On a CPU (no device track),
    only that."""
    import gzip
    import json
    import pathlib

    path = next(pathlib.Path(directory).rglob("perfetto_trace.json.gz"), None)
    if path is None:
        return "no trace written"
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    process = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    devices = {pid for pid, n in process.items() if "/device:" in n and "CPU" not in n}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    streams = {key for key, n in threads.items() if key[0] in devices and "stream" in n.lower()}
    kernels = [  # a GPU's kernels are on its stream lines; its "XLA Modules" and "XLA Ops" lines repeat them
        e for e in events if e.get("ph") == "X" and e.get("pid") in devices and "dur" in e
        and (not streams or (e["pid"], e.get("tid")) in streams)
    ]  # fmt: skip
    if not kernels:
        return f"wall {wall_s * 1e3:.0f} ms; no device track in the trace (a CPU run)"
    busy, end = 0.0, float("-inf")
    for e in sorted(kernels, key=lambda e: e["ts"]):
        start, stop = e["ts"], e["ts"] + e["dur"]
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    by_name = collections.Counter()
    for e in kernels:
        by_name[e["name"]] += e["dur"]
    heads = ", ".join(f"{n[:40]} {t / 1e3:.1f} ms" for n, t in by_name.most_common(top))
    return (f"wall {wall_s * 1e3:.0f} ms, a device kernel running {busy / 1e3:.1f} ms ({busy / 1e4 / wall_s:.0f}%), "
            f"{len(kernels)} kernels; the longest in all: {heads}")  # fmt: skip


def _torch_serve(model, prompts, outs, batches, directory, save_hf, dtype):
    """Hugging Face transformers' PyTorch `generate` over `model`'s weights (written with `save_hf`),
    batch by batch as the static path runs, on the GPU where torch sees one, in `dtype`; None (and a line
    saying so) where torch is not importable. Counts the requests of the first batch whose greedy tokens
    equal the engine's model's (`generate`; all of them in float32, fewer in bfloat16, whose rounding
    differs between the two)."""
    try:
        import torch
        import transformers
    except ImportError:
        print("transformers torch generate: skipped (torch is not importable: pip install -e '.[bench]')")
        return None
    from jaxformer.config import DecodeConfig
    from jaxformer.decode import generate

    save_hf(model, directory)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    peer = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype))
    peer = peer.to(device).eval()

    def batch(b):
        rows = [prompts[i] for i in b]
        width = max(map(len, rows))
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, r in enumerate(rows):  # left-padded, as decoder-only generation wants
            ids[j, width - len(r) :], mask[j, width - len(r) :] = torch.tensor(r), 1
        ids, mask = ids.to(device), mask.to(device)
        n = max(outs[i] for i in b)
        with torch.inference_mode():
            out = peer.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                pad_token_id=0, eos_token_id=None,
            )  # fmt: skip
        return out[:, width:].tolist()  # to the host: the batch is done

    got = batch(batches[0])
    settings = DecodeConfig(strategy="greedy", max_new_tokens=max(outs[i] for i in batches[0]))
    want = generate(model, [prompts[i] for i in batches[0]], settings, eos_id=None).tokens[:, 0].tolist()
    same = sum(g[: outs[i]] == w[: outs[i]] for i, g, w in zip(batches[0], got, want, strict=True))
    print(f"transformers torch {torch.__version__} on {device}, {torch.get_num_threads()} threads: greedy tokens "
          f"of the first batch equal generate's for {same} of {len(got)} requests")  # fmt: skip

    def run():
        t0, ttft = time.perf_counter(), []
        for b in batches:
            batch(b)
            ttft += [time.perf_counter() - t0] * len(b)
        return time.perf_counter() - t0, ttft, []

    return run


def grpo_speed(args, model_config) -> None:
    """A GRPO iteration (`jaxformer.post_train.rl`) at the command line's decoder_only shape, random
    weights: `--grpo-prompts` prompts of the addition task x `--grpo-group` samples of up to
    `--serve-max-new` tokens (temperature 1, EOS = id 2 may end one), then one update; its time split
    into rollout and update (the median of `--rounds` iterations after the first), and the rollout's
    tokens/s against the engine's plain throughput on as many requests, each alone (no prefix sharing)."""
    import tempfile

    from flax import nnx

    from jaxformer.config import Config, DataConfig, GRPOConfig, TrainConfig
    from jaxformer.engine import Engine, SamplingParams
    from jaxformer.post_train import rl

    P, G, max_new = args.grpo_prompts, args.grpo_group, args.serve_max_new
    width = 8 + max_new  # the addition task's prompts are 4-6 characters
    cfg = Config(
        model=model_config("decoder_only", args, max_len=width + 1, dropout_rate=0.0, position="rope"),
        data=DataConfig(max_len=width),
        train=TrainConfig(objective="lm", steps=1 + args.rounds, batch_size=P * G, schedule="constant", warmup_steps=0,
                          log_every=10**6, eval_every=10**6),
        grpo=GRPOConfig(group_size=G, max_new_tokens=max_new, eval_prompts=1),
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as workdir:
        out = rl.run(cfg, workdir, quiet=True)
    rows = out["history"][1:]
    rollout, update = (statistics.median(r[k] for r in rows) for k in ("rollout_s", "update_s"))
    tokens = statistics.median(r["completion_tokens"] for r in rows) * P * G
    model = nnx.merge(out["graphdef"], out["state"].weights)
    ecfg = dataclasses.replace(rl.engine_config(cfg), prefix_sharing=False)
    engine = Engine(model, ecfg, eos_id=2, bos_id=1)
    prompts = [[1, *rl.CharTokenizer().encode(f"{i % 90 + 10}+{i % 7}=")] for i in range(P * G)]
    params = [SamplingParams(max_tokens=max_new, temperature=1.0, seed=i) for i in range(P * G)]
    engine.generate(prompts, params)  # compiles
    times, counts = [], []
    for _ in range(args.rounds):
        t = time.perf_counter()
        outs = engine.generate(prompts, params)
        times.append(time.perf_counter() - t)
        counts.append(sum(len(o.token_ids) + (o.finish_reason == "stop") for o in outs))
    plain = statistics.median(c / t for c, t in zip(counts, times, strict=True))
    print(
        f"grpo: D={args.d_model} H={args.heads} L={args.layers} V={args.vocab} dtype={args.dtype}; {P} prompts x {G} "
        f"samples, up to {max_new} new tokens; {args.rounds} iterations after the first"
    )
    print(f"rollout {rollout:.3f} s ({rollout / (rollout + update):.0%}), update {update:.3f} s "
          f"({update / (rollout + update):.0%})")  # fmt: skip
    print(f"rollout {tokens / rollout:.0f} tokens/s; the engine alone on {P * G} requests {plain:.0f} tokens/s")
