"""pd-serve command line. Flags are named as SGLang and vLLM name them.

    pd-serve demo                                       # local 1P1D cluster + an OpenAI client request
    pd-serve launch --prefill 1 --decode 1 --port 8000  # a local cluster until Ctrl-C
    pd-serve gateway --port 8000 --control-port 8100    # each part on its own ...
    pd-serve prefill --gateway tcp://127.0.0.1:8100     # ... on any host, started in any order
    pd-serve decode --gateway tcp://127.0.0.1:8100
    pd-serve chat "What is the capital of France?"     # the colocated engine in this process
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import fields

from pd_serve.config import (CacheConfig, EngineConfig, GatewayConfig, SchedulerConfig,
                             WorkerConfig, add_config_args, check_port, config_flag, config_kwargs,
                             engine_config_from_args)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and engine")
    for cls in (EngineConfig, CacheConfig, SchedulerConfig):
        add_config_args(g, cls)


def cmd_chat(args: argparse.Namespace) -> None:
    from pd_serve import Engine, SamplingParams

    engine = Engine(config=engine_config_from_args(args))
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": args.message}]
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages),
                                     add_special_tokens=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    start = time.perf_counter()
    num_tokens = 0
    for out in engine.stream(prompt, params):
        print(out.new_text, end="", flush=True)
        num_tokens = len(out.token_ids)
    elapsed = time.perf_counter() - start
    print()
    logging.getLogger("pd_serve").info("%d tokens in %.2f s (%.1f tok/s), finish: %s", num_tokens,
                                       elapsed, num_tokens / elapsed, out.finish_reason)


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("worker")
    add_config_args(g, WorkerConfig)
    add_cluster_key_arg(g)


def add_cluster_key_arg(group) -> None:
    group.add_argument("--cluster-key-file", default=None,
                       help="file holding the cluster secret that authenticates every control and "
                            "KV message (default: $PD_SERVE_CLUSTER_KEY; `launch` hands its "
                            "children this, else a fresh one). The gateway and every worker need "
                            "the same")


MIN_KEY_BYTES = 16  # a cluster key shorter than this is warned of


def cluster_key(path: str | None) -> bytes:
    """The cluster secret: --cluster-key-file, else $PD_SERVE_CLUSTER_KEY, else none (warned)."""

    if path:
        try:
            key = open(path, "rb").read().strip()
        except OSError as e:
            raise ValueError(f"--cluster-key-file {path}: {e.strerror}") from None
        if not key:
            raise ValueError(f"--cluster-key-file {path} is empty")
        where = f"--cluster-key-file {path}"
    else:
        key, where = os.environ.get("PD_SERVE_CLUSTER_KEY", "").encode(), "PD_SERVE_CLUSTER_KEY"
    if not key:
        logging.getLogger("pd_serve").warning(
            "no cluster key: control and KV sockets accept any peer (set PD_SERVE_CLUSTER_KEY or "
            "--cluster-key-file on the gateway and every worker; `pd-serve launch` sets one)")
    elif len(key) < MIN_KEY_BYTES:  # a short secret is a guessable one
        logging.getLogger("pd_serve").warning(
            "%s holds %d bytes: a guessable secret; use %d or more random ones "
            "(openssl rand -hex 32)", where, len(key), MIN_KEY_BYTES)
    return key


def worker_config_from_args(args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig(engine=engine_config_from_args(args),
                        cluster_key=cluster_key(args.cluster_key_file),
                        **config_kwargs(WorkerConfig, args))


def cmd_worker(args: argparse.Namespace) -> None:
    from pd_serve.worker import Worker

    Worker(worker_config_from_args(args), args.command).run()


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("gateway")
    g.add_argument("--port", type=int, default=8000, help="HTTP port")
    g.add_argument("--host", default="127.0.0.1", help="HTTP address to bind")
    g.add_argument("--model", default=None, help="model folder or .gguf file for the tokenizer and "
                   "chat template (default: the embedded SmolLM2-135M-Instruct); workers must "
                   "serve the same model")
    add_config_args(g, GatewayConfig, control_port=8100, served_model_name=None)
    add_cluster_key_arg(g)


def cmd_gateway(args: argparse.Namespace) -> None:
    import asyncio
    from pathlib import Path

    from pd_serve.gateway.server import serve
    from pd_serve.model.gguf_default import model_dir_for

    check_port("--port", args.port)
    model_dir = model_dir_for(args.model)
    if not (model_dir / "tokenizer.json").is_file():
        raise ValueError(f"--model {model_dir}: no tokenizer.json there")
    name = args.served_model_name or ("SmolLM2-135M-Instruct" if not args.model
                                      else Path(args.model).name)

    config = GatewayConfig(**config_kwargs(GatewayConfig, args) | {
        "served_model_name": name, "api_key": args.api_key or os.environ.get("PD_SERVE_API_KEY", ""),
        "cluster_key": cluster_key(args.cluster_key_file)})
    asyncio.run(serve(config, model_dir, args.host, args.port))


def _cluster_from_args(args: argparse.Namespace, log_level: str | None = None):
    from pd_serve.launch import LocalCluster, launch_drain_args, launch_gpu_ids, launch_transfer_args

    for flag, why in (("--worker-id", "launch names its workers itself"),
                      ("--gateway", "launch starts its own gateway; to join another, start the "
                                    "workers alone (pd-serve prefill / decode --gateway ...)")):
        if any(a == flag or a.startswith(flag + "=") for a in args.engine_argv):
            raise ValueError(f"{flag}: {why}; leave it out")
    if args.cluster_key_file:  # to the gateway and every worker, in their environment
        try:
            os.environ["PD_SERVE_CLUSTER_KEY"] = cluster_key(args.cluster_key_file).decode()
        except UnicodeDecodeError:
            raise ValueError(f"--cluster-key-file {args.cluster_key_file}: launch hands the key on "
                             "in PD_SERVE_CLUSTER_KEY, so it must be text (openssl rand -hex 32)") from None
    passthrough = list(args.engine_argv) + (["--model", args.model] if args.model else [])
    gpu_ids = launch_gpu_ids(passthrough, args.gpu_ids.split(",") if args.gpu_ids else None)
    passthrough += launch_transfer_args(passthrough) + launch_drain_args(passthrough)
    gateway_args = ["--model", args.model] if args.model else []
    if args.api_key:  # to the gateway in its environment: a command line is visible in ps
        os.environ["PD_SERVE_API_KEY"] = args.api_key
    for f in fields(GatewayConfig):  # the gateway's flags that were given, passed to it
        value = getattr(args, f.name, None) if f.name not in _LAUNCH_OWNS + ("api_key",) else None
        if value is not None and value is not False:
            gateway_args += [config_flag(f)] + ([] if value is True else [str(value)])
    if args.disable_access_log_for_endpoints is None:  # not a line per start-up poll of /health
        gateway_args += ["--disable-access-log-for-endpoints", "/health"]
    return LocalCluster(port=args.port, host=args.host, num_prefill=args.prefill,
                        num_decode=args.decode,
                        num_colocated=args.colocated, engine_args=passthrough,
                        gateway_args=gateway_args, control_port=args.control_port,
                        log_level=log_level or args.log_level, gpu_ids=gpu_ids,
                        role_tp={role: tp for role, tp in (("prefill", args.prefill_tp),
                                                           ("decode", args.decode_tp))
                                 if tp is not None},
                        role_ep={role: ep for role, ep in (("prefill", args.prefill_ep),
                                                           ("decode", args.decode_ep))
                                 if ep is not None})


def cmd_launch(args: argparse.Namespace) -> None:
    import signal
    import threading

    from pd_serve.launch import LaunchError

    # Ctrl-C and SIGTERM set a flag instead of raising KeyboardInterrupt: an exception landing
    # inside subprocess's own bookkeeping can leave its wait lock held and hang the shutdown.
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    with _cluster_from_args(args) as cluster:
        cluster.wait_ready(stopping=stopping.is_set)
        if stopping.is_set():
            return
        logging.getLogger("pd_serve").info("cluster ready: %s/v1 (Ctrl-C stops it)", cluster.base_url)
        while not stopping.wait(0.5):
            exited = [f"{name} (exit code {p.returncode})" for name, p in cluster.procs
                      if p.poll() is not None]
            if exited:
                raise LaunchError(f"{', '.join(exited)} exited; stopping the rest")


def cmd_demo(args: argparse.Namespace) -> None:
    import openai

    for name in ("httpx", "httpx2"):  # the client's per-request log lines
        logging.getLogger(name).setLevel(logging.WARNING)
    with _cluster_from_args(args, log_level="warning") as cluster:
        cluster.wait_ready()
        client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=(
            args.api_key or os.environ.get("PD_SERVE_API_KEY") or "pd-serve"))
        model = client.models.list().data[0].id
        print(f"> {args.message}")
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": args.message}],
            max_tokens=args.max_tokens, temperature=0.0)
        print(reply.choices[0].message.content)
        timings = (reply.model_extra or {}).get("timings", {})
        phases = ["queue", "prefill", "transfer", "first_token", "decode", "e2e"]
        print("timings: " + ", ".join(f"{k} {timings[k] * 1000:.1f} ms" for k in phases if k in timings))
        print(f"tokens: {reply.usage.prompt_tokens} prompt, {reply.usage.completion_tokens} completion")


_LAUNCH_OWNS = ("control_host", "control_port", "cluster_key")  # launch sets these itself


def _add_launch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers")
    parser.add_argument("--decode", type=int, default=1, help="decode workers")
    parser.add_argument("--colocated", type=int, default=0,
                        help="colocated workers, beside the prefill and decode ones (a colocated-"
                             "only cluster: --prefill 0 --decode 0 --colocated 1)")
    parser.add_argument("--port", type=int, default=8000, help="gateway HTTP port (0: a free one)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="gateway HTTP address to bind (the workers stay on 127.0.0.1)")
    parser.add_argument("--control-port", type=int, default=0, help="gateway control port (0: any)")
    parser.add_argument("--model", default=None)
    add_cluster_key_arg(parser)
    # the gateway's own flags (--api-key, --max-queued-requests, --tool-call-parser, ...): to it
    add_config_args(parser.add_argument_group("gateway"), GatewayConfig, skip=_LAUNCH_OWNS,
                    **{f.name: None for f in fields(GatewayConfig)})
    parser.add_argument("--prefill-tp", type=int, default=None,
                        help="--tp of the prefill workers (default: the --tp given to all workers)")
    parser.add_argument("--decode-tp", type=int, default=None,
                        help="--tp of the decode workers (default: the --tp given to all workers)")
    parser.add_argument("--prefill-ep", type=int, default=None,
                        help="--ep-size of the prefill workers (MoE models; their --tp, or any "
                             "with --tp 1: then a worker takes N GPUs)")
    parser.add_argument("--decode-ep", type=int, default=None,
                        help="--ep-size of the decode workers (MoE models; their --tp, or any "
                             "with --tp 1: then a worker takes N GPUs)")
    parser.add_argument("--gpu-ids", default=None,
                        help="comma-separated GPU ids handed to workers in turn (CUDA_VISIBLE_DEVICES; a worker "
                             "with --tp N (or --ep-size N) takes the next N; default: every visible GPU)")


def cmd_profile(args: argparse.Namespace) -> None:
    from pd_serve.planner import profile

    profile.run(args)


def cmd_plan(args: argparse.Namespace) -> None:
    from pd_serve.planner import plan

    plan.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pd-serve", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)
    chat = sub.add_parser("chat", help="answer one chat message with the colocated engine")
    chat.add_argument("message", help="the user message")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    chat.add_argument("--top-p", type=float, default=1.0)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)
    for role in ("prefill", "decode", "colocated"):
        worker = sub.add_parser(role, help=f"a {role} worker; registers with --gateway")
        add_engine_args(worker)
        add_worker_args(worker)
        worker.set_defaults(func=cmd_worker)
    gateway = sub.add_parser("gateway", help="the OpenAI-compatible HTTP gateway")
    add_gateway_args(gateway)
    gateway.set_defaults(func=cmd_gateway)
    launch = sub.add_parser("launch", help="a local cluster: gateway + workers (other flags go to "
                            "every worker, e.g. --device, --max-total-tokens, --transfer-backend)")
    _add_launch_args(launch)
    launch.set_defaults(func=cmd_launch)
    demo = sub.add_parser("demo", help="start a local 1P1D cluster, ask it one chat question "
                          "with the openai client, print the answer and phase timings, stop")
    demo.add_argument("message", nargs="?", default="What is the capital of France?")
    demo.add_argument("--max-tokens", type=int, default=128)
    _add_launch_args(demo)
    demo.set_defaults(func=cmd_demo)
    from pd_serve.planner.plan import add_plan_args
    from pd_serve.planner.profile import add_profile_args

    profile = sub.add_parser("profile", help="measure prefill and decode step times in-process "
                             "(an EngineCore) and write the profile JSON that plan reads")
    add_engine_args(profile)
    add_profile_args(profile)
    profile.set_defaults(func=cmd_profile)
    plan = sub.add_parser("plan", help="simulate every xPyD split and colocated serving of N "
                          "devices on a profile; recommend the split and batch limits")
    add_plan_args(plan)
    plan.set_defaults(func=cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command in ("launch", "demo"):
        args.engine_argv = rest  # flags for every worker
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pd_serve.launch import LaunchError

    try:
        args.func(args)
    except (ValueError, FileNotFoundError, LaunchError) as e:
        # Bad input is one line that names the flag, file or field; no traceback.
        print(f"pd-serve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
