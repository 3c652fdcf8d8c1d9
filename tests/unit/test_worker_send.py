"""A worker's sends to the gateway never hang it: to an unreachable gateway zmq queues up to its
high-water mark; past it a send waits for at most the link's timeout (flow control), then the
gateway counts as stuck, once, and sends drop at once until the gateway is heard from again.
Heartbeats and the last word never wait (send_nowait). Real zmq sockets."""

from __future__ import annotations

import time

import pytest
import zmq

from pd_serve.launch import free_port
from pd_serve.worker import GatewayLink, send_nowait


@pytest.fixture
def unreachable():
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{free_port()}")  # nothing listens there
    yield sock
    sock.close()


def test_send_nowait_drops_past_the_queue_and_never_waits(unreachable):
    start = time.monotonic()
    sent = [send_nowait(unreachable, b"beat") for _ in range(1500)]
    assert time.monotonic() - start < 30  # (a plain send would hang here for good)
    queued = sent.index(False)  # zmq's high-water mark (1000 by default)
    assert queued > 0 and all(sent[:queued]) and not any(sent[queued:])


def test_link_waits_its_timeout_once_then_drops_until_the_gateway_is_heard(unreachable):
    while send_nowait(unreachable, b"status"):  # fill the queue
        pass
    stuck = []
    link = GatewayLink(unreachable, 0.3, lambda: stuck.append(1))
    start = time.monotonic()
    assert not link.send(b"tokens")  # waited for room up to the timeout, then gave up
    assert 0.25 < time.monotonic() - start < 30 and stuck == [1]
    start = time.monotonic()
    assert not any(link.send(b"tokens") for _ in range(100))  # stuck: dropped at once
    assert time.monotonic() - start < 3 and stuck == [1]
    link.heard()  # a ping came: the next send waits again, and finds it stuck again
    start = time.monotonic()
    assert not link.send(b"status")
    assert time.monotonic() - start > 0.25 and stuck == [1, 1]
    assert link.dropped == 102
