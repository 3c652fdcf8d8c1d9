"""A worker's sends to the gateway never block: to an unreachable gateway, zmq queues up to
its high-water mark, and past it send_nowait drops (a plain send would hang the worker)."""

from __future__ import annotations

import time

import zmq

from pd_serve.launch import free_port
from pd_serve.worker import send_nowait


def test_send_to_an_unreachable_gateway_drops_past_the_queue_and_never_blocks():
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{free_port()}")  # nothing listens there
    try:
        start = time.monotonic()
        sent = [send_nowait(sock, b"status") for _ in range(1500)]
        assert time.monotonic() - start < 30  # (blocking would hang here for good)
        queued = sent.index(False)  # zmq's high-water mark (1000 by default)
        assert queued > 0 and all(sent[:queued]) and not any(sent[queued:])
    finally:
        sock.close()
