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


def test_a_worker_never_answered_says_why_every_interval():
    """A worker the gateway never answers (a wrong address, another cluster key) warns every
    UNHEARD_WARN_S with the likely causes; a host that does not resolve is named as such (a
    red-team pass watched workers wait without a word for 25-52 s)."""
    from pd_serve.worker import UNHEARD_WARN_S, UnheardGateway

    watch = UnheardGateway("tcp://127.0.0.1:8100", start=100.0)
    assert watch.due(100.0 + UNHEARD_WARN_S - 0.1) is None
    warning = watch.due(100.0 + UNHEARD_WARN_S)
    assert warning.startswith(f"no word from the gateway at tcp://127.0.0.1:8100 for {UNHEARD_WARN_S:.0f} s")
    assert "same PD_SERVE_CLUSTER_KEY" in warning
    assert watch.due(100.0 + 1.5 * UNHEARD_WARN_S) is None  # once an interval
    assert watch.due(100.0 + 2 * UNHEARD_WARN_S) is not None
    far = UnheardGateway("tcp://no-such-host.invalid:8100", start=0.0).due(UNHEARD_WARN_S)
    assert "its host 'no-such-host.invalid' does not resolve" in far
