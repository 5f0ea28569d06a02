"""Greedy decoding for evaluation and samples.

This version recomputes the full prefix at every step (no KV cache): simple and exact,
used for the copy-task accuracy, BLEU and the samples printed during training.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

Array = jax.Array


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def greedy_translate(graphdef, params, src_BS: Array, max_len: int, bos_id: int) -> Array:
    """encoder_decoder: greedy target ids [B, max_len] (EOS and what follows it left in)."""
    model = nnx.merge(graphdef, params)
    memory_BSD = model.encode(src_BS)
    B = src_BS.shape[0]
    buf_BT = jnp.zeros((B, max_len + 1), jnp.int32).at[:, 0].set(bos_id)

    def body(i, buf_BT):
        logits_BTV = model.decode(memory_BSD, src_BS, buf_BT[:, :-1])
        return buf_BT.at[:, i + 1].set(jnp.argmax(logits_BTV[:, i], -1).astype(jnp.int32))

    return jax.lax.fori_loop(0, max_len, body, buf_BT)[:, 1:]


@functools.partial(jax.jit, static_argnums=(0, 3))
def greedy_continue(graphdef, params, prompt_BT: Array, num_new: int) -> Array:
    """decoder_only: the prompt [B, P] followed by `num_new` greedy tokens: [B, P + num_new]."""
    model = nnx.merge(graphdef, params)
    B, P = prompt_BT.shape
    buf_BT = jnp.concatenate([prompt_BT, jnp.zeros((B, num_new), jnp.int32)], axis=1)

    def body(i, buf_BT):
        logits_BTV = model(buf_BT)
        return buf_BT.at[:, i + 1].set(jnp.argmax(logits_BTV[:, i], -1).astype(jnp.int32))

    return jax.lax.fori_loop(P - 1, P + num_new - 1, body, buf_BT)


def strip_after_eos(ids, eos_id) -> list[int]:
    ids = [int(i) for i in ids]
    return ids[: ids.index(eos_id)] if eos_id is not None and eos_id in ids else ids


def encode_sources(tok, texts: list[str], max_len: int) -> np.ndarray:
    """Source texts as padded ids [B, S], each ending in EOS (where the tokenizer has one)."""
    eos = [] if tok.eos_id is None else [tok.eos_id]
    ids = np.full((len(texts), max_len), tok.pad_id, np.int32)
    for i, text in enumerate(texts):
        enc = tok.encode(text)[: max_len - len(eos)] + eos
        ids[i, : len(enc)] = enc
    return ids


def translate_texts(graphdef, params, cfg, tok, src_ids: np.ndarray, max_len: int | None = None) -> list[str]:
    out = greedy_translate(graphdef, params, jnp.asarray(src_ids), max_len or src_ids.shape[1], tok.bos_id)
    return [tok.decode(strip_after_eos(row, tok.eos_id)) for row in np.asarray(out)]


def sample_texts(graphdef, params, cfg, data) -> tuple[list[str], list[str]]:
    """A few (input, model output) pairs from held-out data, for logs."""
    tok, objective, L = data.tokenizer, cfg.train.objective, cfg.data.max_len
    sources = data.sample_sources[: cfg.train.num_samples]
    if objective == "seq2seq":
        return sources, translate_texts(graphdef, params, cfg, tok, encode_sources(tok, sources, L))
    if objective == "lm":
        outs = []
        for s in sources:
            prompt = jnp.asarray([tok.encode(s)[-L // 2 :]], jnp.int32)
            out = greedy_continue(graphdef, params, prompt, min(L // 2, cfg.model.max_len - prompt.shape[1]))
            new_ids = [int(i) for i in np.asarray(out[0, prompt.shape[1] :])]
            chunks = np.split(new_ids, [i + 1 for i, t in enumerate(new_ids) if t == tok.eos_id])
            outs.append("\n\n".join(tok.decode(c) for c in chunks))  # EOS ends a paragraph
        return sources, outs
    if objective == "classify":
        from jaxformer.data.sources import APPS

        model = nnx.merge(graphdef, params)
        ids = np.zeros((len(sources), L), np.int32)
        for i, s in enumerate(sources):
            enc = [tok.bos_id, *tok.encode(s)][:L]
            ids[i, : len(enc)] = enc
        return sources, [APPS[int(c)] for c in np.argmax(model.classify(jnp.asarray(ids)), -1)]
    model = nnx.merge(graphdef, params)  # mlm: every 7th token masked, then predicted
    outs = []
    for s in sources:
        ids = np.asarray(tok.encode(s)[:L], np.int32)
        hidden = np.arange(len(ids)) % 7 == 1
        pred = np.asarray(jnp.argmax(model(jnp.asarray(np.where(hidden, tok.mask_id, ids)[None])), -1))[0]
        outs.append(tok.decode(np.where(hidden, pred, ids)))
    return sources, outs
