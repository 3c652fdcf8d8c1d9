"""FP8 experts on the CPU: an FP8 checkpoint's per-expert weights and per-channel scales, and
--quantization fp8 at load, generate what the dense model of the dequantized weights does."""

from __future__ import annotations

import pytest
import torch

from kernels import fused_moe
from pd_serve import Engine, SamplingParams
from pd_serve.model.fp8 import dequantize_weight, quantize_experts
from pd_serve.model.layers import Linear
from pd_serve.model.loader import load_model
from pd_serve.model.moe import Experts
from pd_serve.model.quant import Fp8Linear
from quant_checkpoints import write_dequantized_checkpoint, write_fp8_checkpoint

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 17, 33)]


def _generate(model_dir, prompts, **options) -> list[list[int]]:
    engine = Engine(model_dir, device="cpu", max_total_tokens=512, **options)
    return [o.token_ids for o in engine.generate(prompts, PARAMS)]


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_expert_checkpoint_equals_its_dequantized_model(tiny_moe_checkpoints, tmp_path,
                                                           monkeypatch, kind, backend):
    """The experts stored FP8 with per-channel scales (the rest dense): the fused kernel
    (Triton's interpreter) and the reference both generate the dequantized model's tokens."""
    monkeypatch.setenv("PD_SERVE_TRITON_CPU", "1" if backend == "triton" else "0")
    fp8_dir = write_fp8_checkpoint(tiny_moe_checkpoints[kind], tmp_path / "fp8", experts_only=True)
    dense_dir = write_dequantized_checkpoint(fp8_dir, tmp_path / "dense")
    model = load_model(fp8_dir, torch.float32, "cpu")
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert experts and all(e.gate_up_proj.dtype == torch.float8_e4m3fn for e in experts)
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())
    dense = load_model(dense_dir, torch.float32, "cpu")
    for name, scale in model.state_dict().items():  # the scales hold what the checkpoint says
        if name.endswith("_scale"):
            weight = model.state_dict()[name.removesuffix("_scale")]
            want = dense.state_dict()[name.removesuffix("_scale")]
            got = torch.stack([dequantize_weight(weight[e], scale[e]) for e in range(len(weight))])
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    prompts = _prompts(1)
    launches = fused_moe.triton_launches
    assert (_generate(fp8_dir, prompts, moe_runner_backend=backend)
            == _generate(dense_dir, prompts, moe_runner_backend=backend))
    assert (fused_moe.triton_launches > launches) == (backend == "triton")


def test_quantization_fp8_at_load_reaches_the_experts(tiny_moe_checkpoints):
    """--quantization fp8 on an MoE checkpoint: FP8 attention and shared-expert layers, FP8
    experts (per-channel, as quantize_experts), a dense router; it generates."""
    src = tiny_moe_checkpoints["qwen2_moe"]
    full = load_model(src, torch.float32, "cpu")
    model = load_model(src, torch.float32, "cpu", quantization="fp8")
    block, whole = model.model.layers[0].mlp, full.model.layers[0].mlp
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    assert isinstance(block.shared_expert.gate_up_proj, Fp8Linear)
    assert isinstance(model.model.layers[2].mlp.down_proj, Fp8Linear)  # the dense layer
    assert type(block.gate) is Linear and block.gate.weight.dtype == torch.float32
    weight, scale = quantize_experts(whole.experts.down_proj)
    assert torch.equal(block.experts.down_proj.view(torch.uint8), weight.view(torch.uint8))
    assert torch.equal(block.experts.down_proj_scale, scale)
    tokens = _generate(src, _prompts(2), quantization="fp8")
    assert all(len(t) == PARAMS.max_tokens for t in tokens)


def test_fp8_expert_checkpoint_errors(tiny_moe_checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    fp8_dir = write_fp8_checkpoint(tiny_moe_checkpoints["qwen3_moe"], tmp_path / "fp8",
                                   experts_only=True)
    tensors = load_file(fp8_dir / "model.safetensors")
    name = next(n for n in tensors if n.endswith("experts.3.up_proj.weight"))
    tensors[name] = tensors[name].float()  # one expert's weight left dense
    save_file(tensors, fp8_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"experts\.3\.up_proj\.weight.*FP8"):
        load_model(fp8_dir, torch.float32, "cpu")


def test_fp8_experts_under_expert_parallelism(tiny_moe_checkpoints, tmp_path):
    """EP 2 over replicated attention slices the FP8 experts with their scales: EP 1's tokens."""
    fp8_dir = write_fp8_checkpoint(tiny_moe_checkpoints["qwen3_moe"], tmp_path / "fp8",
                                   experts_only=True)
    prompts = _prompts(3)
    engine = Engine(fp8_dir, device="cpu", max_total_tokens=512, ep_size=2)
    try:
        got = [o.token_ids for o in engine.generate(prompts, PARAMS)]
    finally:
        engine.close()
    assert got == _generate(fp8_dir, prompts)
