"""A CPU transfer's I/O threads run their page copies on one OpenMP thread (base.enter_io_thread).
An OpenMP team of their own would leave libgomp managing more threads than there are CPUs, and
it then throttles how long the forward's idle threads spin."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import torch

from pd_serve.transfer import receiver as receiver_module
from pd_serve.transfer import sender as sender_module
from pd_serve.transfer.base import enter_io_thread
from test_hostile_peers import lands, receiver, sender  # noqa: E402

# In a process of its own: the tests run with OMP_NUM_THREADS=1 (tests/conftest.py), where every
# thread has a team of one already.
_CHECK = textwrap.dedent("""
    import ctypes, threading
    import torch
    from pd_serve.transfer.base import enter_io_thread
    max_threads = ctypes.CDLL(None).omp_get_max_threads
    seen = []
    def io():
        seen.append(max_threads())
        enter_io_thread(torch.device("cpu"))
        seen.append(max_threads())
    thread = threading.Thread(target=io)
    thread.start()
    thread.join()
    print(seen[0], seen[1], max_threads())
""")


def test_an_io_thread_runs_on_one_thread_and_leaves_the_others_alone():
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", _CHECK], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["2", "1", "2"]  # the I/O thread's team: 2, then 1; the main thread's: 2


def test_the_sender_and_receiver_threads_are_io_threads(monkeypatch):
    entered = {}

    def recording(device: torch.device) -> None:
        entered[threading.current_thread().name] = device.type
        enter_io_thread(device)

    monkeypatch.setattr(receiver_module, "enter_io_thread", recording)
    monkeypatch.setattr(sender_module, "enter_io_thread", recording)
    rec, snd = receiver(), sender()
    try:
        lands(rec, snd, "req", [5, 9], [1, 2])  # the copies still land bit-exact
    finally:
        snd.close()
        rec.close()
    assert entered == {"kv-receiver": "cpu", "kv-sender": "cpu"}
