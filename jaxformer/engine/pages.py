"""The page allocator of the paged KV cache (plain Python, outside jit): free pages, reference
counts, and the prefix cache that lets requests sharing whole pages of prompt share those pages.

A full page of prompt is known by a hash of its token ids chained with the hash of the pages before
it (vLLM's prefix caching), so equal hashes mean equal prefixes up to the page's end. A page whose
last reference goes returns to the free list but keeps its hash until it is handed out again, so a
later request with the same prefix still finds it (least recently freed pages are reused first).

A model whose every layer attends over a sliding window (Mistral's) never reads a position again once
it is older than the window of the sequence's next query: the pages wholly behind it are released as
the sequence moves on (`releasable_window`, `pages_behind`), so a sequence holds a bounded number of
pages at once (`pages_at_once`) however long it grows. A shared page goes back to the pool only when
its last holder releases it, as any page does.
"""

from __future__ import annotations

import collections


def page_hashes(ids: list[int], page_size: int, root: int | None = None) -> list[int]:
    """The chained hash of each full page of `ids` (a partial last page has none).

    Args:
        ids: token ids.
        page_size: positions per page.
        root: what the first page's hash is chained to (an encoder-decoder's source, whose
            cross-attention shapes every decoder layer's keys after the first), or None.

    Returns:
        One hash per full page, in order.
    """
    hashes, h = [], root
    for start in range(0, len(ids) - page_size + 1, page_size):
        h = hash((h, tuple(ids[start : start + page_size])))
        hashes.append(h)
    return hashes


def releasable_window(mcfg) -> int:
    """The window behind which a sequence's positions are never read again: the model's sliding window
    when every decoder layer is local, else 0 (a global layer reads the whole prefix: Gemma 2 and 3
    interleave them, so their pages are all kept).

    Args:
        mcfg (ModelConfig): the model's config.

    Returns:
        W > 0, or 0: keep every page.
    """
    layers = range(mcfg.num_decoder_layers)
    return mcfg.sliding_window if layers and all(mcfg.is_local_layer(i) for i in layers) else 0


def pages_behind(position: int, window: int, page_size: int) -> int:
    """How many leading pages of a sequence hold only positions that the query at `position`, and every
    later one, no longer sees: those before position - window + 1 (0 without a window).

    Args:
        position: the sequence's next position to compute.
        window: W (`releasable_window`; 0: none).
        page_size: positions per page.

    Returns:
        The count of leading pages that can be released.
    """
    return max(0, (position - window + 1) // page_size) if window else 0


def pages_at_once(positions: int, window: int, page_size: int, span: int) -> int:
    """The most pages a sequence of `positions` positions holds at one time when it computes at most
    `span` positions a step and releases the pages behind its window after each (`pages_behind`):
    those from the oldest page its next query sees to the page of the step's last position.

    Args:
        positions: the sequence's length at its end (prompt + max_tokens).
        window: W (0: every page is kept).
        page_size: positions per page.
        span: positions computed in one step at most (a prefill chunk, or the decode steps of a call).

    Returns:
        The count of pages.
    """
    whole = -(-positions // page_size)
    # From the page of p - W + 1 to that of p + span - 1: W + span - 2 positions apart at most.
    return min(whole, -(-(window + span - 2) // page_size) + 1) if window else whole


def bucket(n: int, most: int) -> int:
    """The power of two at or above n, at most `most`: the row and page counts of a step's call, so that a
    few compilations cover every mix of requests.

    Args:
        n: the rows, or pages, a call needs.
        most: the most there can be (`max_slots`, or a row's pages at max_context).

    Returns:
        The count the call runs.
    """
    return min(1 << (n - 1).bit_length(), most)


class PageAllocator:
    """Pages 1..N-1 of a pool (page 0 is scratch), reference-counted, with a prefix cache.

    Args:
        num_pages: N, the pool's pages (page 0 included).
    """

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.refs = [0] * num_pages
        self.free = collections.OrderedDict((p, None) for p in range(1, num_pages))  # oldest first
        self.by_hash: dict[int, int] = {}
        self.hash_of: dict[int, int] = {}

    def num_free(self) -> int:
        """Pages free to hand out (cached ones included).

        Returns:
            The count.
        """
        return len(self.free)

    def allocate(self) -> int:
        """A free page, its reference count 1 (a cached page handed out forgets its hash).

        Returns:
            The page id.

        Raises:
            RuntimeError: no page is free (callers check `num_free` first).
        """
        if not self.free:
            raise RuntimeError("the page pool is exhausted")
        page, _ = self.free.popitem(last=False)
        if (h := self.hash_of.pop(page, None)) is not None:
            del self.by_hash[h]
        self.refs[page] = 1
        return page

    def share(self, page: int) -> None:
        """One more reference to `page` (taking it off the free list if it sat there, cached).

        Args:
            page: the page id.
        """
        if self.refs[page] == 0:
            del self.free[page]
        self.refs[page] += 1

    def release(self, page: int) -> None:
        """One reference fewer; at none the page is free again (its hash kept until it is reused).

        Args:
            page: the page id.
        """
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.free[page] = None

    def release_front(self, pages: list[int], start: int, stop: int) -> int:
        """Release `pages[start:stop]` (a sequence's pages behind its window), each entry then 0 (scratch:
        nothing of the sequence is there any more).

        Args:
            pages: a sequence's pages, in order.
            start: the first not yet released.
            stop: the end of those to release now.

        Returns:
            How many were released.
        """
        for i in range(start, stop):
            self.release(pages[i])
            pages[i] = 0
        return max(0, stop - start)

    def forget(self) -> None:
        """Empty the prefix cache (pages computed under weights no longer served): no page is found by its
        hash any more; reference counts and the free list are unchanged."""
        self.by_hash.clear()
        self.hash_of.clear()

    def lookup(self, h: int) -> int | None:
        """The page holding the prefix of hash `h`, or None.

        Args:
            h: a chained page hash (`page_hashes`).

        Returns:
            The page id, or None.
        """
        return self.by_hash.get(h)

    def register(self, page: int, h: int) -> None:
        """Record that `page` holds the (now computed) prefix of hash `h`.

        Args:
            page: the page id.
            h: its chained hash.
        """
        if h not in self.by_hash and page not in self.hash_of:
            self.by_hash[h], self.hash_of[page] = page, h
