"""Block-wise FP8 checkpoints (quant_method fp8 with weight_block_size, DeepSeek-V3 / Qwen3-FP8
layout: float8_e4m3fn weight + float32 weight_scale_inv per [bn, bk] block), written by the test
from a tiny random checkpoint: the model scores a text as the dense model of its dequantized
weights does when each linear layer's input is rounded to FP8 per token and bk-column group
first (forward pre-hooks). On the CPU the layers run kernels/fp8_block_gemm.py's torch
reference from their dequantized weight."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels import fp8_block_gemm as bg
from pd_serve.config import CacheConfig, EngineConfig
from pd_serve.engine.core import EngineCore
from pd_serve.eval import score_tokens
from pd_serve.model.fp8 import Fp8Config
from pd_serve.model.quant import Fp8BlockLinear

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


def write_block_fp8(src: Path, dst: Path, block: list[int]) -> tuple[Path, Path]:
    """(the block-wise FP8 checkpoint of src, the float32 checkpoint of its dequantized weights)."""
    tensors = {}
    for path in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(path))
    quantized, dense = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.startswith("model.layers.") and n.endswith(".weight")
                 and n.split(".")[-2] in LINEARS]:
        weight, scale_inv = bg.quantize_blocks(tensors[name], tuple(block))
        quantized[name] = weight
        quantized[name.removesuffix("weight") + "weight_scale_inv"] = scale_inv
        dense[name] = bg.dequantize_blocks(weight, scale_inv, tuple(block))
    config = json.loads((src / "config.json").read_text())
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": block}
    for out, ts, qc in ((dst / "fp8", quantized, quant), (dst / "dense", dense, None)):
        out.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in ts.items()}, out / "model.safetensors")
        (out / "config.json").write_text(json.dumps({**config, **({"quantization_config": qc}
                                                                   if qc else {})}))
        for f in src.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "generation")):
                shutil.copy(f, out / f.name)
    return dst / "fp8", dst / "dense"


def _core(model_dir) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model_dir), device="cpu",
                                   cache=CacheConfig(max_total_tokens=4096)))


def _round_per_group(group: int):
    def hook(module, args):
        q, scale = bg.quantize_per_group(args[0].reshape(-1, args[0].shape[-1]), group)
        x = q.float() * scale.repeat_interleave(group, 1)[:, :q.shape[1]]
        return (x.reshape(args[0].shape).to(args[0].dtype),)
    return hook


@pytest.mark.parametrize("block", [[128, 128], [16, 32]])
def test_block_fp8_llama_equals_its_dequantized_model(tmp_path, tiny_checkpoints, block):
    """[128, 128] as shipped (every dim of the tiny model ragged against it); [16, 32]: several
    blocks per weight, fused q/k/v parts not on block boundaries."""
    fp8_dir, dense_dir = write_block_fp8(tiny_checkpoints["llama3"], tmp_path, block)
    core, dense = _core(fp8_dir), _core(dense_dir)
    layers = [m for m in core.model.modules() if isinstance(m, Fp8BlockLinear)]
    assert len(layers) == 4 * len(core.model.model.layers)
    for module in dense.model.model.layers.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(_round_per_group(block[1]))
    ids = torch.randint(3, 49152, (60,), generator=torch.Generator().manual_seed(7)).tolist()
    quantized, reference = score_tokens(core, ids), score_tokens(dense, ids)
    assert torch.equal(quantized.top1, reference.top1)
    torch.testing.assert_close(quantized.nll, reference.nll, rtol=1e-4, atol=1e-4)


def test_block_config_parsing():
    cfg = Fp8Config.from_dict({"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert cfg.checkpoint and cfg.weight_block_size == (128, 128) and not cfg.static_activation
    with pytest.raises(ValueError, match="two positive ints"):
        Fp8Config.from_dict({"quant_method": "fp8", "weight_block_size": [128]})
    with pytest.raises(ValueError, match="dynamic activation"):
        Fp8Config.from_dict({"quant_method": "fp8", "weight_block_size": [128, 128],
                             "activation_scheme": "static"})


def test_wrong_block_scale_shape_is_named(tmp_path, tiny_checkpoints):
    fp8_dir, _ = write_block_fp8(tiny_checkpoints["llama3"], tmp_path, [16, 32])
    tensors = load_file(fp8_dir / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    tensors[name] = tensors[name][:, :1].contiguous()
    save_file(tensors, fp8_dir / "model.safetensors")
    with pytest.raises(ValueError, match="down_proj.weight_scale_inv.*need"):
        _core(fp8_dir)


def test_block_fp8_deepseek_v3_equals_its_dequantized_model(tmp_path, tiny_checkpoint_writer,
                                                            default_model_dir):
    """MLA projections (kv_b_proj dequantized at load: attention reads its weight), the dense
    first layer's MLP, shared experts (Fp8BlockLinear) and routed experts (dequantized to the
    model dtype at load: weight-only, so the reference does not round their inputs)."""
    src = tiny_checkpoint_writer("deepseek_v3", tmp_path / "src", default_model_dir, seed=13)
    fp8_dir, dense_dir = write_block_fp8(src, tmp_path, [16, 32])
    core, dense = _core(fp8_dir), _core(dense_dir)
    attn = core.model.model.layers[0].self_attn
    assert isinstance(attn.kv_a_proj_with_mqa, Fp8BlockLinear)
    assert not isinstance(attn.kv_b_proj, Fp8BlockLinear)
    assert isinstance(core.model.model.layers[-1].mlp.shared_expert.down_proj, Fp8BlockLinear)
    for module in dense.model.model.layers.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(_round_per_group(32))
    ids = torch.randint(3, 49152, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    quantized, reference = score_tokens(core, ids), score_tokens(dense, ids)
    assert torch.equal(quantized.top1, reference.top1)
    torch.testing.assert_close(quantized.nll, reference.nll, rtol=1e-4, atol=1e-4)


def test_tp_2_equals_tp_1(tmp_path, tiny_checkpoints):
    """Engine(tp=2) on a block-wise FP8 Llama: q/k/v and gate/up split by rows (scales per
    row), o_proj and down_proj by input columns on their 32-column blocks."""
    from pd_serve import Engine, SamplingParams

    fp8_dir, _ = write_block_fp8(tiny_checkpoints["llama3"], tmp_path, [16, 32])
    prompts = [[5, 17, 300, 42, 9, 1000, 7], [88, 3, 4096]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    options = dict(device="cpu", max_total_tokens=128, page_size=4)
    want = Engine(fp8_dir, **options).generate(prompts, params)
    engine = Engine(fp8_dir, tp=2, **options)
    try:
        got = engine.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    finally:
        engine.close()


def test_shard_off_the_blocks_is_refused():
    """A row-parallel split must fall on the weight's K blocks; rows may split anywhere."""
    linear = torch.nn.Linear(192, 40, bias=False)
    cfg = Fp8Config(checkpoint=True, weight_block_size=(16, 64))
    layer = Fp8BlockLinear.from_linear(linear, [40], cfg, keep_dense=True)
    x = torch.randn(3, 192)
    halves = [layer.shard(columns=(0, 128)), layer.shard(columns=(128, 64))]
    torch.testing.assert_close(halves[0](x[:, :128]) + halves[1](x[:, 128:]), layer(x),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.shard(rows=list(range(7, 30)))(x), layer(x)[:, 7:30])
    with pytest.raises(ValueError, match="do not fall on its 64-column blocks"):
        layer.shard(columns=(0, 96))


def test_deepseek_v3_tp_2_equals_tp_1(tmp_path, tiny_checkpoint_writer, default_model_dir):
    """MLA's q_b_proj by rows, o_proj by input columns, the latent's projections whole; the
    dense experts split over the ranks (ep = tp). Blocks of 16 columns, so that every
    row-parallel input of the tiny model splits in two on block boundaries."""
    from pd_serve import Engine, SamplingParams

    src = tiny_checkpoint_writer("deepseek_v3", tmp_path / "src", default_model_dir, seed=13)
    fp8_dir, _ = write_block_fp8(src, tmp_path, [16, 16])
    prompts = [[5, 17, 300, 42, 9, 1000, 7], [88, 3, 4096]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    options = dict(device="cpu", max_total_tokens=128, page_size=4)
    want = Engine(fp8_dir, **options).generate(prompts, params)
    engine = Engine(fp8_dir, tp=2, ep_size=2, **options)
    try:
        got = engine.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    finally:
        engine.close()
