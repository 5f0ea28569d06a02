"""Qwen 2, Qwen 3, Qwen 3 MoE, Gemma 3 and Gemma 2 checkpoints in and out, against transformers' PyTorch models;
the sliding window Gemma 3's local layers attend over, in the reference, the fused path and the cache.

CI has no torch: scripts/make_family_golden.py (run by hand with torch and transformers 4.57) wrote
tiny random models as transformers saves them and transformers' logits on fixed inputs
(tests/golden/qwen2, qwen3, qwen3_moe, gemma3_text, gemma2). Here `load_hf` must give those logits,
unrolled, scanned and loaded onto a mesh, and `save_hf` must write back the same tensors and config fields. (The other
direction, transformers reading what `save_hf` writes: `make_family_golden.py export` / `check`.)
"""

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import processes
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jaxformer.config import RopeScalingConfig
from jaxformer.interop import hf

GOLDEN = pathlib.Path(__file__).parent / "golden"
FAMILIES = ("qwen2", "qwen3", "qwen3_moe", "gemma3_text", "gemma2", "deepseek_v3")
SCALED = {"qwen3": dict(kind="yarn", factor=4.0, original_max_len=8, beta_fast=8.0, beta_slow=2.0),
          "gemma3_text": dict(kind="linear", factor=8.0, layers="global")}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def sharded_load():
    """The 8-device sharded loads (tests/sharded_worker.py hf_families), started first in a process of
    its own (the device count is fixed when JAX starts) so that it runs while the tests below do."""
    proc = processes.sharded_worker("hf_families", GOLDEN)
    yield proc
    if proc.poll() is None:  # bounded: never leave a worker behind
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def imported():
    """Each golden model loaded unrolled and scanned, Qwen 3 MoE also with norm_topk_prob off (its router
    "softmax_topk"), and their logits on the golden inputs, all in one compiled program."""
    refs = {f: np.load(GOLDEN / f / "logits.npz") for f in FAMILIES}
    models = {}
    for f in FAMILIES:
        models[f] = hf.load_hf(GOLDEN / f)
        models[f"{f}_scanned"] = hf.load_hf(GOLDEN / f, scan_layers=True)
    moe = dataclasses.replace(models["qwen3_moe"].cfg.moe, router="softmax_topk")
    models["qwen3_moe_unnormalised"] = hf.load_hf(GOLDEN / "qwen3_moe", moe=moe)
    ids = refs["qwen2"]["input_ids"]
    assert all(np.array_equal(r["input_ids"], ids) for r in refs.values())
    models["gemma3_text_xla"] = hf.load_hf(GOLDEN / "gemma3_text", attention_impl="xla")  # local_window_size
    for f, scaling in SCALED.items():  # the same weights, RoPE scaled (make_family_golden.py's SCALED)
        models[f"{f}_scaled"] = hf.load_hf(GOLDEN / f, rope_scaling=RopeScalingConfig(**scaling))

    def run(ms, ids):
        logits = {k: m(ids) for k, m in ms.items()}
        # Gemma 3 decoding: a 3-token prefill, then one token a step over its cache (16 slots; the local
        # layer's a ring of its window's 3)
        gemma = ms["gemma3_text"]
        cache = gemma.init_cache(ids.shape[0], 16)
        steps, cache = gemma.decode_step(cache, ids[:, :3], None)
        steps = [steps]
        for p in range(3, ids.shape[1]):
            step, cache = gemma.decode_step(cache, ids[:, p : p + 1], jnp.full((ids.shape[0], 1), p))
            steps.append(step)
        return logits | {"gemma3_text_cached": jnp.concatenate(steps, axis=1)}

    with jax.default_matmul_precision("highest"):
        logits = nnx.jit(run)(models, ids)
    return models, {k: np.asarray(v) for k, v in logits.items()}, refs


def test_imported_models_give_transformers_logits(imported):
    """Qwen 2 (q, k, v biases), Qwen 3 (QK-norm, head dim 16 with d_model 32 over 4 heads), Qwen 3 MoE
    (layer 0 dense, layer 1 top-2 of 8 small experts, renormalised and not) and Gemma 3 (layer 0 local over
    3 positions of 8, layer 1 global, each its RoPE base; sandwich norms of (1 + w), logits soft-capped)
    and Gemma 2 (the same with one RoPE base, no QK-norm, attention logits soft-capped at 2) within 1e-5 of
    transformers' float32 logits, unrolled and scanned; Gemma 3 also through XLA's fused attention (the
    window as local_window_size) and decoded over its cache one token a step; Qwen 3 with yarn RoPE scaling
    and Gemma 3 with linear scaling of its global layer's RoPE, as transformers scales the same weights."""
    models, logits, refs = imported
    cfg = {f: models[f].cfg for f in FAMILIES}
    assert cfg["qwen2"].qkv_bias and not cfg["qwen2"].use_bias and not cfg["qwen2"].qk_norm
    assert cfg["qwen3"].qk_norm and cfg["qwen3"].dim_per_head == 16 != cfg["qwen3"].d_model // cfg["qwen3"].num_heads
    moe = cfg["qwen3_moe"].moe
    assert (moe.num_experts, moe.experts_per_token, moe.expert_d_ff, moe.router) == (8, 2, 8, "topk_softmax")
    assert [moe.is_moe_layer("decoder", i) for i in range(2)] == [False, True]
    for f in FAMILIES:
        for name in (f, f"{f}_scanned"):
            np.testing.assert_allclose(logits[name], refs[f]["logits"], atol=1e-5, rtol=0, err_msg=name)
    gemma = cfg["gemma3_text"]
    assert (gemma.sliding_window, gemma.global_every, gemma.rope_local_base, gemma.rope_base) == (3, 2, 1e4, 1e6)
    assert [gemma.is_local_layer(i) for i in range(2)] == [True, False] and gemma.norm_position == "sandwich"
    for name in ("gemma3_text_xla", "gemma3_text_cached"):
        np.testing.assert_allclose(logits[name], refs["gemma3_text"]["logits"], atol=1e-5, rtol=0, err_msg=name)
    assert cfg["gemma2"].attention_softcap == 2.0 and not cfg["gemma2"].qk_norm
    ds = cfg["deepseek_v3"]  # MLA with both ranks, yarn (mscale != mscale_all_dim), groups, layer 0 dense
    assert (ds.mla.q_lora_rank, ds.mla.kv_lora_rank, ds.mla.rope_head_dim, ds.mla.v_head_dim) == (24, 16, 8, 12)
    assert (ds.moe.router, ds.moe.num_groups, ds.moe.groups_per_token, ds.moe.routed_scaling) == (
        "sigmoid_topk",
        4,
        2,
        2.5,
    )
    assert [ds.moe.is_moe_layer("decoder", i) for i in range(3)] == [False, True, True] and ds.moe.shared_experts == 1
    assert ds.rope_scaling.kind == "yarn" and ds.rope_scaling.attention_factor != 1 != ds.rope_scaling.logits_factor
    unnormalised = refs["qwen3_moe"]["logits_unnormalised"]
    np.testing.assert_allclose(logits["qwen3_moe_unnormalised"], unnormalised, atol=1e-5, rtol=0)
    assert np.abs(unnormalised - refs["qwen3_moe"]["logits"]).max() > 0.01  # the two routers differ here
    for f in SCALED:  # RoPE scaling: Qwen 3's yarn on every layer, Gemma 3's linear on its global layer alone
        np.testing.assert_allclose(logits[f"{f}_scaled"], refs[f]["logits_scaled"], atol=1e-5, rtol=0, err_msg=f)
        assert np.abs(refs[f]["logits_scaled"] - refs[f]["logits"]).max() > 0.1  # the scaling shows


def test_save_hf_writes_back_the_checkpoint(imported, tmp_path):
    """The same tensors (names, shapes, values exactly) and config fields as transformers wrote, from the
    unrolled and the scanned models; each family is the one `family_of` finds for its config."""
    models = imported[0]
    for f in FAMILIES:
        assert hf.family_of(models[f].cfg) == f
        golden = GOLDEN / f
        their_config = json.loads((golden / hf.CONFIG).read_text())
        theirs = load_file(golden / hf.WEIGHTS)
        for name in (f, f"{f}_scanned"):
            out = hf.save_hf(models[name], tmp_path / name)
            ours = load_file(out / hf.WEIGHTS)
            assert sorted(ours) == sorted(theirs), name
            for tensor, value in theirs.items():
                np.testing.assert_array_equal(ours[tensor], value, err_msg=f"{name}: {tensor}")
            our_config = json.loads((out / hf.CONFIG).read_text())
            skip = ("transformers_version", "dtype", "torch_dtype", "router_aux_loss_coef")
            differ = {k: (v, our_config[k]) for k, v in their_config.items()
                      if k in our_config and k not in skip and our_config[k] != v}  # fmt: skip
            assert not differ, f"{name}: {differ}"
            assert hf.config_from_hf(our_config) == hf.config_from_hf(their_config)


def _golden_config(name: str) -> dict:
    return json.loads((GOLDEN / name / hf.CONFIG).read_text())


REFUSED = [  # (golden, config.json changes, the message naming the field)
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4}, r"use_sliding_window=True is not supported"),
    ("qwen2", {"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types \['full_attention', 'sliding"),
    ("qwen2", {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, r"rope_scaling=\{'rope_type': 'dynamic'"),
    ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0}},
     r"rope_scaling\.mscale_all_dim=1\.0 is not supported: jaxformer scales the attention logits by it"),
    ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": False}},
     r"rope_scaling\.truncate=False is not supported for yarn"),
    ("qwen3", {"rope_scaling": {"rope_type": "linear", "factor": 0.5}}, r"model\.rope_scaling\.factor: must be >= 1"),
    ("qwen3", {"attention_bias": True}, r"attention_bias=True is not supported"),
    ("qwen3", {"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ("qwen3_moe", {"mlp_only_layers": [0]}, r"mlp_only_layers=\[0\] is not supported"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, r"num_experts_per_tok=9 must be in \[1, num_experts=8\]"),
    ("qwen3_moe", {"num_experts": 0}, r"num_experts=0 must be a positive number of experts"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, r"decoder_sparse_step=0 must be a positive number of layers"),
    ("gemma3_text", {"layer_types": ["full_attention", "sliding_attention"]},
     r"layer_types=\['full_attention', 'sliding_attention'\] is not supported: jaxformer places a global layer"),
    ("gemma3_text", {"layer_types": ["sliding_attention"]}, r"layer_types=\['sliding_attention'\] must list"),
    ("gemma3_text", {"attn_logit_softcapping": 50.0}, r"attn_logit_softcapping=50\.0 is not supported"),
    ("gemma3_text", {"rope_scaling": {"rope_type": "longrope", "factor": 8.0}}, r"rope_scaling=\{'rope_type': 'long"),
    ("gemma2", {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, r"rope_scaling=\{'rope_type': 'linear'"),
    ("gemma3_text", {"hidden_activation": "gelu"}, r"hidden_activation='gelu' is not supported"),
    ("gemma3_text", {"use_bidirectional_attention": True}, r"use_bidirectional_attention=True is not supported"),
    ("gemma3_text", {"sliding_window": 0}, r"sliding_window=0 must be a positive number of positions"),
    ("deepseek_v3", {"rope_interleave": False}, r"rope_interleave=False is not supported"),
    ("deepseek_v3", {"num_key_value_heads": 2}, r"num_key_value_heads=2 is not supported: latent attention's keys"),
    ("deepseek_v3", {"rms_norm_eps": 1e-5}, r"rms_norm_eps=1e-05 is not supported"),
    ("deepseek_v3", {"attention_bias": True}, r"attention_bias=True is not supported"),
    ("deepseek_v3", {"first_k_dense_replace": 3}, r"first_k_dense_replace=3 must leave an MoE layer of num_hidden"),
    ("deepseek_v3", {"n_group": 0}, r"n_group=0 must be a positive integer"),
    ("deepseek_v3", {"num_experts_per_tok": 9}, r"num_experts_per_tok=9 must be in \[1, n_routed_experts=8\]"),
    ("deepseek_v3", {"topk_group": 5}, r"topk_group=5 must be in \[1, n_group=4\]"),
    ("deepseek_v3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.2}},
     r"rope_scaling\.attention_factor=1\.2 is not supported for yarn"),
]  # fmt: skip


def test_what_jaxformer_cannot_express_is_refused_naming_the_field():
    for name, changes, message in REFUSED:
        with pytest.raises(hf.UnsupportedCheckpoint, match=message):
            hf.config_from_hf(_golden_config(name) | changes)
    # Out: MoE layers where decoder_sparse_step cannot put them (layer 0 of every 2) have no family.
    cfg = hf.config_from_hf(_golden_config("qwen3_moe"))
    with pytest.raises(hf.UnsupportedCheckpoint, match=r"model\.moe\.decoder_offset=0: Qwen 3 MoE's layers"):
        hf.config_to_hf(cfg.replace(moe=dataclasses.replace(cfg.moe, decoder_offset=0)), "qwen3_moe")


def test_peft_adapts_the_dense_families_projections_by_their_hub_names():
    """PEFT's target modules of Qwen 2, 3 and Gemma 3, 2 are Llama's seven projections in every layer; Qwen 3 MoE's
    experts are not read as PEFT modules (refused naming the family)."""
    want = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    for f in ("qwen2", "qwen3", "gemma3_text", "gemma2"):
        modules = hf.peft_modules(f, hf.config_from_hf(_golden_config(f)))
        assert {m.target for m in modules} == want and len(modules) == 2 * len(want), f
        assert modules[0].name == "model.layers.0.self_attn.q_proj"
    with pytest.raises(hf.UnsupportedCheckpoint, match=r"PEFT adapters for qwen3_moe are not supported"):
        hf.peft_modules("qwen3_moe", hf.config_from_hf(_golden_config("qwen3_moe")))


def test_a_sharded_load_onto_fsdp_tensor_and_expert_axes_gives_transformers_logits(sharded_load):
    """Each family (Qwen 3 MoE unrolled and scanned, Gemma 3, DeepSeek-V3) loaded straight onto fsdp=2 x tensor=2
    x expert=2: every parameter equal to a one-device load, heads over tensor, experts over expert, and the logits
    within 1e-5 of transformers'."""
    out, err = processes.communicate(sharded_load, "tests/sharded_worker.py hf_families")
    assert sharded_load.returncode == 0, err[-4000:]
    r = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    for name in ("qwen2", "qwen3", "qwen3_moe", "qwen3_moe_scanned", "gemma3_text", "deepseek_v3"):
        assert r[name]["max_abs_diff"] == 0.0 and r[name]["devices"] == list(range(8)), name
        assert r[name]["logits_diff"] < 1e-5, name
    layer = "decoder.stack.layers.1"
    assert r["qwen2"]["specs"][f"{layer}.self_attn.q"] == "('fsdp', 'tensor', None)"  # [D, H, K]
    assert r["qwen2"]["specs"][f"{layer}.self_attn.q_bias"] == "('tensor', None)"  # [H, K]
    assert r["qwen3_moe"]["specs"]["decoder.stack.layers.0.ffn.wi"] == "('fsdp', 'tensor')"  # dense [D, F]
    assert r["qwen3_moe"]["specs"][f"{layer}.ffn.wi"] == "('expert', 'fsdp', 'tensor')"  # [E, D, F]
    assert r["qwen3_moe_scanned"]["specs"][f"{layer}.ffn.wi"] == "(None, 'expert', 'fsdp', 'tensor')"
    assert r["deepseek_v3"]["specs"][f"{layer}.self_attn.q_up"] == "('fsdp', 'tensor', None)"  # [Cq, H, N + R]
    assert r["deepseek_v3"]["specs"][f"{layer}.ffn.wi"] == "('expert', 'fsdp', 'tensor')"


def test_a_sliding_window_mask_is_the_band_of_the_formula():
    """`Mask(causal=True, window=w)`: query t sees keys t - w < s <= t (+ q_offset), in the dense mask the
    reference builds; XLA's fused path given it as local_window_size gives the reference's outputs; a cache
    step's mask of key lengths windowed at its position says the same band."""
    from jaxformer.attention.kernels import dot_product_attention
    from jaxformer.attention.masks import Mask, causal_cache_mask, windowed

    T, w = 7, 3
    t, s = np.arange(T)[:, None], np.arange(T)[None, :]
    band = (s <= t) & (s > t - w)
    np.testing.assert_array_equal(np.asarray(Mask(causal=True, window=w).dense(T, T))[0, 0], band)
    offset = np.array([2, 4])
    got = np.asarray(Mask(causal=True, q_offset=jnp.asarray(offset), window=w).dense(2, 9))[:, 0]
    want = [(np.arange(9)[None] <= np.arange(2)[:, None] + o) & (np.arange(9)[None] > np.arange(2)[:, None] + o - w)
            for o in offset]  # fmt: skip
    np.testing.assert_array_equal(got, np.stack(want))
    step = windowed(causal_cache_mask(jnp.asarray([[5], [2]])), w, jnp.asarray([[5], [2]]))
    slots = np.arange(9)
    np.testing.assert_array_equal(np.asarray(step.dense(1, 9))[:, 0, 0], [(slots > 2) & (slots <= 5), slots < 3])
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, T, n, 8)), jnp.float32) for n in (4, 2, 2))
    attend = jax.jit(lambda q, k, v: [dot_product_attention(q, k, v, mask=Mask(causal=True, window=w),
                                                            implementation=i) for i in ("naive", "xla")])  # fmt: skip
    with jax.default_matmul_precision("highest"):
        naive, xla = attend(q, k, v)
    np.testing.assert_allclose(np.asarray(xla), np.asarray(naive), atol=1e-6)
    with pytest.raises(ValueError, match=r"a sliding window of 3 is said over a causal Mask, not ndarray"):
        windowed(np.ones((1, 1, T, T), bool), w)


def test_deepseek_multi_token_prediction_goes_out_and_back_as_the_checkpoints_layer_after_the_last(tmp_path):
    """The golden DeepSeek-V3 with one MTP module (model.mtp_depth=1, config.json's num_nextn_predict_layers):
    save_hf writes it as layer 3 of 3 (enorm, hnorm, eh_proj [D, 2D], shared_head.norm and an MoE decoder
    layer's tensors, as the published checkpoint's layer 61), and load_hf, unrolled and scanned, gives back
    every parameter bit for bit; the checkpoint's copies of the embedding and the head there are not read."""
    import jaxformer as jf

    cfg = hf.config_from_hf(_golden_config("deepseek_v3")).replace(mtp_depth=1)
    model = jf.build_model(cfg, 0)
    mtp = {k for k in load_file(hf.save_hf(model, tmp_path / "out") / hf.WEIGHTS) if k.startswith("model.layers.3.")}
    assert {"model.layers.3.enorm.weight", "model.layers.3.eh_proj.weight", "model.layers.3.shared_head.norm.weight",
            "model.layers.3.mlp.gate.e_score_correction_bias", "model.layers.3.mlp.experts.7.down_proj.weight",
            "model.layers.3.self_attn.kv_a_proj_with_mqa.weight"} <= mtp  # fmt: skip
    assert json.loads((tmp_path / "out" / hf.CONFIG).read_text())["num_nextn_predict_layers"] == 1
    weights = load_file(tmp_path / "out" / hf.WEIGHTS)
    weights["model.layers.3.embed_tokens.weight"] = weights["model.embed_tokens.weight"]  # as the release holds
    from safetensors.numpy import save_file

    save_file(weights, tmp_path / "out" / hf.WEIGHTS)
    ours = {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    back = hf.load_hf(tmp_path / "out")
    assert back.cfg.mtp_depth == 1
    for path, value in nnx.to_flat_state(nnx.state(back, nnx.Param)):
        np.testing.assert_array_equal(np.asarray(value[...]), ours[".".join(map(str, path))])
    scanned = hf.load_hf(tmp_path / "out", scan_layers=True)
    np.testing.assert_array_equal(np.asarray(scanned.mtp[0].eh_proj[...]), ours["mtp.0.eh_proj"])
