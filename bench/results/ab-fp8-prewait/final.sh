#!/usr/bin/env bash
# The FP8 GEMV row-sum probe, then the one-batch A/B of this tree against ab_old (f6dabf1).
set -u
export PD_SERVE_COMMIT=$1 PYTHONUNBUFFERED=1
O=$OUT; mkdir -p $O/ab; export OUT=$O/ab
[ -f /tmp/site/.installed ] || OUT=$OUT bash scripts/gpu_check.sh none > /dev/null 2>&1
PYTHONPATH=$PWD:/tmp/site timeout 60 python3 -m pytest -q tests/kernels/test_gemv.py -k cuda 2>&1 | tail -1
PROBE_BUDGET_S=140 PYTHONPATH=$PWD:/tmp/site timeout 200 python3 bench/probes/fp8_gemv_rowsum.py > $OUT/probe.log 2>&1; tail -5 $OUT/probe.log
ROUNDS=1 VARIANTS="new:. old:ab_old" TESTS=0 bash ab_old/run.sh $1 2>&1 | grep json
cd $O && tar czf ab.tgz ab && rm -rf ab
