"""Which worker of a pool takes a request (round_robin, least_load; for prompts also prefix and
cache_aware), and which prefill and decode workers can pair at all.

cache_aware keeps, per worker, the hashes of the page-aligned prompt prefixes the gateway sent
it (a chain: a page's hash covers every token before it), least recently used dropped past the
worker's pool size, the most its prefix cache can hold. A prompt goes to the worker whose index
holds its longest prefix (the least loaded among equals) unless the pool's load is out of
balance (sgl-router's rule: the busiest worker's requests exceed the idlest's by more than
balance_abs_threshold and by more than balance_rel_threshold times), then to the least loaded.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from pd_serve.cache.pool import KVLayout
from pd_serve.config import DECODE_POLICIES, PREFILL_POLICIES
from pd_serve.protocol import WorkerStatus
from pd_serve.transfer.base import layout_mismatch
from pd_serve.transfer.heads import tp_error

POLICIES = {"prefill": PREFILL_POLICIES, "decode": DECODE_POLICIES}
PREFIX_TOKENS = 64  # requests sharing this many leading tokens go to the same prefill worker
# A prefill worker is sent prompts while fewer than this many steps' worth of tokens wait on
# it: it never idles, and the rest wait in the gateway's priority queue, without holding
# decode pages.
PREFILL_QUEUE_STEPS = 4


@dataclass
class WorkerState:
    status: WorkerStatus
    # the ZMQ routing id of the worker's control connection (the gateway's ROUTER assigns one
    # per connection; a worker never picks its own, so no other peer can take it)
    route: bytes = b""
    last_seen: float = field(default_factory=time.monotonic)  # any message, heartbeats too
    beat_seq: int = 0  # the newest Heartbeat.seq heard
    # a message from the worker's loop (it sends its status between steps): it is not stuck
    last_progress: float = field(default_factory=time.monotonic)
    # Requests the gateway has routed here and not seen finish, with their token estimate.
    inflight: dict[str, int] = field(default_factory=dict)
    full_until: float = 0.0  # decode: said its pool was full; no new request before this

    def prefill_has_room(self, num_tokens: int) -> bool:
        """Prefill: this prompt joins what waits here without passing PREFILL_QUEUE_STEPS
        steps of work (a worker with nothing takes any prompt). Under the worker's
        --long-prefill-token-threshold a prompt takes at most that many tokens of a step while
        others wait, so each counts for at most that much: short prompts are still sent to a
        worker busy with long ones, and start beside them."""
        cap = self.status.long_prefill_token_threshold or math.inf
        queued = sum(min(tokens, cap) for tokens in self.inflight.values())
        budget = PREFILL_QUEUE_STEPS * max(1, self.status.max_prefill_tokens)
        return not self.inflight or queued + min(num_tokens, cap) <= budget

    @property
    def worker_id(self) -> str:
        return self.status.worker_id

    @property
    def load(self) -> int:
        """Outstanding tokens: what the gateway routed here and has not seen finish."""
        return sum(self.inflight.values())


class PrefixIndex:
    """The gateway's guess of one worker's prefix cache: page-prefix hashes, LRU-bounded."""

    def __init__(self):
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def match(self, hashes: list[bytes]) -> int:
        """How many of hashes, from the first, are here (pages of a cached prefix)."""
        n = 0
        while n < len(hashes) and hashes[n] in self._hashes:
            n += 1
        return n

    def insert(self, hashes: list[bytes], capacity: int) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > capacity:
            self._hashes.popitem(last=False)


def page_hashes(token_ids: list[int], page_size: int) -> list[bytes]:
    """A hash per full page of token_ids, each covering every token up to the page's end."""
    hashes, h = [], b""
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        page = ",".join(map(str, token_ids[start:start + page_size])).encode()
        h = hashlib.blake2b(h + page, digest_size=16).digest()
        hashes.append(h)
    return hashes


class Router:
    def __init__(self, policy: str, role: str, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5):
        if policy not in POLICIES[role]:
            raise ValueError(f"--{role}-policy {policy!r} must be one of {', '.join(POLICIES[role])}")
        self.policy = policy
        self.balance = (balance_abs_threshold, balance_rel_threshold)
        self._turn = itertools.count()
        self._indexes: dict[tuple[str, str], PrefixIndex] = {}  # (worker id, incarnation)

    def pick(self, workers: list[WorkerState], prompt_token_ids: list[int]) -> WorkerState:
        """workers is non-empty and sorted by worker id."""
        if self.policy == "round_robin":
            return workers[next(self._turn) % len(workers)]
        if self.policy == "prefix":
            head = ",".join(map(str, prompt_token_ids[:PREFIX_TOKENS])).encode()
            return workers[int.from_bytes(hashlib.blake2b(head, digest_size=8).digest(), "big") % len(workers)]
        if self.policy == "cache_aware":
            return self._cache_aware(workers, prompt_token_ids)
        return min(workers, key=lambda w: (w.load, w.worker_id))

    def _cache_aware(self, workers: list[WorkerState], prompt_token_ids: list[int]) -> WorkerState:
        counts = [len(w.inflight) for w in workers]
        abs_threshold, rel_threshold = self.balance
        balanced = not (max(counts) - min(counts) > abs_threshold and max(counts) > rel_threshold * min(counts))
        hashes: dict[int, list[bytes]] = {}  # by page size

        def hashes_for(w: WorkerState) -> list[bytes]:
            size = w.status.layout.get("page_size", 16) if w.status.layout else 16
            if size not in hashes:
                hashes[size] = page_hashes(prompt_token_ids, size)
            return hashes[size]

        def index(w: WorkerState) -> PrefixIndex:
            return self._indexes.setdefault((w.worker_id, w.status.incarnation), PrefixIndex())

        if balanced:
            best = max(workers, key=lambda w: (index(w).match(hashes_for(w)), -len(w.inflight), -w.load))
        else:
            best = min(workers, key=lambda w: (len(w.inflight), w.load, w.worker_id))
        index(best).insert(hashes_for(best), max(1, best.status.num_pages))
        if len(self._indexes) > 2 * len(workers) + 8:  # forget workers long gone (or restarted)
            live = {(w.worker_id, w.status.incarnation) for w in workers}
            self._indexes = {k: v for k, v in self._indexes.items() if k in live}
        return best


def pair_error(prefill: WorkerStatus, decode: WorkerStatus) -> str:
    """Why this prefill worker cannot hand KV to this decode worker ("" if it can): the same
    model KV layout and transfer backend, and TP sizes the model's KV heads allow (any two do:
    each decode rank receives its heads from the prefill ranks holding them)."""
    if prefill.transfer_backend != decode.transfer_backend:
        return (f"transfer backends differ ({prefill.transfer_backend} vs "
                f"{decode.transfer_backend}): start both with the same --transfer-backend")
    if diff := layout_mismatch(KVLayout(**decode.layout), prefill.layout):
        return f"KV layouts differ (prefill vs decode): {diff}"
    heads = decode.layout.get("num_kv_heads", 0)
    for name, status in (("prefill", prefill), ("decode", decode)):
        if error := tp_error(status.tp, heads):
            return f"{name} --tp: {error}"
    if len(decode.transfer_addresses) != decode.tp:
        return f"decode reports {len(decode.transfer_addresses)} KV receivers for --tp {decode.tp}"
    return ""


def status_error(status: WorkerStatus) -> str:
    """Why a registration is refused ("" if it is fine): its layout must be a KV layout."""
    if status.role == "colocated" and not status.layout:
        return ""
    try:
        layout = KVLayout(**status.layout)
    except (TypeError, ValueError) as e:
        return f"bad KV layout: {e}"
    sizes = (layout.num_layers, layout.page_size, layout.num_kv_heads, layout.head_dim)
    if not all(type(n) is int and n >= 1 for n in sizes) or not isinstance(layout.dtype, str):
        return f"bad KV layout {status.layout!r}"
    return ""
