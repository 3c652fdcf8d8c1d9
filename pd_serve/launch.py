"""`pd-serve launch`: a whole local cluster (gateway, N prefill, M decode, K colocated) from one
command. Every child dies with it: on exit, on Ctrl-C, and (PR_SET_PDEATHSIG) if it is killed."""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from pd_serve.config import check_port
from pd_serve.ports import free_port  # noqa: F401 (the launcher's, and its callers')

logger = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1


class LaunchError(RuntimeError):
    """A cluster process failed to start or exited."""


def flag_value(args: list[str], flag: str, default: str) -> str:
    """The last value of `flag` in a command line (`--flag v` or `--flag=v`), else default."""
    value = default
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def _on_cuda(engine_args: list[str]) -> bool:
    device = flag_value(engine_args, "--device", "auto")
    if device == "auto":
        import torch
        return torch.cuda.is_available()
    return device.startswith("cuda")


def launch_transfer_args(engine_args: list[str]) -> list[str]:
    """["--transfer-backend", "ipc"] for workers on CUDA when no backend was chosen: launch's
    workers share one host, where ipc pairs any two GPUs, and also two workers on one GPU
    (which the GPU default, torch/NCCL, cannot)."""
    if flag_value(engine_args, "--transfer-backend", "auto") != "auto":
        return []
    return ["--transfer-backend", "ipc"] if _on_cuda(engine_args) else []


def launch_drain_args(engine_args: list[str]) -> list[str]:
    """["--drain-timeout", "0"] unless one was given: launch stops its gateway with its workers,
    so a draining worker would have no gateway to finish its requests through."""
    return [] if flag_value(engine_args, "--drain-timeout", None) is not None else ["--drain-timeout", "0"]


def launch_gpu_ids(engine_args: list[str], gpu_ids: list[str] | None) -> list[str] | None:
    """The GPU ids handed to the workers in turn: --gpu-ids, else for workers on CUDA every
    visible GPU (CUDA_VISIBLE_DEVICES's entries, or 0..n-1), so workers get GPUs of their own
    while there are enough; None on CPU."""
    if gpu_ids or not _on_cuda(engine_args):
        return gpu_ids
    import torch
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [v.strip() for v in visible.split(",") if v.strip()]
    return [str(i) for i in range(torch.cuda.device_count())] or None


def cpu_threads_per_rank(engine_args: list[str], num_ranks: int) -> int | None:
    """OpenMP threads for each worker rank on CPU: the cores this process may use, shared out
    among the ranks (at least one each). torch's default, a thread per core in every process,
    makes the ranks' OpenMP teams wait on each other's descheduled threads at every parallel
    region: on 2 cores a 2048-token prefill step beside a 9-request decode took 14.5 s instead
    of 2.4 s alone (4.7 s with a thread each). None on CUDA, or when OMP_NUM_THREADS is set
    (the user's choice, which the children inherit)."""
    if "OMP_NUM_THREADS" in os.environ or _on_cuda(engine_args):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, num_ranks))


def worker_gpus(first: int, gpu_ids: list[str] | None, count: int) -> str | None:
    """CUDA_VISIBLE_DEVICES of a worker with `count` ranks whose GPUs start at position
    `first` of the workers' GPUs so far: the next `count` ids, wrapping around."""
    if not gpu_ids:
        return None
    return ",".join(gpu_ids[(first + j) % len(gpu_ids)] for j in range(count))


def _child_setup() -> None:
    """In each child before it runs: it dies with launch (SIGTERM), and it ignores SIGINT, which
    Python then leaves ignored: Ctrl-C reaches the whole process group, and launch stops the
    children itself (SIGTERM), where each printed a KeyboardInterrupt traceback mid-import."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the parent's cleanup still stops the children


def _check_counts(num_prefill: int, num_decode: int, num_colocated: int,
                  role_tp: dict[str, int], role_ep: dict[str, int]) -> None:
    """Bad worker counts and pool sizes are errors before anything starts: a cluster that can
    never serve (prefill workers without decode ones) would otherwise wait out its start-up."""
    for flag, n in (("--prefill", num_prefill), ("--decode", num_decode),
                    ("--colocated", num_colocated)):
        if n < 0:
            raise ValueError(f"{flag} {n} must be >= 0")
    if not num_colocated and not (num_prefill and num_decode):
        raise ValueError(f"--prefill {num_prefill} --decode {num_decode} --colocated 0 serves "
                         "nothing: give prefill and decode workers both (>= 1 each), or "
                         "--colocated N")
    for flag, sizes in (("tp", role_tp), ("ep", role_ep)):
        for role, n in sizes.items():
            if n < 1:
                raise ValueError(f"--{role}-{flag} {n} must be >= 1")


def _bindable_port(host: str, port: int) -> int:
    """`port` (0: a free one) once a test bind of host:port has passed, as the gateway binds
    it (address reuse on, so a port left in TIME_WAIT passes); else a ValueError naming why:
    another server has the port, the host does not resolve or is not this machine's."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host or None, port,
                                                             type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: does not resolve ({e.strerror})") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            why = ("another server has it; stop that one or give another --port"
                   if e.errno == errno.EADDRINUSE else "give an address of this machine")
            raise ValueError(f"--host {host} --port {port}: cannot bind ({e.strerror}): "
                             f"{why}") from None
        return s.getsockname()[1]


class LocalCluster:
    """Starts the processes; stop() (or the context manager) ends all of them."""

    def __init__(self, *, port: int, host: str = "127.0.0.1", num_prefill: int = 1,
                 num_decode: int = 1,
                 num_colocated: int = 0, engine_args: list[str] = (), worker_args: list[str] = (),
                 gateway_args: list[str] = (), control_port: int = 0, log_level: str = "info",
                 gpu_ids: list[str] | None = None, role_tp: dict[str, int] | None = None,
                 role_ep: dict[str, int] | None = None):
        """host, port: the gateway's HTTP address (port 0: a free one, chosen here). gpu_ids:
        handed to the workers in turn, as many each as its ranks: max(--tp, --ep-size), from
        engine_args or role_tp[role] / role_ep[role], which also add `--tp N` / `--ep-size N`
        to that role's workers (--ep-size above --tp: attention replicated)."""
        _check_counts(num_prefill, num_decode, num_colocated, role_tp or {}, role_ep or {})
        check_port("--port", port)
        check_port("--control-port", control_port)
        # Whatever already answers on the port would pass the readiness check below (and a
        # demo would ask it): a port in use is an error before anything starts.
        self.port = _bindable_port(host, port)
        local = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        # Closed by default: the children share a fresh secret unless one is given.
        self.cluster_key = os.environ.get("PD_SERVE_CLUSTER_KEY") or secrets.token_hex(32)
        self.control_port = control_port or free_port()
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.base_url = f"http://{f'[{local}]' if ':' in local else local}:{self.port}"
        self.gateway_command = ["gateway", "--host", host, "--port", str(self.port),
                                "--control-port", str(self.control_port),
                                *gateway_args]  # to start it again
        gateway = f"tcp://127.0.0.1:{self.control_port}"
        roles = ["prefill"] * num_prefill + ["decode"] * num_decode + ["colocated"] * num_colocated
        role_tp, role_ep = role_tp or {}, role_ep or {}
        sizes = [(role_tp.get(role, int(flag_value(list(engine_args), "--tp", "1"))),
                  role_ep.get(role, int(flag_value(list(engine_args), "--ep-size", "1"))))
                 for role in roles]  # each worker's (tp, ep): it runs max(tp, ep) ranks
        # CPU: the ranks share the cores out (a worker's TP followers inherit its environment)
        self.cpu_threads = cpu_threads_per_rank(list(engine_args), sum(max(s) for s in sizes))
        self._start("gateway", self.gateway_command, log_level)
        first_gpu = 0
        for i, (role, (tp, ep)) in enumerate(zip(roles, sizes)):
            env_gpu = worker_gpus(first_gpu, gpu_ids, max(tp, ep))
            first_gpu += max(tp, ep)
            tp_args = ["--tp", str(tp)] if role in role_tp else []
            tp_args += ["--ep-size", str(role_ep[role])] if role in role_ep else []
            self._start(f"{role}-{i}", [role, "--gateway", gateway, "--worker-id", f"{role}-{i}",
                                        *engine_args, *worker_args, *tp_args], log_level, env_gpu)

    def _start(self, name: str, args: list[str], log_level: str, gpu: str | None = None) -> None:
        env = dict(os.environ, PD_SERVE_CLUSTER_KEY=self.cluster_key)
        if self.cpu_threads is not None:
            env["OMP_NUM_THREADS"] = str(self.cpu_threads)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        cmd = [sys.executable, "-m", "pd_serve.cli", "--log-level", log_level, *args]
        self.procs.append((name, subprocess.Popen(cmd, env=env, preexec_fn=_child_setup)))

    def wait_ready(self, timeout_s: float = 300.0, num_workers: int | None = None,
                   stopping=lambda: False) -> dict:
        """Until /health is 200 with every worker registered (or `stopping()`); a child that
        exits is an error."""
        deadline = time.monotonic() + timeout_s
        want = num_workers if num_workers is not None else len(self.procs) - 1
        while time.monotonic() < deadline and not stopping():
            for name, proc in self.procs:
                if proc.poll() is not None:
                    raise LaunchError(f"{name} exited with code {proc.returncode} during start-up")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                    health = json.loads(r.read())
                if len(health["workers"]) >= want:
                    return health
            except urllib.error.HTTPError as e:  # 503: every worker registered, and still not?
                try:
                    health = json.loads(e.read())
                except ValueError:
                    health = {}
                if len(health.get("workers", ())) >= want and health.get("status") != "no workers":
                    raise LaunchError(f"the cluster cannot serve: {health.get('status')}") from None
            except OSError:
                pass
            time.sleep(0.2)
        if stopping():
            return {}
        raise LaunchError(f"cluster not ready within {timeout_s} s")

    def stop(self) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for _, proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
