"""CLI flags are generated from the config dataclasses: every field with a flag parses back to its
default, renamed flags land on their fields, and the choices are config.py's tuples."""

from __future__ import annotations

import argparse

import pytest

from pd_serve.cli import build_parser, worker_config_from_args
from pd_serve.config import (KV_CACHE_DTYPES, EngineConfig, GatewayConfig, WorkerConfig,
                             add_config_args, config_kwargs, engine_config_from_args)


def test_engine_flags_default_to_the_config_defaults():
    args = build_parser().parse_args(["chat", "hi"])
    assert engine_config_from_args(args) == EngineConfig()


def test_flags_set_nested_fields():
    args = build_parser().parse_args(["chat", "hi", "--page-size", "32", "--kv-cache-dtype",
                                      "fp8_e5m2", "--schedule-policy", "priority", "--tp", "2",
                                      "--disable-cuda-graph"])
    config = engine_config_from_args(args)
    assert (config.cache.page_size, config.cache.kv_cache_dtype) == (32, "fp8_e5m2")
    assert config.scheduler.schedule_policy == "priority"
    assert config.tp == 2 and config.disable_cuda_graph


def test_worker_flags_with_other_names(monkeypatch):
    monkeypatch.setenv("PD_SERVE_CLUSTER_KEY", "k")
    args = build_parser().parse_args(["decode", "--gateway", "tcp://127.0.0.1:1",
                                      "--transfer-timeout", "5", "--port", "7"])
    config = worker_config_from_args(args)
    assert (config.transfer_timeout_s, config.port, config.cluster_key) == (5.0, 7, b"k")
    assert config.heartbeat_s == WorkerConfig.__dataclass_fields__["heartbeat_s"].default


def test_gateway_flags_and_cli_defaults():
    parser = argparse.ArgumentParser()
    add_config_args(parser, GatewayConfig, control_port=8100)
    kwargs = config_kwargs(GatewayConfig, parser.parse_args(["--worker-timeout", "3",
                                                             "--timeout-keep-alive", "2.5"]))
    assert GatewayConfig(**kwargs) == GatewayConfig(control_port=8100, worker_timeout_s=3.0,
                                                    timeout_keep_alive_s=2.5)
    with pytest.raises(ValueError, match="--timeout-keep-alive must be > 0"):
        GatewayConfig(timeout_keep_alive_s=0)
    assert GatewayConfig(disable_access_log_for_endpoints=" /health, /metrics,").quiet_paths == (
        "/health", "/metrics")
    with pytest.raises(ValueError, match="--disable-access-log-for-endpoints 'health'"):
        GatewayConfig(disable_access_log_for_endpoints="health")
    for worker in ("prefill", "decode", "colocated"):  # a gateway flag, not a worker's
        with pytest.raises(SystemExit):
            build_parser().parse_args([worker, "--disable-access-log-for-endpoints", "/health"])


def test_choices_come_from_config():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat", "hi", "--kv-cache-dtype", "int4"])
    kv = next(a for a in build_parser()._subparsers._group_actions[0].choices["chat"]._actions
              if a.dest == "kv_cache_dtype")
    assert tuple(kv.choices) == KV_CACHE_DTYPES


def test_a_worker_binding_every_interface_must_say_where_peers_reach_it(monkeypatch):
    monkeypatch.setenv("PD_SERVE_CLUSTER_KEY", "k")
    parse = lambda *flags: worker_config_from_args(build_parser().parse_args(
        ["decode", "--gateway", "tcp://10.0.0.1:1", *flags]))
    config = parse("--host", "0.0.0.0", "--advertise-host", "10.0.0.2")
    assert (config.host, config.reachable_host) == ("0.0.0.0", "10.0.0.2")
    assert parse("--host", "10.0.0.3").reachable_host == "10.0.0.3"
    with pytest.raises(ValueError, match="--advertise-host"):
        parse("--host", "0.0.0.0")


def test_parsers_reach_the_gateway_also_through_launch(monkeypatch):
    """--tool-call-parser / --reasoning-parser are gateway flags; launch hands them to its gateway."""
    import pd_serve.launch

    args = build_parser().parse_args(["gateway", "--tool-call-parser", "hermes",
                                      "--reasoning-parser", "qwen3"])
    config = GatewayConfig(**config_kwargs(GatewayConfig, args))
    assert (config.tool_call_parser, config.reasoning_parser) == ("hermes", "qwen3")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gateway", "--tool-call-parser", "pythonic"])
    seen = {}
    monkeypatch.setattr(pd_serve.launch, "LocalCluster", lambda **kw: seen.update(kw))
    from pd_serve.cli import _cluster_from_args
    args = build_parser().parse_args(["launch", "--colocated", "1", "--tool-call-parser",
                                      "mistral", "--reasoning-parser", "deepseek-r1"])
    args.engine_argv = []
    _cluster_from_args(args)
    assert seen["gateway_args"] == ["--tool-call-parser", "mistral", "--reasoning-parser",
                                    "deepseek-r1", "--disable-access-log-for-endpoints", "/health"]
