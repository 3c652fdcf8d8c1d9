"""Probe (one H200, ~2 min): kernels/gemv.py on FP8 weights over a sweep of block configs against
torch._scaled_mm (dynamic per-token activation scales), Llama-3.1-8B's layer shapes; and batch-1
decode attention per layer at 1k / 4k / 8k context, flashinfer's tensor-core decode against
kernels/paged_attention.py, 32 layers in one CUDA graph. Writes $OUT/probe2-h200.json
(committed as bench/results/probe-bs1-attention-h200.json).

    PYTHONPATH=. python3 bench/probes/fp8_gemv_and_bs1_attention.py
"""
import itertools
import json
import os
import sys

sys.path.insert(0, ".")
import torch

from kernels import gemv
from pd_serve.model import fp8
from _graph_time import flashinfer_decode_one_row, graph_time  # noqa: E402 (bench/probes/)

dev = "cuda"
out = {"device": torch.cuda.get_device_name()}


shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096)}
res = []
orig = gemv._block_config
for name, (N, K) in shapes.items():
    if name == "lm_head":
        continue
    ws = [fp8.quantize_weight(torch.randn(N, K, device=dev) * 0.02) for _ in range(32)]
    x = torch.randn(1, K, dtype=torch.bfloat16, device=dev)
    def sm():
        for w, s in ws: fp8.fp8_linear_scaled_mm(x, w, s)
    us = graph_time(sm) * 1e3 / 32
    res.append({"shape": name, "method": "scaled_mm", "us": us, "gbps": N * K / us / 1e3}); print(res[-1], flush=True)
    best = None
    for cfg in itertools.product((4, 8, 16, 32), (512, 1024, 2048), (4, 8), (2, 4)):
        if cfg[0] * cfg[1] > 32768: continue
        gemv._block_config = lambda k, f, cfg=cfg: cfg
        def tg():
            for w, s in ws: gemv.gemv(x, w, s)
        try:
            us = graph_time(tg) * 1e3 / 32
        except Exception as e:
            print("fail", cfg, repr(e)[:200]); continue
        r = {"shape": name, "method": "gemv", "cfg": cfg, "us": us, "gbps": N * K / us / 1e3}
        res.append(r)
        if best is None or us < best["us"]: best = r
    print("best", best, flush=True)
    del ws
gemv._block_config = orig
out["fp8_gemv"] = res


from kernels.paged_attention import paged_decode_attention

L, S, Hq, Hkv, D = 32, 16, 32, 8, 128
att = []
for ctx in (1024, 4096, 8192):
    P = ctx // S
    kc = [torch.randn(P, S, Hkv, D, dtype=torch.bfloat16, device=dev) for _ in range(L)]
    vc = [torch.randn(P, S, Hkv, D, dtype=torch.bfloat16, device=dev) for _ in range(L)]
    q = torch.randn(1, Hq, D, dtype=torch.bfloat16, device=dev)
    w = flashinfer_decode_one_row(P, S, Hq, Hkv, D, tensor_cores=True, workspace_mib=256, device=dev)
    def fi():
        for i in range(L): w.run(q, (kc[i], vc[i]))
    fi(); torch.cuda.synchronize()
    ref = w.run(q, (kc[0], vc[0]))
    att.append({"ctx": ctx, "attention": "flashinfer-tc", "us_per_layer": graph_time(fi) * 1e3 / L})
    pt = torch.tensor([0, P], dtype=torch.int32, device=dev), torch.arange(P, dtype=torch.int32, device=dev)
    sl = torch.tensor([ctx], dtype=torch.int32, device=dev)
    def tr():
        for i in range(L): paged_decode_attention(q, kc[i], vc[i], *pt, sl, 1 / D ** 0.5)
    o = paged_decode_attention(q, kc[0], vc[0], *pt, sl, 1 / D ** 0.5)
    att.append({"ctx": ctx, "attention": "triton", "us_per_layer": graph_time(tr) * 1e3 / L,
                "maxdiff_vs_fi": (o.float() - ref.float()).abs().max().item()})
    print(att[-2:], flush=True)
    del kc, vc
out["attention_bs1"] = att
json.dump(out, open(os.environ.get("OUT", ".") + "/probe2-h200.json", "w"), indent=1)
