"""Routing policies and the wire codec."""

import pytest

from pd_serve import protocol
from pd_serve.engine.sampling_params import SamplingParams
from pd_serve.gateway.router import Router, WorkerState
from pd_serve.protocol import Admit, KVChunk, KVChunks, TokenBatch, TokenDelta, WorkerStatus


def workers(n: int) -> list[WorkerState]:
    return [WorkerState(WorkerStatus(worker_id=f"w{i}", role="decode", model="m")) for i in range(n)]


def test_round_robin_cycles():
    pool, router = workers(3), Router("round_robin", "decode")
    assert [router.pick(pool, [1]).worker_id for _ in range(6)] == ["w0", "w1", "w2"] * 2


def test_least_load_picks_fewest_outstanding_tokens():
    pool = workers(3)
    pool[0].inflight = {"a": 500}
    pool[1].inflight = {"b": 100, "c": 50}
    pool[2].inflight = {"d": 400}
    assert Router("least_load", "decode").pick(pool, [1]).worker_id == "w1"


def test_prefix_policy_keeps_shared_prefixes_together():
    pool, router = workers(4), Router("prefix", "prefill")
    head = list(range(100, 164))
    picks = {router.pick(pool, head + [i, i + 1]).worker_id for i in range(20)}
    assert len(picks) == 1  # same 64-token head -> same worker
    spread = {router.pick(pool, [i] * 70).worker_id for i in range(40)}
    assert len(spread) > 1  # different heads spread out


def prefill_workers(n: int, num_pages: int = 1000) -> list[WorkerState]:
    return [WorkerState(WorkerStatus(worker_id=f"p{i}", role="prefill", model="m", num_pages=num_pages,
                                     layout={"page_size": 4})) for i in range(n)]


def test_cache_aware_keeps_a_conversation_on_one_worker():
    pool, router = prefill_workers(4), Router("cache_aware", "prefill")
    turns, history = [], [7] * 10
    for turn in range(6):  # each turn's prompt: the whole history so far, plus a new message
        history = history + [turn] * 9
        turns.append(list(history))
    homes = {}
    for conversation in range(8):
        offset = 1000 * (conversation + 1)
        picks = []
        for prompt in turns:
            w = router.pick(pool, [offset] + prompt)
            w.inflight[f"{conversation}-{len(picks)}"] = 1  # running there meanwhile
            picks.append(w.worker_id)
        assert len(set(picks)) == 1, picks
        homes[conversation] = picks[0]
    assert len(set(homes.values())) == 4  # new conversations go where the load is least


def test_cache_aware_spreads_load_past_the_thresholds():
    pool = prefill_workers(2)
    router = Router("cache_aware", "prefill", balance_abs_threshold=4, balance_rel_threshold=1.5)
    prompt = list(range(40))
    picks = []
    for i in range(12):
        w = router.pick(pool, prompt)
        w.inflight[str(i)] = len(prompt)
        picks.append(w.worker_id)
    # the same prompt stays on one worker until it holds more than 4 requests over the other
    # (5 against 0), then the idle one takes requests
    assert picks[:5] == ["p0"] * 5 and picks[5] == "p1"
    counts = [len(w.inflight) for w in pool]
    assert abs(counts[0] - counts[1]) <= 5


def test_cache_aware_forgets_what_the_worker_cannot_hold():
    pool, router = prefill_workers(2, num_pages=4), Router("cache_aware", "prefill")
    first = list(range(16))  # 4 pages: the whole pool
    assert router.pick(pool, first).worker_id == "p0"
    pool[0].inflight["x"] = 1
    router.pick(pool[:1], list(range(100, 116)))  # 4 other pages push the first out of p0
    pool[0].inflight.clear()
    pool[1].inflight["y"] = 1
    assert router.pick(pool, first).worker_id == "p0"  # no match anywhere: least loaded
    restarted = WorkerState(WorkerStatus(worker_id="p0", role="prefill", model="m", num_pages=4,
                                         layout={"page_size": 4}, incarnation="new"))
    assert router.pick([restarted, pool[1]], first).worker_id == "p0"  # a restart: empty index


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="--decode-policy 'prefix' must be one of cache_aware, round_robin, least_load"):
        Router("prefix", "decode")


def test_codec_round_trips_and_rejects_garbage():
    for msg in (Admit("r1", [1, 2, 3], SamplingParams(max_tokens=4, logit_bias={3: -1.5}), 2),
                KVChunks([KVChunk("r2", [5, 6], 0, 3, 1024, True, [7, 8])], [1]),
                TokenBatch("w", [TokenDelta("r1", [9], None, False, None, "")])):
        assert protocol.decode(protocol.encode(msg)) == msg
    with pytest.raises(ValueError, match="undecodable"):
        protocol.decode(b"\x93garbage")
    with pytest.raises(ValueError, match="undecodable"):
        protocol.decode(protocol.encode(Admit("r", [], SamplingParams())).replace(b"Admit", b"Evict"))


def test_pair_error_names_what_keeps_a_prefill_and_a_decode_worker_apart():
    from dataclasses import asdict

    from pd_serve.cache.pool import KVLayout
    from pd_serve.gateway.router import pair_error

    layout = asdict(KVLayout(num_layers=4, page_size=16, num_kv_heads=4, head_dim=8, dtype="bfloat16"))

    def status(role, tp=1, backend="tcp", **changes):
        return WorkerStatus(worker_id=role, role=role, model="m", transfer_backend=backend,
                            layout={**layout, **changes}, tp=tp,
                            transfer_addresses=[f"tcp://h:{i}" for i in range(tp)] if role == "decode" else [])

    for a, b in [(1, 1), (2, 1), (1, 2), (4, 2), (2, 8)]:  # any TP sizes the 4 KV heads allow
        assert pair_error(status("prefill", a), status("decode", b)) == ""
    assert "--transfer-backend" in pair_error(status("prefill", backend="ipc"), status("decode"))
    assert "page_size 32 != 16 (--page-size)" in pair_error(status("prefill", page_size=32), status("decode"))
    assert "num_kv_heads 2 != 4" in pair_error(status("prefill", num_kv_heads=2), status("decode"))
    assert "prefill --tp: TP 3 neither divides" in pair_error(status("prefill", 3), status("decode"))
    short = status("decode", 2)
    short.transfer_addresses = short.transfer_addresses[:1]
    assert "1 KV receivers for --tp 2" in pair_error(status("prefill"), short)


def test_the_gateway_says_at_registration_which_workers_cannot_pair(caplog):
    import asyncio
    import logging
    from dataclasses import asdict

    import zmq

    from pd_serve import protocol
    from pd_serve.cache.pool import KVLayout
    from pd_serve.config import GatewayConfig
    from pd_serve.gateway.cluster import Cluster

    layout = asdict(KVLayout(num_layers=4, page_size=16, num_kv_heads=4, head_dim=8, dtype="bfloat16"))

    async def register_both():
        cluster = Cluster(GatewayConfig())
        await cluster.start()
        ctx = zmq.Context.instance()
        socks = []
        for role, page_size in (("decode", 16), ("prefill", 32)):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, role.encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(cluster.control_address)
            sock.send(protocol.encode(WorkerStatus(
                worker_id=role, role=role, model="m", transfer_backend="tcp",
                layout={**layout, "page_size": page_size},
                transfer_addresses=["tcp://h:1"] if role == "decode" else [])))
            socks.append(sock)
        for _ in range(200):
            if len(cluster.workers) == 2:
                break
            await asyncio.sleep(0.01)
        await cluster.stop()
        for sock in socks:
            sock.close()
        return len(cluster.workers)

    with caplog.at_level(logging.ERROR, logger="pd_serve.gateway.cluster"):
        assert asyncio.run(register_both()) == 2
    assert "prefill prefill cannot send KV to decode decode: KV layouts differ" in caplog.text
    assert "page_size 32 != 16" in caplog.text
