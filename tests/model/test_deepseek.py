"""DeepSeek-V2/V3 (multi-head latent attention, DeepSeekMoE) on tiny random checkpoints written
by transformers: greedy tokens equal transformers' through Engine (fp32, CPU); the KV pool and
the transfer handshake hold the latent only; absorbed decode equals expanded attention."""

from __future__ import annotations

import random
import time

import pytest
import torch
import transformers

from helpers import assert_greedy_matches, assert_pages_settled, hf_greedy
from pd_serve import Engine, SamplingParams
from pd_serve.cache.pool import KVLayout, KVPool
from pd_serve.engine.attention.base import AttentionMetadata
from pd_serve.engine.attention.mla import TorchMLABackend
from pd_serve.model.config import ModelConfig
from pd_serve.transfer.base import layout_mismatch
from pd_serve.transfer.connector import model_layout
from pd_serve.transfer.receiver import KVReceiver
from pd_serve.transfer.sender import KVSender

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def deepseek_dirs(tmp_path_factory, tiny_checkpoint_writer, default_model_dir):
    root = tmp_path_factory.mktemp("deepseek")
    return {kind: tiny_checkpoint_writer(kind, root / kind, default_model_dir, seed=seed)
            for kind, seed in (("deepseek_v2", 12), ("deepseek_v3", 13))}


def _check(model_dir, prompts, num_tokens, **engine_kwargs) -> tuple[Engine, list[int]]:
    engine = Engine(model_dir, device="cpu", max_total_tokens=4096, **engine_kwargs)
    outs = engine.generate(prompts, SamplingParams(max_tokens=num_tokens, **GREEDY))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    matched = [assert_greedy_matches(out.token_ids, *hf_greedy(hf, prompt, num_tokens))
               for prompt, out in zip(prompts, outs)]
    assert_pages_settled(engine)
    return engine, matched


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_matches_transformers(deepseek_dirs, kind):
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 23, 70)]
    _, matched = _check(deepseek_dirs[kind], prompts, 24)
    assert max(matched) >= 16, f"every sequence parted early: {matched}"


def test_triton_mla_backend_matches_transformers(deepseek_dirs, monkeypatch):
    """The GPU backend (Triton MLA decode kernel, in Triton's interpreter on CPU): decode
    batches through the kernel, prefill chunks through the torch path."""
    monkeypatch.setenv("PD_SERVE_TRITON_CPU", "1")
    from kernels import mla_decode
    launches = mla_decode.triton_launches
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (9, 40)]
    engine, matched = _check(deepseek_dirs["deepseek_v3"], prompts, 12, attention_backend="triton")
    assert engine.attention_backend == "triton" and mla_decode.triton_launches > launches
    assert max(matched) >= 8, f"every sequence parted early: {matched}"


def test_deepseek_v3_long_prompt_in_chunks_past_yarn_original_length(deepseek_dirs):
    """A 150-token prompt in 64-token chunks (each attends over the cached latents before it),
    past YaRN's original_max_position_embeddings (64)."""
    gen = torch.Generator().manual_seed(10)
    prompt = torch.randint(3, 49152, (150,), generator=gen).tolist()
    _check(deepseek_dirs["deepseek_v3"], [prompt], 12, chunked_prefill_size=64)


def test_config_reads_mla_and_deepseek_moe(deepseek_dirs):
    v2 = ModelConfig.from_dir(deepseek_dirs["deepseek_v2"])
    v3 = ModelConfig.from_dir(deepseek_dirs["deepseek_v3"])
    for cfg in (v2, v3):
        assert cfg.is_mla and cfg.num_kv_heads == 1 and cfg.head_dim == 32 + 8
        assert cfg.rope_dim == 8 and cfg.rope_interleave
        assert cfg.mlp_only_layers == (0,) and cfg.shared_expert_intermediate_size == 32
        assert not cfg.shared_experts_gated
    assert (v2.scoring_func, v2.topk_method, v2.q_lora_rank) == ("softmax", "group_limited_greedy", 0)
    assert (v3.scoring_func, v3.topk_method, v3.q_lora_rank) == ("sigmoid", "noaux_tc", 24)
    assert v3.routed_scaling_factor == 2.5 and v3.norm_topk_prob and v3.rope_scaling["rope_type"] == "yarn"


def test_kv_pool_and_handshake_hold_the_latent_only(deepseek_dirs):
    """bytes per token = layers x (kv_lora_rank + qk_rope_head_dim) x itemsize, in the pool and
    in the layout a prefill worker announces; a latent pool pairs with itself, not a K/V one."""
    engine = Engine(deepseek_dirs["deepseek_v3"], device="cpu", max_total_tokens=256)
    cfg = engine.model_config
    latent = cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    pool = engine.kv_pool
    assert pool.layout.num_planes == 1 and pool.layout.bytes_per_token == latent
    assert pool.num_bytes == pool.num_tokens * latent
    announced = model_layout(engine)
    assert announced.bytes_per_token == latent and announced.num_kv_heads == 1
    two_planes = KVLayout(**{**announced.__dict__, "num_planes": 2})
    assert "num_planes" in layout_mismatch(announced, two_planes.__dict__)


def test_latent_pages_travel_bit_exact_with_latent_bytes():
    """A 1-plane pool through the sender/receiver handshake (tcp): the pages arrive bit-exact
    and the bytes moved are the latent's."""
    layout = KVLayout(num_layers=3, page_size=4, num_kv_heads=1, head_dim=40, dtype="float32",
                      num_planes=1)
    torch.manual_seed(0)
    src_pool, dst_pool = KVPool(layout, 16, "cpu"), KVPool(layout, 16, "cpu")
    src_pool.buffer.normal_()
    receiver = KVReceiver(dst_pool, "tcp", timeout_s=10)
    sender = KVSender(src_pool, "tcp", timeout_s=10)
    try:
        sender.connect(receiver.address)
        receiver.expect("r", [9, 2, 14])
        sender.send("r", receiver.address, [1, 5, 7], [9, 2, 14])
        results, deadline = [], time.monotonic() + 10
        while not results and time.monotonic() < deadline:
            results += receiver.poll()
            time.sleep(0.01)
        assert [r.ok for r in results] == [True]
        assert results[0].num_bytes == 3 * layout.page_size * 3 * 40 * 4
        assert torch.equal(dst_pool.buffer[:, :, [9, 2, 14]], src_pool.buffer[:, :, [1, 5, 7]])
    finally:
        sender.close()
        receiver.close()


def test_absorbed_decode_equals_expanded_attention():
    """One context attended two ways: as a decode row (weight absorption, MQA over the latent)
    and as the last token of a prefill row (kv_b_proj expanded); the same output."""
    H, R, Dr, Dn, Dv, L = 4, 32, 8, 16, 16, 11
    layout = KVLayout(num_layers=1, page_size=4, num_kv_heads=1, head_dim=R + Dr, dtype="float64",
                      num_planes=1)
    gen = torch.Generator().manual_seed(1)
    q_nope, q_pe = torch.randn(L, H, Dn, generator=gen, dtype=torch.float64), \
        torch.randn(L, H, Dr, generator=gen, dtype=torch.float64)
    latent, k_pe = torch.randn(L, R, generator=gen, dtype=torch.float64), \
        torch.randn(L, Dr, generator=gen, dtype=torch.float64)
    kv_b = torch.randn(H * (Dn + Dv), R, generator=gen, dtype=torch.float64) * 0.2
    pages = [2, 0, 3]
    slots = torch.tensor([pages[i // 4] * 4 + i % 4 for i in range(L)])
    backend = TorchMLABackend(KVPool(layout, 4, "cpu"), H, R, 0.2)
    backend.plan(AttentionMetadata([L], [L], [pages], slots))
    expanded = backend.run_mla(0, q_nope, q_pe, latent, k_pe, kv_b)[-1]  # [H, Dv]
    backend.plan(AttentionMetadata([1], [L], [pages], slots[-1:]))
    absorbed = backend.run_mla(0, q_nope[-1:], q_pe[-1:], latent[-1:], k_pe[-1:], kv_b)[0]
    torch.testing.assert_close(absorbed, expanded, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
def test_tp2_ep2_engine_equals_one_rank(deepseek_dirs, kind):
    """Heads split over two ranks (each storing the whole latent), the experts too."""
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (6, 30)]
    params = SamplingParams(max_tokens=10, **GREEDY)
    options = dict(device="cpu", max_total_tokens=512, chunked_prefill_size=16)
    want = [o.token_ids for o in Engine(deepseek_dirs[kind], **options).generate(prompts, params)]
    engine = Engine(deepseek_dirs[kind], tp=2, ep_size=2, **options)
    try:
        assert engine.kv_pool.layout.num_kv_heads == 1  # the whole latent on this rank
        got = [o.token_ids for o in engine.generate(prompts, params)]
    finally:
        engine.close()
    assert got == want


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
def test_grouped_routing_equals_transformers_router(deepseek_dirs, kind):
    """The same experts and weights as transformers' router, over many random tokens."""
    from pd_serve.model.moe_routing import grouped_topk
    hf = transformers.AutoModelForCausalLM.from_pretrained(deepseek_dirs[kind], dtype=torch.float32)
    router = hf.model.layers[1].mlp.gate
    cfg = ModelConfig.from_dir(deepseek_dirs[kind])
    x = torch.randn(256, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    _, want_weights, want_ids = router(x)
    weights, ids = grouped_topk(x, router.weight, cfg, getattr(router, "e_score_correction_bias", None))
    want_order, order = want_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order))


def test_prefix_cache_on_and_off_give_the_same_tokens(deepseek_dirs):
    """Latent pages reused by the prefix cache (shared system prompts, evictions) change no token."""
    rng = random.Random(2)
    system = [[rng.randrange(3, 400) for _ in range(n)] for n in (37, 21)]
    waves = [[s + [rng.randrange(3, 400) for _ in range(5 + 7 * turn + i)]
              for i, s in enumerate(system * 2)] for turn in range(2)]
    params = SamplingParams(max_tokens=6, **GREEDY)
    options = dict(device="cpu", page_size=8, max_total_tokens=8 * 30, chunked_prefill_size=48)
    on = Engine(deepseek_dirs["deepseek_v3"], **options)
    off = Engine(deepseek_dirs["deepseek_v3"], disable_radix_cache=True, **options)
    for wave in waves:
        want = [o.token_ids for o in off.generate(wave, params)]
        assert [o.token_ids for o in on.generate(wave, params)] == want
    assert on.prefix_cache.hit_tokens > 0
    assert_pages_settled(on)
