"""The engine's compiled programs, pure functions of the model's arrays and the pools: one step of the
continuous batch over the paged cache (`_forward`: a prefill chunk or `steps` decode steps, each row
sampling its own next token), an encoder_decoder source encoded into its slot (`_encode_into`), whole
inputs scored by an encoder_only model (`_score`), and copy-on-write of a shared page (`_copy_page`).
The scheduler (`jaxformer.engine.engine`) builds their inputs and owns what they return, but for whole
inputs, which `score_batches` pads into batches of a few shapes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer import precast
from jaxformer.attention.paged_kernel import paged_kernel_meant
from jaxformer.engine import adapters as _adapters
from jaxformer.engine import paged


@functools.partial(jax.jit, static_argnames=("graphdef", "steps", "top_n", "raw", "verify"), donate_argnames=("pools",))
def _forward(
    graphdef, params, pools, table_BP, ids_BT, positions_BT, valid_BT, last_B, sampling, source, steps_B,
    rows_B=None, penalties=None, *, steps, top_n=0, raw=False, verify=False,
):  # fmt: skip
    """One paged step and the next token of each row (from its last valid position `last_B`), then (decode,
    T = 1) `steps` - 1 more, each feeding the token just drawn, row b running `steps_B[b]` in all; or
    (`verify`, speculative decoding's check of drafted tokens, `steps` 1) the token each position draws,
    every position drawing as a decode step at that position would [B, T]; `sampling`:
    each row's seed, temperature, top-k, top-p and min-p, the EOS id (-1: none) and each row's first position that
    may draw it (`min_tokens`); `source`: None, or (per layer the slots' cross-attention keys and values, the
    slots' source lengths, each row's slot); `rows_B`: None, or each row's adapter (engine.adapters);
    `penalties`: None, or each row's output token counts, prompt tokens, presence, frequency and repetition
    penalties and biases (`paged.penalize`; the counts grow by each token drawn). Returns tokens and
    log-probabilities [B, steps], None or (`top_n` > 0) the `top_n` likeliest ids at each step and their
    log-probabilities [B, steps, top_n] (likeliest first, under the model as the chosen token's), and the
    pools. The log-probabilities are under the logits the token is drawn from (penalties, biases and the
    `min_tokens` hold applied; never the temperature), or (`raw`) under the model's own."""
    model = nnx.merge(graphdef, params)
    if rows_B is not None:
        _adapters.bind_rows(model, rows_B)
    memory, src_lengths_B = None, None
    if source is not None:
        memory_slots, src_lengths_slots, slots_B = source
        memory = jax.tree.map(lambda m: jnp.take(m, slots_B, axis=0), memory_slots)
        src_lengths_B = jnp.take(src_lengths_slots, slots_B, axis=0)
    seeds_B, temperature_B, top_k_B, top_p_B, min_p_B, eos, eos_from_B = sampling

    def one(pools, rows, counts_BV, ids_BT, positions_BT, valid_BT, last_B):
        """Each row's token drawn from its position `last_B` ([B, 1]), or (None) from each position ([B, T])."""
        logits_BTV, pools, rows = paged.paged_step(
            model, pools, table_BP, ids_BT, positions_BT, valid_BT, memory, src_lengths_B, last_B, rows
        )
        B, T, V = logits_BTV.shape  # N = B x T draws, each with its row's settings
        per_N = lambda x_B: jnp.repeat(x_B, T, axis=0)
        logits_NV = raw_NV = logits_BTV.reshape(B * T, V)
        if penalties is not None:
            logits_NV = paged.penalize(logits_NV, per_N(counts_BV), *map(per_N, penalties[1:]))
        at_BT = positions_BT if last_B is None else jnp.take_along_axis(positions_BT, last_B[:, None], axis=1)
        positions_N = at_BT.reshape(B * T) + 1  # the drawn token's
        # `min_tokens`: a row draws no EOS (id `eos`, -1: none) at a position before its `eos_from_B`.
        held_NV = (jnp.arange(V) == eos)[None, :] & (positions_N < per_N(eos_from_B))[:, None]
        logits_NV = jnp.where(held_NV, -jnp.inf, logits_NV)
        keys_N = paged.request_keys(per_N(seeds_B), positions_N)
        settings = map(per_N, (temperature_B, top_k_B, top_p_B, min_p_B))
        tokens_N, logp_N = paged.choose_rows(logits_NV, keys_N, *settings)
        logp_NV = jax.nn.log_softmax((raw_NV if raw else logits_NV).astype(jnp.float32))
        if raw:
            logp_N = jnp.take_along_axis(logp_NV, tokens_N[:, None], axis=1)[:, 0]
        top = tuple(x.reshape(B, T, top_n) for x in jax.lax.top_k(logp_NV, top_n)[::-1]) if top_n else ()
        return tokens_N.reshape(B, T), logp_N.reshape(B, T), top, pools, rows

    counts_BV = None if penalties is None else penalties[0]
    if steps == 1:  # a prefill chunk, one decode step, or the check of drafted tokens (every position's draw)
        tokens_BT, logp_BT, top, pools, _ = one(
            pools, None, counts_BV, ids_BT, positions_BT, valid_BT, None if verify else last_B
        )
        return tokens_BT, logp_BT, top or None, pools

    def body(i, carry):  # decoding (T = 1): the token drawn at step i - 1 goes in at the next position
        tokens_BN, logp_BN, top_BNn, pools, rows, counts_BV, in_B1 = carry
        valid_B1 = valid_BT & (i < steps_B)[:, None]
        t_B1, l_B1, top, pools, rows = one(pools, rows, counts_BV, in_B1, positions_BT + i, valid_B1, last_B)
        t_B, l_B = t_B1[:, 0], l_B1[:, 0]
        top_BNn = tuple(acc.at[:, i].set(x[:, 0]) for acc, x in zip(top_BNn, top, strict=True))
        if counts_BV is not None:  # the token drawn is in the output from the next step on
            counts_BV = counts_BV.at[jnp.arange(t_B.shape[0]), t_B].add((i < steps_B).astype(jnp.int32))
        return tokens_BN.at[:, i].set(t_B), logp_BN.at[:, i].set(l_B), top_BNn, pools, rows, counts_BV, t_B[:, None]

    # The rows' pages are read once for the call's steps, as a dense cache that each step writes as it
    # writes the pages, unless a Pallas paged kernel is meant to read them in place at every step (latent
    # attention's pools always gather). Every layer's rows are then held at once, where a step that
    # gathers holds one layer's at a time.
    gathered = model.cfg.mla.enabled or not paged_kernel_meant(model.cfg.attention_impl)
    rows = paged.gather_rows(pools, table_BP) if gathered else None
    # One body in the loop, the first step included: the model appears once in the program, not twice
    # (a decode shape of a 2-layer scanned model: 2.0 s of CPU to compile, against 2.7 with the first apart).
    # Its trip count stays `steps`, known to XLA, even where every row's `max_tokens` ends sooner: with a
    # count read from the rows, a GPU's loop outside a CUDA graph copies its predicate to the host and
    # waits for it at every step (XLA's while thunk runs a known count without those waits).
    B = ids_BT.shape[0]
    top_BNn = (jnp.zeros((B, steps, top_n), jnp.int32), jnp.zeros((B, steps, top_n), jnp.float32)) if top_n else ()
    carry = (jnp.zeros((B, steps), jnp.int32), jnp.zeros((B, steps), jnp.float32), top_BNn, pools, rows, counts_BV,
             ids_BT)  # fmt: skip
    tokens_BN, logp_BN, top_BNn, pools, _, _, _ = jax.lax.fori_loop(0, steps, body, carry)
    return tokens_BN, logp_BN, top_BNn or None, pools


def cast_plan(graphdef, params, forward_args: tuple, encode_args: tuple | None) -> dict:
    """Which of the engine's parameters its programs only read cast to one narrower dtype, and that dtype
    (`precast.cast_plan`: a float32 kernel of a bfloat16 model): the step (`_forward`, its arguments but
    the graph and the parameters) and, encoder_decoder, a source encoded into its slot (`_encode_into`'s,
    likewise), traced once more. The engine stores those parameters cast: no program, and no step of a
    decoding loop, casts them again.

    Args:
        graphdef (nnx.GraphDef): the engine's model's graph.
        params (nnx.State): its parameters.
        forward_args: `_forward`'s other arguments (pools, page table, ids, ...; any shapes).
        encode_args: `_encode_into`'s other arguments (memory, source, lengths, slot), or None.

    Returns:
        {leaf index of `params`: the dtype to store it in} (`precast.apply_plan` applies it).
    """

    def programs(model, forward_args, encode_args):
        g, p = nnx.split(model)
        out = _forward(g, p, *forward_args, steps=1)
        return out if encode_args is None else (out, _encode_into(g, p, *encode_args))

    model = nnx.merge(graphdef, params)
    return precast.cast_plan(model, model.cfg.dtype, programs, forward_args, encode_args)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("memory",))
def _encode_into(graphdef, params, memory, src_1S, src_lengths_1, slot, adapter=None):
    """Encode one source and write each decoder layer's cross-attention keys and values of it into `slot`;
    `adapter`: None, or the request's adapter (engine.adapters), in the encoder and the cross-attention."""
    model = nnx.merge(graphdef, params)
    if adapter is not None:
        _adapters.bind_rows(model, adapter)
    memory_1SD = model.encode(src_1S, src_lengths=src_lengths_1)
    layers = model.init_cache(1, 1, memory_1SD, src_lengths=src_lengths_1)["layers"]
    write = lambda m, c: {n: m[n].at[slot].set(c["memory"][n][0].astype(m[n].dtype)) for n in "kv"}
    return [write(m, c) for m, c in zip(memory, layers, strict=True)]


@functools.partial(jax.jit, static_argnames=("graphdef", "kind"))
def _score(graphdef, params, ids_BS, lengths_B, rows_B=None, *, kind):
    """encoder_only: class log-probabilities [B, C], masked-LM argmax ids [B, S], or mean states [B, D];
    `rows_B`: None, or each row's adapter (engine.adapters)."""
    model = nnx.merge(graphdef, params)
    if rows_B is not None:
        _adapters.bind_rows(model, rows_B)
    if kind == "classify":
        return jax.nn.log_softmax(model.classify(ids_BS, src_lengths=lengths_B).astype(jnp.float32))
    h_BSD = model.hidden(ids_BS, lengths=lengths_B)
    if kind == "fill":
        return jnp.argmax(model.head(h_BSD), axis=-1)
    valid_BS1 = (jnp.arange(ids_BS.shape[1])[None, :] < lengths_B[:, None])[..., None]
    return jnp.sum(jnp.where(valid_BS1, h_BSD.astype(jnp.float32), 0.0), axis=1) / lengths_B[:, None]


@functools.partial(jax.jit, donate_argnames=("pools",))
def _copy_page(pools, src, dst):
    """Copy-on-write: page `dst` of every pool takes page `src`'s contents."""
    return [
        {n: p.at[dst].set(p[src]) if p.ndim == 3 else p.at[:, dst].set(p[:, src]) for n, p in pool.items()}
        for pool in pools
    ]


def score_batches(
    graphdef, params, rows: list[list[int]], kind: str, batch: int, pad_id: int, most: int, adapters=None, mask_id=None
) -> list[list]:
    """`_score` of whole inputs, `batch` rows a call, each call's positions a power of two (8 at least, `most`
    at most) and its rows `batch` (the last padded): a few compiled shapes serve every input.

    Args:
        graphdef (nnx.GraphDef): the engine's model's graph.
        params (nnx.State): its parameters.
        rows: the inputs' token ids (each at most `most`).
        kind: "classify", "fill" or "embed" (`_score`).
        batch: rows a call.
        pad_id: the padding id.
        most: the positions a call has at most (the model's context).
        adapters (list[int] | None): each input's adapter index (engine.adapters), or None (no adapters).
        mask_id (int | None): "fill": the mask token, each replaced by the likeliest id there.

    Returns:
        One list per input: C log-probabilities, the filled ids, or D floats.
    """
    out = []
    for start in range(0, len(rows), batch):
        part = rows[start : start + batch]
        width = min(max(8, 1 << (max(map(len, part)) - 1).bit_length()), most)
        ids, lengths = np.full((batch, width), pad_id, np.int32), np.ones(batch, np.int32)
        for i, r in enumerate(part):
            ids[i, : len(r)], lengths[i] = r, len(r)
        adapters_B = None  # each row's adapter, the padding rows' the base
        if adapters is not None:
            adapters_B = np.zeros(batch, np.int32)
            adapters_B[: len(part)] = adapters[start : start + batch]
        got = np.asarray(_score(graphdef, params, ids, lengths, adapters_B, kind=kind))
        for i, r in enumerate(part):
            out.append([int(p) if t == mask_id else t for t, p in zip(r, got[i], strict=False)] if kind == "fill"
                       else got[i].tolist())  # fmt: skip
    return out


def drawn(out: tuple, i: int, j: int, n: int) -> tuple[int, float, list[tuple[int, float]] | None]:
    """One row's token at one step of a call of `_forward`, with what it says of it.

    Args:
        out: the call's tokens and log-probabilities [R, steps], and None or the likeliest ids and theirs
            [R, steps, top_n].
        i: the row.
        j: the step.
        n: how many of the likeliest tokens to list (0: none).

    Returns:
        (token, its log-probability, its `n` likeliest (id, log-probability) pairs or None where n is 0).
    """
    tokens, logp, top = out
    pairs = list(zip(top[0][i, j, :n].tolist(), top[1][i, j, :n].tolist(), strict=True)) if n else None
    return int(tokens[i, j]), float(logp[i, j]), pairs
