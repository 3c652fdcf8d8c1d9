"""Tensor parallelism: one rank's shard of a CausalLM, and the collectives its forward needs.

Megatron's split of a decoder: q/k/v and gate/up are column-parallel (a rank holds its query
heads, their KV heads and its slice of the MLP), o_proj and down_proj row-parallel (each rank's
partial sums are all-reduced, the bias added once after), the embedding and the LM head
vocab-parallel (a rank holds a slice of the vocabulary: lookups are all-reduced, logits
all-gathered). KV heads are split across ranks, or replicated when there are fewer KV heads than
ranks: rank r then holds KV head r * num_kv_heads // tp, the one its query heads read. Attention
runs on each rank's own heads over its own KV pool, so the shard is a plain CausalLM of the
local shape (shard_config) with these layers swapped in; nothing in llama.py changes but the
logits gather.

Expert parallelism (MoE models): `--ep-size` N partitions each MoE block's experts over N
ranks (rank r holds experts [r * E / N, (r + 1) * E / N)), which dispatch tokens to each
other's experts and combine the results by all-to-all (moe.py). Either N equals --tp, and
attention, the shared expert and the dense layers' MLPs are split as above, or --tp is 1 and
the N ranks each hold the whole model but the other ranks' experts (attention replicated:
every rank runs every token and holds every KV head, so a P/D hand-off sends from the first
rank and to every rank: transfer/connector.py). The router is replicated either way.

Multi-head latent attention (DeepSeek, mla.py) splits by query heads: q_proj / q_b_proj and
kv_b_proj column-parallel (a rank's heads), o_proj row-parallel; the latent's down projections
(q_a_proj, kv_a_proj_with_mqa) and norms are replicated, so every rank stores the whole latent:
its one KV "head" is replicated, as KV heads are when there are more ranks than heads.

Quantized layers shard as the dense ones do (their `shard()`): column-parallel by rows with
their scales (FP8 per channel or per row block; GPTQ in runs of 8 rows, as its zeros pack),
row-parallel by input columns, each FP8 rank quantizing its own slice of the activations. A
column split must fall on a block-wise FP8 layer's K blocks and a GPTQ layer's groups (clear
errors). An act-order GPTQ layer's column split keeps the groups its input rows come from
(any of them: act-order scatters a group's rows over the input), its rows sorted by group.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kernels.gemv import linear
from pd_serve.model.config import ModelConfig
from pd_serve.model.llama import CausalLM
from pd_serve.model.moe import SparseMoeBlock
from pd_serve.model.quant import Fp8BlockLinear, Fp8Linear, GPTQLinear

_SHARDABLE = (Fp8BlockLinear, Fp8Linear, GPTQLinear)  # the quantized layers: each has shard()


@dataclass(frozen=True)
class TPGroup:
    """A rank's place in its tensor-parallel group: `group` carries the model's collectives,
    `control` (gloo) the host-side broadcasts; None is the default process group."""

    rank: int
    size: int
    group: object = None
    control: object = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_to_all(self, x: torch.Tensor, send_counts: list[int] | None = None,
                   recv_counts: list[int] | None = None) -> torch.Tensor:
        """Rows send_counts[r] of x (in rank order) to rank r; returns the rows received,
        recv_counts[r] from rank r, in rank order. None: x splits evenly, one row each."""
        out = x.new_empty(x.shape[0] if recv_counts is None else sum(recv_counts), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=self.group)
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x [N, ...] -> [size * N, ...] in rank order, on every rank."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts)

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Every rank's [N, V / tp] logits -> [N, V] on every rank."""
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[:, :vocab_size]


def shard_config(cfg: ModelConfig, tp: int, ep: int = 1) -> ModelConfig:
    """The shape one rank's shard computes; a clear ValueError when tp (or ep) does not divide
    it. num_experts stays the model's (the router scores all of them)."""
    def check(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"--tp {tp} does not divide this model: {what}")

    check(tp >= 1, "tp must be >= 1")
    check_ep(cfg, tp, ep)
    check(cfg.num_heads % tp == 0, f"{cfg.num_heads} attention heads")
    check(cfg.num_kv_heads % tp == 0 or tp % cfg.num_kv_heads == 0,
          f"{cfg.num_kv_heads} KV heads (tp must divide them, or be a multiple of them)")
    check(cfg.intermediate_size % tp == 0, f"intermediate size {cfg.intermediate_size}")
    check(cfg.shared_expert_intermediate_size % tp == 0,
          f"shared expert size {cfg.shared_expert_intermediate_size}")
    return replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=max(1, cfg.num_kv_heads // tp),
                   intermediate_size=cfg.intermediate_size // tp,
                   shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // tp)


def check_shards(cfg: ModelConfig, tp: int, ep: int) -> None:
    """The ValueError shard_model would raise on every rank for --tp tp --ep-size ep, raised
    before any rank starts (a follower's traceback came before the worker's one-line error)."""
    if ep > tp:
        check_ep(cfg, tp, ep)
    else:
        shard_config(cfg, tp, ep)


def check_ep(cfg: ModelConfig, tp: int, ep: int) -> None:
    """--ep-size: 1 (a dense model, or an MoE model on one rank), --tp, or any size with
    --tp 1, on an MoE model whose experts it divides (else a ValueError)."""
    if ep == 1 and not (cfg.num_experts and tp > 1):
        return
    if not cfg.num_experts:
        raise ValueError(f"--ep-size {ep}: {cfg.architecture} has no experts")
    if ep != tp and tp != 1:
        raise ValueError(f"--tp {tp} --ep-size {ep}: a mixture of experts ({cfg.architecture}) "
                         f"runs its experts on the --tp ranks, or on --ep-size ranks of "
                         f"replicated attention (--tp 1): give --ep-size equal to --tp")
    if cfg.num_experts % ep:
        raise ValueError(f"--ep-size {ep} does not divide the {cfg.num_experts} experts")


def kv_heads_of(rank: int, tp: int, num_kv_heads: int) -> range:
    """The KV heads rank `rank` holds (replicated ones when tp > num_kv_heads)."""
    if num_kv_heads >= tp:
        per = num_kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    head = rank * num_kv_heads // tp
    return range(head, head + 1)


def vocab_range(rank: int, tp: int, vocab_size: int) -> tuple[int, int]:
    """[start, start + per) of the (padded) vocabulary rank `rank` holds; per = ceil(V / tp)."""
    per = -(-vocab_size // tp)
    return rank * per, per


class RowParallelLinear(nn.Module):
    """y = all_reduce(x @ W_shard^T) + b: x holds this rank's slice of the input features."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.tp = tp
        self.batch1_kernels = False  # see llama.use_batch1_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce((linear if self.batch1_kernels else F.linear)(x, self.weight))
        return y if self.bias is None else y + self.bias


class QuantRowParallel(nn.Module):
    """RowParallelLinear of a quantized layer's shard: y = all_reduce(shard(x)) + b."""

    def __init__(self, shard: nn.Module, bias: torch.Tensor | None, tp: TPGroup):
        super().__init__()
        self.shard, self.tp = shard, tp
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.shard(x))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + per) of the embedding (zero-padded past the vocabulary); ids outside
    them look up zeros here, and the all-reduce sums the one rank that holds each id."""

    def __init__(self, weight: torch.Tensor, start: int, tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.tp.all_reduce(out * inside.unsqueeze(-1).to(out.dtype))


@torch.no_grad()
def shard_model(full: CausalLM, tp: TPGroup, ep_size: int = 1,
                tp_size: int | None = None) -> CausalLM:
    """This rank's shard of `full` (same device and dtype); `full` is left as it is, except
    under replicated attention. ep_size: --ep-size (1, tp.size, or any with tp_size 1).
    tp_size: --tp (default tp.size, the group's ranks); 1 with ep_size = tp.size > 1:
    attention replicated over the group's ranks, which are the expert-parallel ranks; the
    shard is then `full` itself, its experts sliced."""
    cfg = full.config
    if ep_size > (tp_size or tp.size):  # attention replicated: --tp 1, --ep-size N
        check_ep(cfg, tp_size or tp.size, ep_size)
        if ep_size != tp.size:
            raise ValueError(f"--ep-size {ep_size} over a group of {tp.size} ranks")
        for block in [m for m in full.modules() if isinstance(m, SparseMoeBlock)]:
            _keep_experts(block, block, tp)
        return full.eval()
    local = shard_config(cfg, tp.size, ep_size)
    weight = full.model.embed_tokens.weight
    device, dtype = weight.device, weight.dtype
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters in the model's dtype; RoPE tables stay float32
    try:
        with torch.device("meta"):
            model = CausalLM(local)
    finally:
        torch.set_default_dtype(default)
    model.to_empty(device=device)
    model.rope = full.rope  # the RoPE tables depend on head_dim and positions only
    rank = tp.rank
    for theirs, ours in zip(full.model.layers, model.model.layers):
        a, b = theirs.self_attn, ours.self_attn
        if cfg.is_mla:
            _shard_mla(a, b, local, tp)
        else:
            _shard_attention(a, b, cfg, local, tp)
        if isinstance(theirs.mlp, SparseMoeBlock):
            _shard_moe(theirs.mlp, ours.mlp, tp)
        else:
            _shard_mlp(theirs.mlp, ours.mlp, tp)
        ours.input_layernorm.weight.copy_(theirs.input_layernorm.weight)
        ours.post_attention_layernorm.weight.copy_(theirs.post_attention_layernorm.weight)
    model.model.norm.weight.copy_(full.model.norm.weight)
    start, per = vocab_range(rank, tp.size, cfg.vocab_size)
    model.model.embed_tokens = VocabParallelEmbedding(_vocab_rows(weight, start, per), start, tp)
    if not cfg.tie_word_embeddings:
        model.lm_head.weight = nn.Parameter(_vocab_rows(full.lm_head.weight, start, per),
                                            requires_grad=False)
    model.tp = tp
    return model.eval()


def _shard_attention(a: nn.Module, b: nn.Module, cfg: ModelConfig, local: ModelConfig,
                     tp: TPGroup) -> None:
    """Column-parallel q/k/v (this rank's query heads and their KV heads), row-parallel o_proj."""
    hd, rank = cfg.head_dim, tp.rank
    q_rows = _rows(rank * local.num_heads * hd, local.q_size)
    kv = kv_heads_of(rank, tp.size, cfg.num_kv_heads)
    k_rows = _rows(cfg.q_size + kv.start * hd, local.kv_size)
    v_rows = _rows(cfg.q_size + cfg.kv_size + kv.start * hd, local.kv_size)
    _column_parallel(a, b, "qkv_proj", q_rows + k_rows + v_rows)
    b.o_proj = _row_parallel(a.o_proj, q_rows, tp)
    if cfg.qk_norm:
        b.q_norm.weight.copy_(a.q_norm.weight)
        b.k_norm.weight.copy_(a.k_norm.weight)


def _shard_mla(a: nn.Module, b: nn.Module, local: ModelConfig, tp: TPGroup) -> None:
    """This rank's query heads of q_proj / q_b_proj and kv_b_proj, o_proj row-parallel over
    their values; the latent's projections and norms whole (module docstring)."""
    heads = local.num_heads
    qk, kv_b, v = (local.qk_nope_head_dim + local.qk_rope_head_dim,
                   local.qk_nope_head_dim + local.v_head_dim, local.v_head_dim)
    q_name = "q_b_proj" if local.q_lora_rank else "q_proj"
    _column_parallel(a, b, q_name, _rows(tp.rank * heads * qk, heads * qk))
    b.kv_b_proj.weight.copy_(a.kv_b_proj.weight[_rows(tp.rank * heads * kv_b, heads * kv_b)])
    for name in ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm"):
        if isinstance(getattr(a, name, None), _SHARDABLE):
            setattr(b, name, getattr(a, name).shard())  # whole on every rank
        elif hasattr(a, name):
            getattr(b, name).load_state_dict(getattr(a, name).state_dict())
    b.o_proj = _row_parallel(a.o_proj, _rows(tp.rank * heads * v, heads * v), tp)


def _shard_mlp(theirs: nn.Module, ours: nn.Module, tp: TPGroup) -> None:
    """Column-parallel gate/up (this rank's slice of each), row-parallel down."""
    full = theirs.down_proj.in_features
    per = full // tp.size
    gate, up = _rows(tp.rank * per, per), _rows(full + tp.rank * per, per)
    _column_parallel(theirs, ours, "gate_up_proj", gate + up)
    ours.down_proj = _row_parallel(theirs.down_proj, gate, tp)


def _column_parallel(a: nn.Module, b: nn.Module, name: str, rows: list[int]) -> None:
    """b.name: rows `rows` of a.name (and of its bias); an FP8 layer's shard."""
    theirs, ours = getattr(a, name), getattr(b, name)
    if isinstance(theirs, _SHARDABLE):
        setattr(b, name, theirs.shard(rows=rows))
        return
    ours.weight.copy_(theirs.weight[rows])
    if theirs.bias is not None:
        ours.bias.copy_(theirs.bias[rows])


def _row_parallel(layer: nn.Module, columns: list[int], tp: TPGroup) -> nn.Module:
    """The row-parallel shard of `layer` over its input columns `columns` (contiguous)."""
    if isinstance(layer, _SHARDABLE):
        return QuantRowParallel(layer.shard(columns=(columns[0], len(columns))),
                                _clone(layer.bias), tp)
    return RowParallelLinear(layer.weight[:, columns].clone(), _clone(layer.bias), tp)


def _shard_moe(theirs: SparseMoeBlock, ours: SparseMoeBlock, tp: TPGroup) -> None:
    """This rank's experts (ep = tp), the router whole, the shared expert split as an MLP."""
    _keep_experts(theirs, ours, tp)
    ours.gate.load_state_dict(theirs.gate.state_dict())  # DeepSeek-V3's: with its bias
    if theirs.shared_expert is not None:
        _shard_mlp(theirs.shared_expert, ours.shared_expert, tp)
        if hasattr(theirs, "shared_expert_gate"):  # Qwen2-MoE's
            ours.shared_expert_gate.weight.copy_(theirs.shared_expert_gate.weight)


def _keep_experts(theirs: SparseMoeBlock, ours: SparseMoeBlock, ep: TPGroup) -> None:
    """ours holds rank ep.rank's slice of theirs' experts (FP8 ones: their scales too) and
    dispatches tokens over ep (theirs may be ours)."""
    per = theirs.experts.gate_up_proj.shape[0] // ep.size
    first = ep.rank * per
    for name, tensor in list(theirs.experts.named_parameters()):
        setattr(ours.experts, name, nn.Parameter(tensor[first:first + per].clone(),
                                                 requires_grad=False))
    ours.ep, ours.expert_offset = ep, first


def _rows(start: int, size: int) -> list[int]:
    return list(range(start, start + size))


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


def _vocab_rows(weight: torch.Tensor, start: int, per: int) -> torch.Tensor:
    """weight[start : start + per], zero rows past the vocabulary's end."""
    out = weight.new_zeros(per, weight.shape[1])
    rows = weight[start:start + per]
    out[:rows.shape[0]] = rows
    return out
