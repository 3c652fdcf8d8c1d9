"""`--model FILE.gguf`: a tiny random llama written to GGUF here (gguf's writer, llama.cpp's
tensor names and q/k row order, SmolLM2's tokenizer) gives the greedy tokens of the same
weights loaded from safetensors; the conversion is cached; what the converter cannot run is
refused with a clear error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gguf_checkpoints import write_gguf
from pd_serve import Engine, SamplingParams
from pd_serve.model import gguf_default
from pd_serve.model.gguf_default import model_dir_for


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tiny_checkpoint_writer, default_model_dir):
    """(safetensors folder, the same weights as a GGUF file)."""
    root = tmp_path_factory.mktemp("gguf")
    hf_dir = tiny_checkpoint_writer("llama", root / "llama", default_model_dir, seed=13)
    return hf_dir, write_gguf(hf_dir, root / "tiny-llama.gguf")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PD_SERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_gguf_file_equals_safetensors(tiny_llama, cache, monkeypatch):
    hf_dir, gguf_path = tiny_llama
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["The capital of France is", "def add(a, b):", "12345 and héllo 世界"]
    want = Engine(hf_dir, device="cpu", max_total_tokens=1024)
    ours = Engine(str(gguf_path), device="cpu", max_total_tokens=1024)
    assert ours.model_dir.parent == cache
    for prompt in prompts:
        ids = want.tokenizer.encode(prompt)
        assert ours.tokenizer.encode(prompt) == ids
        assert ([o.token_ids for o in ours.generate([ids], params)]
                == [o.token_ids for o in want.generate([ids], params)])
    chat = [{"role": "user", "content": "hi"}]
    assert ours.tokenizer.apply_chat_template(chat) == want.tokenizer.apply_chat_template(chat)
    monkeypatch.setattr(gguf_default, "convert_gguf_to_hf",
                        lambda *a: pytest.fail("the converted folder should be reused"))
    assert model_dir_for(str(gguf_path)) == ours.model_dir  # converted once


def test_folders_and_the_default_pass_through(tmp_path, default_model_dir):
    assert model_dir_for(str(tmp_path)) == tmp_path
    assert model_dir_for(tmp_path / "missing.gguf") == tmp_path / "missing.gguf"  # the loader says
    assert model_dir_for(None).is_dir()


@pytest.mark.parametrize("arch,extra,match", [
    ("qwen2", (), "only llama-architecture GGUF files"),
    ("llama", (("blk.0.ffn_gate_inp.weight", np.ones((4, 64), np.float32)),),
     "ffn_gate_inp.*a mixture of experts"),
    ("llama", (("rope_freqs.weight", np.linspace(1, 3, 8, dtype=np.float32)),),
     "rope_freqs are not a llama3 rope scaling"),
])
def test_unsupported_files_are_refused(tiny_llama, cache, tmp_path, arch, extra, match):
    hf_dir, _ = tiny_llama
    path = write_gguf(hf_dir, tmp_path / "other.gguf", arch=arch, extra_tensors=extra)
    with pytest.raises(ValueError, match=match):
        Engine(str(path), device="cpu", max_total_tokens=256)
    assert not any(p.name.startswith("other") for p in cache.iterdir())  # nothing half-made


def test_other_tokenizers_come_from_transformers(tiny_llama, cache, tmp_path):
    """A tokenizer other than SmolLM2's BPE (here the same vocabulary under llama.cpp's
    "gpt-2" pre-tokenizer) is converted by transformers; our Tokenizer reads what it saved."""
    import transformers

    from pd_serve.model.tokenizer import Tokenizer

    hf_dir, _ = tiny_llama
    path = write_gguf(hf_dir, tmp_path / "gpt2-pre.gguf", pre="gpt-2")
    ours = Tokenizer.from_dir(model_dir_for(path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ("The capital of France is", "héllo 世界 <|im_end|>", "  x  "):
        assert ours.encode(text) == theirs.encode(text)
    assert "hi" in ours.apply_chat_template([{"role": "user", "content": "hi"}])


def llama_cpp_rope_freqs(head_dim: int, theta: float, factor: float, low: float, high: float,
                         old_len: int) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for a Llama 3.1 rope_scaling."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * np.pi * theta ** (i / head_dim)
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_freqs_become_its_rope_scaling(tiny_checkpoints, cache, tmp_path):
    """A Llama 3.1-style file: rope_freqs (from the tiny llama3's factor 8, 1, 4, 64) give back
    its rope_scaling, and the same greedy tokens as safetensors past the original 64 positions."""
    hf_dir = tiny_checkpoints["llama3"]
    freqs = llama_cpp_rope_freqs(16, 10000.0, 8.0, 1.0, 4.0, 64)
    path = write_gguf(hf_dir, tmp_path / "llama31.gguf", extra_tensors=[("rope_freqs.weight", freqs)])
    ours = Engine(str(path), device="cpu", max_total_tokens=1024)
    assert ours.model_config.rope_scaling == {"rope_type": "llama3", "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64}
    want = Engine(hf_dir, device="cpu", max_total_tokens=1024)
    prompt = list(range(100, 200))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert ours.generate([prompt], params)[0].token_ids == want.generate([prompt], params)[0].token_ids
