"""Bad command-line input is one line on stderr naming the flag to change, exit code 2, no
traceback, and (launch) no process started: out-of-range ports, worker counts that can serve
nothing, pool sizes below 1, and addresses that cannot be bound (a port in use, a host that is
not this machine's)."""

from __future__ import annotations

import socket

import pytest

from pd_serve import cli
from pd_serve.launch import LocalCluster


@pytest.fixture
def used_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def one_line_error(capsys, argv: list[str], names: str) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert err[-1].startswith("pd-serve: error: ") and names in err[-1], err


@pytest.mark.parametrize("argv,names", [
    (["--prefill", "-1"], "--prefill -1"),
    (["--prefill", "1", "--decode", "0"], "--decode 0"),  # a prefill pool alone never serves
    (["--prefill", "0", "--decode", "2"], "--prefill 0"),
    (["--prefill-tp", "0"], "--prefill-tp 0"),  # was taken as "not given"
    (["--decode-ep", "-2"], "--decode-ep -2"),
    (["--port", "70000"], "--port 70000"),
    (["--control-port", "-1"], "--control-port -1"),
])
def test_launch_refuses_bad_counts_and_ports_before_starting_anything(monkeypatch, capsys, argv,
                                                                      names):
    def start(self, name, *args, **kwargs):
        raise AssertionError(f"{name} started")

    monkeypatch.setattr(LocalCluster, "_start", start)
    one_line_error(capsys, ["launch", "--device", "cpu", *argv], names)


def test_launch_colocated_alone_or_beside_one_pool_is_fine(monkeypatch):
    started = []
    monkeypatch.setattr(LocalCluster, "_start", lambda self, name, *a, **kw: started.append(name))
    LocalCluster(port=0, num_prefill=0, num_decode=0, num_colocated=1)
    LocalCluster(port=0, num_prefill=1, num_decode=0, num_colocated=1)
    assert started == ["gateway", "colocated-0", "gateway", "prefill-0", "colocated-1"]


@pytest.mark.parametrize("command", ["launch", "demo"])
@pytest.mark.parametrize("argv,names", [
    (["--port", "USED"], "cannot bind"),  # whatever answers there would pass for the cluster
    (["--host", "no-such-host.invalid", "--port", "0"], "--host no-such-host.invalid: does not resolve"),
    (["--host", "192.0.2.1"], "give an address of this machine"),  # (TEST-NET-1: no one's)
    (["--worker-id", "w"], "--worker-id: launch names its workers itself"),
    (["--gateway=tcp://127.0.0.1:9"], "--gateway: launch starts its own gateway"),
])
def test_launch_refuses_a_port_in_use_and_the_flags_it_sets_itself(monkeypatch, capsys, used_port,
                                                                   command, argv, names):
    """A red-team pass ran launch and demo on a port another HTTP server had: launch said
    "cluster ready" (that server's /health answered), demo sent its question there."""
    monkeypatch.setattr(LocalCluster, "_start", lambda self, name, *a, **kw: pytest.fail(name))
    argv = [str(used_port) if a == "USED" else a for a in argv]
    one_line_error(capsys, [command, "--device", "cpu", *argv],
                   names.replace("cannot bind", f"--port {used_port}: cannot bind") if argv[0] == "--port"
                   else names)


def test_launch_port_0_picks_one_and_host_goes_to_the_gateway(monkeypatch):
    """--port 0 is a free port launch picks (the gateway's own pick could not be waited on);
    --host is the gateway's HTTP address, the workers stay on theirs."""
    started = {}
    monkeypatch.setattr(LocalCluster, "_start",
                        lambda self, name, args, *a, **kw: started.setdefault(name, args))
    args, rest = cli.build_parser().parse_known_args(["launch", "--device", "cpu", "--port", "0",
                                                      "--host", "0.0.0.0"])
    args.engine_argv = rest
    cluster = cli._cluster_from_args(args)
    gateway = cli.build_parser().parse_args(started.pop("gateway"))
    assert cluster.port > 0 and gateway.port == cluster.port and gateway.host == "0.0.0.0"
    assert cluster.base_url == f"http://127.0.0.1:{cluster.port}"
    assert all("--host" not in command for command in started.values())


def test_launch_on_every_ipv6_interface_polls_ipv6_loopback(monkeypatch):
    """A gateway on :: takes no IPv4 (asyncio sets IPV6_V6ONLY): launch polls [::1], where it
    polled 127.0.0.1 for its whole start-up time (a review)."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::", 0))
    except OSError:
        pytest.skip("no IPv6 on this machine")
    monkeypatch.setattr(LocalCluster, "_start", lambda self, *a, **kw: None)
    cluster = LocalCluster(port=0, host="::", engine_args=["--device", "cpu"])
    assert cluster.base_url == f"http://[::1]:{cluster.port}" and cluster.port > 0


@pytest.mark.parametrize("argv,names", [
    (["--gateway", "tcp://127.0.0.1:99999"], "--gateway"),  # zmq would wait on it forever
    (["--gateway", "tcp://127.0.0.1"], "--gateway"),
    (["--gateway", "tcp://127.0.0.1:1", "--port", "70000"], "--port 70000"),
    (["--gateway", "tcp://127.0.0.1:1", "--transfer-timeout", "-1"], "--transfer-timeout"),
])
def test_worker_refuses_bad_addresses_and_timeouts(monkeypatch, capsys, argv, names):
    monkeypatch.setenv("PD_SERVE_CLUSTER_KEY", "k")
    monkeypatch.setattr("pd_serve.worker.Worker.__init__", lambda *a: pytest.fail("started"))
    one_line_error(capsys, ["decode", *argv], names)


@pytest.mark.parametrize("flags", [
    lambda port: ["--port", str(port)],
    lambda port: ["--control-port", str(port)],
    lambda port: ["--port", "0", "--control-host", "10.255.255.1"],  # not this machine's
    lambda port: ["--port", "70000"],
])
def test_gateway_that_cannot_bind_says_which_flag(capsys, used_port, monkeypatch, flags):
    monkeypatch.setenv("PD_SERVE_CLUSTER_KEY", "k")
    argv = flags(used_port)
    one_line_error(capsys, ["gateway", "--control-port", "0", *argv], " ".join(argv[-2:]))


@pytest.mark.parametrize("value", ["0", "nan", "1e6", "inf"])
def test_gateway_refuses_a_worker_timeout_its_workers_would_refuse(capsys, monkeypatch, value):
    # (its pings carry it: a worker refuses a ping whose timeout is not in (0, a day])
    monkeypatch.setenv("PD_SERVE_CLUSTER_KEY", "k")
    monkeypatch.setattr("pd_serve.gateway.server.serve", lambda *a: pytest.fail("started"))
    one_line_error(capsys, ["gateway", "--worker-timeout", value], "--worker-timeout")


def test_kv_receiver_that_cannot_bind_says_which_flag(used_port):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parents[1] / "transfer"))
    from peer import LAYOUT, NUM_PAGES, poisoned_pool

    from pd_serve.transfer.receiver import KVReceiver

    with pytest.raises(ValueError, match=f"--host 127.0.0.1 --port {used_port}: the KV receiver"):
        KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), "tcp", port=used_port)


@pytest.mark.parametrize("value", ["https://app.example.com/", "app.example.com", "https://a.com,ftp://b"])
def test_gateway_refuses_an_allowed_origin_that_is_no_origin(capsys, monkeypatch, value):
    # (a browser's Origin is scheme://host[:port]: one with a path would never match)
    monkeypatch.setenv("PD_SERVE_CLUSTER_KEY", "k")
    monkeypatch.setattr("pd_serve.gateway.server.serve", lambda *a: pytest.fail("started"))
    one_line_error(capsys, ["gateway", "--allowed-origins", value], "--allowed-origins")


def test_a_cpu_kv_cache_past_the_memory_or_below_a_page_names_its_flag(caplog):
    """--cpu-kv-cache-gb 10000 failed in the allocator with a traceback, inf with 'cannot
    convert float NaN to integer', a pool below one page without naming the flag. Past the
    memory free now (but within the machine's): a warning (pages commit as they are written)."""
    import torch

    from pd_serve.cache.pool import KVLayout
    from pd_serve.config import CacheConfig
    from pd_serve.engine.executor import _host_memory, _num_kv_pages

    layout = KVLayout(num_layers=30, page_size=16, num_kv_heads=3, head_dim=64, dtype="float32")
    cpu = torch.device("cpu")
    assert _num_kv_pages(CacheConfig(cpu_kv_cache_gb=0.5), layout, cpu) == \
        int(0.5 * 2**30 // layout.bytes_per_page)
    total, available = _host_memory()
    too_much = 2 * total / 2**30
    with pytest.raises(ValueError, match=rf"--cpu-kv-cache-gb {too_much}: a KV cache of .* GiB, "
                                         r"and this machine has .* GiB in all"):
        _num_kv_pages(CacheConfig(cpu_kv_cache_gb=too_much), layout, cpu)
    if available < total * 0.99:  # (a machine with next to nothing in use has no such band)
        between = (available + total) / 2 / 2**30
        _num_kv_pages(CacheConfig(cpu_kv_cache_gb=between), layout, cpu)
        assert "more than the" in caplog.text and "GiB free now" in caplog.text
    with pytest.raises(ValueError, match=r"--max-total-tokens 10000000000: a KV cache"):
        _num_kv_pages(CacheConfig(max_total_tokens=10**10), layout, cpu)
    with pytest.raises(ValueError, match=r"--cpu-kv-cache-gb 1e-09: not one 16-token KV page"):
        _num_kv_pages(CacheConfig(cpu_kv_cache_gb=1e-9), layout, cpu)
    for bad in (float("inf"), float("nan"), 0.0):
        with pytest.raises(ValueError, match="--cpu-kv-cache-gb .* must be > 0 and finite"):
            CacheConfig(cpu_kv_cache_gb=bad)


def test_an_unwritable_model_cache_names_pd_serve_cache(monkeypatch, tmp_path, capsys):
    """$PD_SERVE_CACHE on a file (or where nothing may be written) was a FileExistsError or
    PermissionError traceback."""
    from pd_serve.model import gguf_default

    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("PD_SERVE_CACHE", str(tmp_path / "file" / "cache"))
    with pytest.raises(ValueError, match=r"the model cache .*file/cache cannot be written .*set "
                                         r"PD_SERVE_CACHE to a writable folder"):
        gguf_default.gguf_model_dir(gguf_default.find_default_gguf())
    one_line_error(capsys, ["gateway", "--port", "0"], "PD_SERVE_CACHE")


@pytest.mark.parametrize("argv,names", [
    (["gateway", "--balance-abs-threshold", "-5"], "--balance-abs-threshold -5"),
    (["gateway", "--balance-rel-threshold", "nan"], "--balance-rel-threshold nan"),
    (["gateway", "--balance-rel-threshold", "-1"], "--balance-rel-threshold -1.0"),
    (["decode", "--gateway", "tcp://127.0.0.1:1", "--drain-timeout", "nan"], "--drain-timeout nan"),
    (["decode", "--gateway", "tcp://127.0.0.1:1", "--device", "cuda:abc"], "--device"),
])
def test_values_that_mean_nothing_are_refused(capsys, monkeypatch, argv, names):
    """A red-team pass: NaN and negative thresholds and timeouts, and a device cuda:abc, were
    taken as given."""
    monkeypatch.setenv("PD_SERVE_CLUSTER_KEY", "k")
    monkeypatch.setattr("pd_serve.gateway.server.serve", lambda *a: pytest.fail("started"))
    monkeypatch.setattr("pd_serve.worker.Worker.__init__", lambda *a: pytest.fail("started"))
    one_line_error(capsys, argv, names)


def test_a_model_that_is_no_model_says_so(capsys, monkeypatch, tmp_path):
    """A truncated or foreign .gguf and a file that is neither a folder nor a .gguf name the
    file (were a numpy reshape error, 'GGUF magic invalid' alone, 'no such directory'); a
    gateway host that does not resolve says so (was 'Unknown error -2')."""
    from pd_serve.model.gguf_default import find_default_gguf

    monkeypatch.setenv("PD_SERVE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cut.gguf").write_bytes(find_default_gguf().read_bytes()[:300_000])
    (tmp_path / "noise.gguf").write_bytes(bytes(range(256)) * 400)
    (tmp_path / "notes.txt").write_text("hi")
    for name, names in (("cut.gguf", "cut.gguf: not a GGUF file pd-serve can read"),
                        ("noise.gguf", "noise.gguf: not a GGUF file pd-serve can read"),
                        ("notes.txt", "notes.txt: a file, not a model folder or a .gguf file")):
        one_line_error(capsys, ["chat", "hi", "--model", str(tmp_path / name)], names)
    monkeypatch.setenv("PD_SERVE_CLUSTER_KEY", "k")
    one_line_error(capsys, ["gateway", "--host", "no-such-host.invalid", "--port", "0"],
                   "cannot bind (the host does not resolve")


def test_a_short_cluster_key_is_warned_of(monkeypatch, tmp_path, caplog):
    """A 1-byte PD_SERVE_CLUSTER_KEY was taken without a word (a red-team pass)."""
    monkeypatch.setenv("PD_SERVE_CLUSTER_KEY", "x")
    assert cli.cluster_key(None) == b"x"
    assert "PD_SERVE_CLUSTER_KEY holds 1 bytes: a guessable secret" in caplog.text
    caplog.clear()
    (tmp_path / "key").write_text("a" * 64)
    assert cli.cluster_key(str(tmp_path / "key")) == b"a" * 64 and "guessable" not in caplog.text
