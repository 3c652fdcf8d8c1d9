"""Hosts for multi-host tests on one machine: Linux network namespaces on a bridge.

`Hosts` makes, as root with iproute2, a bridge and one namespace per host, each joined to the
bridge by a veth pair and given its own 10.x.y.z address; the bridge holds .1, so the test's own
namespace reaches every host through it. Names carry this process's pid and a random tag, so
parallel runs do not collide; close() kills whatever still runs in the namespaces and removes
them and the bridge, and a later run removes what a killed run left (its pid is gone).
`NetnsCluster` starts the gateway and the workers of a cluster on such hosts.
"""

from __future__ import annotations

import ipaddress
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time

from cluster_helpers import health

PREFIX = "pdtest"  # namespaces: pdtest-PID-TAG-NAME; bridge pdbTAG; veths pdvTAGN (15 chars max)
GATEWAY_PORT, CONTROL_PORT, KV_PORT = 8000, 8100, 9000  # each host has its own ports


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def netns_unavailable() -> str:
    """Why network namespaces cannot be made here ("" when they can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _kill_inside(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def remove_stale() -> None:
    """Remove the namespaces and bridges of runs whose process is gone."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        m = re.match(rf"{PREFIX}-(\d+)-([0-9a-f]+)-\S+", line)
        if m and not _alive(int(m.group(1))):
            _kill_inside(m.group(0))
            _ip("netns", "del", m.group(0), check=False)
            _ip("link", "del", f"pdb{m.group(2)}", check=False)


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 that no route or address of this namespace overlaps."""
    used = [ipaddress.ip_network(w, strict=False)
            for w in re.findall(r"\b\d+\.\d+\.\d+\.\d+(?:/\d+)?", _ip("-4", "route").stdout
                                + _ip("-4", "addr").stdout)]
    while True:
        net = ipaddress.ip_network(f"10.{random.randint(64, 254)}.{random.randint(0, 255)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net


class Hosts:
    """Network namespaces on one bridge; add(name) makes one and returns its address."""

    def __init__(self):
        remove_stale()
        self.tag = secrets.token_hex(3)
        self.subnet = _free_subnet()
        self.bridge = f"pdb{self.tag}"
        self.addresses: dict[str, str] = {}  # host name -> its address
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.subnet[1]}/{self.subnet.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def ns(self, name: str) -> str:
        return f"{PREFIX}-{os.getpid()}-{self.tag}-{name}"

    def add(self, name: str) -> str:
        ns, veth = self.ns(name), f"pdv{self.tag}{len(self.addresses)}"
        address = str(self.subnet[2 + len(self.addresses)])
        self.addresses[name] = address
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        return address

    def popen(self, name: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """Run argv in host `name`'s namespace (`ip netns exec` execs it: the pid is argv's)."""
        return subprocess.Popen(["ip", "netns", "exec", self.ns(name), *argv], **kwargs)

    def close(self) -> None:
        for name in self.addresses:  # deleting a namespace deletes its veth pair
            _kill_inside(self.ns(name))
            _ip("netns", "del", self.ns(name), check=False)
        _ip("link", "del", self.bridge, check=False)

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NetnsCluster:
    """A gateway and workers, each on a host of its own. Workers bind every interface and
    advertise their host's address (--host 0.0.0.0 --advertise-host), unless `bind_own` binds
    the address itself."""

    def __init__(self, hosts: Hosts, gateway_args: list[str], worker_args: list[str],
                 env: dict[str, str] | None = None):
        """env: variables added to every process's environment."""
        self.hosts, self.worker_args = hosts, worker_args
        self.env = dict(os.environ, PD_SERVE_CLUSTER_KEY=secrets.token_hex(32), **(env or {}))
        self.procs: dict[str, subprocess.Popen] = {}
        self.commands: dict[str, list[str]] = {}
        address = hosts.add("gateway")
        self.base_url = f"http://{address}:{GATEWAY_PORT}"
        self.control = f"tcp://{address}:{CONTROL_PORT}"
        self.start("gateway", ["gateway", "--host", "0.0.0.0", "--port", str(GATEWAY_PORT),
                               "--control-host", "0.0.0.0", "--control-port", str(CONTROL_PORT),
                               *gateway_args])

    def start(self, name: str, args: list[str]) -> None:
        """Start (or start again) process `name` with pd-serve CLI arguments on its host."""
        self.commands[name] = args
        argv = [sys.executable, "-m", "pd_serve.cli", "--log-level", "warning", *args]
        self.procs[name] = self.hosts.popen(name, argv, env=self.env)

    def start_worker(self, name: str, role: str, bind_own: bool = False) -> None:
        address = self.hosts.addresses.get(name) or self.hosts.add(name)
        bind = ["--host", address] if bind_own else ["--host", "0.0.0.0", "--advertise-host", address]
        self.start(name, [role, "--gateway", self.control, "--worker-id", name, *bind,
                          *(["--port", str(KV_PORT)] if role == "decode" else []), *self.worker_args])

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(sig)
        proc.wait(timeout=30)

    def health(self) -> dict:
        return health(self.base_url)

    def wait_workers(self, names: set[str], timeout_s: float = 240.0) -> None:
        """Until the gateway's registered workers are exactly `names`; a process that exits
        is an error."""
        deadline = time.monotonic() + timeout_s
        while True:
            for name, proc in self.procs.items():
                assert proc.poll() is None, f"{name} exited with code {proc.returncode}"
            workers = set(self.health().get("workers", {}))
            if workers == names:
                return
            assert time.monotonic() < deadline, f"registered {sorted(workers)}, not {sorted(names)}"
            time.sleep(0.3)

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
