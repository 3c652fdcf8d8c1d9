"""Host cost of the KV-transfer control path: KVSender and KVReceiver (each in its own
process, as in serving) with data planes that move nothing (`--backend null`) or the real ipc
planes on one GPU's tiny pools (`--backend ipc`: the CUDA events, graph replays and page-id
uploads, with copies of a few bytes), `--requests` requests of 8 pages with `--in-flight` of
them in flight (as bench/transfer.py's pipelined rate). Prints and writes wall time per request
and the CPU time per request of each thread: the sender's caller thread, its I/O thread (the
two share one GIL) and the receiver's I/O thread. One request goes through first, untimed (the
ipc receiver compiles and captures its copy kernel then). `--profile N` runs one more time with
each of those threads under cProfile and prints each one's N functions of most own time
(cProfile slows every call, the small ones most: read the shares, not the microseconds; from
Python 3.12 one profiler covers every thread of a process, so the sender's two threads print
as one table). Own time includes waiting in poll() and sleep().

    python bench/probes/control_path.py --in-flight 32 --output bench/results/probe-control-path-cpu.json
    python bench/probes/control_path.py --backend ipc --profile 25   # on a GPU machine
"""

import argparse
import cProfile
import io
import multiprocessing as mp
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from _common import device_name, git_commit, write_json  # noqa: E402
from pd_serve.cache.pool import KVLayout, KVPool  # noqa: E402
from pd_serve.transfer import receiver as receiver_module  # noqa: E402
from pd_serve.transfer import sender as sender_module  # noqa: E402
from pd_serve.transfer.base import ReceiverPlane, SenderPlane  # noqa: E402

ONE_PROFILER = sys.version_info >= (3, 12)  # cProfile on sys.monitoring: one per process
LAYOUT = KVLayout(num_layers=2, page_size=1, num_kv_heads=1, head_dim=4, dtype="float32")
PAGES = 8  # per request


class NullReceiverPlane(ReceiverPlane):
    def receive(self, sender_id, chunk, frames, dst_page_ids) -> None:
        pass


class NullSenderPlane(SenderPlane):
    sends_src_page_ids = True  # as ipc: one chunk a request, page ids in the header
    chunked = False

    def prepare(self, peer, chunk, src_page_ids, ready) -> list:
        return []


def _io_cpu(cls, profile: bool):
    """cls with its I/O thread's CPU seconds from the first result it published (the untimed
    first request's) to its end kept in `io_cpu_s` (and its cProfile in `io_profile`, with
    `profile`)."""
    class Timed(cls):
        io_cpu_s = 0.0
        io_profile = cProfile.Profile() if profile and not ONE_PROFILER else None
        _first = None

        def _serve(self):
            if self.io_profile:
                self.io_profile.enable()
            try:
                super()._serve()
            finally:
                if self.io_profile:
                    self.io_profile.disable()
                self.io_cpu_s = time.thread_time() - (self._first or 0.0)

        def _publish(self, results):
            if self._first is None and results:
                self._first = time.thread_time()  # the I/O thread publishes
            super()._publish(results)
    return Timed


def _top(profile: cProfile.Profile | None, n: int) -> str:
    if profile is None:
        return ""
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(n)
    return out.getvalue()


def _setup(backend: str) -> tuple[str, torch.device]:
    """(the backend name the connectors use, the pools' device); null planes patched in."""
    if backend == "ipc":
        return "ipc", torch.device("cuda:0")
    receiver_module.make_receiver_plane = lambda backend, pool, timeout, host: NullReceiverPlane(pool, timeout)
    sender_module.make_sender_plane = lambda backend, pool, timeout: NullSenderPlane(pool, timeout)
    return "tcp", torch.device("cpu")


def run_receiver(requests: int, in_flight: int, backend: str, profile: int, to_parent,
                 from_parent) -> None:
    name, device = _setup(backend)
    pool = KVPool(LAYOUT, in_flight * PAGES, device)
    process_profile = cProfile.Profile() if profile and ONE_PROFILER else None
    if process_profile:
        process_profile.enable()
    receiver = _io_cpu(receiver_module.KVReceiver, bool(profile))(pool, name, timeout_s=600)
    receiver.expect("r-1", list(range(PAGES)))  # the untimed first request
    for i in range(requests):
        j = i % in_flight
        receiver.expect(f"r{i}", list(range(j * PAGES, (j + 1) * PAGES)))
    to_parent.put(receiver.address)
    from_parent.get()  # the sender is done
    receiver.close()
    if process_profile:
        process_profile.disable()
    to_parent.put((receiver.io_cpu_s, _top(receiver.io_profile or process_profile, profile)))


def run(requests: int, in_flight: int, backend: str = "null", profile: int = 0) -> dict:
    name, device = _setup(backend)
    ctx = mp.get_context("spawn")
    to_parent, from_parent = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=run_receiver,
                        args=(requests, in_flight, backend, profile, to_parent, from_parent))
    child.start()
    address = to_parent.get(timeout=120)
    sender = _io_cpu(sender_module.KVSender, bool(profile))(
        KVPool(LAYOUT, in_flight * PAGES, device), name, timeout_s=600)
    sender.connect(address)
    sender.send("r-1", address, list(range(PAGES)), list(range(PAGES)))
    if not all(r.ok for r in sender.poll(timeout_s=120)):
        raise RuntimeError("the first request failed")
    acked, sent = set(), 0
    caller_profile = cProfile.Profile() if profile else None
    if caller_profile:
        caller_profile.enable()
    start, caller_cpu = time.perf_counter(), time.thread_time()
    while len(acked) < requests:
        while sent < requests and (sent < in_flight or f"r{sent - in_flight}" in acked):
            pages = list(range((sent % in_flight) * PAGES, (sent % in_flight + 1) * PAGES))
            sender.send(f"r{sent}", address, pages, pages)
            sent += 1
        for result in sender.poll(timeout_s=30):
            if not result.ok:
                raise RuntimeError(f"{result.request_id}: {result.error}")
            acked.add(result.request_id)
    wall, caller_cpu = time.perf_counter() - start, time.thread_time() - caller_cpu
    if caller_profile:
        caller_profile.disable()
    sender.close()
    from_parent.put("done")
    receiver_io, receiver_top = to_parent.get(timeout=60)
    child.join(timeout=30)
    us = 1e6 / requests
    if profile:
        caller = "sender, every thread" if ONE_PROFILER else "sender caller"
        for thread, text in ((caller, _top(caller_profile, profile)),
                             ("sender I/O", _top(sender.io_profile, profile)),
                             ("receiver I/O" + (", every thread" if ONE_PROFILER else ""),
                              receiver_top)):
            if not text:
                continue
            print(f"===== {thread} thread (cProfile, own time) =====\n{text}", flush=True)
    return {"wall_us": wall * us, "sender_caller_cpu_us": caller_cpu * us,
            "sender_io_cpu_us": sender.io_cpu_s * us, "receiver_io_cpu_us": receiver_io * us}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--in-flight", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backend", default="null", choices=["null", "ipc"],
                   help="null: data planes that move nothing (CPU); ipc: the real planes on cuda:0")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="then one run under cProfile: each thread's N functions of most own time")
    p.add_argument("--output", default=None)
    args = p.parse_args()
    runs = []
    for i in range(args.repeats):
        runs.append(run(args.requests, args.in_flight, args.backend))
        print(f"run {i + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in runs[-1].items()), flush=True)
    medians = {k: round(statistics.median(r[k] for r in runs), 1) for k in runs[0]}
    print("median: " + ", ".join(f"{k} {v}" for k, v in medians.items()))
    if args.profile:
        profiled = run(args.requests, args.in_flight, args.backend, args.profile)
        print("under cProfile: " + ", ".join(f"{k} {v:.1f}" for k, v in profiled.items()))
    if args.output:
        write_json(args.output, {
            "probe": f"KV-transfer control path, {args.backend} data planes (us a request)",
            "backend": args.backend,
            "device": device_name(torch.device("cuda:0" if args.backend == "ipc" else "cpu")),
            "git_commit": git_commit(),
            "requests": args.requests, "in_flight": args.in_flight, "pages_per_request": PAGES,
            "runs": runs, "median": medians})


if __name__ == "__main__":
    main()
