"""A transfer peer in its own process, driven by JSON lines on stdin; answers on stdout.

    python peer.py sender|receiver --backend tcp --layout '{...}' --num-pages N --seed S

The sender's pool is torch.manual_seed(S) random data (the test rebuilds it to check bytes);
the receiver's pool is filled with POISON. With --tp A --tp-rank R the sender is rank R of a
tensor-parallel prefill worker: its pool holds that rank's KV heads of the seeded pool.
"""

from __future__ import annotations

import argparse
import json
import select
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from pd_serve.cache.pool import KVLayout, KVPool  # noqa: E402
from pd_serve.model.parallel import kv_heads_of  # noqa: E402
from pd_serve.transfer.receiver import KVReceiver  # noqa: E402
from pd_serve.transfer.sender import KVSender  # noqa: E402

POISON = -7.25
LAYOUT = KVLayout(num_layers=4, page_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
NUM_PAGES = 64
SEED = 11


class Peer:
    """A sender or receiver in a child process."""

    def __init__(self, role: str, backend: str, layout: KVLayout = LAYOUT, timeout: float = 3.0,
                 device: str = "cpu", chunk_bytes: int = 32 * 2**20, tp: int = 1, tp_rank: int = 0):
        self.proc = subprocess.Popen(
            [sys.executable, __file__, role, "--backend", backend, "--layout",
             json.dumps(asdict(layout)), "--num-pages", str(NUM_PAGES), "--seed", str(SEED),
             "--timeout", str(timeout), "--device", device, "--chunk-bytes", str(chunk_bytes),
             "--tp", str(tp), "--tp-rank", str(tp_rank)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if role == "receiver":
            self.address = self._read(60)["address"]

    def call(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read(kw.get("wait", 0) + 60)

    def _read(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, "peer did not answer in time"
        line = self.proc.stdout.readline()
        assert line, f"peer exited with {self.proc.wait()}"
        return json.loads(line)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def seeded_pool(layout: KVLayout, num_pages: int, seed: int, device: str = "cpu") -> KVPool:
    pool = KVPool(layout, num_pages, device)
    gen = torch.Generator().manual_seed(seed)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen).to(pool.buffer.dtype))
    return pool


def rank_pool(full: KVPool, rank: int, tp: int) -> KVPool:
    """The pool of TP rank `rank` of `tp`: its KV heads of `full` (model/parallel.py's split)."""
    heads = kv_heads_of(rank, tp, full.layout.num_kv_heads)
    pool = KVPool(replace(full.layout, num_kv_heads=len(heads)), full.buffer.shape[2],
                  full.buffer.device)
    pool.buffer.copy_(full.buffer[:, :, :, :, heads.start:heads.stop])
    return pool


def poisoned_pool(layout: KVLayout, num_pages: int, device: str = "cpu") -> KVPool:
    pool = KVPool(layout, num_pages, device)
    pool.buffer.fill_(POISON)
    return pool


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["sender", "receiver"])
    ap.add_argument("--backend", default="tcp")
    ap.add_argument("--layout", required=True)
    ap.add_argument("--num-pages", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--chunk-bytes", type=int, default=32 * 2**20)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--tp-rank", type=int, default=0)
    args = ap.parse_args()
    layout = KVLayout(**json.loads(args.layout))
    say = lambda obj: print(json.dumps(obj), flush=True)  # noqa: E731
    if args.role == "sender":
        pool = rank_pool(seeded_pool(layout, args.num_pages, args.seed, args.device), args.tp_rank,
                         args.tp)
        node = KVSender(pool, args.backend, timeout_s=args.timeout, chunk_bytes=args.chunk_bytes,
                        model_layout=layout)
    else:
        node = KVReceiver(poisoned_pool(layout, args.num_pages, args.device), args.backend,
                          timeout_s=args.timeout)
        say({"address": node.address})
    mark = None
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "connect":
                node.connect(cmd["address"])
                say({"ok": True})
            elif op == "mark":  # a ready mark, for the sends that ask for it (shared_mark)
                mark = node.ready_mark()
                say({"ok": mark is not None})
            elif op == "send":
                shared = cmd.pop("shared_mark", False)
                node.send(**cmd, ready=mark if shared else None)
                say({"ok": True})
            elif op == "expect":
                node.expect(**cmd)
                say({"ok": True})
            elif op == "poll":  # wait up to `wait` s for `count` results
                results, deadline = [], time.monotonic() + cmd.get("wait", 0)
                while len(results) < cmd.get("count", 0) and time.monotonic() < deadline:
                    results += node.poll()
                    time.sleep(0.005)
                results += node.poll()
                say({"results": [r.__dict__ for r in results]})
            elif op == "abort":
                node.abort(cmd["request_id"])
                say({"ok": True})
        except Exception as e:
            say({"error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    main()
