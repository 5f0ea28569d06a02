"""Sharded training on 8 virtual CPU devices and on two real processes equals the 1-device run.

The checks run tests/sharded_worker.py in processes of their own, since the device count
is fixed when JAX starts.
"""

import json
import socket

import pytest
from processes import communicate
from processes import sharded_worker as worker

# float32, 5 steps: sharding changes only the order of reductions.
LOSS_RTOL, PARAM_RTOL = 1e-5, 1e-5
MODES = ["decoder_only", "encoder_decoder", "encoder_only"]
# Data parallelism and FSDP alone, and FSDP with tensor parallelism (data x tensor lays the batch
# and the tensor axis out as FSDP x tensor does: that 2-D case is run once), also with the chunked loss
# (against the plain loss on one device), and context parallelism beside data, and beside FSDP with the
# chunked loss over the split length.
STRATEGIES = ["dp8", "fsdp8", "fsdp4_tp2", "dp2_cp4", "fsdp2_cp4_chunked", "tp2_cp4_chunked"]


def result(proc) -> dict:
    """The JSON line the worker printed (None if it printed none), after it exits cleanly."""
    out, err = communicate(proc, f"tests/sharded_worker.py {' '.join(proc.args[2:])}")
    assert proc.returncode == 0, err[-4000:]
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def hf_checkpoint(directory):
    """A tiny Llama saved by `save_hf` in several safetensors shards with an index, in `directory`."""
    import jaxformer as jf
    from jaxformer.interop import hf

    cfg = jf.llama(vocab_size=64, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64, max_len=32, num_decoder_layers=2)
    return hf.save_hf(jf.build_model(cfg), directory, max_shard_bytes=8_000)


@pytest.fixture(scope="module")
def strategies(tmp_path_factory):
    """One worker per mode, run side by side (compilation dominates their time). Each also runs what
    would otherwise take a process of its own (seconds of imports before any work): decoder_only the
    remesh check on its state trained under FSDP=8, the Hugging Face checkpoint's load onto a mesh
    and the one-process side of the two-process test's data and pipeline; encoder_only (it generates
    nothing) the MoE check; encoder_decoder the pipelines and latent attention."""
    hf_dir, remesh = hf_checkpoint(tmp_path_factory.mktemp("hf")), tmp_path_factory.mktemp("remesh")
    more = {
        "decoder_only": ["remesh", remesh, "hf", hf_dir, "singlehost", tmp_path_factory.mktemp("cache1")],
        "encoder_only": ["moe"],
        "encoder_decoder": ["pipeline", tmp_path_factory.mktemp("restage"), "mla"],
    }
    procs = [worker("strategies", mode, *more.get(mode, [])) for mode in MODES]
    merged = {"strategies": {}, "errors": {}, "hf_dir": hf_dir}
    try:
        for proc in procs:
            r = result(proc)
            merged["strategies"].update(r["strategies"])
            merged["errors"].update(r["errors"])
            merged.update({k: r[k] for k in ("moe", "pipeline", "mla", "hf", "singlehost") if k in r})
    finally:
        for p in procs:  # never leave a worker behind
            if p.poll() is None:
                p.kill()
                p.communicate()
    return merged


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mode", MODES)
def test_sharded_training_equals_one_device(strategies, mode, strategy):
    r = strategies["strategies"][f"{mode}/{strategy}"]
    assert r["loss_rel"] < LOSS_RTOL, r
    assert r["param_rel"] < PARAM_RTOL, r
    assert r["sharding_mismatches"] == [], "every array sharded as the rules table says"
    mesh = r["mesh"]
    shares = [mesh["data"] * mesh["fsdp"] * mesh["expert"], mesh["tensor"], mesh["context"]]
    assert r["shard_counts"] == shares, "the shares a device holds"
    assert (r["ring_permutes"] > 0) == ("cp" in strategy), "ring attention where the sequence is split"


@pytest.mark.parametrize("strategy", ["dp8", "fsdp4_tp2", "dp2_cp4"])
@pytest.mark.parametrize("mode", ["decoder_only", "encoder_decoder"])
def test_sharded_generation_equals_one_device(strategies, mode, strategy):
    """Beam search (2 beams, 8 prompts of 1-5 tokens) with the parameters trained on the mesh, run on
    the mesh, vs those trained on one device, run there (the two agree to 1e-5, see above); with a
    context axis, the prompts (sources) are split by position and so are the caches the beams reorder."""
    r = strategies["strategies"][f"{mode}/{strategy}"]["generation"]
    assert r["tokens_equal"], r
    assert r["score_diff"] < 1e-4, r


@pytest.mark.parametrize("mode", MODES)
def test_fsdp_splits_parameters_and_optimizer_state(strategies, mode):
    fractions = strategies["strategies"][f"{mode}/fsdp8"]["max_device_fraction"]
    # 1/8 of the bytes, plus the few small arrays FSDP leaves replicated (head-shaped biases).
    assert fractions["params"] < 0.16 and fractions["opt_state"] < 0.16, fractions
    assert strategies["strategies"][f"{mode}/dp8"]["max_device_fraction"]["params"] == 1.0


def test_mesh_errors_name_what_is_wrong(strategies):
    e = strategies["errors"]
    assert "data=3, fsdp=2, tensor=1 makes 6 devices, but 8 are available" in e["mesh_size"]
    assert (
        "['embedding'].value has a dimension of 36 that mesh axes ('fsdp',) (size 8) do not divide"
        in e["not_divisible"]
    )
    assert "logical axis 'embed' maps to both 'fsdp' and 'tensor'" in e["conflict"]
    assert "batch_size=12 does not divide over the 8 batch shards" in e["batch"]


def test_expert_parallel_moe_equals_one_device(strategies):
    """MoE layers with their experts split over `mesh.expert` (8 devices), both dispatches in the
    explicit all-to-all `shard_map` of `moe.*_expert_parallel`, beside data, FSDP, FSDP with tensor
    parallelism and context parallelism: the first batch's loss and gradients of one device. The
    data x expert dropless case routes as DeepSeek-V3 (sigmoid, groups): its expert loads, the global
    counts the balance bias follows, equal one device's."""
    r = strategies["moe"]
    for name in ("capacity", "capacity_data", "dropless", "dropless_fsdp_tensor", "capacity_context"):
        assert r[name]["loss_rel"] < LOSS_RTOL, (name, r[name]["loss_rel"])
        assert r[name]["load_equal"], name
        worst = max(r[name]["grad_rel"].items(), key=lambda kv: kv[1])
        assert worst[1] < PARAM_RTOL, (name, worst)
        # Each MoE layer's dispatch and combine are all-to-alls over the expert axis, forward and
        # backward (dropless: one more forward, the pair counts each device sends).
        assert r[name]["all_to_all"] >= 4, (name, r[name]["all_to_all"])
    specs = r["capacity"]["specs"]
    wi = next(v for k, v in specs.items() if k.endswith("ffn']['wi'].value") or k.endswith("ffn.wi"))
    assert wi.startswith("('expert', 'fsdp'"), specs  # [E, D, F]: experts over `expert`, D over `fsdp`


def test_latent_attention_sharded_equals_one_device(strategies):
    """Latent attention (`model.mla`) on fsdp=4 x tensor=2: the first batch's loss and gradients equal
    one device's; the up-projections [C, H, K] split C over fsdp and heads over tensor, the
    down-projections [D, C + R] split D over fsdp."""
    r = strategies["mla"]
    assert r["loss_rel"] < LOSS_RTOL, r["loss_rel"]
    worst = max(r["grad_rel"].items(), key=lambda kv: kv[1])
    assert worst[1] < PARAM_RTOL, worst
    spec = lambda name: next(v for k, v in r["specs"].items() if f"'{name}'" in k or k.endswith(f".{name}"))
    assert spec("kv_up").startswith("('fsdp', 'tensor'") and spec("q_up").startswith("('fsdp', 'tensor'"), r["specs"]
    assert spec("kv_down").startswith("('fsdp',") and spec("out").startswith("('tensor', None, 'fsdp'"), r["specs"]


@pytest.mark.parametrize(
    "name", ["decoder_only/gpipe_dp4", "decoder_only/interleaved_fsdp2_tp2", "decoder_only/1f1b_dp4"]
)
def test_pipeline_equals_one_device(strategies, name):
    """A 4-layer decoder pipelined over 2 stages, 2 micro-batches: GPipe (2 layers a stage) beside
    data=4, interleaved (2 chunks of 1 layer a stage) beside fsdp=2 x tensor=2, 1F1B (its backward
    written out, not autodiff's) beside data=4. The first batch's loss and gradients equal one device's
    accumulating the same micro-batches; the activations move between stages by collective permutes; a
    device holds its stage's layers only. (The other modes, and 1F1B's memory against GPipe's at 8
    micro-batches: scripts/pipeline_check.py, scripts/pipeline_memory.py.)"""
    r = strategies["pipeline"][name]
    assert r["loss_rel"] < LOSS_RTOL, r
    assert r["rel"] < PARAM_RTOL, r
    assert r["permutes"] > 0, r
    if name.endswith("dp4"):  # the stack's layers split over the 2 stages; embeddings and head on both
        assert r["params_fraction"] < 0.7, r


def test_pipelined_checkpoint_restores_without_stages_and_back(strategies):
    """The pipelined state of decoder_only/gpipe_dp4 (layers split over stage, 8 devices), saved,
    restored onto one device without stages: the same values, laid out as that mesh asks (orbax
    reshards); that state saved from one device and restored onto stage=2 x data=4: the same again."""
    r = strategies["pipeline"]["restore"]["without_stages"]
    assert r["equal"] and r["shardings_as_requested"] and r["devices"] == [0], r
    r = strategies["pipeline"]["restore"]["back"]
    assert r["equal"] and r["shardings_as_requested"] and r["devices"] == list(range(8)), r


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_equal_one_process(strategies, tmp_path):
    """Two real processes (4 CPU devices each, gloo), each feeding half of every batch: the training of
    one device (the fixture's encoder_decoder reference: the same config, one device), and through the
    data loader disjoint rows whose union is the batch one process with 8 devices reads. A pipeline over
    stage=2 x data=4, a stage a process: the first batch's loss and gradients of the same pipeline in one
    process. (The one-process sides: the fixture's decoder_only worker.)"""
    port = free_port()
    procs = [worker("multihost", pid, port, tmp_path / "cache", devices=4) for pid in (0, 1)]
    try:
        two = result(procs[0])
        other = result(procs[1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    one = strategies["strategies"]["encoder_decoder/one_device"] | strategies["singlehost"]
    for a, b in zip(two["losses"], one["losses"], strict=True):
        assert a == pytest.approx(b, rel=LOSS_RTOL)
    assert two["checksum"] == pytest.approx(one["checksum"], rel=PARAM_RTOL)
    piped, whole = two["pipelined"], one["pipelined"]
    assert piped["permutes"] > 0 and piped["loss"] == pytest.approx(whole["loss"], rel=LOSS_RTOL)
    for k, sums in whole["grads"].items():
        assert piped["grads"][k] == pytest.approx(sums, rel=PARAM_RTOL, abs=1e-7), k
    for objective, whole in one["data"].items():
        halves = two["data"][objective], other["data"][objective]
        for i, rows in enumerate(whole["rows"]):
            assert not set(halves[0]["rows"][i]) & set(halves[1]["rows"][i])
            assert sorted(halves[0]["rows"][i] + halves[1]["rows"][i]) == sorted(rows)
        for step, arrays in whole["arrays"].items():
            for k, v in arrays.items():
                assert halves[0]["arrays"][step][k] + halves[1]["arrays"][step][k] == v, (objective, step, k)


def test_checkpoint_restores_onto_another_mesh(strategies):
    """decoder_only's state trained under FSDP=8 (by the fixture's worker), saved, restored on DP=4 and on 1."""
    r = strategies["strategies"]["remesh"]
    assert r["dp4"]["equal"] and r["dp4"]["shardings_as_requested"] and r["dp4"]["devices"] == [0, 1, 2, 3]
    assert r["one"]["equal"] and r["one"]["shardings_as_requested"] and r["one"]["devices"] == [0]


def test_hf_checkpoint_loads_onto_a_mesh(strategies):
    """A checkpoint in several safetensors shards with an index, loaded onto FSDP=4 x TP=2 over
    8 devices tensor by tensor, unrolled and scanned (each stack filled layer by layer on the
    mesh), by the fixture's decoder_only worker: the logits of one device, parameters split as the
    rules say."""
    from jaxformer.interop import hf

    directory = strategies["hf_dir"]
    index = json.loads((directory / hf.INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 3 and not (directory / hf.WEIGHTS).exists()
    r = strategies["hf"]
    unrolled, scanned = r["unrolled"], r["scanned"]
    assert unrolled["max_abs_diff"] < 1e-5 and scanned["max_abs_diff"] < 1e-5
    assert unrolled["devices"] == scanned["devices"] == list(range(8))
    assert unrolled["specs"]["decoder.stack.layers.0.self_attn.q"] == "('fsdp', 'tensor')"  # [D, H, K]: K whole
    assert unrolled["specs"]["decoder.stack.layers.0.ffn.wo"] == "('tensor', 'fsdp')"  # [F, D]
    assert scanned["specs"]["decoder.stack.layers.self_attn.q"] == "(None, 'fsdp', 'tensor')"  # [L, D, H, K]
    assert scanned["specs"]["decoder.stack.layers.ffn.wo"] == "(None, 'tensor', 'fsdp')"  # [L, F, D]
