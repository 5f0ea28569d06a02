"""The hardware table behind MFU and the planner: the chips JAX names, peaks in the compute dtype."""

import json
from types import SimpleNamespace

import jax
import pytest

from jaxformer import chips
from jaxformer.config import apply_overrides, load_experiment
from jaxformer.train import fit

# device_kind strings as JAX reports them -> (table name, bfloat16 peak, float32 peak at default precision)
KINDS = {
    "NVIDIA H100 80GB HBM3": ("H100 SXM", 989e12, 494.7e12),
    "NVIDIA H100 PCIe": ("H100 PCIe", 756e12, 378e12),
    "NVIDIA H100 NVL": ("H100 NVL", 835e12, 418e12),
    "NVIDIA H200": ("H200", 989e12, 494.7e12),
    "NVIDIA GH200 480GB": ("GH200", 989e12, 494.7e12),
    "NVIDIA A100-SXM4-80GB": ("A100 80GB", 312e12, 156e12),
    "NVIDIA A100-SXM4-40GB": ("A100 40GB", 312e12, 156e12),
    "NVIDIA L4": ("L4", 121e12, 60e12),
    "TPU v4": ("TPU v4", 275e12, 275e12),
    "TPU v5 lite": ("TPU v5e", 197e12, 197e12),
    "TPU v5p": ("TPU v5p", 459e12, 459e12),
    "TPU v6 lite": ("TPU v6e", 918e12, 918e12),
}


@pytest.mark.parametrize("kind", KINDS)
def test_table_knows_the_chips_jax_names(kind):
    name, bf16, f32 = KINDS[kind]
    chip = chips.lookup(kind)
    assert chip.name == name and chip.peak("bfloat16") == bf16 and chip.peak("float32") == f32
    assert chip.memory_bytes > 1e10 and chip.bandwidth > 1e11 and chip.source


def test_peak_is_the_chips_in_the_compute_dtype_else_a_probe(monkeypatch):
    assert chips.lookup("cpu") is None
    peak, source = chips.peak_flops("float32")  # this CPU: a probe in float32
    assert peak > 1e8 and "float32 matmul probe on cpu" in source
    assert chips.peak_flops("bfloat16", override=5e12) == (5e12, "train.peak_flops")
    monkeypatch.setattr(jax, "devices", lambda: [SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")])
    assert chips.peak_flops("bfloat16")[0] == 989e12 and chips.peak_flops("float32")[0] == 494.7e12
    assert "H100 SXM bfloat16 dense peak" in chips.peak_flops("bfloat16")[1]


def test_mfu_never_exceeds_one(tmp_path):
    """A peak the step beats (here a wrong train.peak_flops) is raised to what the step achieved, and said."""
    cfg = apply_overrides(
        load_experiment("experiments/copy_task.py"),
        ["train.steps=12", "train.log_every=4", "train.eval_every=12", "train.num_samples=0", "train.peak_flops=1"],
    )
    fit(cfg, tmp_path, quiet=True)
    mfus = [json.loads(line).get("mfu") for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    mfus = [m for m in mfus if m is not None]
    assert len(mfus) >= 2 and all(0 < m <= 1.0 for m in mfus) and max(mfus) == pytest.approx(1.0)
