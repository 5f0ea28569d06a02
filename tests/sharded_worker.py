"""Sharded training in a process of its own (XLA_FLAGS must be set before JAX starts).

    python tests/sharded_worker.py strategies MODE [remesh DIR] [moe] [pipeline DIR] [mla] [hf DIR] [singlehost DIR]
                                                           # 8 devices: vs 1 device
    python tests/sharded_worker.py multihost PID PORT DIR  # one of two processes, 4 devices each (and stage x data)
    python tests/sharded_worker.py hf DIR                  # a Hugging Face checkpoint loaded onto FSDP=4 x TP=2
    python tests/sharded_worker.py moe                     # MoE loss and gradients, experts split, vs 1 device

`strategies` trains and generates with each strategy, and runs in the same process (a worker process
costs seconds of imports before any work) the tasks named after the mode: `remesh DIR` (decoder_only:
its FSDP=8 state saved to DIR, restored on DP=4 and on 1 device), `moe`, `pipeline DIR` (the pipelined
schedules of every mode, a pipelined state saved to DIR and restored without stages), `mla` (latent
attention on fsdp=4 x tensor=2), `hf DIR` (the Hugging Face checkpoint in DIR loaded onto a mesh) and
`singlehost DIR` (the one-process side of `multihost`'s data, DIR its cache, and pipeline). Its
one-device training of encoder_decoder is the other side of `multihost`'s training.
    python tests/sharded_worker.py hf_moe GOLDEN           # Mixtral, Switch loaded onto fsdp=2 x expert=4
    python tests/sharded_worker.py hf_families GOLDEN      # the new families onto fsdp=2 x tensor=2 x expert=2

Prints one JSON line of results for tests/test_sharding.py (hf_moe: tests/test_interop_moe.py, hf_families:
tests/test_interop_families.py) to check.
"""

from __future__ import annotations

import gc
import json
import sys

import jax
import numpy as np

STEPS, B, T = 5, 8, 8
STRATEGIES = {  # (data, fsdp, tensor[, context[, train.loss_chunk]])
    "dp8": (8, 1, 1),
    "fsdp8": (1, 8, 1),
    "fsdp4_tp2": (1, 4, 2),
    "dp2_cp4": (2, 1, 1, 4),  # each row's 8 positions split 4 ways, ring attention
    # the loss in chunks of 4 tokens a device (its 4 rows x 1 of its 2 positions): 2 chunks of a split length
    "fsdp2_cp4_chunked": (1, 2, 1, 4, 4),
    # tensor parallelism beside the split length (heads and vocabulary over `tensor`), the loss in chunks of
    # 8 tokens a device (its 8 rows x 1 of its 2 positions, half the vocabulary): split both ways
    "tp2_cp4_chunked": (1, 1, 2, 4, 8),
}
# decoding under a mesh: batch over 8 devices; FSDP with tensor parallelism; caches split by position
GENERATE = ("dp8", "fsdp4_tp2", "dp2_cp4")


def config(mode: str, mesh: tuple[int, ...]):
    from jaxformer import config as C

    objective = {"decoder_only": "lm", "encoder_decoder": "seq2seq", "encoder_only": "mlm"}[mode]
    # d_model, heads, ff and vocab all divide by 8 so every strategy can split them.
    model = C.tiny(mode, vocab_size=64, d_model=32, num_heads=4, d_ff=64, dropout_rate=0.1, check_token_ids=False)
    model = model.replace(  # one layer per stack: the layers are alike, compile time is not
        num_encoder_layers=min(model.num_encoder_layers, 1), num_decoder_layers=min(model.num_decoder_layers, 1)
    )
    data, fsdp, tensor, context, chunk = (*mesh, *(1, 1, 1, 1, None)[len(mesh) :])
    chunking = {"loss_chunk": chunk} if chunk else {}  # else "auto": the plain loss at these sizes
    return C.Config(
        model=model,
        data=C.DataConfig(max_len=T),
        train=C.TrainConfig(objective=objective, batch_size=B, learning_rate=1e-2, warmup_steps=1, **chunking),
        mesh=C.MeshConfig(data=data, fsdp=fsdp, tensor=tensor, context=context),
    )


def batches(mode: str) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(STEPS):
        ids = lambda: rng.integers(1, 64, (B, T)).astype(np.int32)
        batch = {"inputs": ids(), "targets": ids(), "weights": np.ones((B, T), np.float32)}
        if mode == "encoder_decoder":
            batch["src"] = ids()
        out.append(batch)
    return out


def train(cfg, devices=None) -> tuple[list[float], object, object, object]:
    from jaxformer import sharding
    from jaxformer.state import init_state
    from jaxformer.train import jit_steps, make_steps

    mesh = sharding.make_mesh(cfg.mesh, devices)
    with sharding.use(mesh, sharding.rules_for(cfg.mesh)):
        graphdef, state, optimizer = init_state(cfg, mesh)
        train_step, _ = jit_steps(*make_steps(graphdef, cfg, optimizer), state, mesh)
        rows = sharding.process_rows(B, mesh)
        losses = []
        for batch in batches(cfg.model.mode):
            local = {k: v[rows] for k, v in batch.items()}  # each process feeds only its rows
            global_batch = sharding.global_batch(local, mesh, B)
            if not losses:  # compiled once, the program's collectives counted
                lowered = train_step.lower(state, global_batch)
                step = lowered.compile()
                # key/value blocks passed around the context axis's ring (0 without one)
                train.ring_permutes = lowered.as_text().count("collective_permute")
                # the partitioned program's permutes: the pipeline's activations moving stage to stage
                train.permutes = step.as_text().count(" collective-permute")
                train.all_to_all = step.as_text().count(" all-to-all(")  # the partitioned program's
            state, metrics = step(state, global_batch)
            losses.append(float(metrics["loss"]))
    return losses, state, mesh, graphdef


def first_gradients(cfg, devices=None) -> dict:
    """The first batch's mean loss and its gradients at the initial parameters (gathered), the
    parameters' specs and the all-to-alls in the compiled (partitioned) program. Gradients, not
    parameters after Adam's steps: Adam turns rounding noise on near-zero gradient entries into
    lr-sized moves, which no two reduction orders reproduce."""
    from flax import nnx

    from jaxformer import pipeline, sharding
    from jaxformer.state import init_state
    from jaxformer.train import loss_sums

    mesh = sharding.make_mesh(cfg.mesh, devices)
    with sharding.use(mesh, sharding.rules_for(cfg.mesh)):
        graphdef, state, _ = init_state(cfg, mesh)
        batch = sharding.global_batch(batches(cfg.model.mode)[0], mesh, B)

        def mean_loss(params):  # as the steps trace it: pipelined where the mesh has stages
            with pipeline.schedule(cfg.train.grad_accum, cfg.mesh.virtual_stages, cfg.mesh.schedule):
                loss, sums = loss_sums(nnx.merge(graphdef, params), cfg.train, batch, None)
            return loss / sums["count"], sums.get("moe_load", np.zeros(()))  # MoE: the loads balancing reads

        step = jax.jit(jax.value_and_grad(mean_loss, has_aux=True)).lower(state.params).compile()
        (loss, load), grads = step(state.params)
        specs = {
            jax.tree_util.keystr(p): str(tuple(x.sharding.spec))
            for p, x in jax.tree_util.tree_leaves_with_path(state.params)
        }
    return {
        "loss": float(loss),
        "load": np.asarray(load),
        "grads": gathered(grads),
        "specs": specs,
        "all_to_all": step.as_text().count(" all-to-all("),
        "permutes": step.as_text().count(" collective-permute"),
        "state": state,
    }


def generated(cfg, graphdef, state, mesh) -> dict | None:
    """Beam search (2 beams, both returned) from the trained model under its mesh: the batch and
    the KV cache sharded like activations, the beams reordered across shards at every step."""
    from flax import nnx

    from jaxformer import decode, sharding
    from jaxformer.config import DecodeConfig

    if cfg.model.mode == "encoder_only":
        return None
    settings = DecodeConfig(strategy="beam", beam_size=2, num_return=2, max_new_tokens=4, extra_len=2)
    rng = np.random.default_rng(1)
    rows = [rng.integers(3, 64, n).tolist() for n in (3, 5, 2, 4, 4, 1, 3, 5)]  # B=8: a row per data shard
    with sharding.use(mesh, sharding.rules_for(cfg.mesh)):
        model = nnx.merge(graphdef, state.params)
        if cfg.model.mode == "decoder_only":
            out = decode.generate(model, rows, settings, eos_id=2)
        else:
            out = decode.translate(model, rows, settings, bos_id=1, eos_id=2)
    return {"tokens": out.tokens.tolist(), "scores": out.scores.tolist()}


def pipelined_gradients() -> dict:
    """The first batch's loss and gradients of a 2-layer decoder over stage=2 x data=4 (GPipe, 2
    micro-batches), each gradient as its sum and its dot with fixed random numbers: where two processes
    hold 4 devices each, the stages lie one a process, so the activations cross between them."""
    got = first_gradients(pipeline_config("decoder_only", 2, stage=2, data=4))
    rng = np.random.default_rng(0)
    sums = {
        k: [float(g.sum()), float((g * rng.standard_normal(g.shape)).sum())] for k, g in sorted(got["grads"].items())
    }
    return {"loss": got["loss"], "grads": sums, "permutes": got["permutes"]}


def gathered(tree) -> dict:
    """{path: the whole array} of `tree`'s leaves. Arrays that span processes are replicated by one
    program for the whole tree, where `multihost_utils.process_allgather` compiles one a leaf."""
    from jax.sharding import PartitionSpec

    paths, leaves = zip(*jax.tree_util.tree_leaves_with_path(tree), strict=True)
    if any(not x.is_fully_addressable for x in leaves):
        replicated = [x.sharding.update(spec=PartitionSpec()) for x in leaves]
        leaves = [x.addressable_data(0) for x in jax.jit(lambda xs: xs, out_shardings=replicated)(list(leaves))]
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in zip(paths, leaves, strict=True)}


def checksum(params: dict) -> float:
    """The sum of every gathered parameter's magnitudes, the key bias left out (see strategies)."""
    return float(sum(np.abs(v).sum() for k, v in params.items() if "k_bias" not in k))


def strategies(mode: str, remesh_dir: str | None = None) -> dict:
    from jaxformer import sharding

    results = {}
    ref_cfg = config(mode, (1, 1, 1))
    ref_losses, ref_state, ref_mesh, graphdef = train(ref_cfg, jax.devices()[:1])
    ref_params = gathered(ref_state.params)
    # the one-process side of `multihost`'s training (encoder_decoder's config, on one device)
    results[f"{mode}/one_device"] = {"losses": ref_losses, "checksum": checksum(ref_params)}
    ref_out = generated(ref_cfg, graphdef, ref_state, ref_mesh)
    for name, shape in STRATEGIES.items():
        cfg = config(mode, shape)
        losses, state, mesh, graphdef = train(cfg)
        params = gathered(state.params)
        # The key bias is left out: its gradient is exactly zero in exact arithmetic (q.b is
        # the same for every key, and softmax ignores it), so Adam turns rounding noise into
        # lr-sized steps that no two reduction orders reproduce.
        rel = max(
            float(np.max(np.abs(params[k] - ref_params[k])) / (np.max(np.abs(ref_params[k])) + 1e-12))
            for k in ref_params
            if "k_bias" not in k
        )
        entry = {
            "loss_rel": float(np.max(np.abs(np.array(losses) - ref_losses) / np.abs(ref_losses))),
            "param_rel": rel,
            "ring_permutes": train.ring_permutes,
        }
        # Actual shardings against the rules table.
        with sharding.use(mesh, sharding.rules_for(cfg.mesh)):
            expected = sharding.state_shardings(jax.eval_shape(lambda s=state: s), mesh)
            entry["shard_counts"] = sharding.shard_counts(("batch", "vocab", "length"))  # as the loss sizes chunks
        entry["mesh"] = dict(mesh.shape)
        entry["sharding_mismatches"] = [
            jax.tree_util.keystr(p)
            for (p, x), want in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(expected), strict=True)
            if not x.sharding.is_equivalent_to(want, x.ndim)
        ]
        # Bytes each device holds of the parameters and optimizer state.
        per_device = {}
        for tree_name, tree in (("params", state.params), ("opt_state", state.opt_state)):
            total = sum(x.nbytes for x in jax.tree.leaves(tree))
            held = [0] * len(jax.devices())
            for x in jax.tree.leaves(tree):
                for shard in x.addressable_shards:
                    held[shard.device.id] += shard.data.nbytes
            per_device[tree_name] = max(held) / total
        entry["max_device_fraction"] = per_device
        if ref_out is not None and name in GENERATE:  # the sharded model's beams: same tokens, scores to rounding
            out = generated(cfg, graphdef, state, mesh)
            entry["generation"] = {
                "tokens_equal": out["tokens"] == ref_out["tokens"],
                "score_diff": float(np.max(np.abs(np.subtract(out["scores"], ref_out["scores"])))),
            }
        results[f"{mode}/{name}"] = entry
        if remesh_dir is not None and mode == "decoder_only" and name == "fsdp8":  # its trained state, saved
            results["remesh"] = remesh(remesh_dir, state)
    return results


def moe() -> dict:
    """A decoder with MoE layers (4 experts, both dispatches) trained on 1 device, and over 8 with the
    experts split (expert=4 beside fsdp or data; expert=2 beside fsdp and tensor; expert=4 beside
    context), the tokens exchanged by the explicit all-to-all of `moe.*_expert_parallel`."""
    import dataclasses

    from jaxformer import config as C

    # DeepSeek-V3's router (sigmoid scores, 2 groups of 2, one chosen) on the data x expert dropless case:
    # its loads, which the balance bias follows, counted over the shards equal one device's
    deepseek = dict(router="sigmoid_topk", num_groups=2, groups_per_token=1, routed_scaling=2.5, balance_rate=1e-3)
    results, refs = {}, {}
    for name, capacity_factor, mesh, routing in (
        ("capacity", 1.0, dict(fsdp=2, expert=4), {}),
        ("capacity_data", 1.0, dict(data=2, expert=4), {}),
        ("dropless", 0.0, dict(data=2, expert=4), deepseek),
        ("dropless_fsdp_tensor", 0.0, dict(fsdp=2, expert=2, tensor=2), {}),  # hidden width split, partial sums
        ("capacity_context", 1.0, dict(data=1, expert=4, context=2), {}),  # each row's positions split 2 ways
    ):
        base = config("decoder_only", (1, 1, 1))
        moe_cfg = C.MoEConfig(num_experts=4, experts_per_token=2, capacity_factor=capacity_factor,
                              z_loss_weight=1e-3, aux_loss_weight=1e-2, **routing)  # fmt: skip
        base = dataclasses.replace(base, model=base.model.replace(dropout_rate=0.0, moe=moe_cfg))
        key = (capacity_factor, bool(routing))
        if key not in refs:  # one device's run, once per dispatch and router
            refs[key] = first_gradients(base, jax.devices()[:1])
        ref, got = refs[key], first_gradients(dataclasses.replace(base, mesh=C.MeshConfig(**mesh)))
        results[name] = {
            "load_equal": bool(np.array_equal(got["load"], ref["load"])),
            "loss_rel": abs(got["loss"] - ref["loss"]) / abs(ref["loss"]),
            "grad_rel": {  # the key bias is left out (see strategies)
                k: float(np.max(np.abs(g - ref["grads"][k])) / (np.max(np.abs(ref["grads"][k])) + 1e-12))
                for k, g in got["grads"].items()
                if "k_bias" not in k
            },
            "specs": got["specs"],
            "all_to_all": got["all_to_all"],
        }
    return results


def mla() -> dict:
    """A decoder with latent attention (`model.mla`, queries compressed too) on fsdp=4 x tensor=2 against
    one device: the first batch's loss and gradients, and the specs the rules gave its projections."""
    import dataclasses

    from jaxformer import config as C

    base = config("decoder_only", (1, 1, 1))
    mla_cfg = C.MLAConfig(kv_lora_rank=16, q_lora_rank=16, rope_head_dim=4, nope_head_dim=8, v_head_dim=8)
    model = base.model.replace(dropout_rate=0.0, position="rope", use_bias=False, mla=mla_cfg)
    base = dataclasses.replace(base, model=model)
    ref = first_gradients(base, jax.devices()[:1])
    got = first_gradients(dataclasses.replace(base, mesh=C.MeshConfig(fsdp=4, tensor=2)))
    return {
        "loss_rel": abs(got["loss"] - ref["loss"]) / abs(ref["loss"]),
        "grad_rel": {
            k: float(np.max(np.abs(g - ref["grads"][k])) / (np.max(np.abs(ref["grads"][k])) + 1e-12))
            for k, g in got["grads"].items()
        },
        "specs": {k: v for k, v in got["specs"].items() if "self_attn" in k},
    }


# A 4-layer decoder pipelined over 2 stages, 2 micro-batches (each compile costs seconds, so three cases
# cover the three schedules and the two compositions; scripts/pipeline_check.py runs every mode): GPipe
# (2 layers a stage) beside data, interleaved (2 chunks of 1 layer a stage) beside FSDP and tensor
# parallelism, 1F1B beside data.
PIPELINES = {  # name: (mode, layers, stage, virtual_stages, data, fsdp, tensor, schedule)
    "decoder_only/gpipe_dp4": ("decoder_only", 4, 2, 1, 4, 1, 1, "gpipe"),
    "decoder_only/interleaved_fsdp2_tp2": ("decoder_only", 4, 2, 2, 1, 2, 2, "gpipe"),
    "decoder_only/1f1b_dp4": ("decoder_only", 4, 2, 1, 4, 1, 1, "1f1b"),
}


def pipeline_config(mode: str, num_layers: int, stage=1, virtual_stages=1, data=1, fsdp=1, tensor=1, schedule="gpipe"):
    """`config(mode)` with `num_layers` scanned layers a stack, no dropout (a pipeline draws its masks
    per micro-batch), 2 micro-batches (train.grad_accum), on the mesh given."""
    import dataclasses

    from jaxformer import config as C

    cfg = config(mode, (1, 1, 1))
    layers = {n: num_layers if getattr(cfg.model, n) else 0 for n in ("num_encoder_layers", "num_decoder_layers")}
    return dataclasses.replace(
        cfg,
        model=cfg.model.replace(scan_layers=True, dropout_rate=0.0, **layers),
        train=dataclasses.replace(cfg.train, grad_accum=2),
        mesh=C.MeshConfig(
            stage=stage, virtual_stages=virtual_stages, data=data, fsdp=fsdp, tensor=tensor, schedule=schedule
        ),
    )


def pipelines(remesh_dir: str) -> dict:
    """PIPELINES against one device accumulating the same 2 micro-batches: the first batch's loss and
    gradients, the collective permutes of the compiled program, the largest share of the parameters'
    bytes a device holds; the GPipe case's state saved and restored onto one device without stages."""
    rel = lambda got, ref: {  # the key bias is left out (see strategies)
        k: float(np.max(np.abs(got[k] - ref[k])) / (np.max(np.abs(ref[k])) + 1e-12)) for k in ref if "k_bias" not in k
    }
    ref = first_gradients(pipeline_config("decoder_only", 4), jax.devices()[:1])
    results = {}
    for name, (mode, layers, *mesh) in PIPELINES.items():
        cfg = pipeline_config(mode, layers, *mesh)
        got = first_gradients(cfg)
        state = got.pop("state")
        held = [0] * len(jax.devices())
        for x in jax.tree.leaves(state.params):
            for shard in x.addressable_shards:
                held[shard.device.id] += shard.data.nbytes
        results[name] = {
            "loss_rel": abs(got["loss"] - ref["loss"]) / abs(ref["loss"]),
            "rel": max(rel(got["grads"], ref["grads"]).values()),
            "permutes": got["permutes"],
            "params_fraction": max(held) / sum(x.nbytes for x in jax.tree.leaves(state.params)),
        }
        if name == "decoder_only/gpipe_dp4":
            results["restore"] = restore_without_stages(remesh_dir, cfg, state, ref["state"])
    return results


def restore_without_stages(directory: str, cfg, state, like) -> dict:
    """`state` (layers split over stage), changed so that no initialisation gives it, saved and
    restored into `like`: the same state on one device, without stages (nothing more to compile);
    that state changed again, saved and restored into `state`'s layout: back onto the stages."""
    from jaxformer.checkpoint import Checkpointer

    saved = jax.jit(lambda s: jax.tree.map(lambda x: x * 2 + 1, s))(state)  # one program, shardings kept
    ckpt = Checkpointer(directory, cfg)
    ckpt.save(saved)
    ckpt.wait()
    restored = ckpt.restore_latest(like)
    ckpt.close()
    # and back: the one-device state, changed again, saved and restored onto the pipelined mesh
    unstaged = jax.jit(lambda s: jax.tree.map(lambda x: x * 3 - 1, s))(restored)
    ckpt = Checkpointer(f"{directory}/back", cfg)
    ckpt.save(unstaged)
    ckpt.wait()
    staged = ckpt.restore_latest(state)
    ckpt.close()

    def same(got, want, requested) -> dict:  # got's values are want's; laid out as requested
        values, wanted = gathered(got), gathered(want)
        return {
            "equal": all(np.array_equal(values[k], wanted[k]) for k in wanted),
            "devices": sorted({d.id for x in jax.tree.leaves(got) for d in x.sharding.device_set}),
            "shardings_as_requested": all(
                x.sharding.is_equivalent_to(y.sharding, x.ndim)
                for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(requested), strict=True)
            ),
        }

    return {"without_stages": same(restored, saved, like), "back": same(staged, unstaged, state)}


def errors() -> dict:
    from jaxformer import config as C
    from jaxformer import sharding
    from jaxformer.config import ConfigError

    out = {}
    for key, fn in {
        "mesh_size": lambda: sharding.make_mesh(C.MeshConfig(data=3, fsdp=2)),
        "not_divisible": lambda: train(config("decoder_only", (1, 8, 1)).__class__(
            model=config("decoder_only", (1, 8, 1)).model.replace(d_model=36, num_heads=4, head_dim=8),
            data=C.DataConfig(max_len=T), train=C.TrainConfig(batch_size=B), mesh=C.MeshConfig(data=1, fsdp=8),
        )),
        "conflict": lambda: sharding.rules_for(C.MeshConfig(custom_rules=(("embed", "fsdp"), ("embed", "tensor")))),
        "batch": lambda: sharding.process_rows(12, sharding.make_mesh(C.MeshConfig(data=8))),
    }.items():  # fmt: skip
        try:
            fn()
            out[key] = None
        except ConfigError as e:
            out[key] = str(e)
    return out


def remesh(directory: str, state) -> dict:
    """A checkpoint written under FSDP over 8 devices (`state`, trained by `strategies`) restores onto
    DP over 4 and onto 1 device."""
    from jaxformer import sharding
    from jaxformer.checkpoint import Checkpointer
    from jaxformer.state import init_state

    cfg = config("decoder_only", (1, 8, 1))
    saved = gathered(state)
    ckpt = Checkpointer(directory, cfg)
    ckpt.save(state)
    ckpt.wait()
    out = {}
    for name, (mesh_shape, devices) in {
        "dp4": ((4, 1, 1), jax.devices()[:4]),
        "one": ((1, 1, 1), jax.devices()[:1]),
    }.items():
        target = config("decoder_only", mesh_shape)
        mesh = sharding.make_mesh(target.mesh, devices)
        with sharding.use(mesh, sharding.rules_for(target.mesh)):
            _, like, _ = init_state(target, mesh)
        restored = ckpt.restore_latest(like)
        values = gathered(restored)
        out[name] = {
            "equal": all(np.array_equal(values[k], saved[k]) for k in saved),
            "devices": sorted({d.id for x in jax.tree.leaves(restored) for d in x.sharding.device_set}),
            "shardings_as_requested": all(
                x.sharding.is_equivalent_to(y.sharding, x.ndim)
                for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(like), strict=True)
            ),
        }
    ckpt.close()
    return out


def hf_sharded(directory: str) -> dict:
    """A (sharded) Hugging Face checkpoint loaded straight onto an FSDP=4 x TP=2 mesh, unrolled and
    scanned: its logits against the same checkpoint loaded onto one device, and where its
    parameters landed."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxformer import sharding
    from jaxformer.config import MeshConfig
    from jaxformer.interop.hf import load_hf

    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (8, 12)), jnp.int32)
    reference = load_hf(directory)(ids)
    mesh_cfg = MeshConfig(data=1, fsdp=4, tensor=2)
    mesh = sharding.make_mesh(mesh_cfg)
    out = {}
    for name, scan in (("unrolled", False), ("scanned", True)):  # scanned: stacks filled layer by layer on the mesh
        with sharding.use(mesh, sharding.rules_for(mesh_cfg)):
            model = load_hf(directory, mesh=mesh, scan_layers=scan)
            logits = nnx.jit(lambda model, ids: model(ids))(model, ids)
        params = {".".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
        out[name] = {
            "max_abs_diff": float(jnp.abs(logits - reference).max()),
            "specs": {k: str(tuple(v.sharding.spec)) for k, v in params.items()},
            "devices": sorted({d.id for v in params.values() for d in v.sharding.device_set}),
        }
    return out


def hf_moe_sharded(golden: str) -> dict:
    """The golden Mixtral and Switch checkpoints (unrolled and scanned) loaded straight onto an
    fsdp=2 x expert=4 mesh: Mixtral's logits against transformers' (the golden file), every
    parameter against the same checkpoint loaded onto one device, and where the experts landed."""
    import pathlib

    import jax.numpy as jnp
    from flax import nnx

    from jaxformer import sharding
    from jaxformer.config import MeshConfig
    from jaxformer.interop.hf import load_hf

    def flat(model):
        return {".".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}

    mesh_cfg = MeshConfig(fsdp=2, expert=4)
    mesh = sharding.make_mesh(mesh_cfg)
    out = {}
    for name, family, scan in (("mixtral", "mixtral", False), ("mixtral_scanned", "mixtral", True),
                               ("switch", "switch", False), ("switch_scanned", "switch", True)):  # fmt: skip
        directory = pathlib.Path(golden) / family
        reference = flat(load_hf(directory, scan_layers=scan))
        with sharding.use(mesh, sharding.rules_for(mesh_cfg)):
            model = load_hf(directory, mesh=mesh, scan_layers=scan)
            if name == "mixtral":
                ref = np.load(directory / "logits.npz")
                with jax.default_matmul_precision("highest"):
                    logits = nnx.jit(lambda m, ids: m(ids))(model, jnp.asarray(ref["input_ids"]))
                out["mixtral_logits_diff"] = float(np.abs(np.asarray(logits) - ref["logits"]).max())
        params = flat(model)
        out[name] = {
            "max_abs_diff": max(
                float(np.abs(np.asarray(v) - np.asarray(reference[k])).max()) for k, v in params.items()
            ),
            "specs": {
                k: str(tuple(v.sharding.spec)) for k, v in params.items() if k.endswith(("ffn.wi", "ffn.router"))
            },
            "devices": sorted({d.id for v in params.values() for d in v.sharding.device_set}),
        }
    return out


def hf_families_sharded(golden: str) -> dict:
    """The golden Qwen 2, Qwen 3, Qwen 3 MoE, Gemma 3 and DeepSeek-V3 checkpoints (Qwen 3 MoE also scanned) loaded onto
    an fsdp=2 x tensor=2 x expert=2 mesh: their logits against transformers' (the golden files, one
    program for all), every parameter against the same checkpoint loaded onto one device, and where the
    attention's and the experts' kernels landed."""
    import pathlib

    import jax.numpy as jnp
    from flax import nnx

    from jaxformer import sharding
    from jaxformer.config import MeshConfig
    from jaxformer.interop.hf import load_hf

    def flat(model):
        return {".".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}

    mesh_cfg = MeshConfig(fsdp=2, tensor=2, expert=2)
    mesh = sharding.make_mesh(mesh_cfg)
    cases = {"qwen2": ("qwen2", False), "qwen3": ("qwen3", False), "qwen3_moe": ("qwen3_moe", False),
             "qwen3_moe_scanned": ("qwen3_moe", True), "gemma3_text": ("gemma3_text", False),
             "deepseek_v3": ("deepseek_v3", False)}  # fmt: skip
    models, out = {}, {}
    for name, (family, scan) in cases.items():
        directory = pathlib.Path(golden) / family
        reference = flat(load_hf(directory, scan_layers=scan))
        with sharding.use(mesh, sharding.rules_for(mesh_cfg)):
            models[name] = load_hf(directory, mesh=mesh, scan_layers=scan)
        params = flat(models[name])
        diff = max(float(np.abs(np.asarray(v) - np.asarray(reference[k])).max()) for k, v in params.items())
        out[name] = {
            "max_abs_diff": diff,
            "specs": {k: str(tuple(v.sharding.spec)) for k, v in params.items()
                      if k.endswith(("self_attn.q", "self_attn.q_bias", "self_attn.q_norm", "ffn.wi", "self_attn.q_up",
                                     "ffn.router_bias"))},
            "devices": sorted({d.id for v in params.values() for d in v.sharding.device_set}),
        }  # fmt: skip
    ids = jnp.asarray(np.load(pathlib.Path(golden) / "qwen2" / "logits.npz")["input_ids"])
    with sharding.use(mesh, sharding.rules_for(mesh_cfg)), jax.default_matmul_precision("highest"):
        logits = nnx.jit(lambda ms, ids: {k: m(ids) for k, m in ms.items()})(models, ids)
    for name, (family, _) in cases.items():
        ref = np.load(pathlib.Path(golden) / family / "logits.npz")["logits"]
        out[name]["logits_diff"] = float(np.abs(np.asarray(logits[name]) - ref).max())
    return out


def data_shares(mesh_shape, cache_dir: str) -> dict:
    """This process's rows of a few global batches of real data (pairs, bucketed; MLM, masked per
    row), read through the loader as `fit` reads them: {objective: [[example index, ...], ...]} and
    a checksum of the arrays read."""
    from jaxformer import config as C
    from jaxformer import sharding
    from jaxformer.data import build_dataset

    mesh = sharding.make_mesh(C.MeshConfig(data=mesh_shape[0], fsdp=mesh_shape[1], tensor=mesh_shape[2]))
    rows = sharding.process_rows(B, mesh)
    out = {}
    for objective, mode, source in (("seq2seq", "encoder_decoder", "en_de"), ("mlm", "encoder_only", "shakespeare")):
        cfg = C.Config(
            model=C.tiny(mode, vocab_size=260, max_len=16),
            data=C.DataConfig(source=source, max_len=16, max_examples=600, cache_dir=cache_dir),
            train=C.TrainConfig(objective=objective, batch_size=B),
        )
        train = build_dataset(cfg).train  # both processes prepare the same cache at once: one rename wins
        steps = (0, 3, 40)
        batches = list(train.stream(0, 41, rows, prefetch=2))
        out[objective] = {
            "rows": [train.rows(s)[rows].tolist() for s in steps],
            "arrays": {str(s): {k: v.tolist() for k, v in batches[s].items()} for s in steps},
        }
    return out


def main() -> None:
    gc.freeze()  # the imported heap out of the collections, which come less often: as tests/conftest.py does
    gc.set_threshold(70_000, 50, 100)
    task = sys.argv[1]
    if task == "strategies":
        mode, more = sys.argv[2], sys.argv[3:]
        remesh_dir = more[more.index("remesh") + 1] if "remesh" in more else None
        out = {"strategies": strategies(mode, remesh_dir), "errors": errors() if mode == "decoder_only" else {}}
        if "moe" in more:
            out["moe"] = moe()
        if "pipeline" in more:
            out["pipeline"] = pipelines(more[more.index("pipeline") + 1])
        if "mla" in more:
            out["mla"] = mla()
        if "hf" in more:
            out["hf"] = hf_sharded(more[more.index("hf") + 1])
        if "singlehost" in more:  # `multihost`'s data and pipeline in one process of 8 devices
            data = data_shares((2, 2, 2), more[more.index("singlehost") + 1])
            out["singlehost"] = {"data": data, "pipelined": pipelined_gradients()}
        print(json.dumps(out))
    elif task == "multihost":
        pid, port = int(sys.argv[2]), int(sys.argv[3])
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
        losses, state, _, _ = train(config("encoder_decoder", (2, 2, 2)))
        shares = data_shares((2, 2, 2), sys.argv[4])
        out = {"losses": losses, "checksum": checksum(gathered(state.params)), "data": shares}
        print(json.dumps(out | {"pipelined": pipelined_gradients()}))
        jax.distributed.shutdown()
    elif task == "hf":
        print(json.dumps(hf_sharded(sys.argv[2])))
    elif task == "hf_moe":
        print(json.dumps(hf_moe_sharded(sys.argv[2])))
    elif task == "hf_families":
        print(json.dumps(hf_families_sharded(sys.argv[2])))
    elif task == "moe":
        print(json.dumps(moe()))


if __name__ == "__main__":
    main()
