"""KV transfer: GB/s against size and per-request latency for each backend, each compared with
the raw copy rate of the link measured in the same run.

    python bench/transfer.py                          # every backend that applies to this machine
    python bench/transfer.py --quick                  # 1-16 MiB, 1k tokens, 2 repeats (CPU smoke run)
    python bench/transfer.py --backends ipc,torch --sizes-mib 64,1024 --output result.json

This process is the sender (pool on --sender-device); the receiver is a child process of this
script (`--role receiver`, JSON lines on stdin/stdout), one per backend, with its pool on
--receiver-device. The KV layout is Llama-3-8B's (32 layers, 8 KV heads, head_dim 128; or
--kv-shape deepseek-v2-lite: 27 layers of one 576-value latent) with pages of 1 MiB (or
--page-size tokens), drawn at random (non-contiguous) on both sides.
A timed request runs from send() to the sender's ok result (a blocking poll wakes as it comes):
the receiver has the pages in its pool and acknowledged. Telling the receiver to expect the request comes first and is not timed.
Each size gets one warm-up request, then --repeats timed ones. GB/s are 1e9 bytes of KV per
second. Sizes up to --in-flight-max-mib are also sent as --in-flight-requests requests with
--in-flight K of them in flight at any time (all expected first; K sent back to back, then one
more as each is acknowledged; timed until the last is acknowledged): the steady rate of a
prefill worker that always has K requests finishing, as bandwidth tests measure a link
(`pipelined_gbps`), with the wall time and the CPU time of the sender's and the receiver's
processes (every thread) per request (`pipelined_*_us`); one request alone (`median_gbps`)
pays the fixed cost per request in full. The raw link rate is one process's plain 1 GiB
`dst.copy_(src)` between the two devices: GPU0 -> GPU1 (P2P) on two GPUs, within the GPU on
one, host memory on CPU.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import itertools
import json
import os
import random
import select
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # `python bench/transfer.py` from a checkout without install

import torch  # noqa: E402

from _common import device_name, git_commit, sync, write_json  # noqa: E402
from pd_serve.cache.pool import KVLayout, KVPool  # noqa: E402
from pd_serve.transfer.backends.nixl import nixl_available  # noqa: E402
from pd_serve.transfer.base import TransferError, TransferResult  # noqa: E402
from pd_serve.transfer.receiver import KVReceiver  # noqa: E402
from pd_serve.transfer.sender import KVSender  # noqa: E402

RESULTS_DIR = REPO_ROOT / "bench" / "results"
MiB = 1 << 20
KV_SHAPES = {  # a token's KV per layer: Llama-3-8B's 8 heads of K and V; DeepSeek-V2-Lite's latent
    "llama3-8b": dict(num_layers=32, num_kv_heads=8, head_dim=128),
    "deepseek-v2-lite": dict(num_layers=27, num_kv_heads=1, head_dim=512 + 64, num_planes=1),
}
DEFAULT_SIZES_MIB = [1, 4, 8, 16, 64, 256, 1024]
DEFAULT_LATENCY_TOKENS = [1024, 4096, 16384]
QUICK = dict(sizes_mib=[1, 4, 16], latency_tokens=[1024], repeats=2)
SPARE_PAGES = 8
POISON = -7.25  # what the receiver's pages hold before data arrives
CHECKSUM_PAGES = 64  # pages per step of a checksum (bounds its int64 temporaries)
RECEIVER_FLAGS = ("role", "layout", "num_pages")  # the child's hidden flags
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # itemsize -> dtype


def parse_args() -> argparse.Namespace:
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default=None, help="comma list; default: torch,ipc,tcp,nixl on "
                   "GPU (torch only when the two pools sit on different GPUs), tcp,torch,nixl on "
                   "CPU (nixl where installed)")
    p.add_argument("--sizes-mib", default=None, help="comma list; default: 1,4,8,16,64,256,1024")
    p.add_argument("--latency-tokens", default=None, help="comma list; default: 1024,4096,16384")
    p.add_argument("--repeats", type=int, default=None, help="timed requests per size (default 5)")
    p.add_argument("--quick", action="store_true", help="sizes 1,4,16 MiB, 1k tokens, 2 repeats")
    p.add_argument("--sender-device", default="cuda:0" if num_gpus else "cpu")
    p.add_argument("--receiver-device",
                   default="cuda:1" if num_gpus >= 2 else "cuda:0" if num_gpus else "cpu")
    p.add_argument("--dtype", default="bfloat16",
                   choices=["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"],
                   help="KV dtype (float8_*: an FP8 KV cache, twice the tokens per 1 MiB page)")
    p.add_argument("--kv-shape", default="llama3-8b", choices=sorted(KV_SHAPES),
                   help="whose KV a token holds: Llama-3-8B's heads or DeepSeek-V2-Lite's latent")
    p.add_argument("--page-size", type=int, default=None,
                   help="tokens per page (default: as many as make a page 1 MiB)")
    p.add_argument("--raw-mib", type=int, default=1024, help="size of the raw link copy")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a transfer may take")
    p.add_argument("--chunk-mib", type=float, default=None,
                   help="the sender's first chunk size (default: KVSender's)")
    p.add_argument("--max-chunk-mib", type=float, default=None,
                   help="the sender's largest chunk size (default: KVSender's)")
    p.add_argument("--spin-ms", type=float, default=None,
                   help="busy-poll window of both I/O threads (default: theirs; 0: never)")
    p.add_argument("--in-flight", type=int, default=8,
                   help="requests in flight for the pipelined rate (1: not measured)")
    p.add_argument("--in-flight-requests", type=int, default=None,
                   help="requests per pipelined measurement (default: 4 x --in-flight)")
    p.add_argument("--in-flight-max-mib", type=int, default=256,
                   help="largest size measured with --in-flight requests at a time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", nargs="?", const="auto", default=None,
                   help="write a JSON result here (alone: bench/results/transfer-<device-kind>.json)")
    # The receiver child's mode.
    p.add_argument("--role", default="sender", choices=["sender", "receiver"], help=argparse.SUPPRESS)
    p.add_argument("--layout", default=None, help=argparse.SUPPRESS)
    p.add_argument("--num-pages", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "receiver":
        return args

    def ints(text: str | None, default: list[int], flag: str) -> list[int]:
        try:
            values = default if text is None else [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            p.error(f"{flag} takes a comma list of integers, got {text!r}")
        if not values or min(values) < 1:
            p.error(f"{flag} needs positive integers")
        return values

    args.sizes_mib = ints(args.sizes_mib, QUICK["sizes_mib"] if args.quick else DEFAULT_SIZES_MIB,
                          "--sizes-mib")
    args.latency_tokens = ints(args.latency_tokens, QUICK["latency_tokens"] if args.quick
                               else DEFAULT_LATENCY_TOKENS, "--latency-tokens")
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.in_flight < 1:
        p.error("--in-flight must be >= 1")
    args.in_flight_requests = args.in_flight_requests or 4 * args.in_flight
    if args.in_flight_requests < args.in_flight:
        p.error("--in-flight-requests must be at least --in-flight")
    args.repeats = args.repeats or (QUICK["repeats"] if args.quick else 5)
    args.sender_device, args.receiver_device = map(torch.device, (args.sender_device, args.receiver_device))
    args.backends = check_backends(p, args.backends, args.sender_device, args.receiver_device)
    return args


def check_backends(p: argparse.ArgumentParser, text: str | None, sender: torch.device,
                   receiver: torch.device) -> list[str]:
    """The backends to run: those asked for (an error when one cannot work on these devices),
    or by default every one that can."""
    on_gpu = sender.type == receiver.type == "cuda"
    why_not = {
        "ipc": None if on_gpu else "needs both pools on CUDA devices",
        "torch": ("needs both pools on the same kind of device" if sender.type != receiver.type
                  else "on GPU needs the two pools on different GPUs (NCCL)"
                  if on_gpu and sender == receiver else None),
        "tcp": None,
        "nixl": None if nixl_available() else "is not installed (pip install pd-serve[nixl])",
    }
    if text is None:
        wanted = ["torch", "ipc", "tcp", "nixl"] if on_gpu else ["tcp", "torch", "nixl"]
        for name in wanted:
            if why_not[name]:
                print(f"skipping {name}: {why_not[name]}", file=sys.stderr)
        return [name for name in wanted if not why_not[name]]
    wanted = [name.strip() for name in text.split(",") if name.strip()]
    for name in wanted:
        if name not in why_not:
            p.error(f"--backends: {name!r} is not one of {', '.join(why_not)}")
        if why_not[name]:
            p.error(f"--backends: {name} {why_not[name]} (sender {sender}, receiver {receiver})")
    return wanted


def kv_layout(shape: str, dtype: str, page_size: int | None) -> KVLayout:
    """A model's KV shape (KV_SHAPES) with page_size tokens per page; default as many as make
    one page 1 MiB."""
    per_token = KVLayout(page_size=1, dtype=dtype, **KV_SHAPES[shape]).bytes_per_token
    return KVLayout(page_size=page_size or MiB // per_token, dtype=dtype, **KV_SHAPES[shape])


def page_checksum(buffer: torch.Tensor, page_ids: list[int]) -> dict:
    """Bit-level fingerprint of pages, in the order given: the int64 sum of the integer view of
    every (layer, K/V, page) block, hashed; and the sum of them all."""
    int_dtype = _INT_VIEW[buffer.element_size()]
    sums = []
    for i in range(0, len(page_ids), CHECKSUM_PAGES):
        index = torch.tensor(page_ids[i:i + CHECKSUM_PAGES], dtype=torch.int64, device=buffer.device)
        pages = buffer.index_select(2, index).view(int_dtype)  # [L, 2, n, S, H, D]
        sums.append(pages.sum(dim=(3, 4, 5), dtype=torch.int64).cpu())  # [L, 2, n]
    block_sums = torch.cat(sums, dim=2).contiguous()  # [L, 2, len(page_ids)]
    return {"sha256": hashlib.sha256(block_sums.numpy().tobytes()).hexdigest(),
            "sum": int(block_sums.sum())}


def spin_kwargs(args: argparse.Namespace) -> dict:
    return {} if args.spin_ms is None else {"spin_s": args.spin_ms / 1e3}


# ---- receiver child -------------------------------------------------------------------------

def serve_receiver(args: argparse.Namespace) -> None:
    """The decode side: a pool full of POISON and a KVReceiver; answers one JSON line per command."""
    device = torch.device(args.receiver_device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    pool = KVPool(KVLayout(**json.loads(args.layout)), args.num_pages, device)
    pool.buffer.fill_(POISON)
    receiver = KVReceiver(pool, args.backends, timeout_s=args.timeout, **spin_kwargs(args))
    say = lambda obj: print(json.dumps(obj), flush=True)  # noqa: E731
    say({"address": receiver.address, "device_name": device_name(device)})
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "expect":  # reports the failures seen since the last expect
                failed = [asdict(r) for r in receiver.poll() if not r.ok]
                if cmd.get("poison"):
                    pool.buffer[:, :, cmd["page_ids"]] = POISON
                    sync(device)
                receiver.expect(cmd["request_id"], cmd["page_ids"])
                say({"failed": failed})
            elif cmd["op"] == "cpu":  # this process's CPU seconds so far, every thread
                say({"cpu_s": time.process_time()})
            elif cmd["op"] == "checksum":
                say(page_checksum(pool.buffer, cmd["page_ids"]))
            elif cmd["op"] == "close":
                break
            else:
                say({"error": f"unknown op {cmd['op']!r}"})
        except Exception as e:
            say({"error": f"{type(e).__name__}: {e}"})
    receiver.close()
    say({"closed": True})
    # Leave without running destructors: the pair's process group and the mapped IPC pool go
    # with the process, and a group torn down after its peer has gone can hang.
    os._exit(0)


class ReceiverProcess:
    """The receiver child of one backend, driven over its stdin/stdout."""

    def __init__(self, backend: str, layout: KVLayout, num_pages: int, args: argparse.Namespace):
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--role", "receiver", "--backends", backend,
             "--receiver-device", str(args.receiver_device), "--layout", json.dumps(asdict(layout)),
             "--num-pages", str(num_pages), "--timeout", str(args.timeout)]
            + ([] if args.spin_ms is None else ["--spin-ms", str(args.spin_ms)]),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = self._read(120)
        self.address, self.device_name = hello["address"], hello["device_name"]

    def call(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        reply = self._read(120)
        if "error" in reply:
            raise TransferError(f"receiver: {reply['error']}")
        return reply

    def _read(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TransferError(f"receiver did not answer within {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise TransferError(f"receiver exited with {self.proc.wait()}")
        return json.loads(line)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call("close")
            self.proc.wait(timeout=30)
        except (TransferError, OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


# ---- sender side ----------------------------------------------------------------------------

class Pair:
    """A KVSender here and a receiver child for one backend, both pools of `num_pages` pages."""

    def __init__(self, backend: str, pool: KVPool, args: argparse.Namespace):
        self.backend, self.pool, self.timeout_s = backend, pool, args.timeout
        self.receiver = ReceiverProcess(backend, pool.layout, pool.num_pages, args)
        self.sender = None
        try:
            chunks = {k: int(v * MiB) for k, v in (("chunk_bytes", args.chunk_mib),
                                                    ("max_chunk_bytes", args.max_chunk_mib))
                      if v is not None}
            self.sender = KVSender(pool, backend, timeout_s=args.timeout, **chunks,
                                   **spin_kwargs(args))
            self.sender.connect(self.receiver.address)
        except BaseException:
            self.close()
            raise
        self.rng = random.Random(args.seed)
        self.request_ids = (f"{backend}-{i}" for i in itertools.count())
        self.results: dict[str, TransferResult] = {}

    def pick_pages(self, num_pages: int) -> tuple[list[int], list[int]]:
        """Random, non-contiguous source and destination page ids."""
        return (self.rng.sample(range(self.pool.num_pages), num_pages),
                self.rng.sample(range(self.pool.num_pages), num_pages))

    def transfer(self, num_pages: int, poison: bool = False) -> tuple[float, list[int], list[int]]:
        """One request of `num_pages` pages; returns seconds from send() to the ok result."""
        src, dst = self.pick_pages(num_pages)
        request_id = next(self.request_ids)
        failed = self.receiver.call("expect", request_id=request_id, page_ids=dst, poison=poison)["failed"]
        if failed:
            raise TransferError(f"receiver reported failures: {failed}")
        sync(self.pool.buffer.device)
        start = time.perf_counter()
        self.sender.send(request_id, self.receiver.address, src, dst)
        result = self._wait(request_id)
        seconds = time.perf_counter() - start
        if not result.ok:
            raise TransferError(f"{request_id} ({num_pages} pages) failed: {result.error}")
        return seconds, src, dst

    def _wait(self, request_id: str) -> TransferResult:
        """The request's result; others that come first are kept for their own waits."""
        deadline = time.monotonic() + self.timeout_s + 5
        while (left := deadline - time.monotonic()) > 0:
            if request_id in self.results:
                return self.results.pop(request_id)
            for result in self.sender.poll(timeout_s=left):  # wakes as a result comes
                self.results[result.request_id] = result
        raise TransferError(f"no result for {request_id} within {self.timeout_s + 5} s")

    def pipelined(self, num_pages: int, k: int, total: int) -> tuple[float, float, float]:
        """Seconds for `total` requests of `num_pages` pages each with at most k in flight: k
        sent back to back, then the next each time the one that used its pages last is
        acknowledged (k disjoint page sets in turn), until the last is acknowledged. The rate a
        prefill worker that always has k requests finishing sustains (the requests sent together
        share one ready mark, as a prefill worker's sends of one layer group do). The receiver
        expects them all before the clock starts. Also the CPU seconds the sender's and the
        receiver's processes spent meanwhile (every thread: where host time per request goes)."""
        src = self.rng.sample(range(self.pool.num_pages), k * num_pages)
        dst = self.rng.sample(range(self.pool.num_pages), k * num_pages)
        sets = [(src[i * num_pages:(i + 1) * num_pages], dst[i * num_pages:(i + 1) * num_pages])
                for i in range(k)]
        parts = [(next(self.request_ids), *sets[j % k]) for j in range(total)]
        for request_id, _, pages in parts:
            if self.receiver.call("expect", request_id=request_id, page_ids=pages, poison=False)["failed"]:
                raise TransferError("receiver reported failures")
        sync(self.pool.buffer.device)
        acked: set[str] = set()
        sent = 0
        deadline = time.monotonic() + self.timeout_s + 5
        receiver_cpu = self.receiver.call("cpu")["cpu_s"]
        sender_cpu = time.process_time()
        start = time.perf_counter()
        while len(acked) < total:
            ready = None  # taken at the first send of this burst
            while sent < total and (sent < k or parts[sent - k][0] in acked):
                request_id, s, d = parts[sent]
                ready = ready or self.sender.ready_mark()
                self.sender.send(request_id, self.receiver.address, s, d, ready=ready)
                sent += 1
            if (left := deadline - time.monotonic()) <= 0:
                raise TransferError(f"{total - len(acked)} of {total} requests unanswered")
            for result in self.sender.poll(timeout_s=left):
                if not result.ok:
                    raise TransferError(f"{result.request_id} ({num_pages} pages) failed: {result.error}")
                acked.add(result.request_id)
        seconds = time.perf_counter() - start
        sender_cpu = time.process_time() - sender_cpu
        return seconds, sender_cpu, self.receiver.call("cpu")["cpu_s"] - receiver_cpu

    def timed(self, num_pages: int, repeats: int) -> list[float]:
        self.transfer(num_pages)  # warm-up
        return [self.transfer(num_pages)[0] for _ in range(repeats)]

    def verify(self, num_pages: int) -> dict:
        """One transfer into poisoned pages; the receiver's checksum must equal the source's."""
        _, src, dst = self.transfer(num_pages, poison=True)
        got = self.receiver.call("checksum", page_ids=dst)
        want = page_checksum(self.pool.buffer, src)
        return {"num_pages": num_pages, "ok": got["sha256"] == want["sha256"],
                "sender_sum": want["sum"], "receiver_sum": got["sum"]}

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self.receiver.close()  # before the sender's pool is freed: ipc maps it until then


def run_backend(backend: str, pool: KVPool, raw_gbps: float, args: argparse.Namespace) -> dict:
    """Sizes, latencies and one verified transfer; a failure ends the backend's run, and its
    rows so far are kept along with the error."""
    layout = pool.layout
    out = {"backend": backend, "sizes": [], "latency": []}
    pair = None
    try:
        pair = Pair(backend, pool, args)
        out.update(chunk_bytes=pair.sender.chunk_bytes, max_chunk_bytes=pair.sender.max_chunk_bytes,
                   spin_s=pair.sender.spin_s)
        out["receiver_device_name"] = pair.receiver.device_name
        for size_mib in args.sizes_mib:
            seconds = pair.timed(size_mib * MiB // layout.bytes_per_page, args.repeats)
            gbps = [size_mib * MiB / s / 1e9 for s in seconds]
            row = {"size_mib": size_mib, "num_bytes": size_mib * MiB, "seconds": seconds,
                   "median_gbps": statistics.median(gbps), "best_gbps": max(gbps)}
            row["ratio_to_raw"] = row["median_gbps"] / raw_gbps
            if args.in_flight > 1 and size_mib <= args.in_flight_max_mib:
                num_pages = size_mib * MiB // layout.bytes_per_page
                total = args.in_flight_requests
                pair.pipelined(num_pages, args.in_flight, total)  # warm-up
                runs = [pair.pipelined(num_pages, args.in_flight, total) for _ in range(args.repeats)]
                piped = [total * size_mib * MiB / seconds / 1e9 for seconds, _, _ in runs]
                per_request = [[1e6 * v / total for v in run] for run in runs]  # us a request
                row.update(in_flight=args.in_flight, in_flight_requests=total,
                           pipelined_gbps=statistics.median(piped),
                           pipelined_ratio_to_raw=statistics.median(piped) / raw_gbps,
                           pipelined_us_per_request=statistics.median(r[0] for r in per_request),
                           pipelined_sender_cpu_us=statistics.median(r[1] for r in per_request),
                           pipelined_receiver_cpu_us=statistics.median(r[2] for r in per_request))
            out["sizes"].append(row)
            log(f"{backend:>5} {size_mib:>6} MiB  median {row['median_gbps']:8.2f} GB/s  "
                f"best {row['best_gbps']:8.2f} GB/s  {row['ratio_to_raw']:6.1%} of raw"
                + (f"  {row['in_flight']} in flight {row['pipelined_gbps']:8.2f} GB/s "
                   f"({row['pipelined_ratio_to_raw']:.1%}; {row['pipelined_us_per_request']:.0f} us "
                   f"a request, CPU sender {row['pipelined_sender_cpu_us']:.0f} us, receiver "
                   f"{row['pipelined_receiver_cpu_us']:.0f} us)" if "pipelined_gbps" in row else ""))
        for tokens in args.latency_tokens:
            num_pages = -(-tokens // layout.page_size)
            seconds = pair.timed(num_pages, args.repeats)
            row = {"tokens": tokens, "size_mib": num_pages * layout.bytes_per_page / MiB,
                   "seconds": seconds, "median_ms": 1e3 * statistics.median(seconds),
                   "best_ms": 1e3 * min(seconds)}
            out["latency"].append(row)
            log(f"{backend:>5} {tokens:>6} tokens ({row['size_mib']:.0f} MiB)  "
                f"median {row['median_ms']:9.2f} ms  best {row['best_ms']:9.2f} ms")
        out["verify"] = pair.verify(max(args.sizes_mib) * MiB // layout.bytes_per_page)
        log(f"{backend:>5} verify {out['verify']['num_pages']} pages: "
            f"{'bit-exact' if out['verify']['ok'] else 'MISMATCH'}")
    except (TransferError, RuntimeError, ValueError) as e:  # RuntimeError: CUDA OOM among them
        out["error"] = f"{type(e).__name__}: {e}"
        log(f"{backend:>5} FAILED: {out['error']}")
    finally:
        if pair is not None:
            pair.close()
        pair = None  # the sender, its staging buffers and (torch) its process group
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def raw_link_rate(src_device: torch.device, dst_device: torch.device, num_bytes: int,
                  repeats: int) -> dict:
    """A plain `dst.copy_(src)` of `num_bytes` from src_device to dst_device in this process,
    bracketed by synchronize on both devices; bytes copied per second (not read + write)."""
    if src_device.type == dst_device.type == "cuda":
        what = (f"P2P copy {src_device} -> {dst_device}" if src_device != dst_device
                else f"device-to-device copy on {src_device}")
    elif src_device.type == dst_device.type == "cpu":
        what = "host memory copy_ in one process"
    else:
        what = f"copy {src_device} -> {dst_device}"
    src = torch.ones(num_bytes, dtype=torch.uint8, device=src_device)
    dst = torch.empty(num_bytes, dtype=torch.uint8, device=dst_device)
    dst.copy_(src)  # warm-up: touches the pages, enables peer access
    seconds = []
    for _ in range(repeats):
        sync(src_device, dst_device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(src_device, dst_device)
        seconds.append(time.perf_counter() - start)
    del src, dst
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    gbps = [num_bytes / s / 1e9 for s in seconds]
    return {"what": what, "num_bytes": num_bytes, "seconds": seconds,
            "median_gbps": statistics.median(gbps), "best_gbps": max(gbps)}


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def print_tables(results: list[dict], raw: dict) -> None:
    print(f"\nraw link: {raw['what']}, {raw['num_bytes'] // MiB} MiB: median "
          f"{raw['median_gbps']:.2f} GB/s, best {raw['best_gbps']:.2f} GB/s")
    print(f"\n{'backend':<8}| {'size MiB':>8} | {'median GB/s':>11} | {'best GB/s':>9} | "
          f"{'to raw':>6} | {'in flight GB/s':>14} | to raw")
    for r in results:
        for row in r["sizes"]:
            piped = (f"{row['pipelined_gbps']:>14.2f} | {row['pipelined_ratio_to_raw']:.3f}"
                     if "pipelined_gbps" in row else f"{'-':>14} | -")
            print(f"{r['backend']:<8}| {row['size_mib']:>8} | {row['median_gbps']:>11.2f} | "
                  f"{row['best_gbps']:>9.2f} | {row['ratio_to_raw']:>6.3f} | {piped}")
    print(f"\n{'backend':<8}| {'tokens':>6} | {'KV MiB':>6} | {'median ms':>9} | {'best ms':>9}")
    for r in results:
        for row in r["latency"]:
            print(f"{r['backend']:<8}| {row['tokens']:>6} | {row['size_mib']:>6.0f} | "
                  f"{row['median_ms']:>9.2f} | {row['best_ms']:>9.2f}")
    print()
    for r in results:
        state = ("bit-exact" if r["verify"]["ok"] else "MISMATCH") if "verify" in r else "not run"
        print(f"{r['backend']:<8}: verify {state}" + (f" ({r['error']})" if "error" in r else ""))


def device_kind(devices: list[torch.device]) -> str:
    """'cpu', or the GPU count and model, e.g. '2xh200'."""
    gpus = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    if not gpus:
        return "cpu"
    return f"{len(gpus)}x{torch.cuda.get_device_name(gpus[0]).split()[-1].lower()}"


def nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def run_facts(args: argparse.Namespace, layout: KVLayout, num_pages: int) -> dict:
    """Devices, versions, commit and flags: what a result file records beside its numbers."""
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"sender_device": str(args.sender_device),
            "sender_device_name": device_name(args.sender_device),
            "receiver_device": str(args.receiver_device),
            "receiver_device_name": device_name(args.receiver_device), "gpu_count": num_gpus,
            "torch_version": torch.__version__, "cuda_version": torch.version.cuda,
            "nccl_version": nccl_version() if num_gpus else None, "git_commit": git_commit(),
            "torch_threads": torch.get_num_threads(), "layout": asdict(layout), "num_pages": num_pages,
            "flags": {k: str(v) if isinstance(v, torch.device) else v
                      for k, v in vars(args).items() if k not in RECEIVER_FLAGS}}


def main() -> None:
    args = parse_args()
    if args.role == "receiver":
        return serve_receiver(args)
    sender_device, receiver_device = args.sender_device, args.receiver_device
    if sender_device.type == "cuda":
        torch.cuda.set_device(sender_device)  # send() records its ready event on this device
    layout = kv_layout(args.kv_shape, args.dtype, args.page_size)
    piped = [m for m in args.sizes_mib if m <= args.in_flight_max_mib] if args.in_flight > 1 else []
    num_pages = max(max(args.sizes_mib) * MiB // layout.bytes_per_page,
                    -(-max(args.latency_tokens) // layout.page_size),
                    args.in_flight * max(piped, default=0) * MiB // layout.bytes_per_page) + SPARE_PAGES
    log(f"layout {asdict(layout)}: {layout.bytes_per_page / MiB:.3g} MiB per page; pools of "
        f"{num_pages} pages on {sender_device} (sender) and {receiver_device} (receiver)")

    raw = raw_link_rate(sender_device, receiver_device, args.raw_mib * MiB, 5)
    log(f"raw link: {raw['what']}: median {raw['median_gbps']:.2f} GB/s")

    pool = KVPool(layout, num_pages, sender_device)
    gen = torch.Generator(sender_device).manual_seed(args.seed)
    for layer in pool.buffer:  # one layer at a time: FP8 has no normal_, so via float32
        layer.copy_(torch.randn(layer.shape, generator=gen, device=sender_device))
    results = [run_backend(backend, pool, raw["median_gbps"], args) for backend in args.backends]
    print_tables(results, raw)

    if args.output:
        kind = device_kind([sender_device, receiver_device])
        path = RESULTS_DIR / f"transfer-{kind}.json" if args.output == "auto" else args.output
        write_json(path, {**run_facts(args, layout, num_pages), "raw_link": raw, "backends": results})
    if any("error" in r or not r.get("verify", {}).get("ok") for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
