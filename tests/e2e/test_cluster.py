"""The disaggregated cluster end to end: real processes, real sockets, the official openai client."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import socket
import time

import openai
import pytest
import torch
import transformers

from cluster_helpers import (assert_greedy_completions, health, metrics, start_cluster,
                             wait_idle)
from helpers import TEST_DEVICE, assert_greedy_matches, hf_greedy
from pd_serve import Engine, SamplingParams
from pd_serve.transfer.backends.nixl import nixl_available

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time, in a land far away,",
           "The three primary colours are", "Water boils at", "In 1492,"]
CHAT = [{"role": "user", "content": "Name a fruit that is yellow."}]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def reference(default_model_dir) -> Engine:
    return Engine(default_model_dir, device=TEST_DEVICE, max_total_tokens=8192)


@pytest.fixture(scope="module")
def cluster_1p1d():
    # Layer-wise KV hand-off (4 groups of SmolLM2's 30 layers, each sent as the forward finishes
    # it); the other splits below send after the last layer (the default, 1 group).
    cluster = start_cluster(1, 1, extra=["--transfer-layer-groups", "4"])
    yield cluster
    cluster.stop()


def client_for(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="x", max_retries=0, timeout=120)


def greedy_text(engine: Engine, prompt, max_tokens=MAX_TOKENS) -> tuple[str, int]:
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
    return out.text, len(out.token_ids)


def test_completions_and_chat_equal_colocated_and_transformers(cluster_1p1d, reference, default_model_dir):
    client = client_for(cluster_1p1d)
    model = client.models.list().data[0].id
    for prompt in PROMPTS[:3]:
        text, n = greedy_text(reference, prompt)
        out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert out.choices[0].text == text and out.usage.completion_tokens == n
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == text
    templated = reference.tokenizer.encode(reference.tokenizer.apply_chat_template(CHAT),
                                           add_special_tokens=False)
    text, n = greedy_text(reference, templated, 40)
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=40, temperature=0)
    assert chat.choices[0].message.content == text
    stream = client.chat.completions.create(model=model, messages=CHAT, max_tokens=40, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    # transformers on the same weights, token for token: cluster == colocated == transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    prompt_ids = reference.tokenizer.encode(PROMPTS[0])
    want = reference.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                           ignore_eos=True))[0]
    if TEST_DEVICE == "cpu":  # on GPU (bf16) tests/gpu compares with transformers instead
        ref, ref_logits = hf_greedy(hf, prompt_ids, MAX_TOKENS)
        assert_greedy_matches(want.token_ids, ref, ref_logits)
    out = client.completions.create(model=model, prompt=prompt_ids, max_tokens=MAX_TOKENS,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == want.text and out.usage.completion_tokens == MAX_TOKENS


def test_seeded_sampling_equals_colocated(cluster_1p1d, reference):
    params = dict(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24)
    want = reference.generate([PROMPTS[3]], SamplingParams(**params, ignore_eos=True))[0]
    client = client_for(cluster_1p1d)
    out = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPTS[3],
                                    extra_body={"ignore_eos": True}, **params)
    assert out.choices[0].text == want.text


def test_n_choices_batched_prompts_and_logit_bias_through_the_cluster(cluster_1p1d, reference):
    """n=2 over two prompts: four requests through prefill and decode side by side, each
    choice the colocated engine's (seed + i per choice), and every page free after; and a
    logit_bias that forces a token through both workers."""
    params = dict(temperature=0.9, seed=77, max_tokens=16)
    client = client_for(cluster_1p1d)
    out = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPTS[4:6],
                                    n=2, extra_body={"ignore_eos": True}, **params)
    want = [reference.generate([prompt], SamplingParams(**(params | {"seed": 77 + i}),
                                                        ignore_eos=True))[0].text
            for prompt in PROMPTS[4:6] for i in range(2)]
    assert [(c.index, c.text) for c in out.choices] == list(enumerate(want))
    assert out.usage.completion_tokens == 4 * 16
    # logit_bias crosses to the workers (int keys in the msgpack map)
    token = reference.tokenizer.encode(" yes")[0]
    out = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPTS[4],
                                    max_tokens=3, temperature=0, logit_bias={str(token): 100},
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == reference.tokenizer.decode([token] * 3)
    assert all(used == 0 for used, _ in wait_idle(cluster_1p1d).values())


def test_min_tokens_and_guided_choice_through_prefill_and_decode(cluster_1p1d, reference):
    """min_tokens masks a stop token id on prefill's token 1 and on decode's tokens alike, as
    the colocated engine does; guided_choice's grammar holds across the hand-off."""
    client = client_for(cluster_1p1d)
    model = client.models.list().data[0].id
    prompt = PROMPTS[5]  # greedy, it samples its first token again at its third
    first = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0].token_ids[0]
    params = dict(temperature=0, max_tokens=10, stop_token_ids=[first])
    want = reference.generate([prompt], SamplingParams(**params, min_tokens=4))[0]
    only_first = reference.generate([prompt], SamplingParams(**params, min_tokens=1))[0]
    assert first not in want.token_ids[:4] and len(only_first.token_ids) < 4  # decode's mask counts
    out = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0,
                                    extra_body={"stop_token_ids": [first], "min_tokens": 4})
    assert out.choices[0].text == want.text
    # prefill's token 1 a stop token, decode ending the request on it: no text (vLLM's rule)
    out = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0,
                                    extra_body={"stop_token_ids": [first]})
    assert (out.choices[0].text, out.choices[0].finish_reason) == ("", "stop")
    assert out.choices[0].model_extra["stop_reason"] == first
    choices = ["red", "green", "blue sky"]
    out = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body={"guided_choice": choices})
    assert out.choices[0].text in choices and out.choices[0].finish_reason == "stop"
    assert all(used == 0 for used, _ in wait_idle(cluster_1p1d).values())


def assert_echoed_logprobs(cluster, reference: Engine) -> None:
    """Completions' echo with logprobs (lm-eval's loglikelihood request) over two prompts, one
    of ids: the prompt's tokens lead, each with the colocated engine's prompt logprob, then the
    sampled ones; streamed, the first chunk brings them."""
    client = client_for(cluster)
    tok = reference.tokenizer
    prompts = [tok.encode(PROMPTS[2]), PROMPTS[0]]
    out = client.completions.create(model=client.models.list().data[0].id, prompt=prompts,
                                    max_tokens=2, temperature=0, echo=True, logprobs=2,
                                    extra_body={"ignore_eos": True})
    stream = client.completions.create(model=client.models.list().data[0].id, prompt=prompts[0],
                                       max_tokens=2, temperature=0, echo=True, logprobs=2,
                                       stream=True, extra_body={"ignore_eos": True})
    first = next(c for c in stream if c.choices and c.choices[0].logprobs)
    for choice, prompt in zip(out.choices, prompts):
        ids = prompt if isinstance(prompt, list) else tok.encode(prompt)
        want = reference.generate([ids], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True,
                                                        logprobs=2, prompt_logprobs=2))[0]
        lp = choice.logprobs
        assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in ids + want.token_ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(
            [e.logprob for e in want.prompt_logprobs + want.logprobs], abs=1e-3)
        assert [len(top) for top in lp.top_logprobs[1:len(ids)]] == [
            len({t for t, _ in e.top} | {e.token_id}) for e in want.prompt_logprobs]
        assert choice.text.endswith(want.text)
    n = len(prompts[0])
    streamed = first.choices[0].logprobs.token_logprobs[:n]
    assert streamed[0] is None and streamed[1:] == pytest.approx(out.choices[0].logprobs.token_logprobs[1:n], abs=1e-3)
    # max_tokens 0 (OpenAI's prompt scoring): the prompt and its logprobs alone
    scored = client.completions.create(model=client.models.list().data[0].id, prompt=prompts[0],
                                       max_tokens=0, echo=True, logprobs=2)
    (choice,) = scored.choices
    assert choice.text == tok.decode(prompts[0], skip_special_tokens=False)
    assert choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.token_logprobs[1:] == \
        pytest.approx(out.choices[0].logprobs.token_logprobs[1:n], abs=1e-3)
    assert all(used == 0 for used, _ in wait_idle(cluster).values())


def test_echo_with_logprobs_scores_the_prompt_in_1p1d_and_colocated(cluster_1p1d, reference):
    assert_echoed_logprobs(cluster_1p1d, reference)
    colocated = start_cluster(0, 0, num_colocated=1)
    try:
        assert_echoed_logprobs(colocated, reference)
    finally:
        colocated.stop()


def test_timings_metrics_and_idle_pages(cluster_1p1d):
    client = client_for(cluster_1p1d)
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0)
    timings = out.model_extra["timings"]
    for key in ("queue", "prefill", "prefill_step", "transfer", "first_token", "decode", "e2e"):
        assert key in timings
    assert 0 < timings["prefill_step"] <= timings["prefill"] < timings["first_token"]
    chunks = list(client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0,
                                            stream=True))
    [finishing] = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishing.model_extra["timings"].keys() == timings.keys()  # streamed: on the last chunk
    assert all("timings" not in c.model_extra for c in chunks if c is not finishing)
    deadline = time.monotonic() + 5  # workers' metrics reach the gateway with their heartbeat (1 s)
    m = metrics(cluster_1p1d.base_url)
    while not any(n == "pd_serve:kv_transfers_total" for n, _ in m) and time.monotonic() < deadline:
        time.sleep(0.2)
        m = metrics(cluster_1p1d.base_url)
    for name in ("pd_serve:time_to_first_token_seconds_count", "pd_serve:e2e_request_latency_seconds_count",
                 "pd_serve:request_queue_time_seconds_count", "pd_serve:inter_token_latency_seconds_count"):
        assert m[(name, "")] >= 1, name
    workers = {w for (_, w) in m if w}
    assert any(w.startswith("prefill") for w in workers) and any(w.startswith("decode") for w in workers)
    assert any(name == "pd_serve:kv_transfers_total" and m[(name, w)] >= 1 for (name, w) in m)
    state = wait_idle(cluster_1p1d)
    assert all(used == 0 and total > 0 for used, total in state.values()), state


def test_64_concurrent_streams_complete_and_free_every_page(cluster_1p1d, reference):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i % 3) for i in range(64)]
    lengths = [4 + (i * 7) % 20 for i in range(64)]
    expected = [greedy_text(reference, p, n)[0] for p, n in zip(prompts, lengths)]

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{cluster_1p1d.base_url}/v1", api_key="x",
                                    max_retries=0, timeout=300)
        model = (await client.models.list()).data[0].id

        async def one(prompt, n):
            stream = await client.completions.create(model=model, prompt=prompt, max_tokens=n,
                                                     temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices])

        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths)))

    assert asyncio.run(main()) == expected
    state = wait_idle(cluster_1p1d)
    assert all(used == 0 for used, _ in state.values()), state


def _open_stream(base_url: str, prompt: str, max_tokens: int) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    body = json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "ignore_eos": True})
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    return sock


def test_client_disconnect_frees_pages_in_decode_and_in_prefill(cluster_1p1d):
    sock = _open_stream(cluster_1p1d.base_url, "Tell me a long story.", 2000)
    sock.settimeout(60)
    received = b""
    while b"data:" not in received:  # streaming has begun (headers may come first)
        chunk = sock.recv(4096)
        assert chunk, "the gateway closed the stream"
        received += chunk
    sock.close()  # mid-decode
    state = wait_idle(cluster_1p1d)
    assert all(used == 0 for used, _ in state.values()), state
    long_prompt = "word " * 1500  # long enough that prefill is still running when we leave
    sock = _open_stream(cluster_1p1d.base_url, long_prompt, 50)
    time.sleep(0.3)
    sock.close()
    state = wait_idle(cluster_1p1d)
    assert all(used == 0 for used, _ in state.values()), state


def test_bad_requests_get_openai_errors(cluster_1p1d):
    client = client_for(cluster_1p1d)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=0)
    assert "max_tokens" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="hi " * 9000, max_tokens=4)
    assert "maximum context length" in str(e.value)


@pytest.mark.parametrize("model", ["default", "qwen3"])
@pytest.mark.parametrize("num_prefill,num_decode", [(2, 1), (1, 2)])
def test_other_splits_give_the_same_tokens(num_prefill, num_decode, model, reference, tiny_checkpoints):
    model_dir = None if model == "default" else tiny_checkpoints[model]
    engine = reference if model_dir is None else Engine(model_dir, device=TEST_DEVICE, max_total_tokens=4096)
    cluster = start_cluster(num_prefill, num_decode, model=model_dir)
    try:
        client = client_for(cluster)
        name = client.models.list().data[0].id
        for prompt in PROMPTS:
            want = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                            ignore_eos=True))[0]
            out = client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS,
                                            temperature=0, extra_body={"ignore_eos": True})
            assert out.choices[0].text == want.text
        templated = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(CHAT),
                                            add_special_tokens=False)
        want = engine.generate([templated], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                           ignore_eos=True))[0]
        for stream in (False, True):  # chat, streamed and not
            chat = client.chat.completions.create(model=name, messages=CHAT, max_tokens=MAX_TOKENS,
                                                  temperature=0, stream=stream,
                                                  extra_body={"ignore_eos": True})
            text = ("".join(c.choices[0].delta.content or "" for c in chat if c.choices) if stream
                    else chat.choices[0].message.content)
            assert text == want.text
        stream = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        want = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                            ignore_eos=True))[0]
        assert "".join(c.choices[0].text for c in stream if c.choices) == want.text
        m = metrics(cluster.base_url)
        role_counts = {r: sum(1 for (n, w) in m if n == "pd_serve:kv_pages_total" and w.startswith(r))
                       for r in ("prefill", "decode")}
        assert role_counts == {"prefill": num_prefill, "decode": num_decode}
        state = wait_idle(cluster)
        assert all(used == 0 for used, _ in state.values()), state
    finally:
        cluster.stop()


def test_tiny_qwen3_cluster_equals_colocated(tiny_checkpoints):
    model_dir = tiny_checkpoints["qwen3"]
    engine = Engine(model_dir, device=TEST_DEVICE, max_total_tokens=4096)
    cluster = start_cluster(1, 1, model=model_dir)
    try:
        client = client_for(cluster)
        model = client.models.list().data[0].id
        for prompt in PROMPTS[:3]:
            ids = engine.tokenizer.encode(prompt)
            want = engine.generate([ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
            out = client.completions.create(model=model, prompt=ids, max_tokens=16, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].text == want.text and out.usage.completion_tokens == 16
        templated = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(CHAT),
                                            add_special_tokens=False)
        want = engine.generate([templated], SamplingParams(temperature=0, max_tokens=16,
                                                           ignore_eos=True))[0]
        for stream in (False, True):
            chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=16,
                                                  temperature=0, stream=stream,
                                                  extra_body={"ignore_eos": True})
            text = ("".join(c.choices[0].delta.content or "" for c in chat if c.choices) if stream
                    else chat.choices[0].message.content)
            assert text == want.text
    finally:
        cluster.stop()


@pytest.mark.skipif(not nixl_available(), reason="nixl is not installed (pip install pd-serve[nixl])")
def test_1p1d_over_nixl_equals_colocated(reference):
    """The KV crosses through NIXL (the decode worker reads it), layer group by layer group."""
    cluster = start_cluster(1, 1, extra=["--transfer-backend", "nixl", "--transfer-layer-groups", "2"])
    try:
        want = [reference.generate([p], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                       ignore_eos=True))[0].text for p in PROMPTS]
        assert_greedy_completions(cluster, PROMPTS, want, MAX_TOKENS)
        deadline = time.monotonic() + 5  # worker metrics come with their heartbeat
        while True:  # each request counted once by the prefill and once by the decode worker
            m = metrics(cluster.base_url)
            moved = sum(v for (n, _), v in m.items() if n == "pd_serve:kv_transfers_total")
            if moved >= 2 * len(PROMPTS) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert moved == 2 * len(PROMPTS)
    finally:
        cluster.stop()


def test_kill_decode_mid_stream_errors_and_survivor_serves():
    cluster = start_cluster(1, 2, gateway_args=("--worker-timeout", "2", "--step-timeout", "20",
                                               "--decode-policy", "round_robin"))
    try:
        client = client_for(cluster)
        model = client.models.list().data[0].id
        stream = client.completions.create(model=model, prompt="Count to one thousand:", max_tokens=2000,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        start = None
        with pytest.raises(openai.APIError):
            for i, _chunk in enumerate(stream):
                if i == 2:  # kill the decode worker that holds this stream
                    busy = [w for w, info in health(cluster.base_url)["workers"].items()
                            if w.startswith("decode") and info["inflight"]]
                    victim = dict(cluster.procs)[busy[0]]
                    os.kill(victim.pid, signal.SIGKILL)
                    start = time.monotonic()
        assert start is None or time.monotonic() - start < 15
        deadline = time.monotonic() + 10
        while len(health(cluster.base_url)["workers"]) > 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        for prompt in PROMPTS[:3]:  # the survivor takes new requests
            out = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
            assert out.choices[0].finish_reason == "length"
    finally:
        cluster.stop()


def test_a_whole_request_that_lost_its_decode_worker_mid_output_starts_over(reference):
    """1P2D: the decode worker of a non-streamed request is killed after tokens have come;
    its client has seen nothing, so the gateway sends it again, and the client gets the
    colocated engine's greedy text, once."""
    cluster = start_cluster(1, 2, gateway_args=("--worker-timeout", "2", "--step-timeout", "60",
                                                "--decode-policy", "round_robin"))
    try:
        client = client_for(cluster)
        model = client.models.list().data[0].id
        prompt, n = PROMPTS[0], 48
        expected = reference.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n,
                                                               ignore_eos=True))[0].text
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(client.completions.create, model=model, prompt=prompt,
                                 max_tokens=n, temperature=0, extra_body={"ignore_eos": True},
                                 timeout=120)
            deadline = time.monotonic() + 60
            while (metrics(cluster.base_url).get(("pd_serve:inter_token_latency_seconds_count", ""), 0) < 3
                   and not answer.done() and time.monotonic() < deadline):
                time.sleep(0.02)  # until decode tokens have reached the gateway
            busy = [w for w, info in health(cluster.base_url)["workers"].items()
                    if w.startswith("decode") and info["inflight"]]
            assert busy and not answer.done(), "the request was not caught mid-output"
            os.kill(dict(cluster.procs)[busy[0]].pid, signal.SIGKILL)
            out = answer.result()
        assert out.choices[0].text == expected and out.usage.completion_tokens == n
        assert metrics(cluster.base_url)[("pd_serve:request_retries_total", "")] == 1
    finally:
        cluster.stop()


def test_requests_on_a_lost_prefill_worker_are_served_by_the_other(reference):
    """2P1D, round robin: one prefill worker freezes (SIGSTOP) as requests arrive, so about half
    land on it; the gateway drops it after --worker-timeout and sends those requests again to
    the other one. Every client gets the colocated engine's greedy text."""
    cluster = start_cluster(2, 1, gateway_args=("--worker-timeout", "4", "--step-timeout", "60",
                                                "--prefill-policy", "round_robin"))
    try:
        client = client_for(cluster)
        model = client.models.list().data[0].id
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(6)]
        expected = [greedy_text(reference, p, 8)[0] for p in prompts]
        victim = next(p for name, p in cluster.procs if name.startswith("prefill"))
        os.kill(victim.pid, signal.SIGSTOP)

        async def main():
            aclient = openai.AsyncOpenAI(base_url=f"{cluster.base_url}/v1", api_key="x",
                                         max_retries=0, timeout=120)
            outs = await asyncio.gather(*(aclient.completions.create(
                model=model, prompt=p, max_tokens=8, temperature=0) for p in prompts))
            return [o.choices[0].text for o in outs]

        try:
            assert asyncio.run(main()) == expected
        finally:
            os.kill(victim.pid, signal.SIGKILL)
        assert metrics(cluster.base_url)[("pd_serve:request_retries_total", "")] >= 1
        assert all(used == 0 for used, _ in wait_idle(cluster).values())
    finally:
        cluster.stop()


def test_a_hung_worker_replaced_under_its_id_exits_when_it_wakes():
    """A worker hangs (SIGSTOP) and a new process starts under its --worker-id, registers and
    serves. When the old one wakes (SIGCONT), the gateway tells it it was replaced and it
    exits, rather than living on with every message it sends refused. (The timeouts outlast
    the new process's start: the request sent to the hung one is retried on the new one when
    it registers, rather than failed by an empty pool.)"""
    cluster = start_cluster(0, 0, 1, gateway_args=("--worker-timeout", "300", "--step-timeout", "300"))
    try:
        client = client_for(cluster)
        model = client.models.list().data[0].id
        name, old = cluster.procs[-1]
        os.kill(old.pid, signal.SIGSTOP)
        level_at = old.args.index("--log-level")
        cluster._start(f"{name}-new", old.args[level_at + 2:], old.args[level_at + 1])
        new = cluster.procs[-1][1]
        answer = client.completions.create(model=model, prompt="Hello", max_tokens=4, timeout=120)
        assert answer.choices[0].text
        os.kill(old.pid, signal.SIGCONT)
        assert old.wait(timeout=120) == 0
        assert new.poll() is None
        answer = client.completions.create(model=model, prompt="Hello", max_tokens=4, timeout=120)
        assert answer.choices[0].text
    finally:
        cluster.stop()


def test_kill_prefill_fails_inflight_and_gateway_restart_reregisters():
    cluster = start_cluster(1, 1, gateway_args=("--worker-timeout", "2", "--step-timeout", "20"))
    try:
        client = client_for(cluster)
        model = client.models.list().data[0].id
        prefill = next(p for name, p in cluster.procs if name.startswith("prefill"))
        os.kill(prefill.pid, signal.SIGSTOP)  # hung mid-request, then gone
        start = time.monotonic()
        with pytest.raises(openai.APIError):
            client.completions.create(model=model, prompt="word " * 400, max_tokens=4)
        assert time.monotonic() - start < 25
        os.kill(prefill.pid, signal.SIGKILL)
        # gateway restart: the workers find the new one on the same control port
        gateway = dict(cluster.procs)["gateway"]
        gateway.kill()
        gateway.wait()
        cluster._start("gateway", cluster.gateway_command, "warning")  # same flags and model
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if any(w.startswith("decode") for w in health(cluster.base_url).get("workers", {})):
                break
            time.sleep(0.3)
        assert any(w.startswith("decode") for w in health(cluster.base_url)["workers"])
    finally:
        cluster.stop()
