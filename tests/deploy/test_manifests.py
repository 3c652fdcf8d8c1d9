"""deploy/kubernetes/ cannot rot: every manifest validates against a current Kubernetes schema
(the `kubernetes-validate` package, strict: unknown fields fail), every container's args parse
with the real pd-serve CLI parser into valid configs, and the pieces that name each other
(Services and ports, the Secret mount, GPUs and --tp) agree. Nothing is applied to a cluster.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

import pytest

from pd_serve.cli import build_parser
from pd_serve.config import GatewayConfig, WorkerConfig, config_kwargs, engine_config_from_args

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (pip install -e '.[test]')")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFESTS = DEPLOY / "kubernetes"
WORKER_ROLES = ("prefill", "decode")
# Values the kubelet puts in $(VAR) from the downward API; any well-formed one serves.
FIELD_SAMPLES = {"status.podIP": "10.1.2.3", "metadata.name": "pd-serve-decode-7c9f-x2x"}


def manifest_files() -> list[Path]:
    return sorted(p for p in MANIFESTS.glob("*.yaml") if p.name != "kustomization.yaml")


def resources() -> list[dict]:
    return [doc for path in manifest_files() for doc in yaml.safe_load_all(path.read_text()) if doc]


def deployment(component: str) -> dict:
    found = [r for r in resources() if r["kind"] == "Deployment"
             and r["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == component]
    assert len(found) == 1, f"{len(found)} Deployments of component {component}"
    return found[0]


def pod_spec(component: str) -> dict:
    return deployment(component)["spec"]["template"]["spec"]


def container(component: str) -> dict:
    (c,) = pod_spec(component)["containers"]
    return c


def expanded_args(c: dict) -> list[str]:
    """The container's args with $(VAR) replaced as the kubelet would, from its env."""
    env = {}
    for var in c.get("env", []):
        field = var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        env[var["name"]] = FIELD_SAMPLES[field] if field else var.get("value")

    def sub(m: re.Match) -> str:
        assert env.get(m.group(1)) is not None, f"$({m.group(1)}) is not in {c['name']}'s env"
        return env[m.group(1)]

    return [re.sub(r"\$\((\w+)\)", sub, arg) for arg in c["args"]]


def parsed(component: str):
    """The container's command line through pd-serve's own parser (an unknown flag or a bad
    choice fails here, as it would in the pod)."""
    c = container(component)
    assert c["command"] == ["pd-serve"], c["command"]
    args = expanded_args(c)
    assert args[0] == component, f"{component}'s container runs `pd-serve {args[0]}`"
    try:
        return build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"pd-serve rejects {component}'s args {args} (its error is above)")


def service(name: str) -> dict:
    (svc,) = [r for r in resources() if r["kind"] == "Service" and r["metadata"]["name"] == name]
    return svc


def container_port(c: dict, target) -> int:
    """A Service's targetPort (a name or a number) as the container's port number."""
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    return ports[target] if isinstance(target, str) else target


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in manifest_files())


def test_manifests_validate_against_current_kubernetes_schema():
    kv = pytest.importorskip("kubernetes_validate",
                             reason="kubernetes-validate is not installed (pip install -e '.[test]')")
    version = kv.latest_version()
    docs = resources()
    assert {d["kind"] for d in docs} >= {"Deployment", "Service"}
    for doc in docs:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']} against Kubernetes {version}: {e}")


def test_gateway_args_parse_into_a_valid_config():
    args = parsed("gateway")
    GatewayConfig(**config_kwargs(GatewayConfig, args))  # raises on a bad value
    c = container("gateway")
    # The Services send to the ports the gateway binds, on every interface.
    assert args.host == args.control_host == "0.0.0.0"
    assert container_port(c, "http") == args.port
    assert container_port(c, "control") == args.control_port
    for svc in ("pd-serve-gateway", "pd-serve-gateway-internal"):
        for port in service(svc)["spec"]["ports"]:
            assert container_port(c, port["targetPort"]) in (args.port, args.control_port)


@pytest.mark.parametrize("role", WORKER_ROLES)
def test_worker_args_parse_into_a_valid_config(role):
    args = parsed(role)
    config = WorkerConfig(engine=engine_config_from_args(args), **config_kwargs(WorkerConfig, args))
    # Peers in other pods reach the worker at its pod IP, whatever it binds.
    assert config.reachable_host == FIELD_SAMPLES["status.podIP"]
    # The gateway address is the Service that takes workers before the gateway is ready.
    address = urlparse(config.gateway)
    svc = service(address.hostname)
    assert svc["spec"].get("publishNotReadyAddresses") is True
    (port,) = [p for p in svc["spec"]["ports"] if p["port"] == address.port]
    assert container_port(container("gateway"), port["targetPort"]) == parsed("gateway").control_port
    if role == "decode":
        assert container_port(container(role), "kv") == config.port
    # One GPU per tensor-parallel rank.
    assert container(role)["resources"]["limits"]["nvidia.com/gpu"] == config.engine.tp


@pytest.mark.parametrize("component", ["gateway", *WORKER_ROLES])
def test_cluster_key_comes_from_the_secret(component):
    """Every process reads the same cluster key, from a file of the mounted Secret."""
    key_file = Path(parsed(component).cluster_key_file)
    volumes = {v["name"]: v for v in pod_spec(component)["volumes"]}
    (mount,) = [m for m in container(component)["volumeMounts"]
                if key_file.parent == Path(m["mountPath"])]
    assert volumes[mount["name"]]["secret"]["secretName"] == "pd-serve-cluster-key"
    assert key_file.name == "cluster-key"


class _Health(BaseHTTPRequestHandler):
    """The gateway's /health as pd_serve/gateway/server.py answers it: 200 with a
    prefill+decode pair registered, else 503, and the registered workers by id either way."""

    workers: dict = {}

    def do_GET(self):
        ready = {"prefill", "decode"} <= {w["role"] for w in self.workers.values()}
        body = json.dumps({"status": "ok" if ready else "no workers", "workers": self.workers})
        self.send_response(200 if ready else 503)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("role", WORKER_ROLES)
def test_worker_readiness_probe_is_registration(role):
    """The exec probe passes once the gateway lists this pod's worker id, 503 or not, and
    fails before, and while the gateway cannot be reached."""
    probe = container(role)["readinessProbe"]["exec"]["command"]
    url = re.search(r"http://[\w.-]+:\d+", probe[-1]).group(0)
    assert url == f"http://pd-serve-gateway-internal:{parsed('gateway').port}"
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    local = probe[:-1] + [probe[-1].replace(url, f"http://127.0.0.1:{server.server_port}")]
    assert local[0] == "python"
    pod = FIELD_SAMPLES["metadata.name"]

    def probe_rc(workers: dict) -> int:
        _Health.workers = workers
        env = dict(os.environ, POD_NAME=pod)
        return subprocess.run([sys.executable, *local[1:]], env=env, capture_output=True,
                              timeout=60).returncode

    try:
        assert probe_rc({}) != 0
        assert probe_rc({pod: {"role": role}}) == 0  # 503: the other pool has not registered yet
        assert probe_rc({pod: {"role": role}, "other": {"role": "prefill" if role == "decode"
                                                         else "decode"}}) == 0
        assert probe_rc({"other": {"role": "prefill"}, "x": {"role": "decode"}}) != 0
    finally:
        server.shutdown()
        server.server_close()
    assert probe_rc({}) != 0  # nothing listens there now


def test_dockerfile_copies_what_exists():
    """The image's COPY sources are paths of this checkout (a rename breaks the build here)."""
    lines = (DEPLOY / "Dockerfile").read_text().splitlines()
    copies = [line.split()[1:-1] for line in lines if line.startswith("COPY ")]
    assert copies
    root = DEPLOY.parent
    for sources in copies:
        for source in sources:
            assert (root / source).exists(), f"deploy/Dockerfile copies {source}: not in the checkout"
