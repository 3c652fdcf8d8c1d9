"""MLA prefill attention two ways, at DeepSeek-V2-Lite's shape: the cached latents expanded
through kv_b_proj into per-head keys and values (what engine/attention/mla.py runs), against
weight absorption (queries into the latent space, MQA over the 576-wide latent, W_v after).

    python bench/mla_prefill.py                   # GPU: bench/results/mla-prefill-h200.json
    python bench/mla_prefill.py --device cpu --tokens 256 --output /tmp/p.json

Per chunk of n new tokens over a context of L (n == L: a whole prompt, causal; n < L: the chunk
after a cached prefix, masked): both through torch's scaled_dot_product_attention, bf16 on GPU
(float32 on CPU), timed in CUDA graphs (bench/w4a16.py's seconds_per_call), medians. Expansion
pads V to the query's 192 dims so flash attention takes it; absorption's 576-dim heads have no
flash kernel. The two outputs are compared (max abs difference).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python bench/mla_prefill.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench._common import device_name, git_commit, write_json  # noqa: E402
from bench.w4a16 import seconds_per_call  # noqa: E402

H, R, DR, DN, DV = 16, 512, 64, 128, 128  # DeepSeek-V2-Lite's attention
SCALE = (DN + DR) ** -0.5


def _pairs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in p.split("x")) for p in text.split(",") if p.strip()]


def expanded(q_nope, q_pe, latent, k_pe, w, mask):
    """[n, H, Dv]: kv_b_proj on every context latent, then multi-head attention."""
    L = latent.shape[0]
    k_nope, v = F.linear(latent, w).view(L, H, DN + DV).split([DN, DV], dim=-1)
    k = torch.cat([k_nope, k_pe[:, None].expand(-1, H, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    v = F.pad(v, (0, DN + DR - DV))
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                       v.transpose(0, 1)[None], attn_mask=mask,
                                       is_causal=mask is None, scale=SCALE)
    return o[0, ..., :DV].transpose(0, 1)


def absorbed(q_nope, q_pe, latent, k_pe, w, mask):
    """[n, H, Dv]: W_k into the queries, MQA over [latent | k_pe], then W_v."""
    w_k, w_v = w.view(H, DN + DV, R).split([DN, DV], dim=1)
    q = torch.cat([torch.bmm(q_nope.transpose(0, 1), w_k), q_pe.transpose(0, 1)], dim=-1)
    c = torch.cat([latent, k_pe], dim=-1)[None, None]  # [1, 1, L, R + Dr]
    o = F.scaled_dot_product_attention(q[None], c, c[..., :R], attn_mask=mask,
                                       is_causal=mask is None, scale=SCALE, enable_gqa=True)
    return torch.bmm(o[0], w_v.transpose(1, 2)).transpose(0, 1)


def run_case(n: int, L: int, device, dtype, args) -> dict:
    gen = torch.Generator(device).manual_seed(args.seed)
    rand = lambda *shape, std=1.0: (torch.randn(*shape, generator=gen, device=device) * std).to(dtype)  # noqa: E731
    q_nope, q_pe = rand(n, H, DN), rand(n, H, DR)
    latent, k_pe, w = rand(L, R), rand(L, DR), rand(H * (DN + DV), R, std=R ** -0.5)
    mask = None
    if n < L:  # the chunk's queries sit at positions L - n .. L - 1
        q_pos = torch.arange(L - n, L, device=device)[:, None]
        mask = torch.arange(L, device=device)[None, :] <= q_pos
    inputs = (q_nope, q_pe, latent, k_pe, w, mask)
    err = (expanded(*inputs).float() - absorbed(*inputs).float()).abs().max().item()
    row = {"new_tokens": n, "context": L, "max_abs_diff": err}
    for name, fn in (("expanded", expanded), ("absorbed", absorbed)):
        row[f"{name}_ms"] = seconds_per_call(lambda fn=fn: fn(*inputs), device, args.calls,
                                             args.repeats) * 1e3
    row["absorbed_over_expanded"] = row["absorbed_ms"] / row["expanded_ms"]
    print(f"n {n:5d} L {L:5d}: expanded {row['expanded_ms']:7.3f} ms  absorbed "
          f"{row['absorbed_ms']:7.3f} ms  ({row['absorbed_over_expanded']:.2f}x)  diff {err:.1e}",
          file=sys.stderr, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--chunks", type=_pairs, default=None,
                   help="NEWxCONTEXT comma list (default 2048x2048,8192x8192,2048x8192; CPU: 256x256,256x1024)")
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="JSON path (default bench/results/mla-prefill-h200.json on GPU)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    chunks = args.chunks or ([(2048, 2048), (8192, 8192), (2048, 8192)] if on_gpu
                             else [(256, 256), (256, 1024)])
    rows = [run_case(n, L, device, dtype, args) for n, L in chunks]
    output = args.output or (str(Path(__file__).parent / "results" / "mla-prefill-h200.json")
                             if on_gpu else None)
    if output:
        write_json(output, {"benchmark": "mla_prefill", "device": device_name(device),
                            "dtype": str(dtype).removeprefix("torch."), "heads": H,
                            "kv_lora_rank": R, "torch_version": torch.__version__,
                            "git_commit": git_commit(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
