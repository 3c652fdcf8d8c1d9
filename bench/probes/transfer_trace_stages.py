"""Per-stage latency of KV transfers from a `PD_SERVE_TRANSFER_TRACE=1` log (the sender's and the
receiver's stderr lines, in one file or several): for each request that went the whole way
(send, recv, land, ack), the microseconds between consecutive stages, as p50 / mean / p90, and
how many requests shared each copy batch. One chunk a request (ipc) is assumed; requests sent
layer group by layer group are skipped.

    PD_SERVE_TRANSFER_TRACE=1 python bench/probes/control_path.py --backend ipc --repeats 1 2> trace.txt
    python bench/probes/transfer_trace_stages.py trace.txt
"""

import argparse
import gzip
import statistics
import sys

# (name, the stage it starts at, the stage it ends at): marks of `read`'s per-request times
STAGES = [
    ("queued, until the I/O thread takes it", "queued", "picked"),
    ("taken, until its header is sent", "picked", "header_sent"),
    ("sent, until the receiver has it", "header_sent", "arrived"),
    ("arrived, until its writes are queued", "arrived", "write_queued"),
    ("writes queued, until the batch's event is recorded", "write_queued", "marked"),
    ("event recorded, until it has landed", "marked", "landed"),
    ("landed, until the ack is sent", "landed", "ack_sent"),
    ("ack sent, until the sender has it", "ack_sent", "acked"),
    ("whole: send() to the sender's result", "queued", "acked"),
]


def read(paths: list[str]) -> tuple[dict[str, dict[str, float]], int]:
    """Each request's absolute stage times (us) and the number of copy batches."""
    requests: dict[str, dict[str, dict]] = {}
    chunked: set[str] = set()  # requests with several chunks of a role: skipped
    batches = 0
    for path in paths:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            for line in f:
                if not line.startswith("[transfer-trace]"):
                    continue
                _, role, request_id, *marks = line.split()
                values = {k: float(v) for k, v in (m.split("=") for m in marks)}
                if role == "batch":
                    batches += 1
                elif role in ("send", "recv", "land", "ack"):
                    if role in requests.setdefault(request_id, {}):
                        chunked.add(request_id)
                    requests[request_id][role] = values
    out = {}
    for request_id, seen in requests.items():
        if request_id in chunked or not all(r in seen for r in ("send", "recv", "land", "ack")):
            continue
        send, recv, land, ack = (seen[r] for r in ("send", "recv", "land", "ack"))
        out[request_id] = {
            "queued": send["t0"], "picked": send["t0"] + send["picked"],
            "header_sent": send["t0"] + send["header_sent"], "arrived": recv["t0"],
            "write_queued": recv["t0"] + recv["queued"], "marked": land["t0"],
            "landed": land["t0"] + land["landed"], "ack_sent": land["t0"] + land["acked"],
            "acked": ack["t0"] + ack["acked"]}
    return out, batches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="trace files (.gz allowed)")
    args = p.parse_args()
    requests, batches = read(args.traces)
    if not requests:
        sys.exit("no request with send, recv, land and ack lines in the traces")
    print(f"{len(requests)} requests, {batches} copy batches "
          f"({len(requests) / max(batches, 1):.1f} requests a batch)")
    print(f"{'stage':52s} {'p50 us':>8s} {'mean':>8s} {'p90':>8s}")
    for name, start, end in STAGES:
        values = sorted(r[end] - r[start] for r in requests.values())
        print(f"{name:52s} {statistics.median(values):8.0f} {statistics.mean(values):8.0f} "
              f"{values[int(0.9 * (len(values) - 1))]:8.0f}")


if __name__ == "__main__":
    main()
