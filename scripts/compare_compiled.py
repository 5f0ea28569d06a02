"""What the compiler made of jaxformer's decoder-only training step and of Hugging Face's Flax GPT-2
step, at the shapes of `benchmark.py --compare`, side by side: FLOPs, bytes, fusions, transposes and
copies, the loss and output-layer path, what is kept for the backward pass, dropout's random bits.

    python scripts/compare_compiled.py                      # XLA:CPU, this machine
    python scripts/compare_compiled.py --target gpu-h100    # XLA's GPU compiler for one H100, deviceless
    python scripts/compare_compiled.py --vocab 8192 --markdown    # the table as Markdown

The GPU target needs JAX's CUDA plugin (`pip install -e ".[gpu-plan,bench]"`; see `jaxformer.gpu`) and
no GPU: nothing is run, only compiled (without autotuning). Both steps are the ones `--compare` times:
jaxformer set up as GPT-2 (pre-norm, learned positions, tanh GELU, tied output, biases, dropout
on embeddings and residuals), `scripts/peers.py`'s FlaxGPT2LMHeadModel, each with the same optax
AdamW (clipped), B x T tokens per step, mean cross-entropy.

"Bytes" are XLA's cost analysis (CPU; the GPU path has none) and, on every target, a count from the
compiled program itself (`jaxformer.plan.hlo_ops`, what `jaxformer plan` reports for a GPU): each
top-level op's result and operands (a fusion reads its operands once, a slice only the slice), by kind
of op, a loop's body once per trip. Counts are of top-level ops: a fusion counts once whatever it fuses.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import sys

os.environ.setdefault("USE_TORCH", "0")  # transformers must not import torch here
sys.path.insert(0, str(pathlib.Path(__file__).parent))

import benchmark
import jax
import peers

from jaxformer import plan, tpu
from jaxformer.train import flops_per_example


def program_stats(text: str, B: int, T: int, V: int, D: int) -> dict:
    """Counts and bytes of the top-level ops of a compiled program (not those inside fusions)."""
    comps, _ = plan.parse_hlo(text)
    inner_ops = lambda i: collections.Counter(j["op"] for c in i["calls"] for j in comps.get(c, []))
    s = collections.Counter()
    by_kind = collections.Counter()  # bytes by kind of top-level op
    logits_elements = B * T * V
    for i, moved_once, times in plan.hlo_ops(text):
        op, moved = i["op"], moved_once * times
        inner = inner_ops(i) if op == "fusion" else collections.Counter({op: 1})
        if op == "fusion":
            s["fusions"] += 1
            s[f"fusions {i['kind']}"] += 1
        gemm = "dot" in inner or "gemm" in i["target"] or "gemm" in " ".join(inner) or "__cublas" in i["target"]
        if op == "custom-call" and i["target"].startswith("__cudnn"):
            kind = "cuDNN"
        elif gemm:
            kind = "matmul"
        elif inner.keys() & {"xor", "shift-right-logical", "rng-bit-generator", "rng"}:
            kind = "dropout bits"
        elif inner.keys() <= {"transpose", "copy", "bitcast", "parameter", "reshape", "broadcast"}:
            kind = "transpose/copy"
        elif inner.keys() & {"reduce", "reduce-window"}:
            kind = "reduction"
        else:
            kind = "elementwise"
        by_kind[kind] += moved
        s[f"ops {kind}"] += 1
        s["bytes"] += moved
        for o in ("transpose", "copy"):
            s[f"{o} ops"] += inner[o] > 0
        s["conditionals"] += op == "conditional"
        s["while loops"] += op == "while"
        first = re.findall(r"\[([\d,]*)\]", i["shape"])
        dims = [int(d) for d in first[0].split(",") if d] if first else []
        elements = 1
        for d in dims:
            elements *= d
        if elements == logits_elements and i["shape"].split("[")[0].lstrip("(") in ("f32", "bf16"):
            s[f"[B,T,V] {i['shape'].split('[')[0].lstrip('(')} ops"] += 1
        if "transpose" in inner and dims and len(dims) == 2 and (dims[0] in (V,) or dims[1] in (V,)):
            s["transposes of a [V, .] array"] += 1
        s["gathers"] += inner["gather"] > 0
        s["scatters"] += inner["scatter"] > 0
    s.update({f"bytes: {k}": v for k, v in by_kind.items()})
    return dict(s)


def build_steps(args):
    """(jaxformer's jitted step, its state, HF Flax's jitted step, its state, the batch, our FLOPs)."""
    cfg, _, state, optimizer, train_step, batch = benchmark.peer_shaped_step("decoder_only", args)
    hf_model, hf_params = peers.hf_flax("decoder_only", args)
    hf_state = (hf_params, optimizer.init(hf_params), jax.random.key(0))
    hf_step = peers.hf_flax_train_step("decoder_only", hf_model, optimizer)
    flops = flops_per_example(cfg.model, "lm", args.seq, args.seq) * args.batch
    return jax.jit(train_step, donate_argnums=0), state, hf_step, hf_state, batch, flops


def on_target(trees: tuple, target: str) -> tuple:
    """`trees` as abstract arrays on one compile-only GPU (`--target gpu-h100`), or themselves (cpu)."""
    if target == "cpu":
        return trees
    from jaxformer import gpu

    device = gpu.topology_devices(target.removeprefix("gpu-"), 1, 1)[0]  # one topology for all of them
    one = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), trees)


def describe(compiled, args) -> dict:
    """The figures of one compiled step."""
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    mem = compiled.memory_analysis()
    stats = program_stats(compiled.as_text(), args.batch, args.seq, args.vocab, args.d_model)
    return stats | {
        "XLA flops": cost.get("flops"),
        "XLA bytes accessed": cost.get("bytes accessed"),
        "temp bytes": mem.temp_size_in_bytes,
        "argument bytes": mem.argument_size_in_bytes,
    }


ROWS = [  # (label, key, unit): the table's rows in order
    ("model FLOPs (train.flops_per_example)", "model flops", "G"),
    ("XLA FLOPs (cost analysis)", "XLA flops", "G"),
    ("XLA bytes accessed (cost analysis)", "XLA bytes accessed", "MB"),
    ("bytes moved by top-level ops", "bytes", "MB"),
    ("  by matmuls", "bytes: matmul", "MB"),
    ("  by cuDNN calls", "bytes: cuDNN", "MB"),
    ("  by reductions (softmax, norms, loss)", "bytes: reduction", "MB"),
    ("  by elementwise ops", "bytes: elementwise", "MB"),
    ("  by transposes and copies alone", "bytes: transpose/copy", "MB"),
    ("  by dropout's random bits", "bytes: dropout bits", "MB"),
    ("fusions", "fusions", ""),
    ("  kLoop / kInput / kOutput", "fusions kLoop/kInput/kOutput", ""),
    ("  kCustom (library matmuls, oneDNN/YNNPACK, Triton)", "fusions kCustom", ""),
    ("top-level ops: matmuls", "ops matmul", ""),
    ("top-level ops: reductions", "ops reduction", ""),
    ("top-level ops: elementwise", "ops elementwise", ""),
    ("top-level ops holding a transpose", "transpose ops", ""),
    ("top-level ops holding a copy", "copy ops", ""),
    ("transposes of a [V, .] array (tied output)", "transposes of a [V, .] array", ""),
    ("ops making a float32 [B, T, V] array", "[B,T,V] f32 ops", ""),
    ("gathers / scatters (embedding, label logit)", "gathers/scatters", ""),
    ("conditionals", "conditionals", ""),
    ("dropout ops (random bits)", "ops dropout bits", ""),
    ("temporaries (memory analysis)", "temp bytes", "MB"),
]


def table(ours: dict, hf: dict, markdown: bool) -> str:
    for d in (ours, hf):
        kinds = ("kLoop", "kInput", "kOutput")
        d["fusions kLoop/kInput/kOutput"] = " / ".join(str(d.get(f"fusions {k}", 0)) for k in kinds)
        d["gathers/scatters"] = f"{d.get('gathers', 0)} / {d.get('scatters', 0)}"
    lines = []
    for label, key, unit in ROWS:
        a, b = ours.get(key), hf.get(key)
        if a is None and b is None:
            continue
        scale = {"G": 1e9, "MB": 1e6, "": 1}[unit]

        def show(x, scale=scale, unit=unit) -> str:
            return "-" if x is None else x if isinstance(x, str) else f"{x / scale:,.1f}" if unit else f"{x:,}"

        ratio = f"{a / b:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else ""
        cells = (f"{label}{' (' + unit + ')' if unit else ''}", show(a), show(b), ratio)
        plain = f"{cells[0]:52s} {cells[1]:>14s} {cells[2]:>14s} {cells[3]:>7s}"
        lines.append("| " + " | ".join(cells) + " |" if markdown else plain)
    head = ("| | jaxformer | HF Flax GPT-2 | ratio |\n|---|---|---|---|" if markdown
            else f"{'':52s} {'jaxformer':>14s} {'HF Flax GPT-2':>14s} {'ratio':>7s}")  # fmt: skip
    return "\n".join([head, *lines])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="cpu", choices=["cpu", "gpu-h100", "gpu-h200", "gpu-a100-80g"])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--attention", default="naive", choices=["naive", "auto", "xla", "cudnn"])
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--dump", help="write both compiled programs' HLO text into this folder")
    args = p.parse_args()
    args.remat, args.scan = "auto", False  # as --compare runs it: layers unrolled, nothing rematerialised
    tpu.compile_only_without_chips()
    ours_step, state, hf_step, hf_state, batch, flops = build_steps(args)
    state, hf_state, batch = on_target((state, hf_state, batch), args.target)
    results = {}
    for name, step, st in (("jaxformer", ours_step, state), ("hf_flax", hf_step, hf_state)):
        compiled = step.lower(st, batch).compile()
        results[name] = describe(compiled, args)
        if args.dump:
            pathlib.Path(args.dump).mkdir(parents=True, exist_ok=True)
            (pathlib.Path(args.dump) / f"{args.target}_{name}.hlo").write_text(compiled.as_text())
    results["jaxformer"]["model flops"] = results["hf_flax"]["model flops"] = flops
    D, H, L, V, T, B = args.d_model, args.heads, args.layers, args.vocab, args.seq, args.batch
    print(f"decoder-only training step, {args.target}: D={D} H={H} L={L} V={V} T={T} B={B} {args.dtype}, "
          f"attention {args.attention}, dropout {args.dropout}, AdamW; jax {jax.__version__}")  # fmt: skip
    print(table(results["jaxformer"], results["hf_flax"], args.markdown))


if __name__ == "__main__":
    main()
