"""Probe (GPU): where a decode step's time goes, by taking kernels out of it.

Runs bench/one_batch.py (its --output JSON gains `ablation_skip`) with the named kinds of
kernel replaced by nothing: their outputs are left wrong (random weights, so nothing reads the
tokens), the rest of the step runs and is timed as usual, CUDA graphs and PDL included. The
step's time less the full step's is what that kind costs where it sits (its launches, gaps and
overlap with its neighbours): the most that fusing it away could save.

    --skip norm        RMSNorm (kernels/norm.py): x, and the residual stream, pass unchanged
    --skip rope_store  RoPE and the KV-cache store (kernels/kv_store.py): q passes unrotated
    --skip attention   the Triton decode attention: its output is q itself
    --skip lm_head     the LM head GEMV and the cast to float32: the logits are zeros
                       (one fill kernel), the argmax still runs
    --skip gemv        every GEMV of kernels/gemv.py (the decoder's linear layers under
                       --enable-batch1-kernels, and the LM head): an uninitialised output

`--set MODULE.NAME=INT,...` changes integer module constants first, as a kernel's block sizes:
`--set kernels.paged_attention._DECODE_BLOCK_N=32` times the step with 32-key decode tiles.

    PYTHONPATH=. python3 bench/probes/step_ablation.py --skip norm,rope_store -- \\
        --preset llama3-8b --quantization fp8 --enable-batch1-kernels --batch-sizes 1 \\
        --contexts 1024 --no-hf --output /tmp/ablation.json

The attention patch reaches the Triton decode kernel only (flashinfer hands one-row decode to it
under --enable-batch1-kernels).
"""

import argparse
import importlib
import json
import sys

sys.path.insert(0, ".")
import torch  # noqa: E402

KINDS = ("norm", "rope_store", "attention", "lm_head", "gemv")


def skip(kind: str) -> None:
    """Replace one kind of kernel by nothing, where the model and backends look it up."""
    if kind == "norm":
        from pd_serve.model import layers
        layers.rms_norm = lambda x, weight, eps, residual=None: (
            x if residual is None else (x, residual))
    elif kind == "rope_store":
        from pd_serve.engine.attention import base
        def no_rope_store(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
                          k_scale=1.0, v_scale=1.0, q_out=None, qk_norm=None):
            return q if q_out is None else q_out
        base.rope_store_kv = no_rope_store
    elif kind == "attention":
        from pd_serve.engine.attention import triton_backend
        triton_backend.paged_decode_attention = lambda q, *args, **kwargs: q
    elif kind == "lm_head":
        from pd_serve.model.llama import CausalLM
        CausalLM.compute_logits = lambda self, hidden: torch.zeros(
            hidden.shape[0], self.config.vocab_size, device=hidden.device)
    elif kind == "gemv":
        from kernels import gemv
        from pd_serve.model import fp8

        def no_gemv(x, weight, weight_scale=None, bias=None, silu_and_mul=False):
            n = weight.shape[0] // 2 if silu_and_mul else weight.shape[0]
            return torch.empty(1, n, dtype=x.dtype, device=x.device)
        gemv.gemv = fp8.gemv = no_gemv
    else:
        raise SystemExit(f"--skip takes {', '.join(KINDS)}; got {kind!r}")


def set_constant(assignment: str) -> None:
    """MODULE.NAME=INT: set an existing integer constant of an importable module."""
    target, _, value = assignment.partition("=")
    module_name, _, name = target.rpartition(".")
    module = importlib.import_module(module_name)
    if not isinstance(getattr(module, name, None), int):
        raise SystemExit(f"--set {assignment!r}: {module_name} has no integer {name}")
    setattr(module, name, int(value))


def main() -> int:
    argv = sys.argv[1:]
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (
        argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip", default="", help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--set", default="", help="comma-separated MODULE.NAME=INT")
    args = parser.parse_args(ours)
    settings = [item for item in args.set.split(",") if item]
    for assignment in settings:
        set_constant(assignment)
    kinds = [kind for kind in args.skip.split(",") if kind]
    for kind in kinds:
        skip(kind)
    from bench import one_batch
    status = one_batch.main(rest)
    if "--output" in rest:  # say in the result what was left out
        path = rest[rest.index("--output") + 1]
        with open(path) as f:
            record = json.load(f)
        record["ablation_skip"] = kinds
        record["ablation_set"] = settings
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main())
