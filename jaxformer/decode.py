"""Generation with a KV cache: greedy, sampling (temperature, top-k, top-p) and beam search,
for decoder-only and encoder-decoder models.

The decoder starts from a prompt [B, P] (right-padded, with per-row lengths); in
encoder_decoder mode the prompt is BOS and the source is encoded once, each layer's
cross-attention keys and values of it computed once and kept in the cache. The prompts
run in one prefill pass, then one token per step inside a jitted `lax.while_loop` that
stops when every row has ended (EOS, or its maximum length).

Cache slot s holds position s of its row, so rows of different lengths need no shifting
and a row's output does not depend on the rest of the batch. Shapes are static: one
compilation per (batch, prompt width, output length, settings); prompt widths are rounded
up to a power of two so that a handful of shapes serve every prompt.

`DecodeConfig.use_cache=False` recomputes the whole prefix at every step instead: the
reference the cache is tested and benchmarked against.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer import lora
from jaxformer.config import DecodeConfig
from jaxformer.layers import as_token_ids, without_id_checks
from jaxformer.models import memory_mask, unrolled
from jaxformer.precast import cast_once
from jaxformer.sharding import constrain, context_ways

Array = jax.Array
NEG_INF = -jnp.inf
SAMPLED = ("temperature", "top_k", "top_p", "min_p")  # the settings of a draw (`sample_logits`), by name
DEFAULTS = DecodeConfig()


class Generation(NamedTuple):
    """What `generate` / `translate` return (NumPy arrays).

    tokens: [B, n, N] generated ids, best first, EOS included, `pad_id` after it.
    scores: [B, n] beam search: length-penalised log-probability log P / ((5 + len) / 6) ** alpha;
      greedy and sampling: the log-probability of the sequence under the model.

    Attributes:
        tokens: [B, n, N] generated ids (n outputs per row, N positions).
        scores: [B, n] their scores.
    """

    tokens: np.ndarray
    scores: np.ndarray


# ----------------------------------------------------------------------------- token choice


def top_k_filter(logits_BV: Array, k: int) -> Array:
    """Logits outside the k largest of each row set to -inf (k = 0: unchanged).

    Args:
        logits_BV: [B, V] logits.
        k: how many to keep per row (0: all).

    Returns:
        [B, V].
    """
    if k == 0 or k >= logits_BV.shape[-1]:
        return logits_BV
    kth_B1 = jax.lax.top_k(logits_BV, k)[0][:, -1:]
    return jnp.where(logits_BV < kth_B1, NEG_INF, logits_BV)


def top_p_filter(logits_BV: Array, p: float) -> Array:
    """Nucleus filter (Holtzman et al. 2020): keep the smallest set of most likely tokens whose
    probability mass reaches p (always at least the most likely one); the rest get -inf.

    Args:
        logits_BV: [B, V] logits.
        p: the probability mass to keep, in (0, 1].

    Returns:
        [B, V].
    """
    if p >= 1.0:
        return logits_BV
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    probs_BV = jax.nn.softmax(sorted_BV.astype(jnp.float32), axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    kept_BV = mass_before_BV < p  # a token is kept if the mass above it has not yet reached p
    threshold_B1 = jnp.min(jnp.where(kept_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits_BV < threshold_B1, NEG_INF, logits_BV)


def min_p_filter(logits_BV: Array, min_p: float) -> Array:
    """Min-p filter (Nguyen et al. 2024, vLLM's and Hugging Face's `min_p`): keep the tokens whose
    probability is at least `min_p` times the likeliest one's; the rest get -inf. On the logits: a token
    is kept where its logit is at least the largest + log(min_p).

    Args:
        logits_BV: [B, V] logits (after the temperature).
        min_p: the fraction of the likeliest token's probability, in [0, 1] (0: all kept).

    Returns:
        [B, V].
    """
    if min_p <= 0.0:
        return logits_BV
    floor_B1 = jnp.max(logits_BV, axis=-1, keepdims=True) + jnp.log(jnp.float32(min_p))
    return jnp.where(logits_BV < floor_B1, NEG_INF, logits_BV)


def sample_logits(
    logits_BV: Array, rng: Array, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> Array:
    """One token per row from softmax(logits / temperature), restricted by min-p, then top-k, then top-p
    (vLLM's order).

    Row b draws with its own key, fold_in(rng, b), so its token depends on its logits alone,
    never on the other rows of the batch.

    Args:
        logits_BV: [B, V] logits.
        rng: the PRNG key.
        temperature: divides the logits (> 0).
        top_k: keep the k largest (0: all).
        top_p: keep the nucleus of this mass (1: all).
        min_p: keep the tokens at least this fraction as likely as the likeliest (0: all).

    Returns:
        tokens (Array): [B] int32.
    """
    logits_BV = logits_BV.astype(jnp.float32) / temperature
    logits_BV = top_p_filter(top_k_filter(min_p_filter(logits_BV, min_p), top_k), top_p)
    keys_B = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, jnp.arange(logits_BV.shape[0]))
    return jax.vmap(jax.random.categorical)(keys_B, logits_BV).astype(jnp.int32)


def length_penalty(length: Array, alpha: float) -> Array:
    """GNMT's lp(Y) = ((5 + |Y|) / 6) ** alpha (Wu et al. 2016), used by the paper with alpha 0.6.

    Args:
        length: the lengths, any shape.
        alpha: the exponent (0: no penalty).

    Returns:
        lp, length's shape, float32.
    """
    return ((5.0 + length) / 6.0) ** alpha


# ----------------------------------------------------------------------------- next-token logits


class Stepper(NamedTuple):
    """The model seen by a search: logits of each row's next token.

    start(prompt_BP, lengths_B) -> (logits_BV, carry): after each row's last prompt token.
    step(carry, tokens_B, positions_B) -> (logits_BV, carry): after tokens placed at positions.
    reorder(carry, rows_B) -> carry: row i takes row rows_B[i]'s history (beam search).
    length: the positions it holds, prompts and new tokens (a row's last position is length - 1).

    Attributes:
        start: (prompt_BP, lengths_B) -> (logits_BV, carry).
        step: (carry, tokens_B, positions_B) -> (logits_BV, carry).
        reorder: (carry, rows_B) -> carry.
        length: the positions it holds.
    """

    start: Callable
    step: Callable
    reorder: Callable
    length: int


def _at(x_BT_, index_B: Array) -> Array:
    """x[b, index_b] for each row: [B, T, ...] -> [B, ...]."""
    return jnp.take_along_axis(x_BT_, index_B[:, None, None], axis=1)[:, 0]


def cached_stepper(model, length: int, memory_BSD: Array | None, src_lengths_B: Array | None) -> Stepper:
    """Prefill once, then one position per step against a KV cache of `length` slots.

    Args:
        model (Transformer): the model (see `decodable`).
        length: the positions of the cache.
        memory_BSD: [B, S, D] the encoder's output (encoder_decoder), or None.
        src_lengths_B: [B] source lengths, or None.

    Returns:
        The `Stepper`.
    """

    def start(prompt_BP, lengths_B):
        cache = model.init_cache(prompt_BP.shape[0], length, memory_BSD, src_lengths=src_lengths_B)
        logits_BPV, cache = model.decode_step(cache, prompt_BP, None, lengths_B=lengths_B)  # a prefill from 0
        return _at(logits_BPV, lengths_B - 1), cache

    def step(cache, tokens_B, positions_B):
        logits_B1V, cache = model.decode_step(cache, tokens_B[:, None], positions_B[:, None])
        return logits_B1V[:, 0], cache

    return Stepper(start, step, model.reorder_cache, length)


def recompute_stepper(model, length: int, memory_BSD: Array | None, src_lengths_B: Array | None) -> Stepper:
    """No cache: every step runs the decoder over the whole (static) buffer of `length` ids
    (and the output layer at the one position whose logits are needed).

    Args:
        model (Transformer): the model.
        length: the positions of the buffer.
        memory_BSD: [B, S, D] the encoder's output, or None.
        src_lengths_B: [B] source lengths, or None.

    Returns:
        The `Stepper`.

    Raises:
        ValueError: under a context axis that does not divide `length`.
    """

    cross_mask = None if memory_BSD is None else memory_mask(src_lengths_B, None, None)
    if length % (n := context_ways()):  # the buffer runs through ring attention like a training sequence
        raise ValueError(
            f"decode.use_cache=False with a context axis of {n}: the buffer of {length} positions (prompt and new "
            f"tokens) must be divisible by it; use the cache (decode.use_cache=True), which takes any length"
        )

    def logits_at(buffer_BL, filled_B, index_B):
        h_BLD = model.decoder(buffer_BL, lengths=filled_B, memory_BSD=memory_BSD, memory_mask=cross_mask)
        return model.lm_head(_at(h_BLD, index_B)[:, None])[:, 0]  # the output layer at one position only

    def start(prompt_BP, lengths_B):
        buffer_BL = jnp.pad(prompt_BP, ((0, 0), (0, length - prompt_BP.shape[1])))
        return logits_at(buffer_BL, lengths_B, lengths_B - 1), buffer_BL

    def step(buffer_BL, tokens_B, positions_B):
        buffer_BL = buffer_BL.at[jnp.arange(buffer_BL.shape[0]), positions_B].set(tokens_B)
        return logits_at(buffer_BL, positions_B + 1, positions_B), buffer_BL

    return Stepper(start, step, lambda buffer_BL, rows_B: jnp.take(buffer_BL, rows_B, axis=0), length)


# ----------------------------------------------------------------------------- searches


def sample_search(stepper, prompt_BP, lengths_B, max_new_B, num_new: int, choose, eos_id: int, pad_id: int, rng):
    """Greedy or sampled decoding: `choose(logits_BV, key) -> tokens_B` at each step.

    Returns (tokens [B, num_new], log-probabilities [B] of the chosen sequences).

    Args:
        stepper (Stepper): the model.
        prompt_BP (Array): [B, P] prompts, right-padded.
        lengths_B (Array): [B] prompt lengths.
        max_new_B (Array): [B] most new tokens per row.
        num_new: N, the new positions of the output.
        choose (Callable): (logits_BV, key) -> tokens_B.
        eos_id: the end-of-sequence id.
        pad_id: the id written after EOS.
        rng (Array): the PRNG key.

    Returns:
        result (tuple[Array, Array]): (tokens [B, N], log-probabilities [B]).
    """
    B = prompt_BP.shape[0]
    logits_BV, carry = stepper.start(prompt_BP, lengths_B)
    last_position = stepper.length - 1

    def cond(s):
        t, *_, done_B, _ = s
        return (t < num_new) & ~jnp.all(done_B)

    def body(s):
        t, logits_BV, carry, out_BN, done_B, logp_B = s
        logp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32))
        tokens_B = jnp.where(done_B, pad_id, choose(logits_BV, jax.random.fold_in(rng, t)))
        logp_B = logp_B + jnp.where(done_B, 0.0, jnp.take_along_axis(logp_BV, tokens_B[:, None], -1)[:, 0])
        out_BN = out_BN.at[:, t].set(tokens_B)
        done_B = done_B | (tokens_B == eos_id) | (t + 1 >= max_new_B)
        logits_BV, carry = stepper.step(carry, tokens_B, jnp.minimum(lengths_B + t, last_position))
        return t + 1, logits_BV, carry, out_BN, done_B, logp_B

    init = (jnp.int32(0), logits_BV, carry, jnp.full((B, num_new), pad_id, jnp.int32), jnp.zeros(B, bool), jnp.zeros(B))
    _, _, _, out_BN, _, logp_B = jax.lax.while_loop(cond, body, init)
    return out_BN, logp_B


def beam_search(stepper, prompt_BP, lengths_B, max_new_B, num_new: int, W: int, alpha: float, eos_id: int, pad_id: int):
    """Beam search with the GNMT length penalty, over rows already repeated W times ([B * W, ...]).

    Each step extends the W live beams of a row by every token and keeps the 2W best
    candidates; those among the first W that end (EOS, or the row's maximum length) join
    the row's W best finished sequences (scored log P / lp(length)), and the W best that
    do not end live on. A row stops once its best live beam, even at the longest length, cannot
    beat its worst finished sequence. Returns (tokens [B, W, num_new], scores [B, W]), best first.

    Args:
        stepper (Stepper): the model, over [B * W] rows.
        prompt_BP (Array): [B * W, P] prompts, right-padded.
        lengths_B (Array): [B * W] prompt lengths.
        max_new_B (Array): [B * W] most new tokens per row.
        num_new: N, the new positions of the output.
        W: the beam size.
        alpha: the length penalty's exponent.
        eos_id: the end-of-sequence id.
        pad_id: the id written after EOS.

    Returns:
        result (tuple[Array, Array]): (tokens [B, W, N], scores [B, W]).
    """
    BW = prompt_BP.shape[0]
    B = BW // W
    logits_BV, carry = stepper.start(prompt_BP, lengths_B)
    max_new_B_ = max_new_B.reshape(B, W)[:, 0]
    last_position = stepper.length - 1
    take = lambda x, idx: jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)

    def cond(s):
        t, *_, done_B = s
        return (t < num_new) & ~jnp.all(done_B)

    def body(s):
        t, logits_BV, carry, alive_BWN, alive_logp_BW, fin_BWN, fin_score_BW, done_B = s
        V = logits_BV.shape[-1]
        logp_BWV = jax.nn.log_softmax(logits_BV.astype(jnp.float32)).reshape(B, W, V)
        candidates_BX = (alive_logp_BW[..., None] + logp_BWV).reshape(B, W * V)
        logp_BC, index_BC = jax.lax.top_k(candidates_BX, 2 * W)  # C = 2W candidates
        parent_BC, tokens_BC = index_BC // V, index_BC % V
        seqs_BCN = take(alive_BWN, parent_BC).at[:, :, t].set(tokens_BC)
        ends_BC = (tokens_BC == eos_id) | (t + 1 >= max_new_B_)[:, None]

        # Only an ending among the W best candidates is final (as in fairseq): beam 1 is greedy.
        final_BC = ends_BC & (jnp.arange(2 * W) < W)[None, :] & ~done_B[:, None]
        finished_BC = jnp.where(final_BC, logp_BC / length_penalty(t + 1.0, alpha), NEG_INF)
        fin_score_BW, keep_BW = jax.lax.top_k(jnp.concatenate([fin_score_BW, finished_BC], 1), W)
        fin_BWN = take(jnp.concatenate([fin_BWN, seqs_BCN], 1), keep_BW)

        alive_logp_BW, keep_BW = jax.lax.top_k(jnp.where(ends_BC, NEG_INF, logp_BC), W)
        alive_BWN = take(seqs_BCN, keep_BW)
        rows = (jnp.arange(B)[:, None] * W + take(parent_BC, keep_BW)).reshape(BW)
        carry = stepper.reorder(carry, rows)

        best_possible_B = alive_logp_BW[:, 0] / length_penalty(max_new_B_.astype(jnp.float32), alpha)
        done_B = done_B | (t + 1 >= max_new_B_) | (best_possible_B <= fin_score_BW[:, -1])
        tokens = take(tokens_BC, keep_BW).reshape(BW)
        logits_BV, carry = stepper.step(carry, tokens, jnp.minimum(lengths_B + t, last_position))
        return t + 1, logits_BV, carry, alive_BWN, alive_logp_BW, fin_BWN, fin_score_BW, done_B

    first_only_BW = jnp.where(jnp.arange(W) == 0, 0.0, NEG_INF)[None, :].repeat(B, 0)  # the W beams start equal
    pads_BWN = jnp.full((B, W, num_new), pad_id, jnp.int32)
    no_scores_BW = jnp.full((B, W), NEG_INF)
    init = (jnp.int32(0), logits_BV, carry, pads_BWN, first_only_BW, pads_BWN, no_scores_BW, jnp.zeros(B, bool))
    *_, fin_BWN, fin_score_BW, _ = jax.lax.while_loop(cond, body, init)
    return fin_BWN, fin_score_BW


def decodable(model):
    """`model` as the decoding loop runs it: LoRA adapters folded into their kernels (`lora.merge`, on
    a copy: one matmul a projection; an int8 base dequantized) and scanned stacks unrolled
    (`models.unrolled`: sliced once).

    Args:
        model (Transformer): the model.

    Returns:
        model (Transformer): the model to decode with (`model` itself when nothing is to fold or unroll).
    """
    if any(lora.adapters(model)) or lora.quantized(model):  # an int8 base: float kernels again
        model = lora.merge(nnx.clone(model))
    return unrolled(model)


@functools.partial(jax.jit, static_argnames=("graphdef", "settings", "num_new", "length", "eos_id", "pad_id"))
def _generate(
    graphdef, params, prompt_BP, lengths_B, max_new_B, src, rng, *, settings, num_new, length, eos_id, pad_id
):
    """Up to `num_new` steps (row b: max_new_B[b]) in a buffer of `length` positions, prompts included.
    `src`: None (decoder_only), or the sources (ids [B, S], lengths [B]) to encode."""
    model = decodable(without_id_checks(nnx.merge(graphdef, params)))  # inputs were checked on the host
    W = settings.beam_size if settings.strategy == "beam" else 1
    if W > 1:  # every beam is a row of its own: [B * W, ...]
        prompt_BP, lengths_B, max_new_B = (jnp.repeat(x, W, axis=0) for x in (prompt_BP, lengths_B, max_new_B))
        src = None if src is None else tuple(jnp.repeat(x, W, axis=0) for x in src)
    prompt_BP = constrain(prompt_BP, ("batch", None))
    memory_BSD, src_lengths_B = None, None
    if src is not None:
        src_BS, src_lengths_B = src
        memory_BSD = model.encode(constrain(src_BS, ("batch", None)), src_lengths=src_lengths_B)
    make = functools.partial(cached_stepper if settings.use_cache else recompute_stepper, length=length,
                             memory_BSD=memory_BSD, src_lengths_B=src_lengths_B)  # fmt: skip
    stepper = _loop_stepper(make, model, prompt_BP, lengths_B)
    if settings.strategy == "beam":
        return beam_search(
            stepper, prompt_BP, lengths_B, max_new_B, num_new, W, settings.length_penalty, eos_id, pad_id
        )
    if settings.strategy == "greedy":
        choose = lambda logits_BV, _: jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    else:
        choose = functools.partial(sample_logits, **{k: getattr(settings, k) for k in SAMPLED})
    tokens_BN, logp_B = sample_search(stepper, prompt_BP, lengths_B, max_new_B, num_new, choose, eos_id, pad_id, rng)
    return tokens_BN[:, None], logp_B[:, None]


def _loop_stepper(make: Callable, model, prompt_BP: Array, lengths_B: Array) -> Stepper:
    """`make(model)`, its loop's step over the model's parameters cast once, before the loop, where
    every step would cast them (`precast.cast_once`: the same values, a float32 kernel of a bfloat16
    model read in bfloat16 rather than cast at each step)."""
    stepper = make(model)
    _, carry = jax.eval_shape(stepper.start, prompt_BP, lengths_B)
    t_B = jax.ShapeDtypeStruct(lengths_B.shape, jnp.int32)
    cast = cast_once(model, model.cfg.dtype, lambda m, *a: make(m).step(*a), carry, t_B, t_B)
    return stepper if cast is model else stepper._replace(step=make(cast).step)


# ----------------------------------------------------------------------------- entry points


def _padded(rows: Sequence[Sequence[int]], what: str, model, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Id rows (lists, or an array [B, T]) -> (ids [B, W] right-padded, lengths [B]); W a power of
    two (>= 8, <= max_tokens). Each row goes through `layers.as_token_ids`: no float, bool or
    out-of-vocabulary id gets past it, and nothing is rounded or wrapped into int32.
    """
    cfg = model.cfg
    if isinstance(rows, (str, bytes)) or any(isinstance(r, (str, bytes)) for r in _iterable(rows, what)):
        raise TypeError(f"{what}s are lists of token ids, not text (for text: continue_texts, translate_texts)")
    if len(rows) == 0:
        raise ValueError(f"no {what}s given")
    checked = []
    for i, r in enumerate(rows):
        checked.append(np.asarray(as_token_ids(r, f"{what} {i}", vocab_size=cfg.vocab_size, rank=1)))
        if (n := len(checked[-1])) > max_tokens:
            raise ValueError(f"{what} {i} has {n} tokens; with model.max_len={cfg.max_len} at most {max_tokens} fit")
    lengths = np.asarray([len(r) for r in checked], np.int32)
    width = min(max(8, 1 << int(lengths.max() - 1).bit_length()), max_tokens)
    ids = np.full((len(rows), width), cfg.pad_id, np.int32)
    for i, r in enumerate(checked):
        ids[i, : len(r)] = r
    return ids, lengths


def _iterable(rows, what: str):
    if not isinstance(rows, (Sequence, np.ndarray, jax.Array)):
        got = "None" if rows is None else type(rows).__name__
        raise TypeError(f"{what}s: a list of token-id lists (or an array [B, T]), got {got}")
    return rows


def _check_settings(settings) -> None:
    if not isinstance(settings, DecodeConfig):
        raise TypeError(f"settings: a jaxformer.config.DecodeConfig, got {type(settings).__name__}")


def _check_special_ids(model, **ids) -> dict:
    """BOS/EOS ids as Python ints, each a token of the vocabulary (None: no such token)."""
    V = model.cfg.vocab_size
    return {k: None if t is None else int(as_token_ids(t, k, vocab_size=V, rank=0)) for k, t in ids.items()}


def _program_settings(settings: DecodeConfig) -> DecodeConfig:
    """The settings `_generate`'s program reads, the others at their defaults: calls that differ only in
    what is passed or applied apart from it (seed: the key; max_new_tokens, extra_len: num_new and
    length; num_return: a slice of its output) or in a strategy's settings another strategy ignores
    share one trace and one compiled program."""
    kept = {"strategy": settings.strategy, "use_cache": settings.use_cache}
    if settings.strategy == "beam":
        kept |= {"beam_size": settings.beam_size, "length_penalty": settings.length_penalty}
    elif settings.strategy == "sample":
        kept |= {k: getattr(settings, k) for k in SAMPLED}
    return DecodeConfig(**kept)


def _run(model, prompt_BP, lengths_B, max_new_B, src, settings: DecodeConfig, num_new, length, eos_id, rng):
    graphdef, params = nnx.split(model)
    rng = jax.random.key(settings.seed) if rng is None else rng
    tokens, scores = _generate(
        graphdef, params, prompt_BP, lengths_B, max_new_B, src, rng, settings=_program_settings(settings),
        num_new=num_new, length=length, eos_id=-1 if eos_id is None else eos_id, pad_id=model.cfg.pad_id,
    )  # fmt: skip
    n = settings.num_return
    return Generation(np.asarray(tokens)[:, :n], np.asarray(scores)[:, :n])


def generate(model, prompts: Sequence[Sequence[int]], settings: DecodeConfig = DEFAULTS, *, eos_id, rng=None):
    """decoder_only: continue each prompt (a list of ids) by up to `settings.max_new_tokens` tokens.

    Rows may differ in length; a row stops at EOS, after max_new_tokens, or at the model's
    maximum length. `rng` (a key) overrides `settings.seed` for sampling.

    Args:
        model (Transformer): a decoder_only model.
        prompts: B lists of ids (or an array [B, T]).
        settings: strategy, lengths, sampling and beam settings.
        eos_id (int | None): the end-of-sequence id, or None (never stop early).
        rng (Array | None): a PRNG key, or None (settings.seed).

    Returns:
        generation (Generation): tokens [B, n, N] and scores [B, n].

    Raises:
        TypeError: prompts that are not id lists, or settings that are not a DecodeConfig.
        ValueError: not a decoder_only model, no prompts, or a prompt too long for model.max_len.
    """
    if model.cfg.mode != "decoder_only":
        raise ValueError(f"generate() continues prompts of a decoder_only model; this one is {model.cfg.mode}")
    _check_settings(settings)
    eos_id = _check_special_ids(model, eos_id=eos_id)["eos_id"]
    L = model.cfg.max_len
    prompt_BP, lengths_B = _padded(prompts, "prompt", model, L - 1)  # room for one new token
    # The buffer: prompts padded to a power of two, then the new tokens (shapes a few compilations cover).
    # A row continues from its own length, so one shorter than the padded width runs more steps.
    length = min(prompt_BP.shape[1] + settings.max_new_tokens, L)
    max_new_B = np.minimum(settings.max_new_tokens, length - lengths_B).astype(np.int32)
    num_new = min(settings.max_new_tokens, length - 1)  # as many as a one-token prompt can take
    return _run(model, prompt_BP, lengths_B, max_new_B, None, settings, num_new, length, eos_id, rng)


def translate(model, sources: Sequence[Sequence[int]], settings: DecodeConfig = DEFAULTS, *, bos_id, eos_id):
    """encoder_decoder: outputs for each source (a list of ids), up to source length + settings.extra_len
    tokens (the paper's limit with extra_len=50) and the model's maximum length.

    Args:
        model (Transformer): an encoder_decoder model.
        sources: B lists of ids (or an array [B, S]).
        settings: strategy, lengths, sampling and beam settings.
        bos_id (int): the id every output starts with.
        eos_id (int | None): the end-of-sequence id.

    Returns:
        generation (Generation): tokens [B, n, N] and scores [B, n].

    Raises:
        TypeError: sources that are not id lists, settings that are not a DecodeConfig, or no bos_id.
        ValueError: not an encoder_decoder model, no sources, or a source too long for model.max_len.
    """
    if model.cfg.mode != "encoder_decoder":
        raise ValueError(f"translate() needs an encoder_decoder model; this one is {model.cfg.mode}")
    _check_settings(settings)
    special = _check_special_ids(model, bos_id=bos_id, eos_id=eos_id)
    bos_id, eos_id = special["bos_id"], special["eos_id"]
    if bos_id is None:
        raise TypeError("bos_id: translate() starts every output with it; got None")
    L = model.cfg.max_len
    src_BS, src_lengths_B = _padded(sources, "source", model, L)
    num_new = min(src_BS.shape[1] + settings.extra_len, L - 1)
    max_new_B = np.minimum(src_lengths_B + settings.extra_len, num_new).astype(np.int32)
    prompt_B1 = np.full((len(sources), 1), bos_id, np.int32)
    src = (src_BS, src_lengths_B)
    lengths_B = np.ones(len(sources), np.int32)
    return _run(model, prompt_B1, lengths_B, max_new_B, src, settings, num_new, 1 + num_new, eos_id, None)


# ----------------------------------------------------------------------------- text


def strip_after_eos(ids, eos_id) -> list[int]:
    """The ids of one output before its first EOS.

    Args:
        ids (Sequence[int]): one output's ids.
        eos_id (int | None): the end-of-sequence id, or None.

    Returns:
        The ids before the first EOS.
    """
    ids = as_token_ids(ids, "ids", rank=1).tolist() if len(ids) else []
    return ids[: ids.index(eos_id)] if eos_id is not None and eos_id in ids else ids


def encode_texts(tok, texts: Sequence[str], what: str, eos: bool = False) -> list[list[int]]:
    """Texts -> id lists (with EOS appended if asked); rejects text the tokenizer cannot represent.

    Args:
        tok (Tokenizer): the tokenizer.
        texts: the texts.
        what: what they are, for the messages ("prompt", "source").
        eos: append EOS.

    Returns:
        One id list per text.

    Raises:
        TypeError: not a list of texts.
        ValueError: a text the tokenizer cannot represent, naming its index.
    """
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise TypeError(f"{what}s: a list of texts, got {'None' if texts is None else type(texts).__name__}")
    rows = []
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"{what} {i}: a text, got {type(text).__name__}")
        try:
            ids = tok.encode(text)
        except ValueError as e:
            raise ValueError(f"{what} {i}: {e}") from None
        unk = getattr(tok, "unk_id", None)
        if unk is not None and unk in ids:
            raise ValueError(f"{what} {i} ({text!r}) has pieces outside the tokenizer's vocabulary")
        rows.append([*ids, tok.eos_id] if eos and ids and tok.eos_id is not None else ids)
    return rows


def translate_texts(model, tok, sources: Sequence[str] | Sequence[Sequence[int]], settings: DecodeConfig) -> list:
    """Source texts (or id lists ending in EOS) -> output texts; with num_return > 1, a list per source.

    Args:
        model (Transformer): an encoder_decoder model.
        tok (Tokenizer): its tokenizer.
        sources: texts, or id lists ending in EOS.
        settings: the decoding settings.

    Returns:
        One text (or a list of num_return texts) per source.
    """
    texts = len(_iterable(sources, "source")) > 0 and all(isinstance(s, str) for s in sources)
    rows = encode_texts(tok, sources, "source", eos=True) if texts else sources
    out = translate(model, rows, settings, bos_id=tok.bos_id, eos_id=tok.eos_id)
    texts = [[tok.decode(strip_after_eos(seq, tok.eos_id)) for seq in row] for row in out.tokens]
    return [t[0] for t in texts] if settings.num_return == 1 else texts


class EmptyContinuation(UserWarning):
    """A continuation with no text in it: which prompt, why, and what to change."""


def continue_texts(model, tok, prompts: Sequence[str], settings: DecodeConfig, stop_at_eos: bool = False) -> list:
    """Prompt texts -> generated continuations. Unless `stop_at_eos`, EOS (the end of a
    paragraph in the LM data) does not stop generation and shows as a blank line.

    A continuation with no text (EOS first with `stop_at_eos`, or nothing but EOS) warns with
    `EmptyContinuation` saying why, rather than handing back an empty string in silence: beam
    search's likeliest sequence often is the shortest (Holtzman et al. 2020), and the empty
    one is as short as it gets.

    Args:
        model (Transformer): a decoder_only model.
        tok (Tokenizer): its tokenizer.
        prompts: the texts to continue.
        settings: the decoding settings.
        stop_at_eos: stop at the end of a paragraph.

    Returns:
        One continuation (or a list of num_return) per prompt.
    """
    eos_id = tok.eos_id if stop_at_eos else None
    out = generate(model, encode_texts(tok, prompts, "prompt"), settings, eos_id=eos_id)
    texts = []
    for p, row in enumerate(out.tokens):
        texts.append([])
        for seq in row:
            ids = [int(i) for i in seq]
            cut = [i + 1 for i, t in enumerate(ids) if t == tok.eos_id]
            texts[-1].append("\n\n".join(tok.decode(c) for c in np.split(ids, cut)))
            if not texts[-1][-1].strip():
                warnings.warn(_why_empty(p, ids, tok.eos_id, settings, stop_at_eos), EmptyContinuation, stacklevel=2)
    return [t[0] for t in texts] if settings.num_return == 1 else texts


def answer_texts(model, tok, prompts: Sequence[str], settings: DecodeConfig, template: str) -> list:
    """Instructions -> responses: each prompt written in the training data's template (an empty
    response to follow), generation stopped at EOS, and the template's end marker taken off. A
    decoder-only model continues the templated prompt; an encoder-decoder reads it as its source.

    Args:
        model (Transformer): a model trained on instruction data.
        tok (Tokenizer): its tokenizer.
        prompts: the instructions.
        settings: the decoding settings.
        template: the data's template name ("alpaca", "chatml", ...).

    Returns:
        One response (or a list of num_return) per prompt.
    """
    from jaxformer.data import templates

    t = templates.get(template)
    fed = [t.prompt(p) for p in prompts]
    if model.cfg.mode == "encoder_decoder":
        return _responses(translate_texts(model, tok, fed, settings), t.end)
    return _responses(continue_texts(model, tok, fed, settings, stop_at_eos=True), t.end)


def _responses(outs: list, end: str) -> list:
    """Continuations cut at the template's end marker (the EOS that follows it stopped them)."""
    cut = lambda text: (text.split(end)[0] if end else text).strip()
    return [cut(o) if isinstance(o, str) else [cut(x) for x in o] for o in outs]


def _why_empty(prompt: int, ids: list[int], eos_id, settings: DecodeConfig, stop_at_eos: bool) -> str:
    ended = stop_at_eos and ids and ids[0] == eos_id
    what = "ends the text at once (EOS first)" if ended else f"holds no text ({len(ids)} tokens: paragraph ends)"
    if settings.strategy != "beam":
        return f"prompt {prompt}: the continuation {what}: the model's {settings.strategy} choice"
    return (
        f"prompt {prompt}: beam search's best continuation {what}: with length_penalty="
        f"{settings.length_penalty}, no longer one scores higher; sample instead (decode.strategy=sample)"
        + (", or do not stop at EOS" if ended else "")
    )


def sample_texts(model, cfg, data) -> tuple[list[str], list[str]]:
    """A few (input, model output) pairs from held-out data, for logs; generation follows `cfg.decode`.

    Args:
        model (Transformer): the model.
        cfg (Config): the run's config (`train.num_samples`, `decode`).
        data (object): the run's data (`data.Batches`), its held-out split and tokenizer.

    Returns:
        (inputs, outputs).
    """
    tok, objective, L = data.tokenizer, cfg.train.objective, cfg.data.max_len
    sources = data.sample_sources[: cfg.train.num_samples]
    if objective == "seq2seq":
        return sources, translate_texts(model, tok, sources, cfg.decode)
    if objective == "lm" and cfg.data.template != "none":  # held-out prompts, already in the template
        from jaxformer.data import templates

        outs = continue_texts(model, tok, sources, cfg.decode, stop_at_eos=True)
        return sources, _responses(outs, templates.get(cfg.data.template).end)
    if objective == "lm":
        prompts = [s[-L // 2 :] for s in sources]  # output runs to the model's maximum length
        return prompts, continue_texts(model, tok, prompts, cfg.decode)
    if objective == "classify":
        L = cfg.data.src_len
        ids = np.zeros((len(sources), L), np.int32)
        for i, s in enumerate(sources):
            enc = [tok.bos_id, *tok.encode(s)][:L]
            ids[i, : len(enc)] = enc
        return sources, [data.labels[int(c)] for c in np.argmax(model.classify(jnp.asarray(ids)), -1)]
    outs = []  # mlm: every 7th token masked, then predicted
    for s in sources:
        ids = np.asarray(tok.encode(s)[:L], np.int32)
        hidden = np.arange(len(ids)) % 7 == 1
        pred = np.asarray(jnp.argmax(model(jnp.asarray(np.where(hidden, tok.mask_id, ids)[None])), -1))[0]
        outs.append(tok.decode(np.where(hidden, pred, ids)))
    return sources, outs
