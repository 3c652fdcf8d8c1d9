"""The planner: cost-model fits, the cluster simulator on hand-checkable cases, and `pd-serve plan`
/ `pd-serve profile` end to end."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from pd_serve.cli import main
from pd_serve.planner import plan
from pd_serve.planner import profile as profile_module
from pd_serve.planner import workload
from pd_serve.planner.costs import CostModel, Pipeline, fit_prefill, interp
from pd_serve.planner.metrics import RequestRecord, compute_metrics
from pd_serve.planner.simulator import ClusterSpec, PoolLimits, metrics, simulate

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # bench/ (a checkout need not install it)
from bench import serving  # noqa: E402
RECORDED = REPO_ROOT / "bench" / "results" / "profile-cpu-smollm2.json"
P, D1, D2, T = 0.5, 0.1, 0.15, 0.2  # prefill, decode step at batch 1 and 2, transfer (s)


def const_costs(prefill=P, decode=(D1, D2), transfer=T, overlap=0.0) -> CostModel:
    """Prefill takes `prefill` whatever the tokens; a decode step depends on the batch only."""
    return CostModel((1.0,), (prefill,), 0.0, (1.0, 2.0), (1.0,), tuple((d,) for d in decode),
                     overlap_s=overlap, bytes_per_token=0, transfer_latency_s=transfer)


def one_p_one_d(**limits) -> ClusterSpec:
    return ClusterSpec(1, 1, prefill=limits.get("prefill", PoolLimits()),
                       decode=limits.get("decode", PoolLimits()))


def ttft(r):
    return r.token_times[0] - r.arrival


def tpot(r):
    return (r.token_times[-1] - r.token_times[0]) / (r.output_len - 1)


# ---- cost models ----------------------------------------------------------------------------
def test_interp_is_piecewise_linear_clamped_below_and_extrapolated_above():
    xs, ys = [16, 32, 64], [1.0, 2.0, 3.0]
    assert interp(24, xs, ys) == pytest.approx(1.5)
    assert interp(48, xs, ys) == pytest.approx(2.5)
    assert interp(4, xs, ys) == 1.0
    assert interp(128, xs, ys) == pytest.approx(5.0)  # last slope: 1 per 32 tokens


def test_fit_prefill_recovers_base_and_attention_cost():
    base = {16: 0.1, 64: 0.2, 256: 0.6}
    c = 1e-6
    points = [{"num_tokens": n, "attn_pairs": n * n // k, "time_s": base[n] + c * n * n / k}
              for n in base for k in (1, 4)]
    tokens, fitted, per_pair = fit_prefill(points)
    assert tokens == (16.0, 64.0, 256.0)
    assert per_pair == pytest.approx(c)
    assert fitted == pytest.approx(tuple(base.values()))
    one_mix = fit_prefill([p for p in points if p["attn_pairs"] == p["num_tokens"] ** 2])
    assert one_mix[2] == 0.0  # one mix per token count: no attention term


def test_decode_step_is_bilinear():
    costs = CostModel((1.0,), (0.0,), 0.0, (1.0, 3.0), (100.0, 300.0), ((1.0, 2.0), (3.0, 6.0)))
    assert costs.decode_step(1, 100) == 1.0 and costs.decode_step(3, 300) == 6.0
    assert costs.decode_step(2, 200) == pytest.approx((1.0 + 2.0 + 3.0 + 6.0) / 4)
    assert costs.decode_step(2, 100) == pytest.approx(2.0)
    assert costs.decode_step(5, 300) == pytest.approx(10.0)  # extrapolated in batch


def test_mixed_step_pays_the_fixed_cost_once():
    costs = const_costs(overlap=0.05)
    assert costs.step_time(64, 0, 0, 0) == P
    assert costs.step_time(0, 0, 2, 10) == D2
    assert costs.step_time(64, 0, 1, 10) == pytest.approx(P + D1 - 0.05)


# ---- the simulator --------------------------------------------------------------------------
def test_one_request_ttft_is_prefill_plus_transfer_and_tpot_is_the_step():
    [r] = simulate(one_p_one_d(), const_costs(), [(1.0, 100, 5)])
    assert ttft(r) == pytest.approx(P + T)
    assert tpot(r) == pytest.approx(D1)
    assert len(r.token_times) == 5
    m = metrics([r], {"ttft": 1000 * (P + T) + 1, "tpot": 1000 * D1 + 1})
    assert m["ttft_ms"]["mean"] == pytest.approx(1000 * (P + T))
    assert m["tpot_ms"]["mean"] == pytest.approx(1000 * D1)
    assert m["num_good"] == 1


def test_two_requests_queue_at_one_prefill_worker():
    # A 100-token budget holds one 100-token prompt per step; B arrives while A computes.
    spec = one_p_one_d(prefill=PoolLimits(chunked_prefill_size=100))
    a, b = simulate(spec, const_costs(transfer=0.0), [(0.0, 100, 2), (0.1, 100, 2)])
    assert ttft(a) == pytest.approx(P)
    assert ttft(b) == pytest.approx(2 * P - 0.1)  # waits for A's step, then its own
    # With room for both in one step they are batched: the same prefill step for both.
    a, b = simulate(one_p_one_d(), const_costs(transfer=0.0), [(0.0, 100, 2), (0.0, 100, 2)])
    assert ttft(a) == ttft(b) == pytest.approx(P)


def test_transfers_of_one_prefill_worker_go_one_at_a_time():
    a, b = simulate(one_p_one_d(), const_costs(), [(0.0, 100, 2), (0.0, 100, 2)])
    assert (ttft(a), ttft(b)) == pytest.approx((P + T, P + 2 * T))


def test_decode_batching_changes_step_time():
    [alone] = simulate(one_p_one_d(), const_costs(transfer=0.0), [(0.0, 100, 6)])
    a, b = simulate(one_p_one_d(), const_costs(transfer=0.0), [(0.0, 100, 6), (0.0, 100, 6)])
    assert tpot(alone) == pytest.approx(D1)
    assert tpot(a) == tpot(b) == pytest.approx(D2)


def test_decode_slots_hold_requests_at_the_gateway():
    spec = one_p_one_d(decode=PoolLimits(max_running_requests=1))
    a, b = simulate(spec, const_costs(), [(0.0, 100, 3), (0.0, 100, 3)])
    e2e_a = P + T + 2 * D1
    assert a.token_times[-1] == pytest.approx(e2e_a)
    assert ttft(b) == pytest.approx(e2e_a + P + T)  # admitted when A frees its slot


def test_a_busy_decode_worker_answers_admission_when_its_step_ends():
    # A decodes from P + T = 0.7 s in steps of D1; B arrives at 0.75, mid-step: its prompt
    # reaches the prefill worker at 0.8, when the decode worker reads its messages.
    a, b = simulate(one_p_one_d(), const_costs(), [(0.0, 100, 5), (0.75, 100, 2)])
    assert ttft(a) == pytest.approx(P + T)
    assert ttft(b) == pytest.approx(0.05 + P + T)
    [alone] = simulate(one_p_one_d(), const_costs(), [(0.75, 100, 2)])  # an idle one at once
    assert ttft(alone) == pytest.approx(P + T)


def test_colocated_mixes_prefill_chunks_into_decode_steps():
    spec = ClusterSpec(num_colocated=1)
    [alone] = simulate(spec, const_costs(), [(0.0, 100, 3)])
    assert ttft(alone) == pytest.approx(P)  # no transfer
    assert tpot(alone) == pytest.approx(D1)
    # B arrives during A's first decode step; its prompt runs in A's next step, which then
    # costs prefill + decode - overlap.
    a, b = simulate(spec, const_costs(overlap=0.05), [(0.0, 100, 3), (P + 0.01, 100, 2)])
    mixed = P + D1 - 0.05
    assert a.token_times == pytest.approx([P, P + D1, P + D1 + mixed])
    assert b.token_times[0] == pytest.approx(P + D1 + mixed)


def test_metrics_match_bench_serving_definitions():
    reqs = simulate(one_p_one_d(), const_costs(), [(0.0, 100, 5), (3.0, 100, 1)])
    records = [RequestRecord(r.input_len, r.output_len, r.arrival, r.token_times, r.output_len)
               for r in reqs]
    slo = {"ttft": 800, "tpot": 50}  # A misses TPOT; B (one token, no TPOT) meets both
    m = metrics(reqs, slo)
    duration = reqs[1].token_times[-1]
    assert m == compute_metrics(records, duration, slo)
    assert m["num_good"] == 1 and m["goodput"] == pytest.approx(1 / duration)


# ---- the planner ----------------------------------------------------------------------------
def test_workload_draws_what_bench_serving_draws():
    args = plan.workload_args(serving.build_parser().parse_args(
        ["--input-len", "64", "--output-len", "16", "--range-ratio", "0.5", "--num-prompts", "20"]),
        max_model_len=2048)
    requests = plan.workload(args, rate=2.0)
    rng = np.random.default_rng(0)
    prompts = workload.random_dataset(rng, 20, 64, 16, 0.5, 49152)
    offsets = workload.arrival_offsets(rng, 20, 2.0, 1.0)
    assert requests == [(float(t), len(p.token_ids), p.output_len) for t, p in zip(offsets, prompts)]


def test_candidates_cover_every_split_and_colocated():
    specs = plan.candidates(3, [256, 512], [16, 64])
    assert list(specs) == ["1p2d", "2p1d", "colocated3"]
    assert all(len(v) == 4 for v in specs.values())


def test_plan_end_to_end_on_the_recorded_profile(capsys):
    flags = ["plan", "--profile", str(RECORDED), "--num-gpus", "2", "--input-len", "64",
             "--output-len", "16", "--num-prompts", "20", "--request-rate", "0.5,2",
             "--slo", "ttft=1500,tpot=150"]
    assert main(flags) == 0
    out, err = capsys.readouterr()
    assert out.count("recommended:") == 2 and "1p1d" in out and "colocated2" in out
    # progress on stderr, a line a split and rate, so a large --num-gpus shows it is moving
    assert [line.split(",")[:2] for line in err.splitlines()] == [
        [f"plan (rate {r}): {name} simulated", f" {i} of 2 splits"]
        for r in ("0.5", "2") for i, name in ((1, "1p1d"), (2, "colocated2"))]
    assert main(flags + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["request_rate"] for r in result["rates"]] == [0.5, 2.0]
    for rate in result["rates"]:
        assert [c["config"] for c in rate["configs"]] == ["1p1d", "colocated2"]
        assert rate["best"]["goodput"] == max(c["goodput"] for c in rate["configs"])
        assert all(0 <= c["slo_attainment"] <= 1 for c in rate["configs"])
    assert main(["plan", "--profile", "/nonexistent.json", "--request-rate", "1",
                 "--slo", "ttft=1"]) == 2


def test_plan_capacity_finds_each_splits_highest_rate_within_the_slos(capsys):
    """--capacity: per split, a rate whose best limits keep >= 90 % within the SLOs and one at
    most 2 % above it that does not (the bisection's bracket), and the split with the most wins."""
    flags = ["plan", "--profile", str(RECORDED), "--num-gpus", "2", "--input-len", "64",
             "--output-len", "16", "--num-prompts", "48", "--slo", "ttft=1500,tpot=150",
             "--chunk-sizes", "2048", "--max-running", "256"]
    assert main(flags + ["--capacity", "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert "plan (capacity): 1p1d simulated, 1 of 2 splits" in err
    assert "colocated2 simulated, 2 of 2 splits" in err
    assert [c["config"] for c in result["configs"]] == ["1p1d", "colocated2"]
    assert result["best"]["capacity_rps"] == max(c["capacity_rps"] for c in result["configs"])
    costs = CostModel.from_profile(json.loads(RECORDED.read_text()))
    wl = plan.workload_args(plan.argparse.Namespace(**dict.fromkeys(plan.DATASET_FLAGS) | {
        "input_len": 64, "output_len": 16, "num_prompts": 48}), None)
    slo = {"ttft": 1500.0, "tpot": 150.0}
    for c in result["configs"]:
        assert c["bound"] == "=", c
        spec = plan.candidates(2, [2048], [256])[c["config"]][0]
        at = plan.evaluate(spec, costs, plan.workload(wl, c["capacity_rps"]), slo)
        above = plan.evaluate(spec, costs, plan.workload(wl, c["fails_at_rps"]), slo)
        assert at["slo_attainment"] >= 0.9 > above["slo_attainment"], (c, at, above)
        assert c["capacity_rps"] < c["fails_at_rps"] <= 1.02 * c["capacity_rps"]
    assert main(flags + ["--capacity"]) == 0
    out = capsys.readouterr().out
    assert "SLO capacity" in out and "recommended:" in out and "per GPU" in out
    for bad in (["--capacity", "--request-rate", "1"], []):  # one of the two, not both or neither
        assert main(flags + bad) == 2
        assert "--request-rate" in capsys.readouterr().err


def test_recorded_profile_fits_its_measurements():
    profile = json.loads(RECORDED.read_text())
    costs = CostModel.from_profile(profile)
    d = profile["decode"]
    for batch, row in zip(d["batch_sizes"], d["time_s"]):
        for context, t in zip(d["context_lens"], row):
            assert costs.decode_step(batch, context) == pytest.approx(t)
    for p in profile["prefill"]["points"]:  # a least-squares fit: close, not exact
        assert costs.prefill_time(p["num_tokens"], p["attn_pairs"]) == pytest.approx(p["time_s"], rel=0.2)


def test_profile_command_writes_the_layout(tmp_path, default_model_dir, capsys):
    out = tmp_path / "p.json"
    assert main(["profile", "--output", str(out), "--device", "cpu", "--prefill-tokens", "8,16",
                 "--decode-batches", "1,2", "--decode-contexts", "8", "--repeats", "1",
                 "--mixed-points", "16:2:8,4:1:8"]) == 0
    profile = json.loads(out.read_text())
    assert profile["kind"] == "pd-serve-profile" and profile["device_type"] == "cpu"
    assert [p["prompt_lens"] for p in profile["prefill"]["points"]] == [[8], [2, 2, 2, 2], [16], [4, 4, 4, 4]]
    assert len(profile["decode"]["time_s"]) == 2 and len(profile["decode"]["time_s"][0]) == 1
    assert profile["kv"]["bytes_per_token"] == 30 * 2 * 3 * 64 * 4  # SmolLM2, float32
    assert [(m["prefill_tokens"], m["batch_size"], m["context_len"]) for m in profile["mixed"]["points"]] \
        == [(16, 2, 8), (4, 1, 8)]
    CostModel.from_profile(profile)
    for bad in ("16:2", "16:2:0", "a:b:c", ""):
        with pytest.raises(SystemExit):
            main(["profile", "--output", str(out), "--mixed-points", bad])
    # longer than the context (here cut to 64 tokens): a clear error before anything is timed
    short = ["profile", "--output", str(tmp_path / "q.json"), "--device", "cpu", "--context-length", "64",
             "--prefill-tokens", "8", "--decode-batches", "1", "--decode-contexts", "8", "--repeats", "1"]
    for flag, value in (("--prefill-tokens", "65"), ("--decode-contexts", "60"), ("--mixed-points", "8:1:60")):
        argv = short + [flag, value]
        assert main(argv) == 2
        assert f"{flag} " in capsys.readouterr().err and not (tmp_path / "q.json").exists()
    assert main(short) == 0


def test_busy_machine_warning(tmp_path, default_model_dir, monkeypatch, caplog):
    """Other processes on the cores are said, with how many cores they kept busy."""
    busy = profile_module.busy_cores(0.05)
    assert busy is None or 0 <= busy <= os.cpu_count()
    assert profile_module.busy_machine_warning(0.1) is None
    assert profile_module.busy_machine_warning(None) is None
    warning = profile_module.busy_machine_warning(1.5)
    assert "kept 1.50 of" in warning and f"{os.cpu_count()} cores" in warning
    monkeypatch.setattr(profile_module, "busy_cores", lambda seconds=1.0: 1.5)
    with caplog.at_level("WARNING", logger="pd_serve.planner.profile"):
        assert main(["profile", "--output", str(tmp_path / "p.json"), "--device", "cpu",
                     "--prefill-tokens", "8", "--decode-batches", "1", "--decode-contexts", "8",
                     "--repeats", "1", "--mixed-points", "8:1:8"]) == 0
    assert "kept 1.50 of" in caplog.text
    assert json.loads((tmp_path / "p.json").read_text())["busy_cores_at_start"] == 1.5


def test_profile_times_decode_back_to_back_under_the_overlap_schedule(tmp_path, monkeypatch,
                                                                      tiny_checkpoints):
    """Where the engine overlaps steps (GPU; forced here on CPU), a decode point is the time per
    step of steps run back to back, as a worker runs them; prefill steps stay whole, and every
    page is free at the end."""
    import argparse

    from pd_serve.engine.core import EngineCore
    from pd_serve.planner import profile as profile_mod

    monkeypatch.setenv("PD_SERVE_OVERLAP_CPU", "1")
    built, calls = [], []
    real_build, real_step = profile_mod._build_core, EngineCore.step

    def build(config):
        built.append(real_build(config))
        calls.clear()  # the warm-up's steps
        return built[-1]

    def step(self, on_layer=None):
        calls.append(self.overlap)
        return real_step(self, on_layer)

    monkeypatch.setattr(profile_mod, "_build_core", build)
    monkeypatch.setattr(EngineCore, "step", step)
    parser = argparse.ArgumentParser()
    from pd_serve.cli import add_engine_args
    add_engine_args(parser)
    profile_mod.add_profile_args(parser)
    args = parser.parse_args(["--model", str(tiny_checkpoints["llama3"]), "--device", "cpu",
                              "--output", str(tmp_path / "p.json"), "--prefill-tokens", "8",
                              "--prefill-mixes", "1", "--decode-batches", "2",
                              "--decode-contexts", "8", "--repeats", "2"])
    result = profile_mod.measure(args)
    core = built[0]
    assert core.overlap is False and core._launched is None
    assert core.allocator.num_used_pages == 0
    assert result["decode"]["time_s"][0][0] > 0
    # prefill: 2 whole steps; decode: 2 untimed + repeats + 2 timed, overlapped; mixed: none fit
    assert calls == [False, False] + [True] * 6, calls


def test_profile_sustains_prefill_steps(tmp_path, monkeypatch, tiny_checkpoints):
    """--sustain-s: a prefill point runs steps back to back for that long and is the mean of the
    last --repeats (a GPU's clocks fall under sustained load); without it, and for mixed points
    always, the least of --repeats. Every page is free at the end."""
    import argparse
    import time as time_mod

    from pd_serve.cli import add_engine_args
    from pd_serve.planner import profile as profile_mod

    built, steps = [], []
    real_build = profile_mod._build_core

    def build(config):
        built.append(real_build(config))
        return built[-1]

    def fake_step(self, expected_tokens):  # step k takes "k seconds", 10 ms of real time
        time_mod.sleep(0.01)
        steps.append(expected_tokens)
        return float(len(steps))

    monkeypatch.setattr(profile_mod, "_build_core", build)
    monkeypatch.setattr(profile_mod._Timer, "_step", fake_step)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    profile_mod.add_profile_args(parser)
    base = ["--model", str(tiny_checkpoints["llama3"]), "--device", "cpu",
            "--output", str(tmp_path / "p.json"), "--prefill-tokens", "8", "--prefill-mixes", "1",
            "--decode-batches", "1", "--decode-contexts", "8", "--mixed-points", "8:1:8", "--repeats", "2"]
    result = profile_mod.measure(parser.parse_args(base + ["--sustain-s", "0.2"]))
    # steps in order: prefill (8 tokens), decode (1 token: 1 untimed + 2, no sustain), mixed (9)
    num_prefill, num_decode, num_mixed = steps.count(8), steps.count(1), steps.count(9)
    assert steps == [8] * num_prefill + [1] * num_decode + [9] * num_mixed and num_decode == 3
    assert num_prefill >= 10 and num_mixed == 2 and result["sustain_s"] == 0.2  # >= 0.2 s of 10 ms
    assert result["prefill"]["points"][0]["time_s"] == num_prefill - 0.5  # mean of the last 2
    assert result["mixed"]["points"][0]["time_s"] == len(steps) - 1  # the least: the first
    assert built[-1].allocator.num_used_pages == 0
    steps.clear()
    result = profile_mod.measure(parser.parse_args(base))  # CPU default: no sustain, the least
    assert result["sustain_s"] == 0.0 and result["prefill"]["points"][0]["time_s"] == 1.0


# ---- the overlap schedule (a GPU profile's host and device times) ------------------------------
def pipelined_costs(host=0.3, device=0.05, decode=(D1, D2)) -> CostModel:
    """A step with prompt tokens takes `host` to launch and `device` on the device (whole step:
    their max); a decode-only step is its period."""
    whole = const_costs(prefill=max(host, device), decode=decode)
    return dataclasses.replace(whole, pipeline=Pipeline(const_costs(prefill=device, decode=decode),
                                                        (1.0,), (host,)))


def test_profile_with_host_and_device_times_gets_a_pipeline():
    """A point's device time is its whole-step time where the device is the slower part (a
    lone or sustained step is then the device's), else its device_s."""
    profile = {"prefill": {"points": [
        {"num_tokens": 16, "attn_pairs": 256, "time_s": 0.015, "host_s": 0.014, "device_s": 0.004},
        {"num_tokens": 2048, "attn_pairs": 2048 ** 2, "time_s": 0.053, "host_s": 0.016,
         "device_s": 0.048}]},
        "decode": {"batch_sizes": [1, 8], "context_lens": [256], "time_s": [[0.005], [0.006]]},
        "kv": {"bytes_per_token": 0}, "transfer": {"gbps": 100.0, "latency_s": 0.0}}
    costs = CostModel.from_profile(profile)
    device = costs.pipeline.device
    assert device.prefill_time(16) == pytest.approx(0.004)
    assert device.prefill_time(2048) == pytest.approx(0.053)
    assert costs.prefill_time(16) == pytest.approx(0.015)  # whole steps stay whole
    assert costs.pipeline.host_time(16) == pytest.approx(0.014)
    assert costs.pipeline.host_time(1032) == pytest.approx(0.015)
    assert costs.pipelined_step(0, 0, 8, 256) == (0.0, pytest.approx(0.006))
    assert costs.pipelined_step(16, 256, 8, 256) == (pytest.approx(costs.pipeline.host_time(24)),
                                                     pytest.approx(device.step_time(16, 256, 8, 256)))
    for p in profile["prefill"]["points"]:
        del p["device_s"]
    assert CostModel.from_profile(profile).pipeline is None  # CPU profiles: whole steps
    assert CostModel.from_profile(json.loads(RECORDED.read_text(encoding="utf-8"))).pipeline is None


def test_overlap_schedule_hides_a_launch_behind_the_step_before():
    """Colocated, pipelined: a lone prompt costs max(host, device); a step's tokens reach the
    client once the host has launched the next step; that launch runs while the step before is
    on the device, and hides behind it when the device is the slower part."""
    spec = ClusterSpec(num_colocated=1)
    H, Dv = 0.3, 0.05
    [alone] = simulate(spec, pipelined_costs(H, Dv), [(0.0, 100, 1)])
    assert ttft(alone) == pytest.approx(H)  # launch (0.3) then nothing to wait for but it
    a, b = simulate(spec, pipelined_costs(H, Dv), [(0.0, 100, 1), (0.1, 100, 1)])
    # A is launched by 0.3; B's launch follows (host until 0.6), and only then does the host
    # wait for A: both tokens reach the client at 0.6, as the engine's step() reports them.
    assert a.token_times[0] == b.token_times[0] == pytest.approx(2 * H)
    # With a device-bound step before it, the launch hides: A's prompt 1.0 s on the device.
    a, b = simulate(spec, pipelined_costs(0.3, 1.0), [(0.0, 100, 1), (0.1, 100, 1)])
    assert a.token_times[0] == pytest.approx(1.0)
    assert b.token_times[0] == pytest.approx(2.0)


def test_overlap_schedule_decodes_at_their_period_and_ends_every_request():
    spec = ClusterSpec(num_colocated=1)
    requests = simulate(spec, pipelined_costs(0.3, 0.05), [(0.0, 100, 4), (0.0, 100, 4), (1.0, 50, 3)])
    a, b, c = requests
    assert len(a.token_times) == len(b.token_times) == 4 and len(c.token_times) == 3
    assert tpot(a) == pytest.approx(D2)  # A and B decode together, one step per period
    assert all(t2 > t1 for r in requests for t1, t2 in zip(r.token_times, r.token_times[1:]))
    # the same workload with whole steps of the same lone cost gives the same tokens per request
    whole = simulate(spec, const_costs(prefill=0.3), [(0.0, 100, 4), (0.0, 100, 4), (1.0, 50, 3)])
    assert [len(r.token_times) for r in whole] == [4, 4, 3]


def test_plan_on_one_gpu_searches_colocated_limits(capsys):
    flags = ["plan", "--profile", str(RECORDED), "--num-gpus", "1", "--input-len", "64",
             "--output-len", "16", "--num-prompts", "16", "--request-rate", "1", "--slo",
             "ttft=1500,tpot=150", "--json"]
    assert main(flags) == 0
    [rate] = json.loads(capsys.readouterr().out)["rates"]
    assert [c["config"] for c in rate["configs"]] == ["colocated1"]
    assert main(flags[:4] + ["0"] + flags[5:]) == 2
    assert "--num-gpus must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("flags,names", [
    (["--slo", "ttft=500,tpot=0"], "--slo: bad SLO value in 'tpot=0': must be > 0"),
    (["--slo", "ttft=-5"], "must be > 0"),
    (["--slo", "ttft=nan"], "must be > 0 and finite"),
    (["--transfer-gbps", "0"], "--transfer-gbps 0.0 must be > 0"),
    (["--transfer-gbps", "-1"], "--transfer-gbps -1.0 must be > 0"),
    (["--dataset", "shared-prefix", "--num-prefixes", "0"], "--num-prefixes must be >= 1"),
    (["--input-len", "100000"], "exceed the profile's context length"),
    (["--profile", "pyproject.toml"], "--profile pyproject.toml: not JSON"),
])
def test_plan_refuses_nonsense_in_one_line(capsys, flags, names):
    """A red-team pass: ZeroDivisionError / IndexError tracebacks (an SLO or link rate of 0, no
    prefixes), and NaN SLOs, negative rates or prompts past the context planned without a word."""
    base = {"--profile": str(RECORDED), "--request-rate": "1", "--slo": "ttft=500,tpot=50",
            "--num-prompts": "4"}
    base.update(dict(zip(flags[::2], flags[1::2])))
    assert main(["plan", *[x for kv in base.items() for x in kv]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err) and names in err[-1], err


@pytest.mark.parametrize("rate", ["nan", "-1"])
def test_plan_refuses_a_rate_that_is_no_rate(rate):
    with pytest.raises(SystemExit):  # (argparse's one line: the rates' type)
        main(["plan", "--profile", str(RECORDED), "--request-rate", rate, "--slo", "ttft=1"])


@pytest.mark.parametrize("flags,names", [
    (["--threads", "-1"], "--threads >= 1"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--output", "/proc/nope/p.json"], "--output /proc/nope/p.json: cannot be written"),
    (["--output", "/tmp"], "--output /tmp: cannot be written"),  # a folder
])
def test_profile_refuses_bad_flags_before_measuring(capsys, tmp_path, flags, names):
    """--threads -1 was a RuntimeError traceback, --repeats 0 meant the default, and an output
    path that cannot be written failed only after the measurements."""
    given = dict(zip(flags[::2], flags[1::2]))
    argv = ["profile", "--output", given.pop("--output", str(tmp_path / "p.json")), "--device",
            "cpu", "--prefill-tokens", "8", "--decode-batches", "1", "--decode-contexts", "8",
            *[x for kv in given.items() for x in kv]]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err) and names in err[-1], err
    assert not (tmp_path / "p.json").exists()
