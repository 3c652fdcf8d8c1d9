"""A 1P1D cluster whose decode worker runs the overlap schedule (on by default on GPU; forced on
here with PD_SERVE_OVERLAP_CPU=1): streamed greedy and seeded output equal the synchronous
engine's, a disconnect mid-decode frees every page."""

from __future__ import annotations

import asyncio
import socket

import openai
import pytest

from cluster_helpers import start_cluster, wait_idle
from helpers import TEST_DEVICE
from pd_serve import Engine, SamplingParams

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time, in a land far away,",
           "Water boils at"]


@pytest.fixture(scope="module")
def cluster():
    with pytest.MonkeyPatch.context() as mp:  # the workers inherit it
        mp.setenv("PD_SERVE_OVERLAP_CPU", "1")
        cluster = start_cluster(1, 1)
    yield cluster
    cluster.stop()


def test_concurrent_streams_and_seeded_sampling_equal_the_synchronous_engine(cluster, default_model_dir):
    reference = Engine(default_model_dir, device=TEST_DEVICE, max_total_tokens=8192)
    assert not reference.overlap or TEST_DEVICE != "cpu"
    cases = [(PROMPTS[i % len(PROMPTS)], 3 + (i * 5) % 17, None if i % 4 else i) for i in range(24)]
    expected = [reference.generate([p], SamplingParams(
        temperature=0.0 if seed is None else 0.8, seed=seed, max_tokens=n))[0].text
        for p, n, seed in cases]

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{cluster.base_url}/v1", api_key="x",
                                    max_retries=0, timeout=300)
        model = (await client.models.list()).data[0].id

        async def one(prompt, n, seed):
            stream = await client.completions.create(
                model=model, prompt=prompt, max_tokens=n, stream=True,
                temperature=0.0 if seed is None else 0.8, seed=seed)
            return "".join([c.choices[0].text async for c in stream if c.choices])

        return await asyncio.gather(*(one(*c) for c in cases))

    assert asyncio.run(main()) == expected
    state = wait_idle(cluster)
    assert all(used == 0 for used, _ in state.values()), state


def test_disconnect_mid_decode_frees_every_page(cluster):
    host, port = cluster.base_url.removeprefix("http://").split(":")
    body = ('{"model": "SmolLM2-135M-Instruct", "prompt": "Tell me a long story.", '
            '"max_tokens": 2000, "temperature": 0, "stream": true, "ignore_eos": true}')
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    sock.settimeout(60)
    received = b""
    while received.count(b"data:") < 5:  # decoding has begun
        chunk = sock.recv(4096)
        assert chunk, "the gateway closed the stream"
        received += chunk
    sock.close()
    state = wait_idle(cluster)
    assert all(used == 0 for used, _ in state.values()), state
