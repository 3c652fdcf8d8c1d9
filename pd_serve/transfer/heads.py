"""Which prefill rank sends which KV heads to which decode rank, when the pools' TP sizes differ.

Under tensor parallelism each rank keeps the KV heads it computes (model/parallel.py's
kv_heads_of: split, or replicated when there are more ranks than KV heads). A decode rank
needs exactly its heads; each comes from the first prefill rank that holds it. Consecutive
heads from one prefill rank travel together as one route (one transfer per request), so
equal TP sizes give one route per rank pair i -> i carrying every head.

Ranks here are attention ranks (--tp of them). A pool with more ranks than that (--tp 1
--ep-size N: attention replicated) holds copies of its attention ranks; connector.py sends from
the first copy to every copy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from pd_serve.model.parallel import kv_heads_of


@dataclass(frozen=True)
class HeadRoute:
    src_rank: int
    dst_rank: int
    src_head: int  # first head, local to the sender's pool
    dst_head: int  # first head, local to the receiver's pool
    num_heads: int


def tp_error(tp: int, num_kv_heads: int) -> str:
    """Why a pool of `tp` ranks cannot hold `num_kv_heads` KV heads ("" if it can)."""
    if tp < 1 or (num_kv_heads % tp and tp % num_kv_heads):
        return (f"TP {tp} neither divides the model's {num_kv_heads} KV heads nor is a multiple "
                "of them")
    return ""


@functools.cache  # asked for every prompt at every layer group: a handful of TP pairs
def head_routes(src_tp: int, dst_tp: int, num_kv_heads: int) -> tuple[HeadRoute, ...]:
    """Every route from a prefill pool of `src_tp` ranks to a decode pool of `dst_tp` ranks,
    ordered by (dst_rank, first head). ValueError for a TP size the heads do not allow."""
    for tp in (src_tp, dst_tp):
        if error := tp_error(tp, num_kv_heads):
            raise ValueError(error)
    holders = {}  # head -> the first prefill rank holding it
    for rank in range(src_tp):
        for head in kv_heads_of(rank, src_tp, num_kv_heads):
            holders.setdefault(head, rank)
    routes: list[HeadRoute] = []
    for dst in range(dst_tp):
        wanted = kv_heads_of(dst, dst_tp, num_kv_heads)
        for head in wanted:
            src = holders[head]
            last = routes[-1] if routes else None
            if last and last.dst_rank == dst and last.src_rank == src:
                routes[-1] = HeadRoute(src, dst, last.src_head, last.dst_head, last.num_heads + 1)
            else:
                local = kv_heads_of(src, src_tp, num_kv_heads)
                routes.append(HeadRoute(src, dst, head - local.start, head - wanted.start, 1))
    return tuple(routes)
