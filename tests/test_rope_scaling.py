"""RoPE scaling (`model.rope_scaling`: linear, yarn, llama3): `functional.rope_frequencies` against
transformers' `ROPE_INIT_FUNCTIONS` (tests/golden/rope_scaling.json, made by scripts/make_rope_golden.py)
and against the formulas; `apply_rope` as position interpolation; the logits' scale of DeepSeek's yarn.
(The scaled models themselves: tests/test_interop_families.py, Qwen 3 yarn and Gemma 3 linear.)"""

import json
import math
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.config import ConfigError, ModelConfig, RopeScalingConfig, yarn_mscale
from jaxformer.functional import apply_rope, rope_frequencies
from jaxformer.interop.families.common import _rope_scaling, _rope_scaling_hf

GOLDEN = json.loads((pathlib.Path(__file__).parent / "golden" / "rope_scaling.json").read_text())["cases"]


def _scaling(case: dict) -> RopeScalingConfig:
    hf = {"rope_scaling": case["rope_scaling"], "max_position_embeddings": case["max_position_embeddings"]}
    return _rope_scaling(hf, logits_mscale=True)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_frequencies_and_attention_factor_are_transformers(name):
    """Each case's inverse frequencies within float32 rounding (rtol 1e-6) of transformers', its
    attention factor to 1e-12; and its rope_scaling written back as the config.json held it."""
    case = GOLDEN[name]
    scaling = _scaling(case)
    inv_freq, factor = rope_frequencies(case["head_dim"], case["rope_theta"], scaling)
    np.testing.assert_allclose(inv_freq, np.float32(case["inv_freq"]), rtol=1e-6, atol=0)
    assert abs(factor - case["attention_factor"]) < 1e-12
    back = _rope_scaling_hf(ModelConfig(position="rope", rope_scaling=scaling))
    assert {k: back.get(k) for k in case["rope_scaling"]} == case["rope_scaling"] | {"factor": scaling.factor}


def test_the_kinds_follow_their_formulas():
    """linear: every frequency / factor. yarn: the pairs turning more than beta_fast times over the trained
    length kept, less than beta_slow times divided by factor, the others between; factor 0.1 ln f + 1.
    llama3: wavelengths under original / high_freq_factor kept, over original / low_freq_factor divided."""
    K, base = 64, 10_000.0
    plain, one = rope_frequencies(K, base)
    np.testing.assert_allclose(plain, base ** (-np.arange(0, K, 2) / K), rtol=1e-6)
    assert one == 1.0
    linear, _ = rope_frequencies(K, base, RopeScalingConfig(kind="linear", factor=8.0))
    np.testing.assert_allclose(linear, plain / 8, rtol=1e-6)
    yarn = RopeScalingConfig(kind="yarn", factor=40.0, original_max_len=4096)
    scaled, factor = rope_frequencies(K, base, yarn)
    turns = 4096 * plain / (2 * math.pi)
    fast, slow = turns > 32 + 1, turns < 1 - 0.1  # clear of the ramp's ends (rounded to whole pairs)
    assert fast.sum() >= 4 and slow.sum() >= 4
    np.testing.assert_allclose(scaled[fast], plain[fast], rtol=1e-6)
    np.testing.assert_allclose(scaled[slow], plain[slow] / 40, rtol=1e-6)
    assert np.all((scaled <= plain * (1 + 1e-6)) & (scaled >= plain / 40 * (1 - 1e-6)))
    assert factor == pytest.approx(0.1 * math.log(40) + 1) and yarn.logits_factor == 1.0
    llama3 = RopeScalingConfig(kind="llama3", factor=8.0, original_max_len=8192)
    scaled, _ = rope_frequencies(128, 500_000.0, llama3)
    plain, _ = rope_frequencies(128, 500_000.0)
    wavelen = 2 * math.pi / plain
    np.testing.assert_allclose(scaled[wavelen < 8192 / 4], plain[wavelen < 8192 / 4], rtol=1e-6)
    np.testing.assert_allclose(scaled[wavelen > 8192], plain[wavelen > 8192] / 8, rtol=1e-6)


def test_apply_rope_scaled_is_position_interpolation_times_the_attention_factor():
    """Linear scaling by f at position p is plain RoPE at p / f; yarn multiplies by its attention factor
    (at position 0, x itself times it); DeepSeek's mscale_all_dim multiplies the logits' scale by
    mscale(f, mscale_all_dim)^2, which `ModelConfig.logits_scale` carries."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 5, 3, 16)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 100, (2, 5)), jnp.float32)
    linear = RopeScalingConfig(kind="linear", factor=4.0)
    np.testing.assert_allclose(apply_rope(x, positions, 500.0, linear), apply_rope(x, positions / 4, 500.0), atol=1e-5)
    yarn = RopeScalingConfig(kind="yarn", factor=4.0, original_max_len=16, mscale=1.0, mscale_all_dim=0.707)
    ratio = yarn_mscale(4.0, 1.0) / yarn_mscale(4.0, 0.707)
    assert yarn.attention_factor == pytest.approx(ratio) and ratio != 1.0
    np.testing.assert_allclose(apply_rope(x, jnp.zeros((2, 5)), 500.0, yarn), x * ratio, rtol=1e-6)
    cfg = ModelConfig(position="rope", head_dim=24, rope_scaling=yarn)
    assert cfg.logits_scale == pytest.approx(24**-0.5 * (0.1 * 0.707 * math.log(4) + 1) ** 2)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(kind="none", factor=2.0), r"model\.rope_scaling\.factor: kind='none' scales nothing"),
        (dict(kind="yarn", factor=4.0), r"model\.rope_scaling\.original_max_len: kind='yarn' needs the length"),
        (dict(kind="yarn", factor=4.0, original_max_len=8, beta_fast=1.0), r"model\.rope_scaling\.beta_fast: must"),
        (dict(kind="llama3", factor=8.0, original_max_len=8, high_freq_factor=0.5), r"rope_scaling\.high_freq_factor"),
        (dict(kind="dynamic"), r"model\.rope_scaling\.kind: 'dynamic' is not one of the choices"),
    ],
)
def test_bad_scalings_are_refused_naming_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        RopeScalingConfig(**fields)


def test_a_scaling_needs_rope_and_global_needs_a_window():
    linear = dict(kind="linear", factor=2.0)
    with pytest.raises(ConfigError, match=r"model\.rope_scaling\.kind: 'linear' scales RoPE's frequencies"):
        ModelConfig(position="learned", rope_scaling=linear)
    with pytest.raises(ConfigError, match=r"model\.rope_scaling\.layers: 'global' leaves the local layers"):
        ModelConfig(position="rope", rope_scaling=linear | {"layers": "global"})
    with pytest.raises(ConfigError, match=r"model\.rope_scaling\.kinds: unknown field"):
        ModelConfig(position="rope", rope_scaling={"kinds": "linear"})
