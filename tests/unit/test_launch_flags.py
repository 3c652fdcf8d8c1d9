"""Which process `pd-serve launch` hands each flag to. It stops its gateway with its workers, so
its workers drain for 0 s on SIGTERM unless --drain-timeout is given; the gateway's own flags
(--api-key, the limits, ...) go to the gateway alone. The processes are not started:
LocalCluster._start records what it would run."""

from __future__ import annotations

import os

import pytest

from pd_serve import cli
from pd_serve.launch import LocalCluster, flag_value


@pytest.mark.parametrize("argv,want", [([], "0"), (["--drain-timeout", "45"], "45")])
def test_launch_workers_drain_timeout(monkeypatch, argv, want):
    started = []
    monkeypatch.setattr(LocalCluster, "_start",
                        lambda self, name, args, log_level, gpu=None: started.append((name, args)))
    args, rest = cli.build_parser().parse_known_args(["launch", "--port", "0", "--device", "cpu",
                                                      *argv])
    args.engine_argv = rest
    cli._cluster_from_args(args)
    workers = {name: flag_value(a, "--drain-timeout", None) for name, a in started if name != "gateway"}
    assert workers == {"prefill-0": want, "decode-1": want}
    assert all("--drain-timeout" not in a for name, a in started if name == "gateway")


def test_launch_passes_the_gateways_flags_to_the_gateway_only(monkeypatch):
    monkeypatch.setenv("PD_SERVE_API_KEY", "")  # (launch sets it; undone after the test)
    """Every gateway flag launch takes reaches the gateway's command and no worker's, and each
    process's command parses as its own subcommand's."""
    started = []
    monkeypatch.setattr(LocalCluster, "_start",
                        lambda self, name, args, log_level, gpu=None: started.append((name, args)))
    given = ["--api-key", "k1", "--max-queued-requests", "3", "--max-outstanding-requests", "5",
             "--admit-timeout", "7.5", "--served-model-name", "m", "--prefill-policy", "round_robin",
             "--tool-call-parser", "hermes"]
    args, rest = cli.build_parser().parse_known_args(["launch", "--port", "0", "--device", "cpu",
                                                      *given])
    args.engine_argv = rest
    assert rest == ["--device", "cpu"]
    cli._cluster_from_args(args)
    commands = dict(started)
    gateway = cli.build_parser().parse_args(commands.pop("gateway"))
    assert (gateway.max_queued_requests, gateway.max_outstanding_requests,
            gateway.admit_timeout_s, gateway.served_model_name, gateway.prefill_policy,
            gateway.tool_call_parser) == (3, 5, 7.5, "m", "round_robin", "hermes")
    assert not gateway.api_key and os.environ["PD_SERVE_API_KEY"] == "k1"  # not in ps
    # not an access line per start-up poll of /health, unless the flag is given
    assert gateway.disable_access_log_for_endpoints == "/health"
    for name, command in commands.items():
        assert not set(given[::2]) & set(command) and "k1" not in command, name
        cli.build_parser().parse_args(command)  # a worker's flags are all its own


def test_launch_children_leave_ctrl_c_to_launch(monkeypatch):
    """Ctrl-C reaches launch's whole process group: its children ignore SIGINT (Python keeps
    an inherited SIG_IGN) and launch stops them, where each printed a KeyboardInterrupt
    traceback from inside its imports (a red-team pass)."""
    import subprocess
    import sys

    from pd_serve import launch

    seen, real = [], subprocess.Popen
    monkeypatch.setattr(launch.subprocess, "Popen", lambda cmd, **kw: seen.append(kw["preexec_fn"])
                        if "pd_serve.cli" in cmd else real(cmd, **kw))
    args, rest = cli.build_parser().parse_known_args(["launch", "--port", "0", "--device", "cpu"])
    args.engine_argv = rest
    cli._cluster_from_args(args)
    assert seen and all(f is launch._child_setup for f in seen)
    out = subprocess.run([sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)"],
                         preexec_fn=launch._child_setup, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True", out


def test_launch_hands_its_cluster_key_file_to_every_child(monkeypatch, tmp_path):
    """--cluster-key-file given to launch went to the workers alone (the gateway kept its own
    key, so none could register; a docs review); the key now reaches every child."""
    from pd_serve import launch

    envs = {}
    monkeypatch.setattr(launch.subprocess, "Popen",
                        lambda cmd, **kw: envs.setdefault(cmd[cmd.index("--log-level") + 2], kw["env"]))
    monkeypatch.setenv("PD_SERVE_CLUSTER_KEY", "")  # (recorded: launch's write is undone)
    monkeypatch.delenv("PD_SERVE_CLUSTER_KEY")
    (tmp_path / "key").write_text("ab" * 32 + "\n")
    args, rest = cli.build_parser().parse_known_args(["launch", "--port", "0", "--device", "cpu",
                                                      "--cluster-key-file", str(tmp_path / "key")])
    args.engine_argv = rest
    assert rest == ["--device", "cpu"]
    cluster = cli._cluster_from_args(args)
    assert cluster.cluster_key == "ab" * 32
    assert set(envs) == {"gateway", "prefill", "decode"}
    assert all(env["PD_SERVE_CLUSTER_KEY"] == "ab" * 32 for env in envs.values())


def test_launch_says_why_a_registered_cluster_cannot_serve(monkeypatch):
    """Every worker registered, and /health still 503 (a pair that cannot hand KV over): launch
    says why at once, where it waited out its start-up time without a word."""
    import http.server
    import json
    import threading

    from pd_serve.launch import LaunchError

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"status": "no prefill worker can send KV to any decode worker: "
                                         "KV layouts differ", "workers": {"p": {}, "d": {}}}).encode()
            self.send_response(503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(LocalCluster, "_start", lambda self, *a, **kw: None)
        cluster = LocalCluster(port=0, engine_args=["--device", "cpu"])
        cluster.base_url = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(LaunchError, match="the cluster cannot serve: no prefill worker can "
                                              "send KV to any decode worker: KV layouts differ"):
            cluster.wait_ready(timeout_s=60, num_workers=2)
    finally:
        server.shutdown()
