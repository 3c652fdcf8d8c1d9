"""One decoder for the Llama family: Llama 2/3.x, Mistral, Qwen2/2.5 (QKV bias), Qwen3 (q/k norm),
and its MoE kin: Mixtral, Qwen2-MoE, Qwen3-MoE (sparse MoE blocks in place of MLPs: moe.py),
DeepSeek-V2/V3 (multi-head latent attention in place of attention: mla.py).

The forward pass takes flat tokens of a whole batch (input_ids [T], positions [T]) and an
attention backend already planned for that batch; it knows nothing of requests or pages.
Sliding-window attention (Mistral v0.1, Qwen2's use_sliding_window) is the backend's too: it is
built with each layer's window (ModelConfig.layer_windows).
Parameter names follow Hugging Face, except that q/k/v and gate/up are fused (see loader.py).
Norms and SiLU-and-mul call kernels/: Triton on GPU, their torch references on CPU (which
reproduce Hugging Face's arithmetic); RoPE is the attention backend's, applied as it stores K
and V (kernels/kv_store.py's rope_store_kv). Linear layers run cuBLAS on GPU;
`use_batch1_kernels` (--enable-batch1-kernels) gives one-row inputs (decode at batch 1)
kernels/gemv.py's GEMV, the MLP's activation in its gate/up GEMV's epilogue. On CPU,
`pack_cpu_weights` gives decode's few-row calls oneDNN on packed weights (layers.cpu_linear).
The residual stream is carried beside the hidden states so the residual add fuses into the
next norm. Nothing here syncs with the host: CUDA graphs
capture the whole forward.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.activation import silu_and_mul
from kernels.gemv import linear
from pd_serve.engine.attention.base import AttentionBackend
from pd_serve.model.config import ModelConfig
from pd_serve.model.layers import Linear, RMSNorm, cpu_linear, pack_cpu_weight
from pd_serve.model.moe import SparseMoeBlock
from pd_serve.model.rope import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.cfg = cfg
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                attn: AttentionBackend) -> torch.Tensor:
        cfg = self.cfg
        q, k, v = self.qkv_proj(x).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)  # [T, Hq, D]
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)  # [T, Hkv, D]
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        # RoPE (and Qwen3's q/k norms before it) happen in the backend, in the kernel that
        # stores K and V.
        qk_norm = ((self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if cfg.qk_norm
                   else None)
        out = attn.run(self.layer_id, q, k, v, rope=(positions, rope.cos, rope.sin),
                       qk_norm=qk_norm)  # [T, Hq, D]
        return self.o_proj(out.reshape(-1, cfg.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        """intermediate_size: default cfg's (Qwen2-MoE's shared expert has its own)."""
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if getattr(gate_up, "batch1_kernels", False):  # the activation in the GEMV (bf16, FP8)
            return self.down_proj(gate_up(x, silu_and_mul=True))
        return self.down_proj(silu_and_mul(gate_up(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_mla:
            from pd_serve.model.mla import MLAttention  # mla.py builds on this module's layers
            self.self_attn = MLAttention(cfg, layer_id)
        else:
            self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.is_moe_layer(layer_id):
            self.mlp = MLP(cfg)
        else:
            shared = cfg.shared_expert_intermediate_size
            self.mlp = SparseMoeBlock(cfg, MLP(cfg, shared) if shared else None)

    def forward(self, x, residual, positions, rope, attn):
        """(x, residual) -> (mlp output, residual stream); residual None at the first layer."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, attn)
        if isinstance(self.mlp, SparseMoeBlock) and self.mlp.takes_one_row(x):
            return self.mlp.forward_one_row(x, residual, self.post_attention_layernorm)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.rope = RotaryEmbedding(cfg.rope_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                    cfg.rope_scaling)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tp = None  # a tensor-parallel shard's TPGroup (model/parallel.py): logits are gathered
        self.batch1_kernels = False  # see use_batch1_kernels
        self.cpu_packed_head: torch.Tensor | None = None  # see pack_cpu_weights

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                after_layer=None) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden].

        after_layer(i), if given, is called once layer i's work is queued (its KV is stored):
        the prefill worker ships finished layers' KV while the rest of the forward runs."""
        x, residual = self.model.embed_tokens(input_ids), None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, positions, self.rope, attn)
            if after_layer is not None:
                after_layer(i)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab], written into `out` if given (the
        CUDA graphs of every batch size share one output)."""
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        logits = (linear(hidden, weight) if self.batch1_kernels
                  else cpu_linear(hidden, weight, None, self.cpu_packed_head))
        if self.tp is not None:  # this rank's slice of the vocabulary
            logits = self.tp.gather_vocab(logits, self.config.vocab_size)
        return logits.float() if out is None else out.copy_(logits)


def pack_cpu_weights(model: CausalLM) -> int:
    """Give every float32 CPU Linear of `model` and its LM head a packed copy of the weight
    (layers.cpu_linear); returns the bytes the copies take (about the weights' own)."""
    total = 0
    for module in model.modules():
        if isinstance(module, Linear):
            module.cpu_packed = pack_cpu_weight(module.weight)
            total += 0 if module.cpu_packed is None else module.weight.nbytes
    if model.config.tie_word_embeddings:  # the head is the embedding table, not a Linear
        head = model.model.embed_tokens.weight
        model.cpu_packed_head = pack_cpu_weight(head)
        total += 0 if model.cpu_packed_head is None else head.nbytes
    else:
        model.cpu_packed_head = model.lm_head.cpu_packed
    return total


def use_batch1_kernels(model: nn.Module) -> None:
    """Give every linear layer of `model` (and its LM head) that has the switch the one-row GEMV
    (kernels/gemv.py), and MoE blocks their one-token experts (kernels/moe_batch1.py): faster
    decode at batch 1 on GPU, but a row computed alone then rounds
    differently from the same row in a batch, so greedy output can depend on the batch."""
    for module in model.modules():
        if hasattr(module, "batch1_kernels"):
            module.batch1_kernels = True
