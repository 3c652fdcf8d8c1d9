"""A tensor-parallel group's processes and control plane: rank 0 is the engine the worker
talks to; ranks 1..world_size-1 follow it (world_size: --tp, or --ep-size over replicated
attention: config.world_size).

Rank 0 starts the followers (one process each, dying with it) and joins the group with them
(gloo on CPU, NCCL on GPU, for the model's collectives; a gloo group beside it, `control`, for
what rank 0 sends them). Before each step rank 0 sends the step's StepPlan (engine/plan.py,
msgpack); every rank runs it on its own executor (engine/core.py: follow), meeting in the
all-reduces and the logits all-gather. `call` runs a call on every follower (a KV hand-off's
expect, cancel, abort) and returns once all have run it. Followers report to rank 0 on a queue
(`start` makes it).
"""

from __future__ import annotations

import multiprocessing
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

from pd_serve.model.parallel import TPGroup

START_TIMEOUT_S = 600  # the followers load their shards meanwhile
IDLE = timedelta(days=365)  # followers wait this long for the next step (they die with rank 0)
REPORTS_BOUND = 65536  # followers' reports waiting on the queue to rank 0


def start(config, port: int, target, args: tuple = ()) -> tuple[TPGroup, list, object]:
    """Rank 0: start the followers, each running target(config, rank, port, reports, *args),
    and join the group. Returns the group, the follower processes and the reports queue."""
    ctx = multiprocessing.get_context("spawn")
    reports = ctx.Queue(maxsize=REPORTS_BOUND)
    followers = [ctx.Process(target=target, args=(config, rank, port, reports, *args), daemon=True,
                             name=f"tp-rank-{rank}") for rank in range(1, config.world_size)]
    for p in followers:
        p.start()
    return join(config, 0, port), followers, reports


def join(config, rank: int, port: int) -> TPGroup:
    """Join the group of config.world_size ranks at 127.0.0.1:port; on GPU rank r uses cuda:r."""
    on_cuda = config.device != "cpu" and torch.cuda.is_available()
    if on_cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if on_cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=config.world_size,
                            timeout=timedelta(seconds=START_TIMEOUT_S))
    # Its own group, so a follower may wait for the next step as long as the worker stays idle
    # (the default group's timeout bounds the collectives inside a step).
    control = dist.new_group(backend="gloo", timeout=IDLE)
    return TPGroup(rank, config.world_size, None, control)


def call(tp: TPGroup, name: str, *args) -> None:
    """Rank 0: run a call on every follower; returns once all have run it."""
    send(tp, ["call", name, *args])
    dist.barrier(group=tp.control)


def send(tp: TPGroup, payload) -> None:
    """Rank 0: msgpack bytes (never a pickle), their length then the bytes, to every follower.
    None: the followers exit."""
    data = msgpack.packb(payload, use_bin_type=True)
    dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0, group=tp.control)
    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=tp.control)


def receive(tp: TPGroup):
    """A follower: the next payload rank 0 sends."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=tp.control)
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=tp.control)
    return msgpack.unpackb(data.numpy().tobytes(), raw=False)
