"""to_hf_state_dict inverts the loader: a checkpoint loaded and exported gives back its tensors;
to_hf_model gives the transformers model that from_pretrained gives."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from pd_serve.model.hf_export import to_hf_model, to_hf_state_dict
from pd_serve.model.checkpoint import checkpoint_files
from pd_serve.model.loader import load_model


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "qwen3", "mistral"])
def test_export_gives_back_the_checkpoint(kind, tiny_checkpoints):
    model_dir = tiny_checkpoints[kind]
    expected = {}
    for path in checkpoint_files(model_dir):  # qwen2 is sharded
        expected.update(load_file(str(path)))
    model = load_model(model_dir, torch.float32, "cpu")
    if model.config.tie_word_embeddings:  # qwen3: save_pretrained leaves the tied head out
        expected.pop("lm_head.weight", None)
        assert "lm_head.weight" not in to_hf_state_dict(model)
    exported = to_hf_state_dict(model)
    assert sorted(exported) == sorted(expected)
    for name, tensor in expected.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("kind", ["llama3", "qwen3"])
def test_hf_model_equals_from_pretrained(kind, tiny_checkpoints):
    """to_hf_model on our loaded model runs exactly what transformers' own loading runs."""
    import transformers

    model_dir = tiny_checkpoints[kind]
    model = load_model(model_dir, torch.float32, "cpu")
    hf = to_hf_model(model, json.loads((model_dir / "config.json").read_text()))
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert type(hf) is type(reference)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_hf_model_equals_from_pretrained(kind, tmp_path, tiny_checkpoint_writer,
                                                  default_model_dir):
    """DeepSeek's shared experts (ours: mlp.shared_expert) go back under transformers' name."""
    test_hf_model_equals_from_pretrained(
        kind, {kind: tiny_checkpoint_writer(kind, tmp_path / kind, default_model_dir, seed=12)})
