"""Host memory of loading a sharded Hugging Face checkpoint onto a mesh with `load_hf`.

    python scripts/hf_load_memory.py                     # Llama-shaped, 156M params (594 MiB float32), 64 MiB shards
    python scripts/hf_load_memory.py --json              # the same figures as one JSON object
    python scripts/hf_load_memory.py --layers 32 --vocab 8000 --variants unrolled,scanned   # stacks of 5.5 shards
    python scripts/hf_load_memory.py --variants unrolled --layers 2 --d-model 256   # a quick look

A Llama-shaped model is built, written with `save_hf` in shards of at most `--shard-mib`, and
loaded in a fresh process onto an FSDP=4 x TP=2 mesh of 8 CPU devices, once per variant:

    unrolled   load_hf(dir, mesh=mesh)
    scanned    load_hf(dir, mesh=mesh, scan_layers=True)   (each parameter stacked on a leading L axis)
    naive      every shard read whole into host memory first (safetensors.numpy.load_file), then
               the same placement: the contrast

On CPU the loaded parameters themselves live in host memory, so what a loader costs is its
transient overhead: peak RSS minus RSS after the load. `load_hf` reads tensor by tensor, so that
must stay below 2x the largest shard file. Peak RSS is the kernel's high-water mark (VmHWM),
reset just before the load through /proc/self/clear_refs; a thread sampling /proc/self/status
every 2 ms splits the peak into anonymous memory and file pages mapped from the checkpoint.

A scanned load ends ~200 MiB above an unrolled one on CPU: its per-layer buffers, freed, stay in
glibc's heaps (with MALLOC_MMAP_THRESHOLD_=1048576 the difference is ~60 MiB, the compiled
programs that write each layer into its stack). It is memory the process reuses, not the loader's.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import threading
import time

MiB = 2**20
VARIANTS = ("unrolled", "scanned", "naive")


# ----------------------------------------------------------------------------- resident memory


def memory() -> dict[str, int]:
    """This process's resident memory in bytes: VmRSS, its peak VmHWM, and RSS split into
    anonymous memory (RssAnon) and mapped file pages (RssFile)."""
    status = pathlib.Path("/proc/self/status").read_text()
    return {
        k: int(re.search(rf"^{k}:\s+(\d+) kB", status, re.M)[1]) * 1024
        for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    }


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        pathlib.Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class PeakSampler(threading.Thread):
    """Samples /proc/self/status every `period` seconds: the largest RSS seen, with its anonymous
    and file-backed parts at that moment."""

    def __init__(self, period: float = 0.002):
        super().__init__(daemon=True)
        self.period, self.peak, self.done = period, memory(), threading.Event()

    def run(self):
        while not self.done.is_set():
            now = memory()
            if now["VmRSS"] > self.peak["VmRSS"]:
                self.peak = now
            time.sleep(self.period)

    def stop(self) -> dict[str, int]:
        self.done.set()
        self.join()
        return self.peak


# ----------------------------------------------------------------------------- the load (child process)


def load(directory: str, variant: str) -> dict:
    """Load `directory` onto FSDP=4 x TP=2 (8 devices) as `variant`; this process's memory around it."""
    import jax
    from flax import nnx

    from jaxformer import sharding
    from jaxformer.config import MeshConfig
    from jaxformer.interop import hf

    mesh_cfg = MeshConfig(data=1, fsdp=4, tensor=2)
    mesh = sharding.make_mesh(mesh_cfg)
    jax.device_put(0.0, jax.devices()[0]).block_until_ready()  # the runtime's own buffers, before the baseline
    baseline = memory()
    exact = reset_peak()
    sampler = PeakSampler()
    sampler.start()
    start = time.perf_counter()
    if variant == "naive":  # the whole checkpoint in host memory, then placed as load_hf places it
        from safetensors.numpy import load_file

        everything = {}
        for file in sorted(pathlib.Path(directory).glob("*.safetensors")):
            everything |= load_file(file)
        hf.SafetensorsReader.__getitem__ = lambda self, name: everything[name]
    with sharding.use(mesh, sharding.rules_for(mesh_cfg)):
        model = hf.load_hf(directory, mesh=mesh, scan_layers=variant == "scanned")
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    if variant == "naive":
        everything.clear()  # the naive loader's copy is dropped once the model holds its parameters
    sampled = sampler.stop()
    after = memory()
    return {
        "variant": variant,
        "seconds": round(seconds, 2),
        "peak_exact": exact,  # VmHWM reset at the baseline; else it may hold an earlier peak
        "baseline": baseline["VmRSS"],
        "baseline_file": baseline["RssFile"],
        "peak": max(after["VmHWM"], sampled["VmRSS"]),
        "after": after["VmRSS"],
        "peak_anon": sampled["RssAnon"],
        "peak_file": sampled["RssFile"],
        "after_anon": after["RssAnon"],
        "after_file": after["RssFile"],
        "param_bytes": sum(p.nbytes for p in params),
        "device_bytes": sum(s.data.nbytes for p in params for s in p.addressable_shards),  # with replicas
    }


# ----------------------------------------------------------------------------- the checkpoint (this process)


def write_checkpoint(args, directory: pathlib.Path) -> dict:
    """A Llama-shaped random model saved in shards; sizes of the checkpoint."""
    import jaxformer as jf
    from jaxformer.interop import hf

    cfg = jf.llama(
        vocab_size=args.vocab, d_model=args.d_model, num_heads=args.heads, num_kv_heads=args.kv_heads,
        d_ff=args.d_ff, num_decoder_layers=args.layers, max_len=512,
    )  # fmt: skip
    model = jf.build_model(cfg)
    hf.save_hf(model, directory, max_shard_bytes=args.shard_mib * MiB)
    sizes = [p.stat().st_size for p in directory.glob("*.safetensors")]
    return {
        "config": f"llama V={cfg.vocab_size} D={cfg.d_model} H={cfg.num_heads} G={cfg.kv_heads} F={cfg.d_ff} "
        f"L={cfg.num_decoder_layers}, float32, max_shard_bytes={args.shard_mib} MiB",
        "params": jf.count_params(model),
        "shards": len(sizes),
        "largest_shard": max(sizes),
        "total": sum(sizes),
    }


def run_child(directory: pathlib.Path, variant: str) -> dict:
    """`load` in a fresh Python with 8 CPU devices (XLA_FLAGS must be set before JAX starts)."""
    env = os.environ | {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(directory), variant], env=env, capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(f"{variant} load failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(ckpt: dict, results: list[dict]) -> str:
    mib = lambda b: f"{b / MiB:,.0f}"
    shard = ckpt["largest_shard"]
    lines = [
        ckpt["config"],
        f"{ckpt['params'] / 1e6:.1f}M params; {ckpt['shards']} shards, largest {mib(shard)} MiB, "
        f"total {mib(ckpt['total'])} MiB. Loaded onto FSDP=4 x TP=2 (8 CPU devices). MiB:",
        "",
        f"{'variant':<9} {'baseline':>8} {'peak':>6} {'after':>6} {'peak-after':>10} {'/shard':>6} "
        f"{'peak-base':>9} {'/params':>7} {'file@peak':>9} {'time':>6}",
    ]
    for r in results:
        lines.append(
            f"{r['variant']:<9} {mib(r['baseline']):>8} {mib(r['peak']):>6} {mib(r['after']):>6} "
            f"{mib(r['peak'] - r['after']):>10} {(r['peak'] - r['after']) / shard:>6.2f} "
            f"{mib(r['peak'] - r['baseline']):>9} {(r['peak'] - r['baseline']) / r['param_bytes']:>7.2f} "
            f"{mib(r['peak_file'] - r['baseline_file']):>9} {r['seconds']:>5.1f}s"
        )
    lines += [
        "",
        "peak-after: the loader's transient overhead (/shard: in largest shards; load_hf's bound is 2).",
        "peak-base: all the load cost (/params: in parameter bytes).",
        "file@peak: file pages mapped at the peak, over the baseline's (the checkpoint's, counted in RSS).",
    ]
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(load(sys.argv[2], sys.argv[3])))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--d-ff", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--shard-mib", type=int, default=64)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {VARIANTS}")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON (bytes)")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"--variants: {sorted(unknown)} not among {VARIANTS}")
    with tempfile.TemporaryDirectory(prefix="hf_load_memory-") as tmp:
        ckpt = write_checkpoint(args, pathlib.Path(tmp))
        results = [run_child(pathlib.Path(tmp), v) for v in variants]
    if args.json:
        print(json.dumps({"checkpoint": ckpt, "loads": results}, indent=2))
    else:
        print(table(ckpt, results))


if __name__ == "__main__":
    main()
