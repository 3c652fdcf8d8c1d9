"""What CURVE costs a control message: the gateway's socket pair (a DEALER sending to a ROUTER
over loopback TCP, pyzmq as the gateway and workers use it), plain and under
pd_serve.protocol.secure_control, the time a message over a burst of N (the sender in a thread,
the receiver taking each whole message), for the sizes control messages have: a heartbeat
(~200 B), a decode step's TokenBatch at batch 256 (~5.7 KB), a long prompt's Prefill (~512 KB),
and for scale a 64 MiB KV message (KV sockets stay plain).
Rounds alternate plain and CURVE; each row gives every round's figure.

    python bench/probes/control_curve.py --output bench/results/control-curve-cpu.json
"""

import argparse
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import zmq  # noqa: E402

from pd_serve import protocol  # noqa: E402

SIZES = {"heartbeat": 200, "token_batch_256": 5700, "prefill_128k_tokens": 512 * 1024,
         "kv_64mib": 64 << 20}  # (the last for scale: KV transfers stay plain)


def per_message_us(key: bytes, size: int, count: int) -> float:
    ctx = zmq.Context()
    server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    protocol.secure_control(server, key, server=True)
    protocol.secure_control(client, key, server=False)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client.connect(f"tcp://127.0.0.1:{port}")
    data = os.urandom(size)
    client.send(data)
    server.recv_multipart()  # connected (and the handshake done)
    sender = threading.Thread(target=lambda: [client.send(data) for _ in range(count)])
    start = time.perf_counter()
    sender.start()
    for _ in range(count):
        server.recv_multipart()
    elapsed = time.perf_counter() - start
    sender.join()
    ctx.destroy(0)
    return elapsed / count * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    rows = []
    for name, size in SIZES.items():
        count = max(8, min(20000, 2**27 // size))
        plain, curve = [], []
        for _ in range(args.rounds):
            plain.append(round(per_message_us(b"", size, count), 2))
            curve.append(round(per_message_us(b"k" * 32, size, count), 2))
        rows.append({"message": name, "bytes": size, "count": count, "plain_us": plain,
                     "curve_us": curve})
        print(f"{name:>20} {size:>7} B: plain {min(plain):8.1f} us, CURVE {min(curve):8.1f} us "
              f"(best of {args.rounds})", flush=True)
    result = {"probe": "bench/probes/control_curve.py", "machine": platform.processor() or
              platform.machine(), "cpus": os.cpu_count(), "zmq": zmq.zmq_version(), "rows": rows}
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
