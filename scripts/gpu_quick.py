"""The GPU check's `quick` part: the headline figures in one command of under 8 minutes on one H100.

    python scripts/gpu_quick.py OUT_DIR                     # what `bash scripts/gpu_check.sh OUT quick` runs
    QUICK_SHAPE=tiny python scripts/gpu_quick.py OUT_DIR    # the same path at toy shapes, on a CPU in seconds

Each measurement runs in a process of its own under a time cap (its own, and never past the part's
budget, QUICK_BUDGET_S seconds, 420 unless set), so one slow step cannot take the others' time; a step
stopped at its cap, or failed, is a row that says so. The cheap steps go first, so that they are on
record whatever the expensive pair does:

    device     the device, jax/flax/torch versions, the chip's bf16 peak and the model FLOPs (for MFU)
    ring       cuDNN's calls as the ring's blocks use them, against attention over all keys
               (tests/test_ring.py's cudnn case; skipped without an NVIDIA GPU)
    decode     greedy decoding ms/token at batch 1 and 32 (D=1024, L=12, H=16, V=50304, bf16, 256 new
               tokens after 8; `scripts/benchmark.py --decode`), beside the time to read the weights once
    jaxformer  the 1.3B GPT-2 shape (D=2048, L=24, H=16, V=50304, T=1024, AdamW, no dropout), bf16 compute
               over float32 weights, cuDNN attention, scanned layers with remat "auto" (dots_saveable),
               batch 16: one compile, 2 warm-up steps, median of 3 rounds of 3 steps
               (`scripts/benchmark.py --gpt2-step`)
    torch      Hugging Face PyTorch GPT2LMHeadModel + torch.compile at the same shape and batch, bf16
               autocast, fused AdamW (`scripts/peers.py torch_gpt2`; skipped without torch and CUDA)

Batch 16, scanned with "auto": the layer stack the 1.3B experiment and the planner default to, at the
larger batch of the accelerators guide's measured peaks (36.0 GB at batch 16, by an earlier version);
chosen, not measured to be the fastest. QUICK_BATCH, QUICK_STACK (e.g. "unrolled", "scanned:full") and
QUICK_ATTENTION change them.

It prints one markdown table and writes it to OUT_DIR/quick.md, with the figures as JSON in
OUT_DIR/quick.json; the steps' own output goes to stdout (gpu_check.sh keeps it in quick.log).
Exit status 1 if a step failed, was stopped at its cap or was not started for lack of time, else 0
(no torch, or no GPU for the cuDNN test, is a skip, not a failure).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent

# (gpt2 shape, decode shape, timed rounds x steps, attention) per QUICK_SHAPE; "tiny" is for a CPU.
SHAPES = {
    "1p3b": {
        "gpt2": {"D": 2048, "H": 16, "L": 24, "V": 50304, "T": 1024},
        "decode": {"D": 1024, "H": 16, "L": 12, "V": 50304, "new": 256},
        "rounds": 3, "steps": 3, "attention": "cudnn", "batch": 16,
    },
    "tiny": {
        "gpt2": {"D": 64, "H": 4, "L": 2, "V": 512, "T": 64},
        "decode": {"D": 64, "H": 4, "L": 2, "V": 512, "new": 8},
        "rounds": 1, "steps": 2, "attention": "auto", "batch": 4,
    },
}  # fmt: skip
# Each step's own cap in seconds; the part's budget caps them all. Expected on one H100 (not yet
# measured with this code): device ~15 s, ring ~30 s, decode ~60 s, jaxformer ~90 s, torch ~150 s.
CAPS = {"device": 60, "ring": 75, "decode": 90, "jaxformer": 150, "torch": 240}
DECODE_BATCHES = (1, 32)
MIN_STEP_S = 15  # a step with less than this left of the budget is not started
NO_TIME = "no time left"
REMATS = ("", "auto", "none", "full", "dots_saveable", "offload_dots", "offload_inputs")  # model.remat
ATTENTIONS = ("naive", "auto", "xla", "cudnn", "splash")  # model.attention_impl


def run_step(name: str, cmd: list[str], cap: float, env: dict | None = None) -> dict:
    """Run `cmd` in a process group of its own for at most `cap` seconds, streaming its output to
    ours: {"rc", "seconds", "output", "timed_out"}. At the cap the whole group is killed (torch's
    compile workers, pytest's children), not only the first process."""
    print(f"== quick {name} (cap {cap:.0f} s): {' '.join(cmd)}", flush=True)
    t = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines: list[str] = []

    def pump():
        for line in proc.stdout:
            lines.append(line)
            print(line, end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc, timed_out = proc.wait(timeout=cap), False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rc, timed_out = proc.wait(), True
    reader.join(timeout=5)
    seconds = time.perf_counter() - t
    print(f"== quick {name}: " + (f"stopped at its cap of {cap:.0f} s" if timed_out else f"exit {rc}") +
          f" after {seconds:.1f} s", flush=True)  # fmt: skip
    return {"rc": rc, "seconds": seconds, "output": "".join(lines), "timed_out": timed_out}


def last_json(output: str) -> dict | None:
    """The last line of `output` that is a JSON object, or None."""
    for line in reversed(output.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def why_not(r: dict) -> str:
    """A failed or stopped step's one-line reason."""
    if r["timed_out"]:
        return f"stopped at its cap ({r['seconds']:.0f} s)"
    tail = [ln.strip() for ln in r["output"].splitlines() if ln.strip()]
    return f"failed (exit {r['rc']}): {tail[-1][:120] if tail else 'no output'}"


PROBE = """
import json, sys
shape = json.loads(sys.argv[1])
import jax, flax
from jaxformer import chips, tpu
tpu.compile_only_without_chips()  # as benchmark.py: with libtpu on a machine without TPU chips, the CPU
from jaxformer.train import flops_per_example
sys.path.insert(0, "scripts")
from benchmark import gpt2_shape
info = {"jax": jax.__version__, "flax": flax.__version__, "platform": jax.default_backend(),
        "device": jax.devices()[0].device_kind}
info["peak_flops"], info["peak_source"] = chips.peak_flops("bfloat16")
g = shape["gpt2"]
model = gpt2_shape(g["D"], g["H"], g["L"], g["V"], g["T"])
info["flops_per_example"] = flops_per_example(model, "lm", g["T"], g["T"])
try:
    import torch
    info["torch"], info["cuda"] = torch.__version__, torch.cuda.is_available()
except ImportError:
    info["torch"], info["cuda"] = None, False
print(json.dumps(info))
"""


def settings(env) -> tuple[str, int, str, str, float]:
    """(shape, batch, layer stack, attention, budget in seconds) from the QUICK_* variables, each checked
    before anything runs: a wrong one stops the part with one line naming it."""
    shape = env.get("QUICK_SHAPE", "1p3b")
    if shape not in SHAPES:
        raise SystemExit(f"gpu_quick: QUICK_SHAPE must be one of {', '.join(SHAPES)}, got {shape!r}")
    batch, budget = env.get("QUICK_BATCH", str(SHAPES[shape]["batch"])), env.get("QUICK_BUDGET_S", "420")
    if not batch.isdigit() or int(batch) < 1:
        raise SystemExit(f"gpu_quick: QUICK_BATCH must be a positive whole number, got {batch!r}")
    try:
        budget_s = float(budget)
    except ValueError:
        budget_s = 0.0
    if not budget_s > 0:
        raise SystemExit(f"gpu_quick: QUICK_BUDGET_S must be a positive number of seconds, got {budget!r}")
    stack = env.get("QUICK_STACK", "scanned")
    layout, _, remat = stack.partition(":")
    if layout not in ("unrolled", "scanned") or remat not in REMATS:
        raise SystemExit(f"gpu_quick: QUICK_STACK must be unrolled or scanned, each with an optional "
                         f":{'|'.join(r for r in REMATS if r)}, got {stack!r}")  # fmt: skip
    attention = env.get("QUICK_ATTENTION", SHAPES[shape]["attention"])
    if attention not in ATTENTIONS:
        raise SystemExit(f"gpu_quick: QUICK_ATTENTION must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    return shape, int(batch), stack, attention, budget_s


def stack_text(stack: str) -> str:
    """A layer stack as the table names it: "scanned" -> "scanned, remat auto (dots_saveable)"."""
    layout, _, remat = stack.partition(":")
    remat = remat or "auto"
    if remat == "auto":
        remat = f"auto ({'dots_saveable' if layout == 'scanned' else 'none'})"
    return f"{layout}, remat {remat}"


def main(out: pathlib.Path) -> int:
    shape_name, B, stack, attention, budget = settings(os.environ)
    shape = SHAPES[shape_name]
    deadline = time.perf_counter() + budget
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    results: dict[str, dict] = {}

    def step(name: str, cmd: list[str], **extra_env) -> dict | None:
        left = deadline - time.perf_counter()
        if left < MIN_STEP_S:
            results[name] = {"rc": None, "seconds": 0.0, "output": "", "timed_out": False, "skipped": NO_TIME}
            print(f"== quick {name}: not started, {left:.0f} s left of the budget", flush=True)
            return None
        results[name] = run_step(name, cmd, min(CAPS[name], left), env | extra_env)
        return results[name]

    g, d = shape["gpt2"], shape["decode"]
    step("device", [py, "-c", PROBE, json.dumps(shape)], XLA_PYTHON_CLIENT_PREALLOCATE="false")  # reads, no work
    info = last_json(results["device"]["output"]) or {}

    node = "tests/test_ring.py::test_a_fused_kernel_s_blocks_combine_to_attention_over_all_keys[cudnn]"
    step("ring", [py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", node])

    step("decode", [
        py, "scripts/benchmark.py", "--decode", "--modes", "decoder_only", "--d-model", str(d["D"]),
        "--heads", str(d["H"]), "--layers", str(d["L"]), "--vocab", str(d["V"]), "--dtype", "bfloat16",
        "--attention", "auto", "--decode-lengths", str(d["new"]), "--decode-strategies", "greedy",
        "--decode-batches", ",".join(map(str, DECODE_BATCHES)), "--recompute-lengths", "", "--repeats", "3",
    ])  # fmt: skip

    # Each training run may use 90% of the GPU (JAX's default is 75%), as torch may use all of it.
    run = {**g, "B": B, "rounds": shape["rounds"], "steps": shape["steps"]}
    jax_run = json.dumps(run | {"attention": attention, "stack": stack})
    step("jaxformer", [py, "scripts/benchmark.py", "--gpt2-step", jax_run], XLA_PYTHON_CLIENT_MEM_FRACTION=".90")
    if info.get("cuda"):
        # peers.py turns transformers' torch models off (USE_TORCH=0) unless told otherwise: it is also
        # imported by JAX processes; transformers 4.x reads that switch
        step("torch", [py, "scripts/peers.py", "torch_gpt2", json.dumps(run)], USE_TORCH="1")
    else:
        why = "the device probe failed" if not info else "no torch" if info["torch"] is None else "no CUDA for torch"
        results["torch"] = {"rc": None, "seconds": 0.0, "output": "", "timed_out": False, "skipped": why}

    rows, figures = table(results, info, shape_name, g, d, B, stack, attention)
    text = "\n".join(rows) + "\n"
    print("\n" + text, end="", flush=True)
    (out / "quick.md").write_text(text)
    (out / "quick.json").write_text(json.dumps(figures, indent=1) + "\n")
    # a step stopped at its cap, failed, or not started for lack of time; no torch or no GPU is a skip
    failed = [k for k, r in results.items() if r["timed_out"] or r["rc"] or r.get("skipped") == NO_TIME]
    return 1 if failed else 0


def table(results: dict, info: dict, shape_name: str, g: dict, d: dict, B: int, stack: str, attention: str):
    """(the markdown table's lines, the figures as a dict) from the steps' results."""
    figures = {"shape": shape_name, "device": info}
    header = ["| check | setting | tokens/s | MFU | peak memory | ms/token | result | wall s |", "|---" * 8 + "|"]
    rows = []

    def row(check, setting, result, r, tokens="", mfu="", memory="", ms=""):
        wall = f"{r['seconds']:.0f}" if r and r.get("seconds") else ""
        rows.append(f"| {check} | {setting} | {tokens} | {mfu} | {memory} | {ms} | {result} | {wall} |")

    def status(r: dict) -> str | None:  # None when the step ran and exited 0
        if r.get("skipped"):
            return f"skipped: {r['skipped']}"
        return why_not(r) if r["timed_out"] or r["rc"] else None

    r = results["device"]
    versions = f"jax {info.get('jax')}, flax {info.get('flax')}, torch {info.get('torch')}"
    row("device", f"{info.get('device', '?')} ({info.get('platform', '?')})", status(r) or versions, r)

    gpt2 = f"D={g['D']} L={g['L']} H={g['H']} V={g['V']} T={g['T']}, B={B}"
    speed = {}
    for name, label, setting in (
        ("jaxformer", "jaxformer", f"{gpt2}, {stack_text(stack)}, attention {attention}, bf16"),
        ("torch", "torch.compile GPT2LMHeadModel", f"{gpt2}, sdpa, bf16 autocast"),
    ):
        r = results[name]
        out = None if status(r) else last_json(r["output"])
        if out is None:
            row(label, setting, status(r) or "no figures in its output", r)
            continue
        tokens = B * g["T"] / out["step_s"]
        speed[name] = tokens
        mfu = info["flops_per_example"] * B / out["step_s"] / info["peak_flops"] if info.get("peak_flops") else None
        figures[name] = out | {"tokens_per_s": tokens, "mfu": mfu, "batch": B}
        mfu_text = f"{100 * mfu:.1f}%" if mfu is not None else "?"
        row(label, setting, "ok", r, f"{tokens:.0f}", mfu_text, f"{out['peak_memory_gb']:.1f} GB")
    if len(speed) == 2:
        ratio = speed["jaxformer"] / speed["torch"]
        figures["jaxformer_over_torch"] = ratio
        row("jaxformer / torch.compile", f"tokens/s, B={B}", f"{ratio:.3f}x", None)

    r = results["ring"]
    outcome = status(r)
    if outcome is None:  # pytest's summary ("1 passed in 31.2s"), and a skip's reason
        lines = r["output"].splitlines()
        summary = [ln.strip("= ") for ln in lines if " in " in ln and ("passed" in ln or "skipped" in ln)]
        reasons = [ln.split(": ", 1)[-1] for ln in lines if ln.startswith("SKIPPED")]
        outcome = "; ".join((summary or ["ok"])[-1:] + reasons[-1:])
    figures["ring"] = outcome
    row("cuDNN ring blocks", "tests/test_ring.py cudnn case", outcome, r)

    r = results["decode"]
    per_token, weights = parse_decode(r["output"]) if not status(r) else ({}, None)
    figures["decode_ms_per_token"] = per_token
    decode = f"D={d['D']} L={d['L']} H={d['H']} V={d['V']}, bf16, greedy, {d['new']} new tokens"
    for b in DECODE_BATCHES:
        if b in per_token:
            note = f"ok; one read of the weights: {weights} ms" if b == 1 and weights else "ok"
            row(f"decode B={b}", decode, note, r, ms=f"{per_token[b]:.2f}")
        else:
            row(f"decode B={b}", decode, status(r) or "no figure in its output", r)
    return header + rows, figures


def parse_decode(output: str) -> tuple[dict, str | None]:
    """({batch: ms/token}, the time to read the weights once in ms, or None) from `benchmark.py
    --decode`'s table: rows `mode strategy B new cache compile_s run_s ms/token tokens/s`."""
    per_token, weights = {}, None
    for line in output.splitlines():
        f = line.split()
        if len(f) == 9 and f[0] == "decoder_only" and f[1] == "greedy" and f[4] == "yes":
            per_token[int(f[2])] = float(f[7])
        elif line.startswith("decoder_only: weights") and line.endswith(" ms"):
            weights = f[-2]
    return per_token, weights


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        raise SystemExit(__doc__)
    sys.exit(main(pathlib.Path(sys.argv[1])))
