"""Serving across hosts: the gateway, prefill and decode workers each in a network namespace of
its own (tests/e2e/netns_helpers.py), reached only through a bridge at their own addresses.

One cluster per transfer backend (tcp; torch: gloo on CPU; nixl: UCX over TCP, where nixl is
installed): 1P1D, then a second prefill worker joins (2P1D), then the decode worker is killed
with SIGKILL and started again on its host. Greedy output equals the colocated engine's
throughout. The test process is the client, in its own namespace. Skipped where namespaces
cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import openai
import pytest

from cluster_helpers import assert_greedy_completions, metrics
from helpers import TEST_MODEL
from netns_helpers import Hosts, NetnsCluster, netns_unavailable
from pd_serve import Engine, SamplingParams
from pd_serve.transfer.backends.nixl import nixl_available

pytestmark = pytest.mark.skipif(bool(why := netns_unavailable()), reason=why)

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time,", "Water boils at"]
MAX_TOKENS = 16
WORKER_TIMEOUT_S = 3.0
# CPU everywhere: torch is gloo there (NCCL cannot pair two workers on one GPU).
WORKER_ARGS = ["--device", "cpu", "--max-total-tokens", "4096", "--transfer-timeout", "10",
               *(["--model", TEST_MODEL] if TEST_MODEL else [])]
GATEWAY_ARGS = ["--worker-timeout", str(WORKER_TIMEOUT_S), "--step-timeout", "60",
                "--prefill-policy", "round_robin", *(["--model", TEST_MODEL] if TEST_MODEL else [])]


@pytest.fixture(scope="module")
def expected(default_model_dir) -> list[str]:
    engine = Engine(default_model_dir, device="cpu", max_total_tokens=4096)
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True))
    return [out.text for out in outs]


NIXL = pytest.param("nixl", marks=pytest.mark.skipif(
    not nixl_available(), reason="nixl is not installed (pip install pd-serve[nixl])"))
# Between namespaces of one machine UCX would move the pages through shared memory or
# cross-memory attach, never the bridge; TCP alone is what it has between hosts without RDMA.
BACKEND_ENV = {"nixl": {"UCX_TLS": "tcp"}}


@pytest.fixture(scope="module", params=["tcp", "torch", NIXL])
def cluster(request):
    with Hosts() as hosts:
        cluster = NetnsCluster(hosts, GATEWAY_ARGS, [*WORKER_ARGS, "--transfer-backend", request.param],
                               env=BACKEND_ENV.get(request.param))
        try:
            cluster.start_worker("prefill-0", "prefill")
            cluster.start_worker("decode-0", "decode")
            cluster.wait_workers({"prefill-0", "decode-0"})
            yield cluster
        finally:
            cluster.stop()


def assert_serves(cluster: NetnsCluster, expected: list[str]) -> None:
    """Greedy completions (ignore_eos) through the bridge equal the colocated engine's, and
    then no KV page is held by a request on any worker."""
    assert_greedy_completions(cluster, PROMPTS, expected, MAX_TOKENS)


def test_1p1d_across_hosts_equals_colocated(cluster, expected):
    if "prefill-1" in cluster.procs:  # run after the 2P1D test
        cluster.kill("prefill-1")
    cluster.wait_workers({"prefill-0", "decode-0"})
    assert_serves(cluster, expected)


def test_2p1d_across_hosts_equals_colocated(cluster, expected):
    if "prefill-1" not in cluster.procs:
        # This one binds its own address (--host 10.x.y.z), the others 0.0.0.0 and advertise it.
        cluster.start_worker("prefill-1", "prefill", bind_own=True)
    cluster.wait_workers({"prefill-0", "prefill-1", "decode-0"})
    before = metrics(cluster.base_url)
    assert_serves(cluster, expected)
    after = metrics(cluster.base_url)
    for name in ("prefill-0", "prefill-1"):  # round robin: both computed prompts
        key = ("pd_serve:prompt_tokens_total", name)
        assert after.get(key, 0) > before.get(key, 0), f"{name} computed no prompt"


def test_decode_killed_and_restarted_on_its_host(cluster, expected):
    prefills = {name for name in cluster.procs if name.startswith("prefill")}
    cluster.kill("decode-0")  # SIGKILL: no goodbye, the gateway notices the silence
    cluster.wait_workers(prefills, timeout_s=4 * WORKER_TIMEOUT_S)
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as e:  # no decode worker: refused at once
        client.completions.create(model=client.models.list().data[0].id, prompt="Hello",
                                  max_tokens=4)
    assert e.value.status_code == 503
    cluster.start_worker("decode-0", "decode")  # same host, address and KV port
    cluster.wait_workers(prefills | {"decode-0"})
    assert_serves(cluster, expected)
