"""MoE models on the CPU: config.json's MoE fields, routing as transformers routes (ties too),
checkpoints with per-expert or fused expert tensors, and what MoE models refuse."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kernels.fused_moe import select_experts
from pd_serve.model.config import ModelConfig
from pd_serve.model.loader import load_model
from pd_serve.model.moe import SparseMoeBlock
from pd_serve.model.parallel import shard_config


def _config(model_dir) -> ModelConfig:
    return ModelConfig.from_dir(model_dir)


def test_config_reads_the_moe_fields(tiny_moe_checkpoints):
    mixtral = _config(tiny_moe_checkpoints["mixtral"])
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (8, 2, 48)
    assert mixtral.norm_topk_prob and all(mixtral.is_moe_layer(i) for i in range(2))
    qwen2 = _config(tiny_moe_checkpoints["qwen2_moe"])
    assert qwen2.qkv_bias and qwen2.shared_expert_intermediate_size == 48
    assert [qwen2.is_moe_layer(i) for i in range(3)] == [True, True, False]  # mlp_only_layers [2]
    qwen3 = _config(tiny_moe_checkpoints["qwen3_moe"])
    assert qwen3.qk_norm and qwen3.norm_topk_prob and qwen3.num_experts == 8
    assert [qwen3.is_moe_layer(i) for i in range(4)] == [False, True, False, True]  # step 2
    model = load_model(tiny_moe_checkpoints["qwen2_moe"], torch.float32, "cpu")
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["SparseMoeBlock", "SparseMoeBlock", "MLP"]


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_routing_equals_transformers_ties_included(norm_topk_prob):
    """Router rows repeated, so several experts score exactly alike for every token."""
    config = transformers.Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3,
                                         norm_topk_prob=norm_topk_prob)
    router = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(config)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 16, generator=gen)
    with torch.no_grad():
        router.weight.copy_(rows[torch.tensor([0, 1, 0, 2, 1, 0, 2, 2])])
    x = torch.randn(40, 16, generator=gen)
    x[:5] = 0.0  # all eight experts tie
    _, ref_weights, ref_ids = router(x)
    weights, ids = select_experts(x @ router.weight.detach().T, 3, norm_topk_prob)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights.float(), rtol=0, atol=0)


def _fused_copy(src, dst):
    """The checkpoint with each layer's experts stacked as transformers 5 holds them."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    cfg = _config(src)
    for i in range(cfg.num_layers):
        prefix = f"model.layers.{i}.block_sparse_moe.experts"
        gate_up = [torch.cat([tensors.pop(f"{prefix}.{e}.w1.weight"), tensors.pop(f"{prefix}.{e}.w3.weight")])
                   for e in range(cfg.num_experts)]
        down = [tensors.pop(f"{prefix}.{e}.w2.weight") for e in range(cfg.num_experts)]
        tensors[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack(down)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_fused_expert_tensors_load_as_per_expert_ones(tiny_moe_checkpoints, tmp_path):
    src = tiny_moe_checkpoints["mixtral"]
    per_expert = load_model(src, torch.float32, "cpu").state_dict()
    fused = load_model(_fused_copy(src, tmp_path / "fused"), torch.float32, "cpu").state_dict()
    assert per_expert.keys() == fused.keys()
    for name, tensor in per_expert.items():
        assert torch.equal(tensor, fused[name]), name


def test_moe_checkpoint_errors_name_the_tensor(tiny_moe_checkpoints, tmp_path):
    src = tiny_moe_checkpoints["qwen3_moe"]
    dst = shutil.copytree(src, tmp_path / "fewer_experts")
    raw = json.loads((dst / "config.json").read_text())
    raw["num_experts"] = raw.pop("num_local_experts", raw.get("num_experts")) - 1
    (dst / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"experts\.7\.\w+\.weight.*expert 7 of 7"):
        load_model(dst, torch.float32, "cpu")
    with pytest.raises(ValueError, match="mixture of experts"):
        shard_config(_config(src), 2)


def test_dummy_moe_model_is_deterministic(tiny_moe_checkpoints):
    a = load_model(tiny_moe_checkpoints["qwen2_moe"], torch.float32, "cpu", load_format="dummy")
    b = load_model(tiny_moe_checkpoints["qwen2_moe"], torch.float32, "cpu", load_format="dummy")
    block = a.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock) and block.experts.gate_up_proj.std() > 0.01
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_moe_runner_backend_flag_and_resolution():
    from pd_serve.cli import build_parser
    from pd_serve.config import engine_config_from_args
    from pd_serve.model.moe import resolve_moe_backend

    args = build_parser().parse_args(["chat", "hi", "--moe-runner-backend", "triton"])
    assert engine_config_from_args(args).moe_runner_backend == "triton"
    assert resolve_moe_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_moe_backend("auto", torch.device("cuda", 0)) == "triton"
    with pytest.raises(ValueError, match="moe-runner-backend"):
        resolve_moe_backend("cutlass", torch.device("cpu"))


def test_triton_moe_backend_generates_the_torch_backends_tokens(tiny_moe_checkpoints, monkeypatch):
    """The fused kernel in Triton's interpreter through the whole engine (prefill and decode)."""
    from kernels import fused_moe
    from pd_serve import Engine, SamplingParams

    model_dir = tiny_moe_checkpoints["qwen3_moe"]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (4, 19)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("PD_SERVE_TRITON_CPU", "1" if backend == "triton" else "0")
        launches = fused_moe.triton_launches
        engine = Engine(model_dir, device="cpu", max_total_tokens=512, moe_runner_backend=backend)
        outs[backend] = [o.token_ids for o in engine.generate(prompts, params)]
        assert (fused_moe.triton_launches > launches) == (backend == "triton")
    assert outs["triton"] == outs["torch"]


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_batch1_kernels_keep_the_torch_backends_tokens(tiny_moe_checkpoints, monkeypatch, kind):
    """--enable-batch1-kernels on Qwen3-MoE and Qwen2-MoE (a shared expert), in Triton's
    interpreter: one-token steps run the post-attention norm, router and routing as one launch
    (kernels/moe_routing.py's route_one_row), the experts on kernels/moe_batch1.py, and Qwen3's
    q/k norms inside the RoPE + KV store kernel (Triton attention backend); in float32 the
    greedy tokens stay the torch backends'."""
    from kernels import gemv, kv_store, moe_batch1, moe_routing
    from pd_serve import Engine, SamplingParams

    model_dir = tiny_moe_checkpoints[kind]
    prompt = [torch.randint(3, 49152, (11,), generator=torch.Generator().manual_seed(5)).tolist()]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    want = Engine(model_dir, device="cpu", max_total_tokens=512, moe_runner_backend="torch",
                  attention_backend="torch").generate(prompt, params)[0].token_ids
    monkeypatch.setenv("PD_SERVE_TRITON_CPU", "1")
    # 64 rows a GEMV program, not 2: the interpreter runs programs one at a time (as in
    # tests/unit/test_graph_runner.py)
    block_config = gemv._block_config
    monkeypatch.setattr(gemv, "_block_config", lambda n, k, fp8: (64, *block_config(n, k, fp8)[1:]))
    engine = Engine(model_dir, device="cpu", max_total_tokens=512, moe_runner_backend="triton",
                    attention_backend="triton", enable_batch1_kernels=True)
    experts, stores = moe_batch1.triton_launches, kv_store.triton_launches
    monkeypatch.setattr(moe_routing, "_counters", {})  # route_one_row makes its counter anew
    got = engine.generate(prompt, params)[0].token_ids
    config = engine.model.config
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    assert moe_layers == 2
    assert moe_batch1.triton_launches - experts == 2 * moe_layers * (params.max_tokens - 1)
    assert list(moe_routing._counters) == [torch.device("cpu")]  # route_one_row ran
    assert kv_store.triton_launches - stores == config.num_layers * params.max_tokens
    assert got == want
