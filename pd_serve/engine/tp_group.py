"""A tensor-parallel worker: rank 0 is the engine the worker talks to; ranks 1..tp-1 follow it.

Rank 0 starts the followers (one process each, dying with it), and before each step it
broadcasts the step's inputs (per chunk: positions, token ids, KV pages, whether it samples) on
a gloo group. Every rank then runs the same forward on its shard (model/parallel.py) and its own
KV pool (its KV heads; the same page ids on every rank: the pool size is the smallest any rank
can hold), meeting in the all-reduces and the logits all-gather; rank 0 alone samples.
CUDA graphs and the overlap schedule are off under TP for now.

A prefill or decode worker's followers also hold their half of the KV hand-off
(transfer/tp_handoff.py): a step's broadcast carries what the step's forward sends (prefill),
and `call` runs a hand-off call (expect, cancel, abort) on every follower before it returns.
Followers report their transfers' results on a queue (`results`).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import signal
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

from pd_serve.engine.runner import chunk_ids
from pd_serve.engine.sampler import PendingSample
from pd_serve.engine.scheduler import ScheduledChunk, SchedulerOutput
from pd_serve.model.parallel import TPGroup

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 600  # the followers load their shards meanwhile
IDLE = timedelta(days=365)  # followers wait this long for the next step (they die with rank 0)
PR_SET_PDEATHSIG = 1


def start(config, port: int, handoff=None) -> tuple[TPGroup, list, object]:
    """Rank 0: start the followers and join the group (gloo on CPU, NCCL on GPU; a gloo group
    beside it for the step broadcasts). Returns the group, the follower processes and the queue
    on which their hand-off halves (built from `handoff`, a HandoffSpec, if given) report."""
    from pd_serve.transfer.tp_handoff import RESULTS_BOUND
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue(maxsize=RESULTS_BOUND)
    followers = [ctx.Process(target=follow, args=(config, rank, port, handoff, results), daemon=True,
                             name=f"tp-rank-{rank}") for rank in range(1, config.tp)]
    for p in followers:
        p.start()
    return join(config, 0, port), followers, results


def join(config, rank: int, port: int) -> TPGroup:
    """Join the group of config.tp ranks at 127.0.0.1:port; on GPU rank r uses cuda:r."""
    on_cuda = config.device != "cpu" and torch.cuda.is_available()
    if on_cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if on_cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=config.tp, timeout=timedelta(seconds=START_TIMEOUT_S))
    # Its own group, so a follower may wait for the next step as long as the worker stays idle
    # (the default group's timeout bounds the collectives inside a step).
    control = dist.new_group(backend="gloo", timeout=IDLE)
    return TPGroup(rank, config.tp, None, control)


def follow(config, rank: int, port: int, handoff=None, results=None) -> None:
    """A follower's process: build this rank's engine (and hand-off half), then run the steps
    and calls rank 0 broadcasts."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
    from pd_serve.engine.core import EngineCore

    core = EngineCore(config, tp_rank=rank, tp_port=port)
    runner = core.runner
    runner.sampler = _NoSampler()
    half = None
    if handoff is not None:
        from pd_serve.transfer.tp_handoff import Follower
        half = Follower(core, handoff, rank, results)
    try:
        while (msg := receive(core.tp)) is not None:
            if msg[0] == "step":
                _, steps, extra = msg
                runner.launch(mirror_plan(steps), half.after_layer(extra) if half else None)
            else:  # ("call", name, request id, *args): then meet rank 0 at the barrier
                if half is not None:
                    half.call(*msg[1:])
                dist.barrier(group=core.tp.control)
    finally:
        if half is not None:
            half.close()
    dist.destroy_process_group()


def broadcast(tp: TPGroup, plan: SchedulerOutput | None, extra=None) -> None:
    """Rank 0: send the step's inputs, and `extra` for the followers' hand-off halves (None:
    the followers exit)."""
    payload = None if plan is None else ["step", [
        [c.start, c.num_tokens, c.sample, chunk_ids(c.request, c.start, c.start + c.num_tokens),
         c.request.page_ids] for c in plan.chunks], extra]
    _send(tp, payload)


def call(tp: TPGroup, name: str, request_id: str, *args) -> None:
    """Rank 0: run a hand-off call on every follower; returns once all have run it."""
    _send(tp, ["call", name, request_id, *args])
    dist.barrier(group=tp.control)


def _send(tp: TPGroup, payload) -> None:
    """msgpack bytes (never a pickle): their length, then the bytes, broadcast from rank 0."""
    data = msgpack.packb(payload, use_bin_type=True)
    dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0, group=tp.control)
    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=tp.control)


def receive(tp: TPGroup):
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=tp.control)
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=tp.control)
    return msgpack.unpackb(data.numpy().tobytes(), raw=False)


class _Mirror:
    """What the runner reads of a request, rebuilt from a broadcast chunk."""

    def __init__(self, start: int, token_ids: list[int], page_ids: list[int]):
        self.start, self.token_ids, self.page_ids = start, token_ids, page_ids

    def token_at(self, pos: int) -> int:
        return self.token_ids[pos - self.start]

    @property
    def all_token_ids(self) -> list[int]:
        return [0] * self.start + self.token_ids


def mirror_plan(steps) -> SchedulerOutput:
    return SchedulerOutput(chunks=[ScheduledChunk(_Mirror(start, ids, pages), start, num, sample)
                                   for start, num, sample, ids, pages in steps])


class _NoSampler:
    """Followers compute logits (the all-gather needs every rank) but do not sample."""

    def launch(self, logits: torch.Tensor, requests) -> PendingSample:
        return PendingSample(torch.empty(0, dtype=torch.long, device=logits.device), [])
