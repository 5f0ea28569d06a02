"""docs/parameters.md against the code: every table's paths, shapes and logical axes are those of
the models it describes, the complete trees leave nothing out, the catalogue covers every
parameter of every model here, and the examples run as written.

A table is read when the line before it is a marker: `<!-- tree: NAME -->` (every parameter of
CONFIGS[NAME], nothing else), `<!-- any -->` (each row in some config), `<!-- rules -->` (the
default sharding rules), `<!-- hf -->` (Hugging Face rules); `<!-- run -->` marks a Python block.
Shapes are evaluated with the letters bound to each config's sizes, all distinct here.
"""

import functools
import pathlib
import re

import pytest
from flax import nnx

import jaxformer as jf
from jaxformer import sharding
from jaxformer.config import MeshConfig
from jaxformer.interop.hf import FAMILIES

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "parameters.md"
TEXT = DOC.read_text()

# V, D, H, F, P, relative_buckets, L distinct; G = 2 where grouped, K = 6 (5 for T5), C = 5.
SMALL = dict(vocab_size=96, d_model=24, num_heads=4, d_ff=40, max_len=10, relative_buckets=8)
L = 3
ENC_DEC = dict(num_encoder_layers=L, num_decoder_layers=L)
VARIANT = dict(  # every option the presets leave out, in one encoder-decoder
    num_kv_heads=2, activation="swiglu", share_embeddings=False, tie_output=False, norm_position="pre",
    embed_norm=True, type_vocab_size=2, position="learned", logits_bias=True,
)  # fmt: skip
CONFIGS = {
    "llama": jf.llama(**SMALL, num_kv_heads=2, num_decoder_layers=L),
    "llama_scanned": jf.llama(**SMALL, num_kv_heads=2, num_decoder_layers=L, scan_layers=True),
    "gpt2": jf.gpt2_small(**SMALL, num_decoder_layers=L),
    "paper": jf.paper_base(**SMALL, **ENC_DEC),
    "paper_variant": jf.paper_base(**SMALL, **ENC_DEC, **VARIANT),
    "bart": jf.bart_base(**SMALL, **ENC_DEC),
    "t5": jf.t5_small(**SMALL | dict(head_dim=5), **ENC_DEC),
    "t5_v1_1": jf.t5_v1_1_small(**SMALL | dict(head_dim=5), **ENC_DEC),
    "bert_classifier": jf.bert_base(**SMALL, num_encoder_layers=L, num_classes=5),
    "bert_untied": jf.bert_base(**SMALL, num_encoder_layers=L, tie_output=False, norm="rmsnorm"),
}
HF_CONFIGS = {"llama": "llama", "gpt2": "gpt2", "bert": "bert_classifier", "bart": "bart", "t5": "t5"}


# ----------------------------------------------------------------------------- reading the doc


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _tables() -> list[tuple[str, list[dict]]]:
    """(marker, rows as {header: cell}) for every table right after a `<!-- marker -->` line."""
    lines, out = TEXT.splitlines(), []
    for n, line in enumerate(lines):
        marker = re.fullmatch(r"<!-- (.+) -->", line.strip())
        if not marker or marker[1] == "run":
            continue
        header, rows = _cells(lines[n + 1]), []
        for row in lines[n + 3 :]:
            if not row.startswith("|"):
                break
            rows.append(dict(zip(header, _cells(row), strict=True)))
        out.append((marker[1], rows))
    return out


def _table(marker: str) -> list[dict]:
    (rows,) = [rows for m, rows in _tables() if m == marker]
    return rows


def _code(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _dims(cfg) -> dict:
    return dict(
        V=cfg.vocab_size, D=cfg.d_model, H=cfg.num_heads, G=cfg.kv_heads, K=cfg.dim_per_head, F=cfg.d_ff,
        L=L, P=cfg.max_len, C=cfg.num_classes, position_offset=cfg.position_offset,
        type_vocab_size=cfg.type_vocab_size, relative_buckets=cfg.relative_buckets,
    )  # fmt: skip


def _shape(cell: str, cfg) -> tuple[int, ...]:
    (text,) = _code(cell)
    return tuple(eval(e, {"__builtins__": {}}, _dims(cfg)) for e in text.strip("[]").split(","))


def _axes(cell: str) -> tuple:
    return tuple(None if a.strip() == "None" else a.strip() for a in cell.split(","))


def _sides(cfg) -> list[str]:
    return {"decoder_only": ["decoder"], "encoder_only": ["encoder"]}.get(cfg.mode, ["encoder", "decoder"])


def _expand(path: str, cfg) -> list[str]:
    """The concrete paths of a documented one in `cfg`: {side} over its stacks, {i} over layers."""
    paths = [path.replace("{side}", s) for s in _sides(cfg)] if "{side}" in path else [path]
    return [p.replace("{i}", str(i)) for p in paths for i in range(L)] if "{i}" in path else paths


def _pattern(path: str) -> str:
    return re.escape(path).replace(r"\{side\}", "(encoder|decoder)").replace(r"\{i\}", r"\d+")


@functools.cache
def _tree(cfg) -> dict[str, tuple]:
    """path -> (shape, logical axes, dtype) of every parameter of a model of `cfg`."""
    model = nnx.eval_shape(lambda: jf.Transformer(cfg, rngs=nnx.Rngs(0)))
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(map(str, p)): (v.shape, tuple(v.get_metadata()["out_sharding"]), v.dtype) for p, v in flat}


def _check_row(row: dict, path: str, cfg) -> None:
    shape, axes, _ = _tree(cfg)[path]
    assert shape == _shape(row["shape"], cfg), f"{path}: shape {shape}, documented {row['shape']}"
    assert axes == _axes(row["logical axes"]), f"{path}: axes {axes}, documented {row['logical axes']}"


# ----------------------------------------------------------------------------- the tables


@pytest.mark.parametrize("marker", [m for m, _ in _tables() if m.startswith("tree: ")])
def test_a_complete_tree_is_the_model(marker):
    cfg = CONFIGS[marker.removeprefix("tree: ")]
    listed = {p: row for row in _table(marker) for p in _expand(_code(row["path"])[0], cfg)}
    actual = _tree(cfg)
    assert sorted(set(actual) - set(listed)) == [], "parameters the doc leaves out"
    assert sorted(set(listed) - set(actual)) == [], "documented paths the model lacks"
    for path, row in listed.items():
        _check_row(row, path, cfg)


def test_every_catalogued_parameter_exists_as_described():
    for row in _table("any"):
        (path,) = _code(row["path"])
        found = [
            (p, cfg) for cfg in CONFIGS.values() if not cfg.scan_layers for p in _expand(path, cfg) if p in _tree(cfg)
        ]
        assert found, f"{path} is in no model"
        for p, cfg in found:
            _check_row(row, p, cfg)


def test_the_catalogue_covers_every_parameter():
    patterns = [_pattern(_code(row["path"])[0]) for row in _table("any")]
    for name, cfg in CONFIGS.items():
        if not cfg.scan_layers:
            missing = [p for p in _tree(cfg) if not any(re.fullmatch(x, p) for x in patterns)]
            assert missing == [], f"{name}: not in the catalogue"


@pytest.mark.parametrize("name", [n for n, c in CONFIGS.items() if not c.scan_layers])
def test_scanned_paths_drop_the_index_and_stack_on_a_leading_layers_axis(name):
    expected = {}
    for path, (shape, axes, dtype) in _tree(CONFIGS[name]).items():
        layer = re.fullmatch(r"(.*\.stack\.layers)\.(\d+)\.(.*)", path)
        if layer is None:
            expected[path] = (shape, axes, dtype)
        else:
            expected[f"{layer[1]}.{layer[3]}"] = ((L, *shape), ("layers", *axes), dtype)
    assert _tree(CONFIGS[name].replace(scan_layers=True)) == expected


def test_parameters_are_float32_whatever_the_compute_dtype():
    bfloat16 = CONFIGS["paper_variant"].replace(dtype="bfloat16")
    for cfg in [*CONFIGS.values(), bfloat16]:
        assert {str(dtype) for *_, dtype in _tree(cfg).values()} == {"float32"}


def test_shared_embeddings_are_one_variable():
    paper = nnx.eval_shape(lambda: jf.Transformer(CONFIGS["paper"], rngs=nnx.Rngs(0)))
    assert paper.encoder.embed is paper.decoder.embed is paper.lm_head.tied_to is paper.src_embed
    bert = nnx.eval_shape(lambda: jf.Transformer(CONFIGS["bert_classifier"], rngs=nnx.Rngs(0)))
    assert bert.mlm_head.decoder.tied_to is bert.encoder.embed


def test_the_sharding_table_is_the_default_rules():
    rules = dict(sharding.rules_for(MeshConfig()))
    rows = [r for r in _table("rules") if _code(r["logical axis"])]
    for row in rows:
        (logical,) = _code(row["logical axis"])
        mesh_axis = _code(row["mesh axis"])
        assert rules[logical] == (mesh_axis[0] if mesh_axis else None), logical
    named = {name for _, names, _ in _tree(CONFIGS["llama_scanned"]).values() for name in names} - {None}
    assert named <= {_code(r["logical axis"])[0] for r in rows}


def test_hugging_face_examples_are_rules_of_their_family():
    for row in _table("hf"):
        family = row["family"]
        (theirs,) = _code(row["Hugging Face tensor"])
        ours, layout = tuple(_code(row["jaxformer path(s)"])), _code(row["layout"])[0]
        rules = {r.theirs: r for r in FAMILIES[family].rules(CONFIGS[HF_CONFIGS[family]])}
        assert theirs in rules, f"{family}: no rule for {theirs}"
        assert (rules[theirs].ours, rules[theirs].layout) == (ours, layout), theirs


def test_the_examples_run(tmp_path, monkeypatch):
    pytest.importorskip("safetensors", reason="the Hugging Face example writes safetensors")
    blocks = re.findall(r"<!-- run -->\n```python\n(.*?)```", TEXT, re.S)
    assert len(blocks) == 3
    monkeypatch.chdir(tmp_path)
    namespace = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)
