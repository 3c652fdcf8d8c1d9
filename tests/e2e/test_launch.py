"""`pd-serve launch` as a user runs it: one command, an OpenAI endpoint, Ctrl-C ends everything."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import openai
import pytest

from cluster_helpers import health
from helpers import TEST_DEVICE, TEST_TRANSFER
from pd_serve.launch import free_port


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_launch_serves_openai_and_ctrl_c_stops_every_child():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pd_serve.cli", "--log-level", "warning", "launch",
                             "--prefill", "1", "--decode", "1", "--port", str(port), "--api-key", "k1",
                             "--device", TEST_DEVICE, "--max-total-tokens", "4096", *TEST_TRANSFER]
                            + (["--model", os.environ["PD_SERVE_TEST_MODEL"]] if os.environ.get("PD_SERVE_TEST_MODEL") else []))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while len(health(base).get("workers", {})) < 2:
            assert proc.poll() is None, "launch exited during start-up"
            assert time.monotonic() < deadline, "cluster not ready"
            time.sleep(0.5)
        children = _children(proc.pid)
        assert len(children) == 3  # gateway, prefill, decode
        with pytest.raises(openai.AuthenticationError):  # --api-key reached the gateway
            openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0).models.list()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="k1", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16, temperature=0)
        if not os.environ.get("PD_SERVE_TEST_MODEL"):  # the real SmolLM2 knows
            assert "Paris" in reply.choices[0].message.content
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 15
        while any(_alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(c) for c in children), "a child outlived launch"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_worker_with_no_gateway_to_hear_says_so():
    """A decode worker whose --gateway has nobody listening logs why it waits (UNHEARD_WARN_S
    after it starts), where it waited without a word."""
    port = free_port()  # nothing listens there
    proc = subprocess.Popen([sys.executable, "-m", "pd_serve.cli", "--log-level", "warning", "decode",
                             "--gateway", f"tcp://127.0.0.1:{port}", "--device", TEST_DEVICE,
                             "--max-total-tokens", "1024", *TEST_TRANSFER]
                            + (["--model", os.environ["PD_SERVE_TEST_MODEL"]] if os.environ.get("PD_SERVE_TEST_MODEL") else []),
                            stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PD_SERVE_CLUSTER_KEY="k" * 32))
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr] + [lines.put(None)],
                     daemon=True).start()
    try:
        deadline = time.monotonic() + 240
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))  # (Empty: no warning)
            assert line is not None, f"the worker exited ({proc.wait()}) without the warning"
            if "no word from the gateway" in line:
                assert f"tcp://127.0.0.1:{port}" in line and "PD_SERVE_CLUSTER_KEY" in line, line
                break
    finally:
        proc.kill()
        proc.wait()
