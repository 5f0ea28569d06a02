"""Data: deterministic splits and batches, tokenizers, and errors naming file and line."""

import lzma
import re

import numpy as np
import pytest

from jaxformer import config as C
from jaxformer.data import ByteTokenizer, DataError, SentencePieceTokenizer, build_dataset


def cfg_for(source="shakespeare", objective="lm", mode="decoder_only", **data):
    model = C.tiny(mode, vocab_size=260, max_len=32, num_classes=8 if objective == "classify" else 0)
    return C.Config(
        model=model,
        data=C.DataConfig(source=source, max_len=32, **data),
        train=C.TrainConfig(objective=objective, batch_size=4),
    )


def test_batches_are_a_deterministic_function_of_step():
    cfg = cfg_for(max_examples=2000)
    a, b = build_dataset(cfg), build_dataset(cfg)
    for step in (0, 7, len(a.train) + 3):
        for k in a.train.get(step):
            np.testing.assert_array_equal(a.train.get(step)[k], b.train.get(step)[k])
    assert not np.array_equal(a.train.get(0)["inputs"], a.train.get(1)["inputs"])
    # Every training window is served exactly once per epoch.
    seen = np.concatenate([a.train.get(i)["inputs"][:, 0] for i in range(len(a.train))])
    assert len(seen) == len(a.train) * 4


def test_lm_targets_are_inputs_shifted():
    b = build_dataset(cfg_for(max_examples=500)).train.get(0)
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])


def test_splits_are_disjoint_and_seeded():
    from jaxformer.data import sources

    records = list(range(1000))
    train, val, test = sources.split(records, 0.1, 0.1, seed=3, path="x")
    assert len(set(train) | set(val) | set(test)) == 1000 and not set(val) & set(test)
    assert sources.split(records, 0.1, 0.1, seed=3, path="x") == (train, val, test)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "Wherefore art thou, Romeo? — ünïcödé"
    assert tok.decode(tok.encode(text)) == text
    assert min(tok.encode(text)) >= 4 and max(tok.encode(text)) < tok.vocab_size


def test_sentencepiece_trains_and_round_trips(tmp_path):
    texts = [f"the {w} is on the table number {i}" for i, w in enumerate(["cat", "dog", "cup", "book"] * 50)]
    tok = SentencePieceTokenizer.train(texts, tmp_path / "tok.model", vocab_size=60)
    assert tok.vocab_size == 60 and tok.pad_id == 0 and tok.mask_id > tok.eos_id
    assert tok.decode(tok.encode("the dog is on the table")) == "the dog is on the table"
    assert SentencePieceTokenizer(tmp_path / "tok.model").encode("the cat") == tok.encode("the cat")


def test_mlm_masking_follows_bert_proportions():
    cfg = cfg_for(objective="mlm", mode="encoder_only", max_examples=3000)
    data = build_dataset(cfg)
    batches = [data.train.get(i) for i in range(200)]
    chosen = np.concatenate([b["weights"].ravel() for b in batches]) > 0
    inputs = np.concatenate([b["inputs"].ravel() for b in batches])[chosen]
    targets = np.concatenate([b["targets"].ravel() for b in batches])[chosen]
    assert abs(chosen.mean() - 0.15) < 0.01
    assert abs((inputs == ByteTokenizer.mask_id).mean() - 0.8) < 0.03
    assert abs((inputs == targets).mean() - 0.1 - 0.1 / 256) < 0.03  # unchanged (+ random hits)


def test_classification_labels_are_the_applications():
    data = build_dataset(cfg_for("lohelp_apps", "classify", "encoder_only"))
    labels = np.concatenate([data.train.get(i)["label"] for i in range(len(data.train))])
    counts = np.bincount(labels, minlength=8)
    assert counts.argmax() == 0  # scalc is the largest class
    assert (counts > 0).all()


def write_xz(path, text):
    with lzma.open(path, "wt", encoding="utf-8") as f:
        f.write(text)


def test_bad_data_errors_name_file_and_line(tmp_path):
    with pytest.raises(DataError, match=r"missing\.tsv\.xz: no such data file"):
        build_dataset(cfg_for("en_de", "seq2seq", "encoder_decoder", path=str(tmp_path / "missing.tsv.xz")))
    bad = tmp_path / "bad.tsv.xz"
    write_xz(bad, "id\ten\tde\ntext/a/b#1\tone two three\tein zwei drei\ntext/a/b#2\tonly two columns\n")
    with pytest.raises(DataError, match=r"bad.tsv.xz:3: expected 3 tab-separated columns, got 2"):
        build_dataset(cfg_for("en_de", "seq2seq", "encoder_decoder", path=str(bad)))
    tiny = tmp_path / "tiny.tsv.xz"
    write_xz(tiny, "id\ten\tde\n" + "".join(f"text/a/b#{i}\tone two three\teins zwei drei\n" for i in range(5)))
    with pytest.raises(DataError, match=r"tiny\.tsv\.xz: the validation split is empty"):
        build_dataset(cfg_for("en_de", "seq2seq", "encoder_decoder", path=str(tiny)))
    long = tmp_path / "long.tsv.xz"
    rows = "".join(f"text/a/b#{i}\tone two three\teins zwei drei\n" for i in range(60))
    write_xz(long, "id\ten\tde\n" + rows + "text/a/b#x\t" + "word " * 40 + "\tlang\n")
    with pytest.raises(DataError, match=r"long.tsv.xz:62: sequence of \d+ tokens exceeds data.max_len=32"):
        build_dataset(
            cfg_for(
                "en_de",
                "seq2seq",
                "encoder_decoder",
                path=str(long),
                too_long="reject",
                val_fraction=0.3,
                test_fraction=0.3,
            )
        )


def test_tokenizer_larger_than_model_vocab_is_rejected(tmp_path):
    cfg = cfg_for(max_examples=500, cache_dir=str(tmp_path))
    cfg = C.Config(model=cfg.model.replace(vocab_size=100), data=cfg.data, train=cfg.train)
    with pytest.raises(DataError, match=r"260 ids but model\.vocab_size=100 \(set it to at least 260\)"):
        build_dataset(cfg)
    assert not list(tmp_path.iterdir())  # the byte tokenizer's size is known: refused before the corpus is read


def test_sentencepiece_sizes_it_cannot_train_name_the_size_that_works(tmp_path):
    texts = [f"the {w} is on the table number {i}" for i, w in enumerate(["cat", "dog", "cup", "book"] * 50)]
    with pytest.raises(DataError, match=r"data\.spm_vocab_size=9 is too small .* >= (\d+)$") as small:
        SentencePieceTokenizer.train(texts, tmp_path / "tok.model", vocab_size=9)
    with pytest.raises(DataError, match=r"data\.spm_vocab_size=900 is too large .* at most (\d+) pieces$") as large:
        SentencePieceTokenizer.train(texts, tmp_path / "tok.model", vocab_size=900)
    assert not list(tmp_path.iterdir())  # no model, vocabulary or temporary file of a failed training
    # The sizes named are the limits: the distinct characters (space as "▁") plus 5 special pieces, and
    # the corpus's pieces; one past either still fails.
    least, most = (int(re.findall(r"\d+", str(e.value))[-1]) for e in (small, large))
    assert least == len(set("".join(texts))) + 5
    for size in (least, most):
        assert SentencePieceTokenizer.train(texts, tmp_path / f"{size}.model", vocab_size=size).vocab_size == size
    for size in (least - 1, most + 1):
        with pytest.raises(DataError):
            SentencePieceTokenizer.train(texts, tmp_path / f"{size}.model", vocab_size=size)


def test_ids_past_the_tokenizer_decode_to_nothing(tmp_path):
    """A model's vocabulary may exceed its tokenizer's (padded for the matmuls): samples may hold such ids."""
    byte = ByteTokenizer()
    assert byte.decode([*byte.encode("ab"), byte.vocab_size, 50_000]) == "ab"
    texts = [f"the {w} is on the table" for w in ["cat", "dog", "cup", "book"] * 50]
    sp = SentencePieceTokenizer.train(texts, tmp_path / "tok.model", vocab_size=40)
    assert sp.decode([*sp.encode("the dog"), sp.vocab_size, 999]) == "the dog"


def test_bucketed_batches_vary_in_width_and_join_for_evaluation():
    from jaxformer.evaluate import _arrays

    data = build_dataset(cfg_for("lohelp_apps", "classify", "encoder_only"))
    widths = {data.test.get(i)["src"].shape[1] for i in range(len(data.test))}
    assert len(widths) > 1 and max(widths) <= 32  # buckets of data.max_len=32
    joined = _arrays(data.test, len(data.test))
    assert joined["src"].shape == (len(data.test) * 4, max(widths))
    assert len(joined["label"]) == len(joined["src"])


# ----------------------------------------------------------------------------- the user's files


def files_cfg(files, objective="lm", mode="decoder_only", batch_size=2, num_classes=0, **data):
    model = C.tiny(mode, vocab_size=260, max_len=32, num_classes=num_classes)
    data = C.DataConfig(source="files", files=tuple(str(f) for f in files), max_len=32, **data)
    return C.Config(model=model, data=data, train=C.TrainConfig(objective=objective, batch_size=batch_size))


def read_source(cfg):
    from jaxformer.data import sources
    from jaxformer.data.sources import source_of

    return sources.read(source_of(cfg), labelled=cfg.train.objective == "classify")


def test_every_format_gives_the_same_records(tmp_path):
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    pairs = [(f"source {i} ünï", f"Ziel {i}") for i in range(30)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"en": s, "de": t, "x": 1}) + "\n" for s, t in pairs))
    (tmp_path / "a.tsv").write_text("de\ten\n" + "".join(f"{t}\t{s}\n" for s, t in pairs))
    pq.write_table(pa.table({"de": [t for _, t in pairs], "en": [s for s, _ in pairs]}), tmp_path / "a.parquet")
    with lzma.open(tmp_path / "b.jsonl.xz", "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps({"en": s, "de": t}) + "\n\n" for s, t in pairs))  # blank lines are skipped
    got = {}
    for name in ("a.jsonl", "a.tsv", "a.parquet", "b.jsonl.xz"):
        cfg = files_cfg([tmp_path / name], "seq2seq", "encoder_decoder", fields=("en", "de"))
        records, labels = read_source(cfg)
        got[name] = [r[1:] for r in records]
        assert labels == () and records[0][0].startswith(str(tmp_path / name))
    assert all(v == pairs for v in got.values())
    # Globs: every match, in sorted order.
    cfg = files_cfg([tmp_path / "*.jsonl*"], "seq2seq", "encoder_decoder", fields=("en", "de"))
    assert [r[1:] for r in read_source(cfg)[0]] == pairs + pairs


def test_plain_text_by_line_or_paragraph(tmp_path):
    (tmp_path / "t.txt").write_text("one line\nsecond line\n\nthird\n\n\nfourth\nfifth\n")
    lines = read_source(files_cfg([tmp_path / "t.txt"]))[0]
    assert [r[1] for r in lines] == ["one line", "second line", "third", "fourth", "fifth"]
    assert lines[2][0] == f"{tmp_path / 't.txt'}:4"
    paragraphs = read_source(files_cfg([tmp_path / "t.txt"], text_unit="paragraph"))[0]
    assert [r[1] for r in paragraphs] == ["one line\nsecond line", "third", "fourth\nfifth"]


def test_labels_are_indices_into_the_declared_set(tmp_path):
    import json

    rows = [{"text": f"text number {i}", "label": ["neg", "pos", "mid"][i % 3]} for i in range(12)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    kw = dict(objective="classify", mode="encoder_only", num_classes=3)
    records, labels = read_source(files_cfg([tmp_path / "c.jsonl"], labels=("pos", "neg", "mid"), **kw))
    assert labels == ("pos", "neg", "mid") and [labels[r[2]] for r in records] == [r["label"] for r in rows]
    records, labels = read_source(files_cfg([tmp_path / "c.jsonl"], **kw))
    assert labels == ("mid", "neg", "pos")  # none declared: the sorted labels found
    with pytest.raises(DataError, match=r"c\.jsonl:3: label 'mid' is not in the label set \(pos, neg\)"):
        read_source(files_cfg([tmp_path / "c.jsonl"], labels=("pos", "neg"), **kw))


@pytest.mark.parametrize(
    "name, content, objective, match",
    [
        ("e.txt", b"", "lm", r"e\.txt: empty file"),
        ("u.txt", b"fine\nbad \xff byte\n", "lm", r"u\.txt:2: not UTF-8"),
        ("m.jsonl", b'{"source": "a", "target": "b"}\n{"source": "c"}\n', "seq2seq", r"m\.jsonl:2: no field 'target'"),
        ("j.jsonl", b'{"text": "a"}\n[1, 2]\n', "lm", r"j\.jsonl:2: a JSON object is expected"),
        ("h.tsv", b"text\tother\nx\ty\n", "seq2seq", r"h\.tsv:1: the header has no column 'source'"),
        ("r.tsv", b"source\ttarget\na\tb\nc\n", "seq2seq", r"r\.tsv:3: expected 2 tab-separated columns, got 1"),
        ("p.txt", b"a\nb\n", "seq2seq", r"p\.txt: plain text holds one field"),
        ("x.csv", b"a\n", "lm", r"x\.csv: cannot tell the format"),
    ],
)
def test_bad_user_files_fail_naming_file_and_line(tmp_path, name, content, objective, match):
    (tmp_path / name).write_bytes(content)
    mode = {"lm": "decoder_only", "seq2seq": "encoder_decoder"}[objective]
    with pytest.raises(DataError, match=match):
        build_dataset(files_cfg([tmp_path / name], objective, mode))


def test_missing_parquet_column_and_unmatched_glob_fail(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d\.parquet: no column 'text' \(it has body\)"):
        build_dataset(files_cfg([tmp_path / "d.parquet"]))
    with pytest.raises(DataError, match=r"nothing-\*\.txt: matches no file"):
        build_dataset(files_cfg([tmp_path / "nothing-*.txt"]))


def test_a_shipped_corpus_is_its_file_read_as_user_data(tmp_path):
    from jaxformer.data import sources

    shipped = build_dataset(cfg_for(max_examples=800))
    path = sources.SHIPPED["shakespeare"].files[0]
    own = build_dataset(files_cfg([path], batch_size=4, text_unit="paragraph", max_examples=800))
    for step in (0, 5):
        for k, v in shipped.train.get(step).items():
            np.testing.assert_array_equal(v, own.train.get(step)[k])


def test_files_config_errors_name_the_field():
    with pytest.raises(C.ConfigError, match=r"data\.files"):
        C.DataConfig(source="files")
    with pytest.raises(C.ConfigError, match=r"data\.fields"):
        files_cfg(["x.jsonl"], "seq2seq", "encoder_decoder", fields=("text",))
    cfg = C.apply_overrides(files_cfg(["x.jsonl"]), ["data.files=a.jsonl, b/*.jsonl"])
    assert cfg.data.files == ("a.jsonl", "b/*.jsonl")


# ----------------------------------------------------------------------------- order, resume, shares


@pytest.fixture(scope="module")
def datasets():
    """A small dataset per objective (bucketed for pairs and classification)."""
    return {
        "lm": build_dataset(cfg_for(max_examples=300)),
        "mlm": build_dataset(cfg_for(objective="mlm", mode="encoder_only", max_examples=300)),
        "seq2seq": build_dataset(cfg_for("en_de", "seq2seq", "encoder_decoder", max_examples=1500)),
        "classify": build_dataset(cfg_for("lohelp_apps", "classify", "encoder_only", max_examples=3000)),
    }


def assert_batches_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.parametrize("objective", ["lm", "seq2seq"])
def test_an_epoch_serves_each_example_once_and_the_next_reshuffles(datasets, objective):
    train = datasets[objective].train
    epoch = [train.rows(s) for s in range(len(train))]
    seen = np.concatenate(epoch)
    assert len(seen) == len(set(seen.tolist())) == len(train) * train.batch_size
    assert (seen < train.num_examples).all() and len(seen) > train.num_examples - train.batch_size * 32
    assert not np.array_equal(train.rows(len(train)), epoch[0])


@pytest.mark.parametrize("objective", ["lm", "mlm", "seq2seq", "classify"])
def test_a_stream_resumed_at_any_step_is_the_uninterrupted_one(datasets, objective):
    train = datasets[objective].train
    stop = 40  # past a chunk of 32 bucketed batches
    uninterrupted = list(train.stream(0, stop, prefetch=2))
    resumed = list(train.stream(33, stop))  # a fresh start in the middle, read in the loop
    assert len(uninterrupted) == stop
    for a, b in zip(uninterrupted[33:], resumed, strict=True):
        assert_batches_equal(a, b)
    fresh = build_dataset(cfg_for(max_examples=300)) if objective == "lm" else None  # another process
    if fresh is not None:
        assert_batches_equal(fresh.train.get(37), uninterrupted[37])


@pytest.mark.parametrize("objective", ["lm", "mlm", "seq2seq", "classify"])
def test_process_shares_read_disjoint_rows_that_make_the_global_batch(datasets, objective):
    train, B = datasets[objective].train, 4
    for step in (0, 5, 33):
        shares = [slice(0, 2), slice(2, 4)]  # two processes' rows, as sharding.process_rows gives them
        rows = [train.rows(step)[s] for s in shares]
        assert not set(rows[0].tolist()) & set(rows[1].tolist())
        parts = [train.get(step, s) for s in shares]
        whole = train.get(step)
        assert_batches_equal({k: np.concatenate([p[k] for p in parts]) for k in whole}, whole)
        assert len(next(iter(whole.values()))) == B


@pytest.mark.parametrize("block", [1, 3, 1 << 24])
def test_lines_read_by_blocks_are_the_lines_of_the_file(tmp_path, block):
    from jaxformer.data.sources import read_lines

    for raw in [b"", b"a", b"a\n", b"a\r\nb\r\n\n\nc", b"\n\n", "\u00fc\n\u00df\u4e2d\n".encode()]:
        (tmp_path / "t.txt").write_bytes(raw)
        expected = raw.decode().split("\n")[: -1 if raw.endswith(b"\n") else None] if raw else []
        got = list(read_lines(tmp_path / "t.txt", block))
        assert got == [(i + 1, line.removesuffix("\r")) for i, line in enumerate(expected)]
    (tmp_path / "t.txt").write_bytes(b"ok\nfine\nbad \xff\n")
    with pytest.raises(DataError, match=r"t\.txt:3: not UTF-8 \(invalid start byte at byte 4\)"):
        list(read_lines(tmp_path / "t.txt", block))
