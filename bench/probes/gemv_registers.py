"""Registers a thread of kernels/gemv.py's GEMV for sm_90a, on any machine, GPU or not: Triton
compiles each configuration to PTX for an H100/H200 target and the ptxas that ships in Triton's
wheel (`ptxas-blackwell`, CUDA 13) reports registers and spills. Registers bound how many
programs share an SM (65,536 a SM), and so how many weight loads are in flight: the figures
behind kernels/gemv.py's docstring. They are the installed Triton's (3.9 in the CPU venv on
2026-12-01; the H200 machine runs 3.6, whose code may differ).

    python bench/probes/gemv_registers.py                          # kernels/gemv.py's choices
    python bench/probes/gemv_registers.py --rowsum "4,1024,4 8,1024,8"   # and FP8 row-sum ones
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile, do not interpret
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import gemv  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"
# (label, fp8, glu, block_n, block_k, num_warps, num_stages, rowsum): kernels/gemv.py's choices
# at Llama-3.1-8B's shapes (N, K) (gate/up: the fused [gate | up] weight, GLU halves block_n)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate/up": (28672, 4096), "down": (4096, 14336)}


def gemv_cfgs(extra_rowsum: list) -> list:
    rows = []
    for fp8 in (True, False):
        for name, (n, k) in SHAPES.items():
            bn, bk, warps, stages, rowsum = gemv._block_config(n, k, fp8)
            glu = name == "gate/up"
            rows.append((f"{'fp8' if fp8 else 'bf16'} {name}", fp8, glu,
                         max(1, bn // 2) if glu else bn, bk, warps, stages, rowsum))
    for bn, bk, warps in extra_rowsum:  # FP8 row-sum configurations, not GLU
        rows.append(("fp8 extra", True, False, bn, bk, warps, 1, True))
    return rows


def registers(kernel, signature: dict, constexprs: dict, num_warps: int, num_stages: int) -> tuple:
    """(registers a thread, spill-store bytes) of one configuration."""
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=TARGET,
                              options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        out = subprocess.run([str(PTXAS), "-arch=sm_90a", "-v", str(ptx), "-o", str(ptx) + ".o"],
                             capture_output=True, text=True, timeout=120)
    text = out.stderr + out.stdout
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores", text)
    if regs is None:
        raise RuntimeError(f"ptxas said: {text.strip()[:300]}")
    return int(regs.group(1)), int(spill.group(1)) if spill else 0


def programs_per_sm(regs: int, num_warps: int) -> int:
    return min(65536 // (regs * 32 * num_warps), 64 // num_warps, 32)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rowsum", default="", type=lambda v: [tuple(map(int, c.split(",")))
                                                          for c in v.split()],
                    help='FP8 row-sum configurations to add, "BN,BK,WARPS BN,BK,WARPS ..."')
    args = ap.parse_args()
    if not PTXAS.exists():
        sys.exit(f"no {PTXAS}: this Triton wheel ships no ptxas for sm_90a")
    gemv.tl = tl
    base = {"x_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32", "K": "i32"}
    rows = []
    kernel = gemv._kernel._build(triton)
    sig = {**base, "w_scale_ptr": "*fp32", "bias_ptr": "*bf16", **{
        k: "constexpr" for k in ("FP8", "HAS_BIAS", "GLU", "ROWSUM", "BLOCK_N", "BLOCK_K", "PDL")}}
    for label, fp8, glu, bn, bk, warps, stages, rowsum in gemv_cfgs(args.rowsum):
        consts = {"FP8": fp8, "HAS_BIAS": False, "GLU": glu, "ROWSUM": rowsum, "BLOCK_N": bn,
                  "BLOCK_K": bk, "PDL": True}
        regs = registers(kernel, {**sig, "w_ptr": "*fp8e4nv" if fp8 else "*bf16"}, consts, warps,
                         stages)
        form = "rowsum" if rowsum else "tile"
        rows.append((f"{label} {form} ({bn}, {bk}, {warps}w)", bn, bk, warps, *regs))
    print(f"{'configuration':34} {'regs':>5} {'spill B':>8} {'programs/SM':>12}")
    for label, bn, bk, warps, regs, spill in rows:
        print(f"{label:34} {regs:5} {spill:8} {programs_per_sm(regs, warps):12}")


if __name__ == "__main__":
    main()
