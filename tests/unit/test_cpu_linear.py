"""CPU linear layers on oneDNN-packed weights (pd_serve/model/layers.py cpu_linear,
llama.pack_cpu_weights) against F.linear, and the engine building with them on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pd_serve.model.layers import CPU_PACKED_ROWS, Linear, cpu_linear, pack_cpu_weight

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="this torch has no oneDNN")


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Float32 sums of the same products in another order: relative error ~1e-7, far below
    any real difference."""
    assert a.shape == b.shape
    assert ((a - b).norm() / b.norm()).item() < 1e-6


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 64, 65, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(200, 96, generator=gen)
    b = torch.randn(200, generator=gen) if bias else None
    x = torch.randn(rows, 96, generator=gen)
    packed = pack_cpu_weight(weight)
    assert packed is not None
    _close(cpu_linear(x, weight, b, packed), F.linear(x, weight, b))
    wide = torch.randn(rows, 192, generator=gen)[:, ::2]  # a strided x
    _close(cpu_linear(wide, weight, b, packed), F.linear(wide, weight, b))


def test_packed_rows_do_not_depend_on_the_batch():
    """The docstring's promise: on the packed weight a row's result is the same bits whatever
    rows run beside it (MKL's sgemm does not promise that)."""
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(576, 320, generator=gen), torch.randn(64, 320, generator=gen)
    packed = pack_cpu_weight(weight)
    first = cpu_linear(x[:2], weight, None, packed)[0]
    for rows in (3, 16, 33, 64):
        assert rows in CPU_PACKED_ROWS
        assert torch.equal(cpu_linear(x[:rows], weight, None, packed)[0], first)


def test_not_packed_where_it_does_not_apply():
    assert pack_cpu_weight(torch.randn(8, 8, dtype=torch.bfloat16)) is None
    layer = Linear(8, 8)
    assert layer.cpu_packed is None  # packing is the engine's choice, not the layer's default


def test_engine_packs_its_layers_and_agrees_with_unpacked(default_model_dir, monkeypatch):
    """The CPU engine packs every Linear and the LM head, and a batch of decode rows gives
    the unpacked model's logits (the same sums in another order) through the packed path."""
    from pd_serve import Engine
    from pd_serve.model import layers, llama
    from pd_serve.model.llama import CausalLM

    packed_calls = []

    def counting(x, weight, bias, packed):
        packed_calls.append(packed is not None and x.shape[0] in CPU_PACKED_ROWS)
        return cpu_linear(x, weight, bias, packed)

    monkeypatch.setattr(layers, "cpu_linear", counting)
    monkeypatch.setattr(llama, "cpu_linear", counting)

    engine = Engine(device="cpu", max_total_tokens=512)
    model = engine.executor.model
    assert isinstance(model, CausalLM) and model.cpu_packed_head is not None
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.cpu_packed is not None for m in linears)

    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        packed_logits = model.compute_logits(hidden)
        mlp = model.model.layers[0].mlp
        packed_mlp = mlp(hidden)
        assert packed_calls == [True] * 3  # the LM head, gate/up, down
        for m in linears:
            m.cpu_packed = None
        model.cpu_packed_head = None
        _close(model.compute_logits(hidden), packed_logits)
        _close(mlp(hidden), packed_mlp)


def test_an_untied_head_shares_its_linear_packing(tiny_checkpoints):
    """An untied LM head is a Linear: packed once, and compute_logits uses that copy."""
    from pd_serve.model.llama import pack_cpu_weights
    from pd_serve.model.loader import load_model

    model = load_model(tiny_checkpoints["llama3"], torch.float32, "cpu")
    assert not model.config.tie_word_embeddings
    weights = sum(m.weight.nbytes for m in model.modules() if isinstance(m, Linear))
    assert pack_cpu_weights(model) == weights  # the head counted once, as the Linear it is
    assert model.cpu_packed_head is model.lm_head.cpu_packed is not None
    hidden = torch.randn(4, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        _close(model.compute_logits(hidden), F.linear(hidden, model.lm_head.weight))
