"""The data pipeline's figures: preparing a corpus, the loader's speed and memory, padding.

    python scripts/benchmark_data.py prepare --size 1GB     # build the corpus, prepare it: MB/s, peak RSS
    python scripts/benchmark_data.py loader --size 10MB     # tokens/s served and peak RSS (after prepare)
    python scripts/benchmark_data.py padding                # real-token fraction of translation, classification batches
    python scripts/benchmark_data.py all --sizes 10MB,1GB   # each of the above in its own process

The corpus is the shipped Shakespeare, its paragraphs shuffled and repeated to the size asked
(plain text, one document per blank-line paragraph), written under --dir. Byte-level tokens, as
`experiments/lm_shakespeare.py`. Each measurement runs in a fresh process so that its peak RSS
(`ru_maxrss`, the process and, for prepare, its largest worker) is its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import resource
import shutil
import subprocess
import sys
import time

import numpy as np

UNITS = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


def parse_size(text: str) -> int:
    return int(float(text[:-2]) * UNITS[text[-2:].upper()]) if text[-2:].upper() in UNITS else int(text)


def build_corpus(size: int, directory: pathlib.Path) -> pathlib.Path:
    """Shakespeare's paragraphs, shuffled and repeated up to `size` bytes (each pass shuffled anew)."""
    from jaxformer.data import sources

    path = directory / f"corpus-{size}.txt"
    if path.is_file() and path.stat().st_size >= size:
        return path
    paragraphs = [r[1].encode("utf-8") for r in sources.iter_records(sources.SHIPPED["shakespeare"])]
    rng, written = np.random.default_rng(0), 0
    directory.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".part"), "wb") as f:
        while written < size:
            for i in rng.permutation(len(paragraphs)):
                f.write(paragraphs[i] + b"\n\n")
                written += len(paragraphs[i]) + 2
                if written >= size:
                    break
    path.with_suffix(".part").rename(path)
    return path


def config(corpus: pathlib.Path, directory: pathlib.Path, workers: int, batch: int, seq: int):
    from jaxformer import config as C

    return C.Config(
        model=C.tiny("decoder_only", vocab_size=260, max_len=seq),
        data=C.DataConfig(
            source="files", files=(str(corpus),), text_unit="paragraph", max_len=seq,
            cache_dir=str(directory / f"cache-{corpus.stat().st_size}"), prepare_workers=workers,
        ),
        train=C.TrainConfig(objective="lm", batch_size=batch),
    )  # fmt: skip


def peak_rss_mb() -> dict:
    self_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    child_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"peak_rss_mb": self_kb / 1024, "peak_worker_rss_mb": child_kb / 1024}


def bench_prepare(args) -> dict:
    from jaxformer.data.prepare import prepare

    corpus = build_corpus(parse_size(args.size), args.dir)
    cfg = config(corpus, args.dir, args.workers, args.batch, args.seq)
    shutil.rmtree(cfg.data.cache_dir, ignore_errors=True)  # measured from nothing
    start = time.perf_counter()
    prepared = prepare(cfg, progress=not args.quiet)
    seconds = time.perf_counter() - start
    size = corpus.stat().st_size
    return {
        "what": "prepare", "size_mb": size / 2**20, "workers": args.workers, "seconds": seconds,
        "mb_per_s": size / 2**20 / seconds, "documents": prepared.manifest["documents"], **peak_rss_mb(),
    }  # fmt: skip


def bench_loader(args) -> dict:
    from jaxformer.data import build_dataset

    corpus = build_corpus(parse_size(args.size), args.dir)
    cfg = config(corpus, args.dir, args.workers, args.batch, args.seq)
    data = build_dataset(cfg)  # prepared before: found again
    rss_before = peak_rss_mb()["peak_rss_mb"]
    tokens, steps, start = 0, 0, time.perf_counter()
    for batch in data.train.stream(0, 1 << 40, prefetch=args.prefetch):
        tokens += batch["inputs"].size
        steps += 1
        if time.perf_counter() - start > args.seconds:
            break
    seconds = time.perf_counter() - start
    return {
        "what": "loader", "size_mb": corpus.stat().st_size / 2**20, "batch": args.batch, "seq": args.seq,
        "prefetch": args.prefetch, "steps": steps, "tokens_per_s": tokens / seconds,
        "examples": data.train.num_examples, "rss_before_reading_mb": rss_before, **peak_rss_mb(),
    }  # fmt: skip


def bench_padding(args) -> dict:
    """Real-token fraction of translation batches (source and target slots) over one epoch, padded
    to the widths, in length buckets and packed, for each source width asked with the experiment's
    target width, and of classification batches (`experiments/classify_lohelp.py`); for packing
    also the share of the training examples an epoch holds."""
    from jaxformer.config import load_experiment

    base = load_experiment("experiments/translate_en_de.py")
    out = {"what": "padding"}
    for S in map(int, args.src_widths.split(",")):
        cfg = dataclasses.replace(base, data=dataclasses.replace(base.data, src_max_len=S))
        out[f"translation, source {S} / target {cfg.data.max_len} tokens"] = fractions(cfg, args.dir / "translate")
    cfg = load_experiment("experiments/classify_lohelp.py")
    name = f"classification, {cfg.data.src_len} tokens, up to {cfg.data.max_segments} texts a packed row"
    out[name] = fractions(cfg, args.dir / "classify")
    return out


def fractions(cfg, workdir: pathlib.Path) -> dict:
    """{case: real-token fraction of one training epoch} padded, bucketed and packed, and the share
    of the training examples a packed epoch holds."""
    from jaxformer.data import build_dataset
    from jaxformer.train import real_fraction

    out = {}
    cases = (("padded", 1, False), ("length buckets", cfg.data.length_buckets, False), ("packed", 1, True))
    for name, buckets, pack in cases:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, length_buckets=buckets, pack=pack))
        train = build_dataset(cfg, workdir).train
        real = slots = 0.0
        for step in range(len(train)):
            r, s = real_fraction(train.get(step))
            real, slots = real + r, slots + s
        out[name] = round(real / slots, 4)
        if pack:
            used = sum(len(r) for s in range(len(train)) for r in train.rows(s))
            out["packed: examples in an epoch"] = round(used / train.num_examples, 4)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("prepare", "loader", "padding", "all"))
    p.add_argument("--size", default="10MB")
    p.add_argument("--sizes", default="10MB,1GB", help="all: the corpus sizes measured")
    p.add_argument("--dir", type=pathlib.Path, default=pathlib.Path("runs/benchmark_data"))
    p.add_argument("--workers", type=int, default=2, help="prepare: tokenizing processes")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--prefetch", type=int, default=2, help="loader: grain threads")
    p.add_argument("--src-widths", default="64,56", help="padding: translation source widths (data.src_max_len)")
    p.add_argument("--seconds", type=float, default=10.0, help="loader: how long batches are read")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args()
    if args.what != "all":
        print(json.dumps({"prepare": bench_prepare, "loader": bench_loader, "padding": bench_padding}[args.what](args)))
        return
    common = ["--dir", str(args.dir), "--workers", str(args.workers), "--batch", str(args.batch)]
    common += ["--seq", str(args.seq)]
    common += [
        "--prefetch",
        str(args.prefetch),
        "--seconds",
        str(args.seconds),
        "--src-widths",
        args.src_widths,
        "--quiet",
    ]
    runs = [["padding"]] + [[what, "--size", size] for size in args.sizes.split(",") for what in ("prepare", "loader")]
    for run in runs:
        out = subprocess.run([sys.executable, __file__, *run, *common], capture_output=True, text=True, check=True)
        print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
