"""Tokenize once: prepared corpora hold the tokenized records, are found again while nothing changed,
are built anew when something did, and a killed build is never read and is finished by a rerun."""

import collections
import dataclasses
import itertools
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys

import numpy as np
import processes
import pytest

from jaxformer import config as C
from jaxformer.cli import main
from jaxformer.data import ByteTokenizer, sources
from jaxformer.data.prepare import SPLITS, prepare


def write_corpus(path: pathlib.Path, n: int = 300, tag: str = "") -> None:
    rows = [{"text": f"document {i}{tag}: " + "word " * (i % 17)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def cfg_for(files, cache_dir, **data):
    return C.Config(
        model=C.tiny("decoder_only", vocab_size=260, max_len=16),
        data=C.DataConfig(source="files", files=tuple(map(str, files)), max_len=16, cache_dir=str(cache_dir), **data),
        train=C.TrainConfig(objective="lm", batch_size=2),
    )


def contents(prepared) -> dict:
    out = {}
    for split in SPLITS:
        tokens, offsets = prepared.documents(split, "text")
        out[split] = (np.asarray(tokens).copy(), np.asarray(offsets).copy())
    return out


def test_prepared_documents_are_the_records_tokenized(tmp_path):
    write_corpus(tmp_path / "c.jsonl")
    cfg = cfg_for([tmp_path / "c.jsonl"], tmp_path / "cache")
    prepared = prepare(cfg, progress=False)
    records, _ = sources.read(sources.Source((str(tmp_path / "c.jsonl"),), ("text",)))
    tok = ByteTokenizer()
    for split, part in zip(SPLITS, sources.split(records, 0.05, 0.05, 0, "c"), strict=True):
        tokens, offsets = prepared.documents(split, "text")
        docs = [tokens[a:b].tolist() for a, b in itertools.pairwise(offsets)]
        assert docs == [[*tok.encode(r[1]), tok.eos_id] for r in part]  # each document ends in EOS
    assert prepared.manifest["sources"][0]["sha256"] == sources_sha(tmp_path / "c.jsonl")


def sources_sha(path):
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_an_unchanged_corpus_is_reused_and_a_changed_one_rebuilt(tmp_path, capsys):
    corpus, cache = tmp_path / "c.jsonl", tmp_path / "cache"
    write_corpus(corpus)
    sets = ["--set", "data.source=files", "--set", f"data.files={corpus}", "--set", f"data.cache_dir={cache}"]
    argv = ["prepare", "--config", "experiments/lm_shakespeare.py", "--workdir", str(tmp_path / "w"), "--quiet"]
    assert main(argv + sets) == 0
    first = capsys.readouterr().out.split(":")[0]
    stamp = os.stat(pathlib.Path(first) / "train.text.bin").st_mtime_ns
    assert main(argv + sets) == 0  # found again: nothing is written
    assert capsys.readouterr().out.split(":")[0] == first
    assert os.stat(pathlib.Path(first) / "train.text.bin").st_mtime_ns == stamp
    write_corpus(corpus, tag="!")  # changed text: another cache
    assert main(argv + sets) == 0
    second = capsys.readouterr().out.split(":")[0]
    assert main([*argv, *sets, "--set", "data.max_len=64"]) == 0  # changed settings: another cache
    third = capsys.readouterr().out.split(":")[0]
    assert len({first, second, third}) == 3


KILLED = """
import sys, time
from jaxformer.data import build, prepare as P
from jaxformer import config as C
build.CHUNK, build.PART_BYTES = 8, 2048
encode = build._encode_chunk
def slow(fields):
    time.sleep(0.02)
    return encode(fields)
build._encode_chunk = slow
cfg = C.Config(
    model=C.tiny("decoder_only", vocab_size=260, max_len=16),
    data=C.DataConfig(source="files", files=(sys.argv[1],), max_len=16, cache_dir=sys.argv[2]),
    train=C.TrainConfig(objective="lm", batch_size=2),
)
P.prepare(cfg, progress=False)
"""


def test_a_killed_prepare_is_never_read_and_a_rerun_finishes_its_parts(tmp_path, monkeypatch):
    from jaxformer.data import build

    corpus, cache = tmp_path / "c.jsonl", tmp_path / "cache"
    write_corpus(corpus, n=1500)
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(corpus), str(cache)])
    parts = lambda: len(list(cache.glob("*.tmp-*/p[0-9]*.json"))) >= 2  # two parts finished, others half-written
    processes.wait_until(parts, proc, "the build to finish two parts", poll=0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not list(cache.glob("*/manifest.json")), "a killed build left a cache that would be read"
    finished = len(list(cache.glob("*.tmp-*/p[0-9]*.json")))
    monkeypatch.setattr(build, "PART_BYTES", 2048)  # the same parts as the killed build
    calls = []
    encode = build._encode_chunk
    monkeypatch.setattr(build, "_encode_chunk", lambda fields: calls.append(1) or encode(fields))
    cfg = cfg_for([corpus], cache)
    prepared = prepare(cfg, progress=False)  # the rerun does the parts the killed build had not finished
    assert not list(cache.glob("*.tmp-*"))
    redone = len(calls)
    calls.clear()
    clean = prepare(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, cache_dir=str(tmp_path / "clean"))))
    assert finished >= 2 and redone <= len(calls) - finished
    for split, (tokens, offsets) in contents(prepared).items():
        np.testing.assert_array_equal(tokens, contents(clean)[split][0])
        np.testing.assert_array_equal(offsets, contents(clean)[split][1])


def test_parallel_prepare_of_file_parts_equals_one_process(tmp_path, monkeypatch):
    from jaxformer.data import build
    from jaxformer.data import prepare as P

    texts = [f"document {i}: " + "word " * (i % 17) for i in range(1500)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    # Paragraphs of one to three lines, and a TSV whose header only the first part holds.
    (tmp_path / "d.txt").write_text("".join(t + "\n" + "more\n" * (i % 3) + "\n" for i, t in enumerate(texts)))
    (tmp_path / "e.tsv").write_text("id\ttext\n" + "".join(f"{i}\t{t}\n" for i, t in enumerate(texts)))
    monkeypatch.setattr(P, "PARALLEL_ABOVE", 0)  # worker processes, each file cut into parts of ~4 KB
    monkeypatch.setattr(build, "PART_BYTES", 4096)
    files = [tmp_path / n for n in ("c.jsonl", "d.txt", "e.tsv")]
    cfg = cfg_for(files, tmp_path / "one", prepare_workers=1, max_examples=4400, text_unit="paragraph")
    one = prepare(cfg, progress=False)
    data = dataclasses.replace(cfg.data, prepare_workers=2, cache_dir=str(tmp_path / "two"))
    two = prepare(dataclasses.replace(cfg, data=data), progress=False)
    assert len(sources.parts(sources.Source(tuple(map(str, files)), ("text",), unit="paragraph"), 4096)) > 20
    assert one.manifest["documents"]["train"] > 3500 and one.samples() == two.samples()
    for split in SPLITS:
        for a, b in zip(contents(one)[split], contents(two)[split], strict=True):
            np.testing.assert_array_equal(a, b)
    reference, _ = sources.read(sources.Source(tuple(map(str, files)), ("text",), unit="paragraph"))
    assert len(reference) == 4500  # read whole, serially: the same records
    with open(tmp_path / "e.tsv", "a") as f:  # line numbers run on across parts
        f.write("x\ty\tz\n")
    with pytest.raises(sources.DataError, match=r"e\.tsv:1502: expected 2 tab-separated columns, got 3"):
        prepare(cfg, progress=False)


def test_a_bad_line_fails_before_anything_is_written(tmp_path):
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus)
    with open(corpus, "a") as f:
        f.write('{"body": "no text field"}\n')
    with pytest.raises(sources.DataError, match=r"c\.jsonl:301: no field 'text'"):
        prepare(cfg_for([corpus], tmp_path / "cache"), progress=False)
    assert not (tmp_path / "cache").exists()


def test_a_sentencepiece_size_too_small_leaves_nothing_and_the_size_it_names_trains(tmp_path):
    write_corpus(tmp_path / "c.jsonl")
    workdir, cache = tmp_path / "run", tmp_path / "cache"
    workdir.mkdir()
    cfg = cfg_for([tmp_path / "c.jsonl"], cache, tokenizer="sentencepiece", spm_vocab_size=9)
    with pytest.raises(sources.DataError, match=r"^data\.spm_vocab_size=9 is too small .* >= \d+$") as e:
        prepare(cfg, workdir, progress=False)
    assert not list(workdir.iterdir()) and not cache.exists()  # no tokenizer.model, no cache to find again
    least = int(str(e.value).rsplit(" ", 1)[1])
    prepared = prepare(C.with_values(cfg, {"data.spm_vocab_size": least}), workdir, progress=False)
    assert (workdir / "tokenizer.model").is_file() and prepared.manifest["tokenizer"].startswith("sentencepiece:")


def test_sources_are_cut_to_their_own_width_and_an_unset_width_keeps_the_cache(tmp_path):
    rows = [{"source": "s" * (i % 30), "target": "t" * (i % 20 + 1)} for i in range(1, 200)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def pairs_cfg(**data):
        files, cache = (str(tmp_path / "p.jsonl"),), str(tmp_path / "cache")
        return C.Config(
            model=C.tiny("encoder_decoder", vocab_size=260, max_len=16),
            data=C.DataConfig(source="files", files=files, max_len=16, cache_dir=cache, **data),
            train=C.TrainConfig(objective="seq2seq", batch_size=2),
        )

    prepared = prepare(pairs_cfg(src_max_len=8), progress=False)
    tok = ByteTokenizer()
    records, _ = sources.read(sources.Source((str(tmp_path / "p.jsonl"),), ("source", "target")))
    train, _, _ = sources.split(records, 0.05, 0.05, 0, "p")
    for field, width, j in (("source", 8, 1), ("target", 16, 2)):
        tokens, offsets = prepared.documents("train", field)
        docs = [tokens[a:b].tolist() for a, b in itertools.pairwise(offsets)]
        assert docs == [[*tok.encode(r[j]), tok.eos_id][:width] for r in train]  # cut to the field's width
    # A width equal to max_len is the unset one: caches prepared before src_max_len existed are found again.
    assert prepare(pairs_cfg(), progress=False).directory == prepare(pairs_cfg(src_max_len=16)).directory
    assert prepare(pairs_cfg(), progress=False).directory != prepared.directory
    with pytest.raises(sources.DataError, match=r"p\.jsonl:\d+: sequence of 9 tokens exceeds data\.src_max_len=8"):
        prepare(pairs_cfg(src_max_len=8, too_long="reject"), progress=False)


def test_each_record_is_read_once_and_labels_found_by_parts_index_the_sorted_set(tmp_path, monkeypatch):
    from jaxformer.data import build

    # The first part holds only "pos": its own label index (0) is not the corpus' (2).
    rows = [
        {"text": f"text number {i}", "label": "pos" if i < 60 else ["neg", "pos", "mid"][i % 3]} for i in range(300)
    ]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(build, "PART_BYTES", 2048)
    reads, iter_records = [], sources.iter_records
    monkeypatch.setattr(
        sources, "iter_records", lambda *a, **k: (reads.append(r[0]) or r for r in iter_records(*a, **k))
    )
    cfg = C.Config(
        model=C.tiny("encoder_only", vocab_size=260, max_len=16, num_classes=3),
        data=C.DataConfig(source="files", files=(str(tmp_path / "c.jsonl"),), max_len=16, cache_dir=str(tmp_path)),
        train=C.TrainConfig(objective="classify", batch_size=2),
    )
    prepared = prepare(cfg, progress=False)
    line = lambda where: int(where.rsplit(":", 1)[1])
    counted = collections.Counter(map(line, reads))
    records, labels = sources.read(sources.Source((str(tmp_path / "c.jsonl"),), ("text", "label")), labelled=True)
    splits = sources.split(records, 0.05, 0.05, 0, "c")
    samples = splits[2][: cfg.train.num_samples]  # read again for the manifest, with the records before them
    assert len(counted) == 300 and max(counted.values()) <= 2
    assert max(n for n, c in counted.items() if c == 2) == max(line(r[0]) for r in samples)
    assert prepared.label_names == labels == ("mid", "neg", "pos")
    for split, part in zip(SPLITS, splits, strict=True):
        assert prepared.labels(split).tolist() == [r[2] for r in part]
    assert prepared.samples()[1] == [labels[r[2]] for r in samples]


def test_a_replaced_cache_is_removed_unless_another_workdir_uses_it_and_clean_takes_the_rest(tmp_path, capsys):
    from jaxformer.data import prepare as P

    corpus, cache = tmp_path / "c.jsonl", tmp_path / "cache"
    write_corpus(corpus, n=60)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cfg = cfg_for([corpus], cache)
    longer = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_len=12))  # a changed setting
    first = prepare(cfg, tmp_path / "a", progress=False).directory
    assert prepare(cfg, tmp_path / "b", progress=False).directory == first  # two workdirs use it
    second = prepare(longer, tmp_path / "a", progress=False).directory
    assert first.is_dir(), "b still uses it"
    assert prepare(longer, tmp_path / "b", progress=False).directory == second
    assert not first.exists() and second.is_dir(), "replaced, and no workdir uses it any more"
    # A reader (eval) records nothing; what no workdir uses, and a killed build's leftovers, go on clean.
    again = prepare(cfg, tmp_path / "a", progress=False, own=False).directory
    assert again == first and prepare(cfg, tmp_path / "a", progress=False, own=False).directory.is_dir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = cache / f"{first.name}.tmp-{socket.gethostname()}-{int(dead.stdout)}"
    building = cache / f"{first.name}.tmp-{socket.gethostname()}-{os.getpid()}"
    killed.mkdir()
    building.mkdir()
    argv = ["prepare", "--config", "experiments/lm_shakespeare.py", "--workdir", str(tmp_path / "b"), "--quiet"]
    sets = ["data.source=files", f"data.files={corpus}", f"data.cache_dir={cache}"]
    assert main([*argv, "--clean", *(x for s in sets for x in ("--set", s))]) == 0  # b moves on to a third
    said = capsys.readouterr().out
    third = pathlib.Path(said.split(":")[0])
    assert f"removed {first}" in said and f"removed {killed}" in said and "2 removed" in said
    kept = [second.name, third.name, building.name, P.RECORDS]  # a's, b's, a build in progress
    assert sorted(p.name for p in cache.iterdir()) == sorted(kept)
