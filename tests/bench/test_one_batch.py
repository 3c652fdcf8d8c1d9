"""bench/one_batch.py: the FLOP and byte accounting, and a tiny-preset run on CPU end to end
(engine and transformers) whose JSON has every case with sane numbers."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # bench/ (a checkout need not install it)

from bench.one_batch import PRESETS, _pairs, fill_defaults, main, parse_args  # noqa: E402
from bench.one_batch_report import attention_flops, decode_figures, param_counts  # noqa: E402
from pd_serve.model.config import ModelConfig  # noqa: E402
from pd_serve.model.llama import CausalLM  # noqa: E402


def test_llama3_8b_accounting():
    cfg = ModelConfig.from_dict(PRESETS["llama3-8b"])
    with torch.device("meta"):
        counts = param_counts(CausalLM(cfg))
    assert counts["all"] == 8_030_261_248  # Llama-3.1-8B
    per_layer = 4096 * (6144 + 4096) + 3 * 4096 * 14336  # qkv, o, gate_up, down
    assert counts["decoder_linear"] == 32 * per_layer
    assert counts["lm_head"] == counts["embedding"] == 128256 * 4096
    norms = (2 * 32 + 1) * 4096
    assert counts["all"] == counts["decoder_linear"] + counts["lm_head"] + counts["embedding"] + norms
    # DESIGN.md's bs1 floor: 16.1 GB of bf16 weights over a 4.17 TB/s copy rate = 3.85 ms
    row = decode_figures({"seconds": 2 * 3.85e-3, "mean_context": 1024}, 1, 2,
                         counts["all"] * 2, 0, 4172e9)
    assert row["floor_ms"] == pytest.approx(3.85, abs=0.01)
    assert row["ratio_to_floor"] == pytest.approx(1.0, abs=0.01)
    with torch.device("meta"):
        tied = param_counts(CausalLM(ModelConfig.from_dict(PRESETS["llama3-1b"])))
    assert tied["all"] == 1_235_814_400 and tied["tied"]  # Llama-3.2-1B: the head counted once


def test_attention_flops_and_grid_parsing():
    cfg = ModelConfig.from_dict(PRESETS["tiny"])
    # 3 tokens: 6 causal (query, key) pairs, 4 FLOPs per pair per head_dim per head per layer
    assert attention_flops(cfg, [3]) == 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 6
    assert attention_flops(cfg, [3, 3]) == 2 * attention_flops(cfg, [3])
    assert _pairs("1x512, 4X2048") == [(1, 512), (4, 2048)]
    for bad in ("", "4", "1x0", "ax2", "1x2x3"):
        with pytest.raises(argparse.ArgumentTypeError):
            _pairs(bad)


def test_default_grids():
    args = parse_args([])
    fill_defaults(args, torch.device("cuda"))
    assert args.batch_sizes == [1, 8, 32, 64, 128, 256] and args.contexts == [1024, 4096]
    assert args.prefill_grid == [(1, 512), (1, 2048), (4, 2048), (1, 8192)]
    assert args.hf_context == 1024 and args.hf_batch_sizes == [1, 64] and args.hf_prefill == [(4, 2048)]
    args = parse_args(["--contexts", "512"])
    fill_defaults(args, torch.device("cpu"))
    assert args.contexts == [512] and args.hf_context == 512 and args.batch_sizes == [1, 8, 32]


def test_tiny_run_on_cpu(tmp_path, capsys):
    out = tmp_path / "one-batch.json"
    # KV budget 1 MB = 976 tokens of the tiny preset (1 KiB each in float32): bs4 x 512 cannot fit.
    rc = main(["--preset", "tiny", "--device", "cpu", "--attention-backend", "torch",
               "--batch-sizes", "1,4", "--contexts", "32,512", "--prefill-grid", "1x32,2x64",
               "--prefill-repeats", "2", "--decode-steps", "3", "--decode-warmup", "1",
               "--hf", "--hf-batch-sizes", "1,4", "--hf-prefill", "2x64",
               "--kv-budget-gb", "0.001", "--output", str(out)])
    assert rc == 0
    record = json.loads(out.read_text())
    assert record["errors"] == [] and record["complete"]
    assert record["preset"] == "tiny" and record["dtype"] == "float32"
    assert record["versions"]["torch"] == torch.__version__ and "flashinfer" in record["versions"]
    assert isinstance(record["git_commit"], str) and record["git_commit"]
    assert record["engine"]["attention_backend"] == "torch" and not record["engine"]["cuda_graphs"]
    ceilings = record["ceilings"]
    assert ceilings["copy"]["median_gbps"] > 0 and ceilings["matmul"]["median_tflops"] > 0
    assert record["weight_bytes"] == record["params"]["all"] * 4

    prefill = {(r["batch"], r["length"]): r for r in record["prefill"]}
    assert sorted(prefill) == [(1, 32), (2, 64)]
    for (b, n), r in prefill.items():
        assert r["tokens"] == b * n and len(r["samples"]) == 2
        assert r["seconds"] > 0 and r["tokens_per_s"] == pytest.approx(b * n / r["seconds"])
        assert r["flops_all_params"] > r["flops_linear"] > 0 and r["flops_attention"] > 0
        assert r["ratio_to_floor"] == pytest.approx(r["seconds"] / r["floor_s"])
        assert r["fraction_of_matmul_linear"] == pytest.approx(1 / r["ratio_to_floor"])

    decode = {(r["batch"], r["context"]): r for r in record["decode"]}
    assert sorted(decode) == [(1, 32), (1, 512), (4, 32), (4, 512)]
    assert "needs" in decode[4, 512]["skipped"] and "ms_per_step" not in decode[4, 512]
    for key in [(1, 32), (1, 512), (4, 32)]:
        r = decode[key]
        assert r["steps"] == 3 and r["ms_per_step"] > 0 and r["floor_ms"] > 0 and r["ratio_to_floor"] > 0
        assert r["tokens_per_s"] == pytest.approx(key[0] * 1e3 / r["ms_per_step"])
        assert key[1] + 1 <= r["mean_context"] <= key[1] + 12
        assert r["kv_bytes"] == pytest.approx(key[0] * r["mean_context"] * record["kv_bytes_per_token"])

    hf = record["transformers"]
    assert hf["version"] and [(r["batch"], r["context"]) for r in hf["decode"]] == [(1, 32), (4, 32)]
    for r in hf["decode"] + hf["prefill"]:
        assert r["ours_over_hf"] > 0 and "error" not in r
    assert decode[1, 32]["ours_over_hf"] == hf["decode"][0]["ours_over_hf"]
    assert prefill[2, 64]["ours_over_hf"] == hf["prefill"][0]["ours_over_hf"]

    table = capsys.readouterr().out
    assert "decode" in table and "bs4 ctx512" in table and "ours/HF" in table


def test_direct_fill_decodes_at_the_exact_context(tmp_path):
    """--decode-fill direct admits rows as a decode worker does: no prefill steps, and the timed
    steps read exactly context + 1 + warm-up + (step - 1) tokens per row."""
    out = tmp_path / "direct.json"
    assert main(["--preset", "tiny", "--device", "cpu", "--no-hf", "--batch-sizes", "1,3",
                 "--contexts", "40", "--prefill-grid", "1x16", "--decode-steps", "4",
                 "--decode-warmup", "2", "--decode-fill", "direct", "--output", str(out)]) == 0
    record = json.loads(out.read_text())
    for row in record["decode"]:
        assert row["fill_steps"] == 0 and row["ms_per_step"] > 0
        assert row["mean_context"] == 40 + 1 + 2 + (4 - 1) / 2


def test_qwen3_30b_a3b_accounting():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B a token uses; a decode step's floor reads the
    non-expert weights and the experts its batch is expected to reach."""
    from bench.one_batch_report import Bench, expected_experts_hit

    cfg = ModelConfig.from_dict(PRESETS["qwen3-30b-a3b"])
    with torch.device("meta"):
        counts = param_counts(CausalLM(cfg))
    experts = 48 * 128 * 3 * 2048 * 768
    assert counts["all"] == 30_532_122_624 and counts["experts"] == experts
    assert counts["active"] == counts["all"] - experts + experts // 16  # top 8 of 128
    attention = 2048 * (4096 + 2 * 512) + 4096 * 2048
    assert counts["decoder_linear"] == 48 * (attention + 2048 * 128 + 8 * 3 * 2048 * 768)
    assert expected_experts_hit(128, 8, 1) == pytest.approx(8)
    assert expected_experts_hit(128, 8, 64) == pytest.approx(125.94, abs=0.01)
    bench = Bench(None, torch.device("cpu"), torch.bfloat16, cfg, None, {}, counts=counts,
                  stored_bytes=2 * counts["all"], expert_bytes=2 * experts)
    weight_bytes, hit = bench.step_weight_bytes(1)
    assert hit == pytest.approx(8) and weight_bytes == pytest.approx(2 * counts["active"])
    weight_bytes, hit = bench.step_weight_bytes(64)
    assert weight_bytes == pytest.approx(2 * (counts["all"] - experts * (1 - hit / 128)))
    dense = Bench(None, torch.device("cpu"), torch.bfloat16, ModelConfig.from_dict(PRESETS["tiny"]),
                  None, {}, stored_bytes=1000)
    assert dense.step_weight_bytes(64) == (1000, None)


@pytest.mark.parametrize("tied", [False, True])
def test_transformers_runs_on_our_very_tensors(tied):
    """The baseline model shares our weights (no second copy of a 61 GB model)."""
    from bench.one_batch_hf import shared_hf_model
    from pd_serve.model.loader import dummy_model

    preset = dict(PRESETS["tiny-moe"], tie_word_embeddings=tied)
    ours = dummy_model(ModelConfig.from_dict(preset), torch.float32, "cpu")
    hf = shared_hf_model(ours, preset)
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    theirs = hf.model.layers[1].mlp.experts.down_proj
    assert theirs.data_ptr() == ours.model.layers[1].mlp.experts.down_proj.data_ptr()
    head = ours.model.embed_tokens.weight if tied else ours.lm_head.weight
    assert hf.lm_head.weight.data_ptr() == head.data_ptr()
    q = hf.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(q, ours.model.layers[0].self_attn.qkv_proj.weight[:q.shape[0]])
    assert hf.model.rotary_emb.inv_freq.dtype == torch.float32
    with torch.no_grad():
        assert torch.isfinite(hf(input_ids=torch.tensor([[5, 6, 7]])).logits).all()


def test_tiny_moe_run_on_cpu(tmp_path):
    """The MoE preset end to end on CPU (engine and transformers): the decode floor counts the
    experts a batch reaches, the prefill FLOPs the experts a token uses."""
    out = tmp_path / "moe.json"
    assert main(["--preset", "tiny-moe", "--device", "cpu", "--attention-backend", "torch",
                 "--batch-sizes", "1,4", "--contexts", "32", "--prefill-grid", "2x64",
                 "--prefill-repeats", "1", "--decode-steps", "2", "--decode-warmup", "1",
                 "--hf", "--hf-batch-sizes", "4", "--hf-prefill", "2x64",
                 "--output", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["errors"] == [] and record["complete"]
    params = record["params"]
    assert record["expert_bytes"] == params["experts"] * 4 and params["active"] < params["all"]
    other = record["weight_bytes"] - record["expert_bytes"]
    decode = {r["batch"]: r for r in record["decode"]}
    assert decode[1]["experts_hit_per_layer"] == pytest.approx(2)  # top 2 of 8
    assert decode[1]["weight_bytes"] == pytest.approx(other + record["expert_bytes"] / 4)
    assert 2 < decode[4]["experts_hit_per_layer"] < 8
    prefill = record["prefill"][0]
    assert prefill["flops_all_params"] == 2 * params["active"] * 128
    hf = record["transformers"]
    assert [r["ours_over_hf"] > 0 for r in hf["decode"] + hf["prefill"]] == [True, True]
