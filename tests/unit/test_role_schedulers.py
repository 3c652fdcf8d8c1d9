"""Each role's scheduler (role.py, prefill/scheduler.py, decode/scheduler.py) driven by hand,
without processes or sockets: messages in, messages out, and every page back in the pool.

The KV hand-off is a connector that records what it is asked to do; the P/D test copies the
pages from the prefill engine's pool into the decode engine's itself, where the transfer layer
would, and checks the tokens against the colocated role's."""

from __future__ import annotations

import re
import threading

import pytest

from helpers import assert_pages_settled
from pd_serve.config import EngineConfig
from pd_serve.decode.scheduler import DecodeScheduler
from pd_serve.engine.core import EngineCore
from pd_serve.engine.sampling_params import Grammar, SamplingParams
from pd_serve.model.tokenizer import Tokenizer
from pd_serve.prefill.scheduler import PrefillScheduler
from pd_serve.protocol import (AbortRequest, Admit, AdmitReply, GatewayPing, Generate, Prefill,
                               PrefillDone, StartDecode, TokenBatch)
from pd_serve.role import ColocatedScheduler
from pd_serve.transfer.base import TransferResult
from pd_serve.transfer.connector import KVConnector
from pd_serve.worker import Worker

PAGE_SIZE = 16
PROMPTS = [list(range(5, 5 + n)) for n in (7, 20, 33)]


class RecordingConnector(KVConnector):
    """Records the hand-off's calls; results are queued by the test."""

    addresses = ["tcp://decode-rank-0"]

    def __init__(self, num_layers: int):
        self.last_layer = num_layers - 1
        self.sent, self.expected, self.cancelled, self.results = [], {}, [], []

    def routes(self, decode_tp: int) -> tuple:
        return ()

    def send_layers(self, sends, layer: int) -> None:
        if layer == self.last_layer:
            self.sent.extend(sends)

    def expect(self, request_id: str, page_ids: list[int]) -> None:
        self.expected[request_id] = list(page_ids)

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    def poll(self) -> list[TransferResult]:
        results, self.results = self.results, []
        return results

    @property
    def alive(self) -> bool:
        return True

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def cores(tiny_checkpoints) -> dict[str, EngineCore]:
    def core(num_pages: int, prefix_cache: bool = True) -> EngineCore:
        return EngineCore(EngineConfig.from_flat(
            model=str(tiny_checkpoints["llama3"]), device="cpu", page_size=PAGE_SIZE,
            max_total_tokens=num_pages * PAGE_SIZE, chunked_prefill_size=16), prefix_cache=prefix_cache)
    return {"colocated": core(16), "prefill": core(16), "decode": core(16, prefix_cache=False),
            "decode_cached": core(16)}


def greedy(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def roles(cores, decode_core: str = "decode"):
    """A fresh prefill and decode scheduler over the module's engines."""
    prefill = PrefillScheduler(cores["prefill"], "p0", RecordingConnector(cores["prefill"].kv_pool.layout.num_layers))
    decode = DecodeScheduler(cores[decode_core], "d0",
                             RecordingConnector(cores[decode_core].kv_pool.layout.num_layers))
    return prefill, decode


def rows(messages) -> list:
    return [row for m in messages if isinstance(m, TokenBatch) for row in m.items]


def run_to_end(role, limit: int = 200) -> dict[str, list[int]]:
    """Step until no work is left; each request's streamed tokens (rows must end each once)."""
    tokens: dict[str, list[int]] = {}
    ended = set()
    for _ in range(limit):
        if not role.has_work():
            break
        for row in rows(role.step()):
            assert row.request_id not in ended
            tokens.setdefault(row.request_id, []).extend(row.token_ids)
            if row.finished:
                ended.add(row.request_id)
    assert not role.has_work()
    return tokens


def assert_all_pages_free(core: EngineCore) -> None:
    assert_pages_settled(core)


def colocated_tokens(cores) -> dict[str, list[int]]:
    colocated = ColocatedScheduler(cores["colocated"], "c0")
    for i, prompt in enumerate(PROMPTS):
        assert colocated.handle(Generate(f"r{i}", prompt, greedy())) == []
    tokens = run_to_end(colocated)
    assert_all_pages_free(cores["colocated"])
    return tokens


def test_colocated_streams_every_token_once_and_frees_every_page(cores):
    tokens = colocated_tokens(cores)
    assert sorted(tokens) == ["r0", "r1", "r2"] and all(len(t) == 6 for t in tokens.values())


def test_colocated_refuses_a_bad_prompt_and_aborts_free_pages(cores):
    colocated = ColocatedScheduler(cores["colocated"], "c0")
    [batch] = colocated.handle(Generate("bad", [], greedy()))
    assert batch.items[0].finished and "empty" in batch.items[0].error
    colocated.handle(Generate("a", PROMPTS[2], greedy(50)))
    colocated.step()
    assert colocated.held_request_ids() == {"a"}
    assert colocated.handle(AbortRequest("a")) == []
    assert colocated.held_request_ids() == set()
    run_to_end(colocated)
    assert_all_pages_free(cores["colocated"])


@pytest.mark.parametrize("grammar", [Grammar("regex", "("), Grammar("ebnf", "root ::= "),
                                     Grammar("json_schema", "{"),
                                     Grammar("json_schema", '{"type": "nonsense"}')])
def test_a_grammar_that_does_not_parse_is_refused_at_the_door(cores, grammar):
    """The gateway refuses such a grammar (a 400), but a peer with the cluster key may send
    one: it is refused with the request, not compiled in a step that then fails the worker."""
    colocated = ColocatedScheduler(cores["colocated"], "c0")
    [batch] = colocated.handle(Generate("bad", PROMPTS[0], SamplingParams(max_tokens=3, grammar=grammar)))
    assert batch.items[0].finished and f"invalid {grammar.kind}" in batch.items[0].error
    prefill, decode = roles(cores)
    [done] = prefill.handle(Prefill("bad", PROMPTS[0], SamplingParams(grammar=grammar), ["tcp://d"], [0]))
    assert not done.ok and f"invalid {grammar.kind}" in done.error
    [reply] = decode.handle(Admit("bad", PROMPTS[0], SamplingParams(grammar=grammar)))
    assert not reply.ok and not reply.retryable and f"invalid {grammar.kind}" in reply.error
    colocated.handle(Generate("good", PROMPTS[1], greedy()))
    assert len(run_to_end(colocated)["good"]) == greedy().max_tokens
    assert_all_pages_free(cores["colocated"])


def test_float_fields_sent_as_huge_ints_sample(cores):
    """msgpack keeps an integral float field an int: one past int64 (the codec takes it, and
    validation bounds these fields below only) still samples, as the float it stands for."""
    big = 2**64 - 1
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=big, repetition_penalty=big)
    assert type(params.temperature) is float and params.temperature == float(big)
    colocated = ColocatedScheduler(cores["colocated"], "c0")
    colocated.handle(Generate("big", PROMPTS[0], params))
    colocated.handle(Generate("good", PROMPTS[1], greedy()))
    tokens = run_to_end(colocated)
    assert len(tokens["big"]) == 3 and len(tokens["good"]) == greedy().max_tokens
    assert_all_pages_free(cores["colocated"])


def test_prefill_holds_pages_until_the_transfer_result(cores):
    prefill, _ = roles(cores)
    core, conn = cores["prefill"], prefill.connector
    prompt = PROMPTS[1]  # 20 tokens, 2 pages, 2 chunks of 16
    assert prefill.handle(Prefill("p", prompt, greedy(), conn.addresses, [7, 9])) == []
    messages = []
    while prefill.has_work():
        messages += prefill.step()
    assert messages == [] and [s.request_id for s in conn.sent] == ["p"]
    assert conn.sent[0].dst_page_ids == [7, 9] and len(conn.sent[0].src_page_ids) == 2
    assert prefill.held_request_ids() == {"p"} and core.allocator.num_used_pages == 2
    [done] = prefill.on_transfer(TransferResult("p", ok=True, num_bytes=123, seconds=0.5))
    assert isinstance(done, PrefillDone) and done.ok and done.first_token_id >= 0 and not done.retryable
    assert done.timings["transfer_bytes"] == 123
    assert prefill.held_request_ids() == set()
    assert_all_pages_free(core)


def test_prefill_refuses_and_aborts(cores):
    prefill, _ = roles(cores)
    core, conn = cores["prefill"], prefill.connector
    [refused] = prefill.handle(Prefill("x", PROMPTS[1], greedy(), conn.addresses, [1]))
    assert not refused.ok and "reserved 1 pages, the prompt needs 2" in refused.error
    # aborted while waiting: gone at once
    prefill.handle(Prefill("w", PROMPTS[0], greedy(), conn.addresses, [3]))
    prefill.handle(AbortRequest("w"))
    assert prefill.held_request_ids() == set() and not prefill.has_work()
    # aborted while its KV is on its way: cancelled, pages kept until the result
    prefill.handle(Prefill("s", PROMPTS[0], greedy(), conn.addresses, [3]))
    prefill.step()
    prefill.handle(AbortRequest("s"))
    assert conn.cancelled == ["s"] and core.allocator.num_used_pages == 1
    [done] = prefill.on_transfer(TransferResult("s", ok=False, error="cancelled"))
    assert not done.ok and done.retryable  # (the KV did not arrive: another pair may serve it)
    assert not refused.retryable
    assert_all_pages_free(core)


def test_decode_admission_limits(cores):
    _, decode = roles(cores)
    core = cores["decode"]
    big = list(range(5, 5 + 15 * PAGE_SIZE))  # 15 of the 16 pages
    ok = decode.handle(Admit("big", big, greedy()))[0]
    assert isinstance(ok, AdmitReply) and ok.ok and len(ok.dst_page_ids) == 15
    assert decode.connector.expected["big"] == ok.dst_page_ids
    full = decode.handle(Admit("more", PROMPTS[2], greedy()))[0]
    assert not full.ok and full.retryable and "KV cache full" in full.error
    bad = decode.handle(Admit("bad", [core.model_config.vocab_size], greedy()))[0]
    assert not bad.ok and not bad.retryable and "outside the vocabulary" in bad.error
    decode.handle(AbortRequest("big"))
    assert decode.connector.cancelled == ["big"] and decode.held_request_ids() == set()
    assert_all_pages_free(core)


def test_decode_waits_for_pages_its_reservations_hold(cores):
    """A running request that needs a page while the rest of decode's pool is reserved for
    prompts whose KV is on its way waits for room (the worker polls every 1 ms meanwhile): it
    is not ended early as larger than the pool. Once a reservation goes, it runs to max_tokens."""
    _, decode = roles(cores)
    core = cores["decode"]
    prompt = list(range(5, 5 + PAGE_SIZE - 1))  # one page; its 2nd decode step needs a 2nd
    assert decode.handle(Admit("r", prompt, greedy()))[0].ok
    decode.handle(StartDecode("r", 42))
    decode.on_transfer(TransferResult("r", ok=True))
    big = list(range(5, 5 + 15 * PAGE_SIZE))  # the other 15 pages
    assert decode.handle(Admit("big", big, greedy()))[0].ok
    got = [t for row in rows(decode.step()) for t in row.token_ids]  # fits in page 1
    for _ in range(3):
        assert rows(decode.step()) == [] and decode.has_work() and decode.poll_ms() == 1
    decode.handle(AbortRequest("big"))
    for row in rows(decode.step()):
        got += row.token_ids
    assert decode.poll_ms() == 0
    tokens = run_to_end(decode)
    assert len([42] + got + tokens["r"]) == greedy().max_tokens
    assert_all_pages_free(core)


def test_a_step_launched_from_idle_is_no_stall(tiny_checkpoints, monkeypatch):
    """Under the overlap schedule a step launched from idle gives no rows yet (its tokens come
    with the next step): the worker steps again at once, not after a stall's 1 ms poll."""
    monkeypatch.setenv("PD_SERVE_OVERLAP_CPU", "1")
    core = EngineCore(EngineConfig.from_flat(model=str(tiny_checkpoints["llama3"]), device="cpu",
                                             page_size=PAGE_SIZE, max_total_tokens=16 * PAGE_SIZE))
    role = ColocatedScheduler(core, "c0")
    role.handle(Generate("a", PROMPTS[0], greedy()))
    assert rows(role.step()) == [] and core.step_in_flight and role.poll_ms() == 0
    assert len(run_to_end(role)["a"]) == greedy().max_tokens
    assert_all_pages_free(core)


def test_decode_failed_transfer_and_a_first_token_that_ends_the_request(cores):
    _, decode = roles(cores)
    core = cores["decode"]
    decode.handle(Admit("f", PROMPTS[0], greedy()))
    decode.connector.results.append(TransferResult("f", ok=False, error="peer died"))
    [batch] = decode.on_transfer(decode.connector.poll()[0])
    assert batch.items[0].finished and "KV transfer failed: peer died" in batch.items[0].error
    # max_tokens=1: token 1 (from prefill) is the last; the request ends at its start
    decode.handle(Admit("one", PROMPTS[0], greedy(max_tokens=1)))
    assert decode.handle(StartDecode("one", 42)) == []  # its KV is not in yet
    [batch] = decode.on_transfer(TransferResult("one", ok=True))
    assert [(r.request_id, r.token_ids, r.finished, r.finish_reason) for r in batch.items] == \
        [("one", [], True, "length")]
    assert decode.held_request_ids() == set() and not decode.has_work()
    assert_all_pages_free(core)


@pytest.mark.parametrize("token", [-1, 10**9])
def test_decode_fails_a_first_token_outside_the_vocabulary(cores, token):
    """Token 1 comes from prefill, through the gateway: one outside the vocabulary (-1 is
    PrefillDone's default) fails its request and frees its pages; the worker's step, and the
    other requests, go on."""
    _, decode = roles(cores)
    core = cores["decode"]
    for rid, prompt in (("bad", PROMPTS[0]), ("good", PROMPTS[1])):
        decode.handle(Admit(rid, prompt, greedy()))
        assert decode.on_transfer(TransferResult(rid, ok=True)) == []
    [batch] = decode.handle(StartDecode("bad", token))
    assert [(r.request_id, r.finished) for r in batch.items] == [("bad", True)]
    assert "outside the vocabulary" in batch.items[0].error
    assert decode.connector.cancelled == ["bad"] and "bad" not in decode.held_request_ids()
    assert decode.handle(StartDecode("good", 42)) == []
    assert len(run_to_end(decode)["good"]) == greedy().max_tokens - 1
    assert_all_pages_free(core)


def test_prefill_then_decode_equals_colocated(cores):
    """The whole P/D hand-off in one process: the gateway's part (Admit, Prefill, StartDecode)
    and the transfer's (page copies, results) done here."""
    expected = colocated_tokens(cores)
    prefill, decode = roles(cores)
    p_pool, d_pool = cores["prefill"].kv_pool.buffer, cores["decode"].kv_pool.buffer
    firsts: dict[str, int] = {}
    for i, prompt in enumerate(PROMPTS):
        [reply] = decode.handle(Admit(f"r{i}", prompt, greedy()))
        assert reply.ok
        prefill.handle(Prefill(f"r{i}", prompt, greedy(), reply.transfer_addresses, reply.dst_page_ids))
    while prefill.has_work():
        assert prefill.step() == []
    for send in prefill.connector.sent:
        d_pool[:, :, send.dst_page_ids] = p_pool[:, :, send.src_page_ids]
        [done] = prefill.on_transfer(TransferResult(send.request_id, ok=True))
        firsts[done.request_id] = done.first_token_id
        assert decode.on_transfer(TransferResult(send.request_id, ok=True)) == []
        assert decode.handle(StartDecode(done.request_id, done.first_token_id)) == []
    assert_all_pages_free(cores["prefill"])
    tokens = run_to_end(decode)
    assert {i: [firsts[i]] + t for i, t in tokens.items()} == expected
    assert_all_pages_free(cores["decode"])


def hand_off(prefill, decode, cores, decode_core: str, request_id: str, prompt: list[int],
             params: SamplingParams | None = None):
    """One request through Admit, Prefill, the page copies and StartDecode (the gateway's and the
    transfer layer's parts); returns (AdmitReply, PrefillDone) and leaves the request decoding."""
    params = params or greedy()
    [reply] = decode.handle(Admit(request_id, prompt, params))
    assert reply.ok
    prefill.handle(Prefill(request_id, prompt, params, reply.transfer_addresses, reply.dst_page_ids,
                           dst_cached_tokens=reply.cached_tokens))
    while prefill.has_work():
        assert prefill.step() == []
    [send] = [s for s in prefill.connector.sent if s.request_id == request_id]
    assert decode.connector.expected[request_id] == send.dst_page_ids == reply.dst_page_ids
    p_pool, d_pool = cores["prefill"].kv_pool.buffer, cores[decode_core].kv_pool.buffer
    d_pool[:, :, send.dst_page_ids] = p_pool[:, :, send.src_page_ids]
    [done] = prefill.on_transfer(TransferResult(request_id, ok=True))
    assert decode.on_transfer(TransferResult(request_id, ok=True)) == []
    assert decode.handle(StartDecode(request_id, done.first_token_id)) == []
    return reply, done


def test_decode_side_reuse_sends_only_a_follow_up_turns_new_pages(cores):
    """Turn 2 of a conversation (turn 1's prompt and answer, then new tokens) on the decode
    worker that ran turn 1: its cache holds turn 1's full pages, so the reply names only the
    pages after them, prefill sends only those, and the tokens equal the colocated role's on
    turn 2's prompt. An abort before the KV arrives gives the shared pages back to the cache."""
    turn1 = list(range(5, 45))  # 40 tokens: 2 full pages and a part
    prefill, decode = roles(cores, "decode_cached")
    reply1, done1 = hand_off(prefill, decode, cores, "decode_cached", "t1", turn1)
    assert reply1.cached_tokens == 0 and len(reply1.dst_page_ids) == 3
    answer = [done1.first_token_id] + run_to_end(decode)["t1"]
    turn2 = turn1 + answer + list(range(300, 320))  # 66 tokens: 5 pages
    colocated = ColocatedScheduler(cores["colocated"], "c0")
    colocated.handle(Generate("t2", turn2, greedy()))
    expected = run_to_end(colocated)["t2"]
    assert_all_pages_free(cores["colocated"])

    # Turn 1's decode computed the KV of turn1 + answer[:-1] (45 tokens): 2 full pages cached.
    reply2, done2 = hand_off(prefill, decode, cores, "decode_cached", "t2", turn2)
    assert reply2.cached_tokens == 2 * PAGE_SIZE and len(reply2.dst_page_ids) == 3
    assert done2.timings["transferred_tokens"] == len(turn2) - 2 * PAGE_SIZE
    assert done2.timings["cached_tokens"] == 2 * PAGE_SIZE  # prefill's own cache: turn 1's pages
    assert [done2.first_token_id] + run_to_end(decode)["t2"] == expected

    # Admitted on cached pages, aborted before its KV: nothing leaks, the cache keeps its pages.
    core = cores["decode_cached"]
    cached_before = core.prefix_cache.num_pages
    [reply3] = decode.handle(Admit("t3", turn2 + [7] * 16, greedy()))
    assert reply3.cached_tokens >= 2 * PAGE_SIZE
    decode.handle(AbortRequest("t3"))
    assert decode.held_request_ids() == set() and core.prefix_cache.num_pages >= cached_before
    assert_all_pages_free(core)
    assert_all_pages_free(cores["prefill"])


class SilencedWorker:
    """The part of worker.Worker that handles a silent gateway (its own methods), over a real
    role; what it sends is recorded."""

    _gateway_gone, _reconcile, abort = Worker._gateway_gone, Worker._reconcile, Worker.abort

    def __init__(self, role):
        self.scheduler, self.worker_id, self.sent = role, role.worker_id, []
        self._dropped, self._dropped_why, self._aborted = set(), "", set()
        self._ping_timeout_s, self._gateway_deadline = 6.0, 0.0

    def send_all(self, messages) -> None:
        self.sent.extend(messages)


@pytest.mark.parametrize("role_name", ["colocated", "prefill"])
def test_requests_dropped_while_the_gateway_was_silent_fail_at_its_next_ping(cores, role_name):
    """A worker that heard no ping for 1.5x the gateway's timeout drops its requests; a paused
    gateway that comes back still waits for them, so its next ping listing them gets an error
    for each (a PrefillDone from prefill, a final row otherwise), once; requests the ping does
    not list, or that ended normally, get nothing."""
    if role_name == "colocated":
        role = ColocatedScheduler(cores["colocated"], "c0")
        role.handle(Generate("a", PROMPTS[2], greedy(50)))
        role.handle(Generate("b", PROMPTS[0], greedy(50)))
        role.step()
    else:  # waiting for their turn (once sending, an abort waits for the transfer's result)
        role, _ = roles(cores)
        for rid, pages in (("a", [1]), ("b", [2])):
            role.handle(Prefill(rid, PROMPTS[0], greedy(), role.connector.addresses, pages))
    worker = SilencedWorker(role)
    worker._gateway_gone()
    assert role.held_request_ids() == set()
    worker.sent.clear()
    worker._reconcile(GatewayPing("g", ["a", "z"], 4.0))
    if role_name == "colocated":
        [failed] = rows(worker.sent)
        assert failed.request_id == "a" and failed.finished and "dropped" in failed.error
    else:
        [failed] = worker.sent
        assert isinstance(failed, PrefillDone) and failed.request_id == "a" and not failed.ok
        assert "no ping from the gateway for 6.0 s" in failed.error
    worker.sent.clear()
    worker._reconcile(GatewayPing("g", ["a", "b"], 4.0))
    assert worker.sent == []
    assert not role.has_work()
    assert_all_pages_free(role.core)


def test_decode_runs_on_while_a_grammar_compiles(cores, monkeypatch):
    """A request whose grammar is still compiling (held here until released) waits out of the
    batch with its KV and token 1; the batch decodes on meanwhile, and no compile runs on the
    step's thread. Once compiled, the request joins, keeps to its grammar, and every page
    comes back."""
    prefill, decode = roles(cores)
    core = cores["decode"]
    compiler = core.executor.grammars()
    compile_now, release = compiler._compile, threading.Event()

    def held_compile(grammar):
        assert threading.current_thread() is not threading.main_thread(), "compiled in the step"
        assert release.wait(120)
        return compile_now(grammar)
    monkeypatch.setattr(compiler, "_compile", held_compile)
    hand_off(prefill, decode, cores, "decode", "a", PROMPTS[0])
    constrained = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                 grammar=Grammar("regex", "[a-z]{1,41}"))
    _, done = hand_off(prefill, decode, cores, "decode", "g", PROMPTS[1], constrained)
    tokens: dict[str, list[int]] = {}
    for _ in range(50):
        for row in rows(decode.step()):
            tokens.setdefault(row.request_id, []).extend(row.token_ids)
            assert row.request_id == "a"
            if row.finished:
                break
        else:
            continue
        break
    assert len(tokens["a"]) == 5 and decode.has_work()  # "g" waits for its grammar
    release.set()
    tokens = run_to_end(decode)
    text = Tokenizer.from_dir(core.model_dir).decode([done.first_token_id] + tokens["g"])
    assert len(tokens["g"]) == 5 and re.fullmatch("[a-z]*", text), text
    assert_all_pages_free(core)
    assert_all_pages_free(cores["prefill"])


def test_a_worker_that_fails_tells_the_gateway_why(monkeypatch):
    """An error out of the worker's loop ends the process, and its WorkerExit says what it was
    (the gateway logs it beside the requests it fails), with the flags to change for a GPU out
    of memory; the connector and the engine are still closed."""
    from types import SimpleNamespace

    import torch

    import pd_serve.worker as worker_module

    class FailingSocket:
        def poll(self, *args):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")

        def setsockopt(self, *args):
            pass

        def close(self):
            pass

    sent, closed = [], []
    worker = Worker.__new__(Worker)
    worker.role, worker.worker_id, worker.incarnation = "decode", "d0", "i0"
    worker._stop, worker._exit_reason, worker._sock = False, "stopped", FailingSocket()
    worker.config = SimpleNamespace(gateway="tcp://gateway")
    worker.scheduler = SimpleNamespace(poll_ms=lambda: 1)
    worker.codec = SimpleNamespace(encode=lambda msg: sent.append(msg) or b"")
    worker.connector = SimpleNamespace(close=lambda: closed.append("connector"))
    worker.core = SimpleNamespace(model_dir="m", close=lambda: closed.append("core"))
    monkeypatch.setattr(Worker, "_heartbeat", lambda self: None)
    monkeypatch.setattr(worker_module, "send_nowait", lambda sock, data: None)
    with pytest.raises(torch.OutOfMemoryError):
        worker.run()
    [exit_msg] = sent
    assert exit_msg.reason == ("failed: OutOfMemoryError: CUDA out of memory. Tried to allocate "
                               "2.00 GiB; lower --mem-fraction-static, --max-running-requests or "
                               "--chunked-prefill-size")
    assert closed == ["connector", "core"]
