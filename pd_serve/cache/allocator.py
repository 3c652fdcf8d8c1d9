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
            self._refcounts[page_id] += 1

    def free(self, page_ids: list[int]) -> None:
        for page_id in page_ids:
            if self._refcounts[page_id] == 0:
                raise RuntimeError(f"double free of page {page_id}")
            self._refcounts[page_id] -= 1
            if self._refcounts[page_id] == 0:
                self._free.append(page_id)
