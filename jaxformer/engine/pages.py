"""The page allocator of the paged KV cache (plain Python, outside jit): free pages, reference
counts, and the prefix cache that lets requests sharing whole pages of prompt share those pages.

A full page of prompt is known by a hash of its token ids chained with the hash of the pages before
it (vLLM's prefix caching), so equal hashes mean equal prefixes up to the page's end. A page whose
last reference goes returns to the free list but keeps its hash until it is handed out again, so a
later request with the same prefix still finds it (least recently freed pages are reused first).
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
