#!/usr/bin/env bash
# The attention's early exit before the PDL wait (8290840) against 93ff6e1: FP8 batch 1 at a
# server's context length (64 splits, 17 with keys) and at the bench's (17 splits).
set -u
export PD_SERVE_COMMIT=$1 PYTHONUNBUFFERED=1
O=$OUT; mkdir -p $O/r; export OUT=$O/r
[ -f /tmp/site/.installed ] || OUT=$OUT bash scripts/gpu_check.sh none > $OUT/setup.log 2>&1
echo "setup [${SECONDS}s]"
A="--preset llama3-8b --quantization fp8 --enable-batch1-kernels --batch-sizes 1 --contexts 1024 --no-hf --prefill-grid 1x128 --prefill-repeats 1 --decode-steps 32"
r() {  # tree dir, name, extra args
  f=$OUT/$2; (cd $1 && PYTHONPATH=$PWD:/tmp/site timeout 150 python3 -m bench.one_batch $A $3 --output $f.json > $f.log 2>&1)
  echo "$2 [${SECONDS}s]: $(grep -E '^bs1 ' $f.log | awk '{print $4}')"
}
r . new-ctx131k "--context-length 131072"
r ab_old old-ctx131k "--context-length 131072"
r . new-ctx131k-r2 "--context-length 131072"
r ab_old old-ctx131k-r2 "--context-length 131072"
PYTHONPATH=$PWD:/tmp/site timeout 70 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_paged_attention.py -k "cuda and (graph_replays or decode_matches or fp8)" > $OUT/kernel-tests.log 2>&1
echo "tests [${SECONDS}s]: $(tail -1 $OUT/kernel-tests.log)"
cd $O && tar czf r.tgz r && rm -rf r
