"""Refcounted page allocator: the only owner of which KV pages are free."""

from __future__ import annotations

from collections import deque


class PageAllocator:
    """Hands out page ids in [0, num_pages).

    Out of room is a return value (`allocate` returns None), never an exception. A page goes
    back to the free list when its refcount drops to zero; freeing a free page is a bug and
    raises, so a double free cannot silently hand one page to two requests.
    """

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"the KV cache needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._refcounts = [0] * num_pages
        # Pages the prefix cache holds (cache/radix.py marks them); the evictable ones are those
        # whose only holder it is (refcount 1), counted as refcounts change: a status report
        # reads it every heartbeat without walking the cache.
        self._cached = [False] * num_pages
        self.num_evictable_pages = 0
        # Called with a cached page whose last other holder let go (the prefix cache listens)
        self.on_evictable = None

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> list[int] | None:
        if not self.can_allocate(num_pages):
            return None
        page_ids = [self._free.popleft() for _ in range(num_pages)]
        for page_id in page_ids:
            self._refcounts[page_id] = 1
        return page_ids

    def refcount(self, page_id: int) -> int:
        return self._refcounts[page_id]

    def incref(self, page_ids: list[int]) -> None:
        """Share pages (prefix caching): each needs one more free() before it is free again."""
        for page_id in page_ids:
            if self._refcounts[page_id] == 0:
                raise RuntimeError(f"incref of free page {page_id}")
            if self._cached[page_id] and self._refcounts[page_id] == 1:
                self.num_evictable_pages -= 1
            self._refcounts[page_id] += 1

    def free(self, page_ids: list[int]) -> None:
        for page_id in page_ids:
            if self._refcounts[page_id] == 0:
                raise RuntimeError(f"double free of page {page_id}")
            self._refcounts[page_id] -= 1
            if self._refcounts[page_id] == 0:
                if self._cached[page_id]:
                    raise RuntimeError(f"page {page_id} freed while the prefix cache holds it")
                self._free.append(page_id)
            elif self._cached[page_id] and self._refcounts[page_id] == 1:
                self.num_evictable_pages += 1
                if self.on_evictable is not None:
                    self.on_evictable(page_id)

    def set_cached(self, page_id: int, cached: bool) -> None:
        """The prefix cache takes (True) or drops (False) its reference's mark on a page it
        holds: the page counts as evictable while that reference is its only one."""
        if self._refcounts[page_id] == 0 or self._cached[page_id] == cached:
            raise RuntimeError(f"set_cached({page_id}, {cached}) on a page in the wrong state")
        self._cached[page_id] = cached
        if self._refcounts[page_id] == 1:
            self.num_evictable_pages += 1 if cached else -1
