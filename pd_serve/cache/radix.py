"""Prefix cache: full pages of computed KV kept after their requests end, found again by tokens.

A tree over pages: each node is one full page, keyed by its page_size token ids under its
parent (the tokens before it), so a path from the root is a prefix and matching is page by page
(a partial last page is never shared: the request that owns it may still write into it).

Ownership is the allocator's refcount: the cache holds one reference on each cached page, and a
request that reuses a page holds another (allocator.incref at match). A page whose only holder
is the cache can be evicted. A request that uses a node has matched its whole path, so a node's
ancestors are held at least as often as the node: the evictable pages are the nodes whose
refcount is 1, and eviction takes least recently inserted leaves first, working up.

Eviction pops candidate leaves from a heap instead of scanning the tree: a leaf is pushed when
an insert ends at it, when its last child is evicted, and when its page's last holder but the
cache lets go (the allocator tells the cache; a holder may give a page back without inserting,
e.g. a reservation that failed or was aborted before its KV came); entries that are stale
(touched since, no longer a leaf, evicted) or in use are dropped when popped, and the node's
next push brings it back.
"""

from __future__ import annotations

import heapq
import itertools

from pd_serve.cache.allocator import PageAllocator


class _Node:
    __slots__ = ("key", "page_id", "parent", "children", "last_used")  # parent None: evicted

    def __init__(self, key: tuple, page_id: int, parent: "_Node | None", last_used: int):
        self.key, self.page_id, self.parent, self.last_used = key, page_id, parent, last_used
        self.children: dict[tuple, _Node] = {}


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self._clock = itertools.count(1)
        self.root = _Node((), -1, None, 0)
        self._leaves: list[tuple[int, int, _Node]] = []  # heap of (last_used, seq, node)
        self._seq = itertools.count()
        self.num_pages = 0  # pages the cache holds a reference on
        self.hit_tokens = 0  # totals, for metrics: tokens found / looked up at admission
        self.query_tokens = 0
        self.evicted_pages = 0
        self._node_of: dict[int, _Node] = {}  # page id -> its node
        allocator.on_evictable = self._evictable

    def _keys(self, token_ids: list[int], num_pages: int):
        ps = self.page_size
        return (tuple(token_ids[i * ps:(i + 1) * ps]) for i in range(num_pages))

    def match(self, token_ids: list[int], max_pages: int | None = None) -> list[int]:
        """The cached pages of token_ids' longest cached prefix (at most max_pages), each
        incref'd for the caller, who gives them back like its own (insert, then free)."""
        pages = [node.page_id for node in self._path(token_ids, max_pages)]
        self.allocator.incref(pages)
        self.query_tokens += len(token_ids)
        self.hit_tokens += len(pages) * self.page_size
        return pages

    def match_length(self, token_ids: list[int]) -> int:
        """Tokens of token_ids' longest cached prefix (no reference taken; for ordering)."""
        return len(self._path(token_ids)) * self.page_size

    def _path(self, token_ids: list[int], max_pages: int | None = None) -> list[_Node]:
        """The nodes of token_ids' longest cached prefix, root excluded."""
        n = len(token_ids) // self.page_size
        if max_pages is not None:
            n = min(n, max_pages)
        node, path = self.root, []
        for key in self._keys(token_ids, n):
            node = node.children.get(key)
            if node is None:
                break
            path.append(node)
        return path

    def dfs_order(self, items: list, tokens_of) -> list:
        """items (e.g. queued requests) grouped by their cached prefixes, as SGLang's dfs-weight
        policy orders them: each item hangs at the deepest cached node of tokens_of(item); a
        node's weight is the items under it; a depth-first walk visits children heaviest first
        and gives a node's own items after its children's. Ties keep items' order."""
        at: dict[int, list] = {}
        weight: dict[int, int] = {}
        for item in items:
            path = self._path(tokens_of(item))
            at.setdefault(id(path[-1] if path else self.root), []).append(item)
            for node in [self.root] + path:
                weight[id(node)] = weight.get(id(node), 0) + 1
        order, stack = [], [(self.root, False)]
        while stack:  # iterative post-order: prefixes can be thousands of pages deep
            node, expanded = stack.pop()
            if expanded:
                order.extend(at.get(id(node), ()))
                continue
            stack.append((node, True))
            children = [c for c in node.children.values() if id(c) in weight]
            children.sort(key=lambda c: -weight[id(c)])
            stack.extend((c, False) for c in reversed(children))
        return order

    def insert(self, token_ids: list[int], page_ids: list[int], share: bool = False) -> list[int]:
        """Cache the full pages of a request's computed prefix: token_ids are its tokens whose
        KV is in page_ids (len(token_ids) // page_size pages, one reference each held by the
        caller). The cache takes over the caller's reference on each page it did not hold;
        returns the pages it already had under those tokens (the caller frees those).
        share: the caller keeps its references (a running request whose prompt is computed,
        so requests arriving meanwhile find it): the cache takes a reference of its own on
        each page it did not hold, and returns nothing."""
        node, duplicates = self.root, []
        now = next(self._clock)
        for key, page_id in zip(self._keys(token_ids, len(token_ids) // self.page_size), page_ids):
            child = node.children.get(key)
            if child is None:
                if share:
                    self.allocator.incref([page_id])
                child = node.children[key] = _Node(key, page_id, node, now)
                self._node_of[page_id] = child
                self.allocator.set_cached(page_id, True)
                self.num_pages += 1
            else:
                child.last_used = now
                if not share:
                    duplicates.append(page_id)
            node = child
        if node is not self.root and not node.children:
            self._push(node)
        return duplicates

    def _push(self, node: _Node) -> None:
        heapq.heappush(self._leaves, (node.last_used, next(self._seq), node))

    def _evictable(self, page_id: int) -> None:
        node = self._node_of.get(page_id)
        if node is not None and not node.children:
            self._push(node)

    def evict(self, num_pages: int) -> int:
        """Give back to the allocator up to num_pages pages only the cache holds, least
        recently used leaves first; returns how many."""
        refcount = self.allocator.refcount
        evicted = 0
        while self._leaves and evicted < num_pages:
            last_used, _, node = heapq.heappop(self._leaves)
            if node.parent is None or node.children or node.last_used != last_used \
                    or refcount(node.page_id) != 1:
                continue  # stale, or in use (pushed again when only the cache holds it)
            parent, node.parent = node.parent, None
            del parent.children[node.key]
            del self._node_of[node.page_id]
            self.allocator.set_cached(node.page_id, False)
            self.allocator.free([node.page_id])
            self.num_pages -= 1
            evicted += 1
            if parent is not self.root and not parent.children:
                self._push(parent)
        if len(self._leaves) > 4 * self.num_pages + 64:  # drop stale entries now and then
            self._leaves = [e for e in self._leaves if e[2].parent is not None and not e[2].children]
            heapq.heapify(self._leaves)
        self.evicted_pages += evicted
        return evicted

    def flush(self) -> int:
        """Evict every page only the cache holds; returns how many."""
        self._leaves = [(n.last_used, next(self._seq), n) for n in self.nodes() if not n.children]
        heapq.heapify(self._leaves)
        return self.evict(self.num_pages)

    def num_evictable_pages(self) -> int:
        """Pages only the cache holds (the allocator counts them as refcounts change)."""
        return self.allocator.num_evictable_pages

    def nodes(self):
        """Every cached node (tests check the allocator's counts against a walk)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
