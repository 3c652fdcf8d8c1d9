"""What the kernels read before their PDL wait (kernels/_triton.py): only what no kernel of the
forward writes. On the CPU PDL is off, so a load of the kernel before's output moved ahead of
`gdc_wait()` would pass every other test there and read stale data on a GPU. This test reads
the kernels' source: each tl.load ahead of a kernel's wait goes through one of the pointer
arguments named here, and every kernel with a wait is named.
"""

from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "kernels"

# kernel -> the pointer arguments it may load before its wait (weights, scales, the host's
# staged positions and slots, RoPE's tables)
PREWAIT_READS = {
    "gemv_kernel": {"w_ptr", "w_scale_ptr", "bias_ptr"},
    "rms_norm_kernel": {"w_ptr"},
    "rope_store_kv_kernel": {"pos_ptr", "slot_ptr", "cos_ptr", "sin_ptr", "q_norm_ptr",
                             "k_norm_ptr"},
    # the step's query blocks, lengths and page lists, which the host stages
    "attention_kernel": {"q_blocks_ptr", "qo_indptr_ptr", "seq_lens_ptr", "kv_indptr_ptr",
                         "kv_indices_ptr"},
    "route_kernel": {"w_ptr", "norm_w_ptr"},
    "expert_gate_up_gemv_kernel": set(),
    # the expert ids: written by the routing two launches back, which the kernel between
    # (gate/up) waits on before it lets this one start (kernels/moe_batch1.py)
    "expert_down_gemv_kernel": {"ids_ptr", "w_ptr"},
    "fp8_gemm_kernel": {"w_ptr", "s_ptr"},
    "fp8_quant_kernel": set(),
    "split_k_reduce_kernel": set(),
}


def _calls(node: ast.AST, name: str) -> bool:
    """Whether node holds a call of something named `name` (an attribute or a plain name)."""
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            func = call.func
            if (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")) == name:
                return True
    return False


def prewait_loads(kernel: ast.FunctionDef) -> set[str]:
    """The *_ptr names that tl.load calls use in the statements before the one that waits."""
    names = set()
    for stmt in kernel.body:
        if _calls(stmt, "gdc_wait"):
            return names
        for call in ast.walk(stmt):
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "load" and call.args):
                names |= {n.id for n in ast.walk(call.args[0])
                          if isinstance(n, ast.Name) and n.id.endswith("_ptr")}
    raise AssertionError(f"{kernel.name} has no statement that calls gdc_wait")


def waiting_kernels() -> dict[str, ast.FunctionDef]:
    """Every function under kernels/ whose own body (not a function nested in it) calls
    gdc_wait, by name."""
    found = {}
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                    _calls(s, "gdc_wait") for s in node.body if not isinstance(s, ast.FunctionDef)):
                assert node.name not in found, f"two kernels named {node.name}"
                found[node.name] = node
    return found


def test_every_waiting_kernel_is_listed():
    assert set(waiting_kernels()) == set(PREWAIT_READS)


def test_loads_before_the_wait_read_only_what_no_kernel_writes():
    for name, kernel in waiting_kernels().items():
        read = prewait_loads(kernel)
        assert read <= PREWAIT_READS[name], f"{name} reads {sorted(read)} before its PDL wait"


def test_a_load_of_the_kernel_befores_output_ahead_of_the_wait_is_caught():
    source = '''
def k(x_ptr, w_ptr, PDL):
    w = tl.load(w_ptr + 1)
    x = tl.load(x_ptr + 0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    y = tl.load(x_ptr + 2)
'''
    kernel = ast.parse(source).body[0]
    assert prewait_loads(kernel) == {"w_ptr", "x_ptr"}
