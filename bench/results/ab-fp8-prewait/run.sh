#!/usr/bin/env bash
# A/B of the batch-1 decode step: this tree (new) against copies in ab_*/ (name:folder pairs in
# VARIANTS), alternating, for each of QUANTS; PART_QUANTS limits the ab_part variant.
set -u
export PD_SERVE_COMMIT=$1 PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
[ -f /tmp/site/.installed ] || OUT=$OUT bash scripts/gpu_check.sh none > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "${TESTS:-1}" = 1 ]; then
  timeout 240 python3 -m pytest -q -x tests/kernels/test_gemv.py -k cuda 2>&1 | tail -3
  timeout 200 python3 -m pytest -q -x tests/gpu/test_model_vs_hf_gpu.py -k "batch1" 2>&1 | tail -3
fi
ARGS="--preset llama3-8b --enable-batch1-kernels --batch-sizes 1,64 --contexts 1024 --no-hf --prefill-grid 1x128 --prefill-repeats 1 --decode-steps 32"
for round in ${ROUNDS:-1}; do
  for q in ${QUANTS:-fp8 bf16}; do
    qa=""; [ $q = fp8 ] && qa="--quantization fp8"
    for v in ${VARIANTS:-new:. old:ab_old}; do
      name=${v%%:*}; dir=${v#*:}
      (cd $dir && PYTHONPATH=$PWD:/tmp/site timeout 150 python3 -m bench.one_batch $ARGS $qa --output $OUT/$name-$q-r$round.json > $OUT/$name-$q-r$round.log 2>&1)
      python3 - $OUT/$name-$q-r$round.json <<'PY'
import json, sys
for f in sys.argv[1:]:
    try:
        d = json.load(open(f))
        print(f.rsplit('/', 1)[-1], [(r["batch"], round(r["ms_per_step"], 3), round(r["ratio_to_floor"], 3)) for r in d["decode"]], flush=True)
    except Exception as e:
        print(f, "failed", e, flush=True)
PY
    done
  done
done
