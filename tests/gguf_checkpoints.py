"""GGUF files written by the tests from a Hugging Face llama checkpoint, as llama.cpp's converter
writes them: its tensor names, q/k rows in its rotate-adjacent order, float32 tensors, and the
default model's (SmolLM2's) tokenizer metadata."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.torch import load_file

from pd_serve.model.gguf_default import find_default_gguf

# Hugging Face name (under model.layers.N.) -> llama.cpp's (under blk.N.)
LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def permute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (what its converter writes): the inverse of the loader's
    unpermute_rope_rows."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: Path, path: Path, *, arch: str = "llama", extra_tensors=(),
               pre: str | None = None) -> Path:
    """The checkpoint in hf_dir as a float32 GGUF file, with the default model's tokenizer
    (its pre-tokenizer named `pre` when given); extra_tensors: (name, array) pairs to add."""
    import gguf

    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = gguf.GGUFReader(str(find_default_gguf()))
    meta = {name: field.contents() for name, field in tok.fields.items()
            if name.startswith("tokenizer.")}
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(pre or meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(meta["tokenizer.chat_template"])
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        w = tensor.float().numpy()
        base, suffix = name.rsplit(".", 1)
        if base.startswith("model.layers."):
            layer, part = base.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{LAYER_NAMES[part]}.{suffix}"
        else:
            gguf_name = f"{GLOBAL_NAMES[base]}.{suffix}"
        if ".q_proj." in name:
            w = permute_rope_rows(w, cfg["num_attention_heads"])
        elif ".k_proj." in name:
            w = permute_rope_rows(w, cfg["num_key_value_heads"])
        writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    for name, w in extra_tensors:
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
