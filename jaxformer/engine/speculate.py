"""Speculative decoding by prompt lookup (vLLM's "ngram" method): a request's next tokens guessed from its
own text, then checked by one step of the model over all of them.

The guess (`draft`): the tokens that followed an earlier occurrence of the sequence's last n tokens (its
prompt and output so far), n from `prompt_lookup_max` down to `prompt_lookup_min`: text that repeats
itself (code being edited, a document summarised or quoted, a list, a loop) is guessed right. The check
(`steps._forward(verify=True)`): the model reads the last token and the k drafted ones at once, and each
position draws its token as a decode step at that position would, with the same per-position key
(`paged.request_keys`); the drafted tokens are taken while each equals the token drawn before it, and the
first token drawn that differs (or the one after the last draft) is taken too (`accepted`). So a
request's tokens are exactly those it gets without speculation, greedy or sampled: only the number of
model calls changes, from one per token to one per 1 + (accepted drafts) tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

if TYPE_CHECKING:
    from jaxformer.config import EngineConfig


def drafts(reqs: list, cfg: EngineConfig, max_context: int) -> dict:
    """Each decoding request's drafted tokens (`draft`): none for one whose tokens a penalty, a bias, a form
    or a bad word shapes (its check would need each draft's counts or state), none past its `max_tokens` or
    the context.

    Args:
        reqs: the engine's requests about to decode.
        cfg: the engine's settings (`speculative_tokens`, `prompt_lookup_max`, `prompt_lookup_min`).
        max_context: the engine's context.

    Returns:
        {request: its drafted tokens}, or {} where speculation is off or nothing is drafted.
    """
    if not cfg.speculative_tokens:
        return {}
    out = {}
    for r in reqs:
        # k at most, and no more than its tokens taken with the one drawn after them leave room for
        room = min(cfg.speculative_tokens, r.params.max_tokens - len(r.out) - 1, max_context - len(r.tokens) - 1)
        plain = not (r.params.penalized or r.guide or r.banned) and room > 0
        out[r] = draft(r.tokens, room, cfg.prompt_lookup_max, cfg.prompt_lookup_min) if plain else []
    return out if any(out.values()) else {}


def draft(tokens: list[int], k: int, longest: int, shortest: int) -> list[int]:
    """Prompt lookup: the (up to) k tokens that followed the latest earlier occurrence of the sequence's last
    n tokens, for the largest n in [shortest, longest] that occurs earlier; a later occurrence with fewer than
    k tokens after it gives way to the latest with k.

    Args:
        tokens: the sequence so far (prompt and output).
        k: the most tokens drafted.
        longest: the longest n-gram looked up.
        shortest: the shortest n-gram looked up.

    Returns:
        The drafted tokens (none where nothing matches).
    """
    seq = np.asarray(tokens)
    L = len(seq)
    for n in range(min(longest, L - 1), shortest - 1, -1):
        windows = sliding_window_view(seq[: L - 1], n)  # every n-gram that ends before the last token
        starts = np.flatnonzero((windows == seq[L - n :]).all(axis=1))
        if starts.size:
            full = starts[starts + n + k <= L]  # followed by k tokens
            at = (full if full.size else starts)[-1] + n
            return seq[at : at + k].tolist()
    return []


def accepted(drawn: np.ndarray, drafted: list[int]) -> int:
    """How many tokens a row takes from its check: the drafted tokens that each equal the token drawn before
    them, then one more (the first drawn that differs, or the one after the last draft).

    Args:
        drawn: [T] the tokens its positions drew (position j's draw follows the last token and drafts[:j]).
        drafted: its drafted tokens.

    Returns:
        1 + the count of drafts taken.
    """
    n = 0
    while n < len(drafted) and drawn[n] == drafted[n]:
        n += 1
    return n + 1
