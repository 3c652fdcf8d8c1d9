"""kernels/prefetch.py: the L2 prefetch changes nothing it touches and runs where it can, and
the model's batch-1 path asks it for o_proj's weight and the head of the gate/up weight.

The kernel's PTX cannot run in Triton's interpreter: on CPU the dispatch does nothing (the
compile test builds it for sm_90); on a CUDA machine the cuda tests run it, eagerly and in a
CUDA graph between two GEMVs, whose results must not change."""

from __future__ import annotations

import pytest
import torch

from kernels import gemv, prefetch
from kernels.prefetch import l2_prefetch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_does_nothing_off_the_gpu():
    before = prefetch.triton_launches
    l2_prefetch(torch.ones(64, 4096, dtype=torch.bfloat16), torch.ones(4, 16))
    assert prefetch.triton_launches == before


@pytest.mark.parametrize("views,match", [
    ((torch.ones(4, 8)[:, :3],), "contiguous"),
    ((torch.ones(3, dtype=torch.uint8),), "multiple of 16"),
    ((torch.ones(64, dtype=torch.uint8)[8:40],), "aligned"),
    ((torch.ones(16),) * 4, "at most 3"),
])
def test_rejects_what_it_cannot_prefetch(views, match):
    with pytest.raises(ValueError, match=match):
        l2_prefetch(*views)


@needs_cuda
def test_prefetch_leaves_memory_and_results_unchanged():
    """Eagerly and captured in a graph between two GEMVs (PDL on where the GPU has it): one
    launch a call, the weights bit for bit as before, the GEMVs' outputs as without it."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(6144, 4096, device="cuda", generator=g).to(torch.float8_e4m3fn)
    scale = torch.rand(6144, device="cuda", generator=g) + 0.5
    x = torch.randn(1, 4096, device="cuda", generator=g).bfloat16()
    copy = w.clone()
    views = (w, w[:100], w[3072:3172])
    before = prefetch.triton_launches
    l2_prefetch(*views)
    torch.cuda.synchronize()
    assert prefetch.triton_launches == before + 1
    assert torch.equal(w.view(torch.uint8), copy.view(torch.uint8))

    def step():
        y = gemv.gemv(x, w, scale)
        l2_prefetch(*views)
        return gemv.gemv(y[:, :4096].contiguous(), w, scale)
    expected = step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


def test_batch1_layers_prefetch_o_proj_and_the_gate_up_head(monkeypatch):
    """Under use_batch1_kernels a one-row forward asks, in each layer, for o_proj's whole
    weight and the first PREFETCH_GATE_UP_MIB MiB of gate/up, half from the gate rows and half
    from the up rows; a batch of two asks for nothing; 0 and 0 turn it off."""
    from types import SimpleNamespace

    from bench.one_batch import PRESETS
    from pd_serve.model import llama
    from pd_serve.model.config import ModelConfig
    cfg = ModelConfig.from_dict(dict(PRESETS["tiny"], intermediate_size=1024))
    model = llama.CausalLM(cfg)
    calls = []
    monkeypatch.setattr(llama, "l2_prefetch", lambda *views: calls.append(views))
    monkeypatch.setattr(llama, "PREFETCH_GATE_UP_MIB", 1 / 4)  # 256 KiB: 512 rows of 512 B
    attn = SimpleNamespace(run=lambda layer_id, q, k, v, rope: q)  # attention as identity

    def forward(layer, rows: int):
        x = torch.randn(rows, cfg.hidden_size)
        with torch.no_grad():
            layer.self_attn(x, torch.arange(rows), model.rope, attn)

    forward(model.model.layers[0], 1)
    assert not calls  # not switched on
    llama.use_batch1_kernels(model)
    for layer in model.model.layers:
        calls.clear()
        forward(layer, 1)
        (views,) = calls
        gate_up = layer.mlp.gate_up_proj.weight  # [2 x 1024, 128] float32: 512 B a row
        assert views[0] is layer.self_attn.o_proj.weight
        assert views[1].data_ptr() == gate_up.data_ptr() and views[1].shape == (256, 128)
        assert views[2].data_ptr() == gate_up[1024].data_ptr() and views[2].shape == (256, 128)
        calls.clear()
        forward(layer, 2)
        assert not calls
    monkeypatch.setattr(llama, "PREFETCH_GATE_UP_MIB", 0)
    monkeypatch.setattr(llama, "PREFETCH_O_PROJ", 0)
    forward(model.model.layers[0], 1)
    assert not calls
