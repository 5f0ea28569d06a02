"""The search for the largest batch that fits: which batches to compile next, given the peaks of those
compiled so far (a refusal of the compiler's counts as above the memory)."""

from __future__ import annotations

import math
import re


def _refused_bytes(message: str, memory: float) -> float:
    """The peak a TPU compiler's out-of-memory refusal implies: `memory` plus what its temporaries need
    beyond what it had for them ("required for HLO temporaries (42.47G) exceeds available HBM
    (30.75G)"), or infinity when it gives no figure."""
    size = lambda m: float(m.group(1)) * 1024 ** ("KMGT".index(m.group(2)) + 1)
    required = re.search(r"required for HLO temporaries \(([\d.]+)([KMGT])\)", message)
    available = re.search(r"exceeds available HBM \(([\d.]+)([KMGT])\)", message)
    return memory + size(required) - size(available) if required and available else math.inf


def _largest_batch(peaks_at, shards: int, memory: float, start: int | None = None, within: float = 0.0, jobs: int = 1):
    """The largest multiple of `shards` whose step fits in `memory`, and the smallest tried that does
    not (None if none was). The search stops once that gap is at most `within` of the latter (or
    one step), or after 12 rounds. `peaks_at(batches)` compiles a round's batches side by side and
    gives their peaks; a round holds up to `jobs` tries (see `_round`)."""
    known: dict[int, float] = {}  # batch -> peak (a refusal: above memory)
    for _ in range(12):
        if not (tries := _round(known, shards, memory, start, within, jobs)):
            break
        known.update(zip(tries, peaks_at(tries), strict=True))
    fits = max((b for b, p in known.items() if p <= memory), default=0)
    return fits, min((b for b, p in known.items() if p > memory and b > fits), default=None)


def _round(known: dict, shards: int, memory: float, start: int | None, within: float, jobs: int) -> list[int]:
    """Up to `jobs` batches to compile side by side: the next try, then the try that would follow it
    if it came out as the lines through the known batches foretell, and so on."""
    tries, assumed = [], dict(known)
    while len(tries) < jobs and (batch := _next_try(assumed, shards, memory, start, within)) is not None:
        tries.append(batch)
        foretold = _foretell(assumed, batch)  # a foretold refusal stays a refusal, however near
        assumed[batch] = foretold if foretold <= memory else max(foretold, math.nextafter(memory, math.inf))
    return tries


def _foretell(known: dict, batch: int) -> float:
    """A batch's peak by the line through the known figures nearest it (one figure: in proportion;
    none: nothing, so that it is foretold to fit)."""
    points = sorted((b, p) for b, p in known.items() if math.isfinite(p))
    below, above = [x for x in points if x[0] < batch], [x for x in points if x[0] > batch]
    pair = [*below[-1:], *above[:1]] if below and above else _rising(below)
    if len(pair) == 2:
        (b0, p0), (b1, p1) = pair
        return p0 + (p1 - p0) * (batch - b0) / (b1 - b0)
    nearest = below[-1:] or above[:1]
    return nearest[0][1] * batch / nearest[0][0] if nearest else 0.0


def _rising(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The last of the (batch, peak) points and the last before it with a lower peak: the line a
    search extends. A compiler that rematerialises once over its memory limit (XLA's GPU compiler)
    can give a larger batch the smaller peak; a line through those two would fall."""
    if not points:
        return []
    lower = [x for x in points[:-1] if x[1] < points[-1][1]]
    return [*lower[-1:], points[-1]]


def _next_try(known: dict, shards: int, memory: float, start: int | None, within: float) -> int | None:
    """The batch to compile next given the peaks `known` (None: the search is done).

    Memory grows about linearly with the batch, but rows cost less at small batches (fixed
    buffers) and a TPU compiler's refusal understates the excess (it rematerialises harder near
    its limit), so lines overshoot. Each try takes the lower of two lines' edges (through the
    largest batch that fits and the largest below it with a lower peak; between the largest that
    fits and the smallest that does not),
    aimed just below it so that a fit can end the search; a gap wider than 4x is cut at its
    geometric middle, every try cuts at least an eighth of it, and once a fit is close to the
    lines' edge the next try is the one that would close the gap from above. The first try is
    `start` (the configured batch), then its double when it fits, or the smallest batch when not."""
    if not known:
        return start or shards
    below = sorted(b for b, p in known.items() if p <= memory)
    if not below:
        return None if shards in known else shards
    fits = below[-1]
    over = min((b for b, p in known.items() if p > memory and b > fits), default=None)
    edges = []  # where lines through known batches reach the memory
    if len(rising := _rising([(b, known[b]) for b in below])) == 2:
        (b0, p0), (b1, p1) = rising
        edges.append(b1 + (memory - p1) * (b1 - b0) / (p1 - p0))
    if over is not None and math.isfinite(known[over]):
        edges.append(fits + (memory - known[fits]) * (over - fits) / (known[over] - known[fits]))
    if over is None:
        guess = min(edges, default=2 * fits if fits > shards else 4 * shards)
    else:
        if over - fits <= max(within * over, shards):
            return None
        guess = min(edges, default=math.sqrt(fits * over)) - within * over / 2
        if over > 4 * fits:
            guess = min(guess, math.sqrt(fits * over))
        if guess < fits * (1 + within / 2):  # the edge is near: the try that closes the gap from above
            guess = fits * (1 + 0.9 * within)
        gap = over - fits
        guess = min(max(guess, fits + gap / 8), over - gap / 8, over - shards)
    guess = max(int(guess) // shards * shards, fits + shards)
    return None if over is not None and guess >= over else guess
