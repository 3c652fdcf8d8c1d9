"""`pd-serve profile` on a GPU, where the engine runs the overlap schedule: prefill and mixed
points get the host's launch time and the device's time apart (skipped without CUDA)."""

from __future__ import annotations

import argparse

import pytest
import torch

from pd_serve.cli import add_engine_args
from pd_serve.planner import profile as profile_mod
from pd_serve.planner.costs import CostModel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_profile_splits_host_and_device_time(tmp_path, tiny_checkpoints):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    profile_mod.add_profile_args(parser)
    result = profile_mod.measure(parser.parse_args([
        "--model", str(tiny_checkpoints["llama3"]), "--device", "cuda",
        "--output", str(tmp_path / "p.json"), "--prefill-tokens", "16,64", "--prefill-mixes", "1",
        "--decode-batches", "1,2", "--decode-contexts", "16", "--mixed-points", "16:2:16",
        "--repeats", "2", "--sustain-s", "0"]))
    points = result["prefill"]["points"] + result["mixed"]["points"]
    for p in points:
        # the spin (0.2 s) is outside both; a tiny model's step is a few ms either way
        assert 0 < p["host_s"] < 0.1 and 0 < p["device_s"] < 0.1, p
    costs = CostModel.from_profile(result)
    assert costs.pipeline is not None
    host, device = costs.pipelined_step(16, 256, 2, 16)
    assert host > 0 and device > 0
