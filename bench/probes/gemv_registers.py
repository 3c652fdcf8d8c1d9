"""Registers a thread of kernels/gemv.py's GEMV (and of bench/probes/fp8_gemv_rowsum.py's
row-sum form) for sm_90a, on any machine, GPU or not: Triton compiles each configuration to PTX
for an H100/H200 target and the ptxas that ships in Triton's wheel (`ptxas-blackwell`, CUDA 13)
reports registers and spills. Registers bound how many programs share an SM (65,536 a SM), and
so how many weight loads are in flight: the figures behind kernels/gemv.py's docstring. They
are the installed Triton's (3.9 in the CPU venv on 2026-12-01; the H200 machine runs 3.6,
whose code may differ).

    python bench/probes/gemv_registers.py            # kernels/gemv.py at this commit
    python bench/probes/gemv_registers.py --rowsum   # the probe's row-sum form
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
# (label, fp8, glu, block_n, block_k, num_warps, num_stages): kernels/gemv.py's choices
GEMV_CFGS = [("fp8 K<8192", True, False, *gemv._block_config(4096, True)),
             ("fp8 K>=8192", True, False, *gemv._block_config(14336, True)),
             ("bf16 K<8192", False, False, *gemv._block_config(4096, False)),
             ("bf16 K>=8192", False, False, *gemv._block_config(14336, False)),
             ("bf16 gate/up", False, True, max(1, gemv._block_config(4096, False)[0] // 2),
              *gemv._block_config(4096, False)[1:])]


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
    ap.add_argument("--rowsum", action="store_true", help="the row-sum probe's configurations")
    args = ap.parse_args()
    if not PTXAS.exists():
        sys.exit(f"no {PTXAS}: this Triton wheel ships no ptxas for sm_90a")
    gemv.tl = tl
    base = {"x_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32", "K": "i32"}
    rows = []
    if args.rowsum:
        import fp8_gemv_rowsum as probe
        sig = {**base, "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "BLOCK_N": "constexpr",
               "BLOCK_K": "constexpr", "PDL": "constexpr"}
        for bn, bk, warps in probe.CFGS:
            regs = registers(probe.gemv_rowsum, sig, {"BLOCK_N": bn, "BLOCK_K": bk, "PDL": True},
                             warps, 1)
            rows.append((f"rowsum ({bn}, {bk}, {warps} warps)", bn, bk, warps, *regs))
    else:
        kernel = gemv._kernel._build(triton)
        for label, fp8, glu, bn, bk, warps, stages in GEMV_CFGS:
            sig = {**base, "w_ptr": "*fp8e4nv" if fp8 else "*bf16", "w_scale_ptr": "*fp32",
                   "bias_ptr": "*bf16", **{k: "constexpr" for k in
                                           ("FP8", "HAS_BIAS", "GLU", "BLOCK_N", "BLOCK_K", "PDL")}}
            consts = {"FP8": fp8, "HAS_BIAS": False, "GLU": glu, "BLOCK_N": bn, "BLOCK_K": bk,
                      "PDL": True}
            rows.append((f"{label} ({bn}, {bk}, {warps} warps)", bn, bk, warps,
                         *registers(kernel, sig, consts, warps, stages)))
    print(f"{'configuration':34} {'regs':>5} {'spill B':>8} {'programs/SM':>12}")
    for label, bn, bk, warps, regs, spill in rows:
        print(f"{label:34} {regs:5} {spill:8} {programs_per_sm(regs, warps):12}")


if __name__ == "__main__":
    main()
