#!/usr/bin/env bash
# The GPU machine's whole check in one command: install the carried wheels, run the GPU tests,
# the one-batch benchmark and the end-to-end tests on --device cuda; logs and JSON go to $OUT.
#
# Here (once):   bash ../shared/device/fetch-gpu-wheels.sh pyzmq msgpack prometheus-client gguf \
#                  openai pydantic pydantic-core annotated-types typing-inspection distro jiter sniffio \
#                  httpx2 httpcore2 truststore idna anyio typing-extensions h11  (versions as the CPU venv)
#                mkdir -p .gpu-model/tok && cp <SmolLM2 folder>/{tokenizer.json,tokenizer_config.json,generation_config.json} .gpu-model/tok/
# There:         OUT=... PD_SERVE_COMMIT=<sha> bash scripts/gpu_check.sh [step ...]
#                ($OUT/summary.json: each step's status and pytest summary, with the commit, GPUs
#                and versions; $OUT/all.tgz: all of $OUT; the script exits 1 when a step failed)
# Steps: tests (kernels + gputests) gputests onebatch fp8 (FP8 weights) offline (FP8, 1000 x 1000)
# offline-fp8kv (the same with an FP8 KV cache and 512 running requests), pdl (decode at batch 1
# and 64 with PD_SERVE_PDL=0 then 1, or PDL_VALUES: programmatic dependent launch off / on, kernels/_triton.py)
# w4a16 (W4A16 GEMM vs bf16 GEMM, Llama-3.1-8B layer shapes); on two GPUs (nvidia-h200-x2),
# for the phase-ratio issue: profile (pd-serve profile of a dummy Llama-3.1-8B-shaped model),
# phaseratio-prefill (2048 in / 128 out) and phaseratio-decode (256 in / 1024 out): 1P1D,
# colocated x2 and x1, rates from the profile's predicted capacities, SLOs ttft=2000 ms and
# tpot=15 ms (prefill-heavy) or 8 ms (decode-heavy; 10 ms at 461f0eb stressed nothing);
# phaseratio-limits: the prefill-heavy workload on colocated x2 with the limits `pd-serve plan
# --capacity` recommends (--max-running-requests 16 --chunked-prefill-size 1024), at PR_RATES.
# phaseratio-all-prefill / -decode (the 4-8 GPU issue: nvidia-h200-x4 or -x8): every xPyD split
# of the machine's GPUs and colocated on all of them, 400-prompt bursts, rates from the profile
# (PROFILE=bench/results/profile-h200-llama3-8b.json to skip the profile step); the
# planner's predictions for them are in bench/results/plan-h200-4-8-gpus/.
# transfer (GPU transfer tests + bench/transfer.py over torch and ipc with 32 requests in flight,
# then ipc with 8 / 32 / 128 in flight; two GPUs: kind nvidia-h200-x2), transfer-fp8
# (the same bench with an FP8 KV cache: the quantization issue's half-the-bytes check); tp (two
# GPUs: TP 2 vs TP 1 in bf16, teacher-forced; bench/tp_handoff.py: 8k-token prefill TP 2 vs TP 1
# and a 1P(TP2)-1D(TP1) cluster sharing GPU 0, with its transfer rate); e2e
# (default: tests onebatch e2e, in that order). Carry .whl and .gpu-model.
# TRANSFER_ARGS adds flags to the transfer benchmark (e.g. --sizes-mib 8,64).
# ONEBATCH_ARGS adds flags to the one-batch and fp8 runs (e.g. --profile, --enable-batch1-kernels).
# PROFILE: the profile the phase-ratio steps take their rates from (default: this run's, from the
# profile step); PR_TIMEOUT: seconds per phase-ratio step (default 570). burst: 1000 x (2048 in,
# 128 out) at request rate inf against 1P1D on one GPU over ipc, then colocated x1 (the
# serving-under-load issue: 0 failed requests; serving-burst-h200-*.json). Each step gets SIGINT at
# its timeout, so a benchmark still writes what it measured.
# The GPU machine cannot carry the 94 MB default GGUF, so the end-to-end tests serve a tiny
# random Llama written there with SmolLM2's tokenizer, under the default model's name.
set -uo pipefail
OUT=${OUT:-/tmp/pd-serve-out}
mkdir -p "$OUT"
# (once per machine: a second run of this script, side by side, must not rewrite what the
# first one imports)
[ -f /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && touch /tmp/site/.installed; } || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 PD_SERVE_COMMIT=${PD_SERVE_COMMIT:-unknown}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

model=/tmp/gpu-model/SmolLM2-135M-Instruct
big=/tmp/gpu-model/llama3-8b-dummy  # config + tokenizer only: served with --load-format dummy
python3 - "$model" "$big" <<'EOF' || exit 1
import json, shutil, sys
from pathlib import Path
sys.path.insert(0, "tests")
from conftest import write_tiny_checkpoint
# Llama-3.1-8B's shape with SmolLM2's tokenizer (so its vocabulary, 49152 rows, not 128256).
big = Path(sys.argv[2])
big.mkdir(parents=True, exist_ok=True)
for f in Path(".gpu-model/tok").iterdir():
    shutil.copy(f, big / f.name)
(big / "config.json").write_text(json.dumps({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 8192, "vocab_size": 49152,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}))
# head_dim 64, so the flashinfer backend serves it (its kernels have no head_dim 16); the
# default model's context (8192), which the end-to-end tests' limits assume.
write_tiny_checkpoint("llama3", Path(sys.argv[1]), Path(".gpu-model/tok"), seed=1,
                      shape=dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                 max_position_embeddings=8192))
EOF
# The tests' default model (tests/conftest.py's default_model_dir) is the GGUF this machine
# cannot carry: every test step takes the tiny model above instead (tests/gpu's profile test
# errored at setup without it until 2026-12-02).
export PD_SERVE_TEST_MODEL=$model

step() {  # step NAME TIMEOUT_S CMD...: run, log to $OUT/NAME.log, print the tail
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "== $name: $*"
  timeout -s INT -k 30 "$limit" "$@" >"$OUT/$name.log" 2>&1  # INT: benches write what they have
  local rc=$?
  echo "== $name rc=$rc in $((SECONDS - start)) s"
  [ $rc -eq 0 ] || echo "$name rc=$rc" >>"$OUT/failed-steps.txt"  # (steps run side by side too)
  # one line per step for summary.json: name, rc, seconds, pytest's last summary line if any
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" \
    "$(grep -E '[0-9]+ (passed|failed|error)' "$OUT/$name.log" | tail -n 1 | tr -d '=' | xargs)" \
    >>"$OUT/steps.tsv"
  tail -n 15 "$OUT/$name.log"
}

e2e() {  # the end-to-end tests in five groups side by side (a cluster start costs ~30 s on GPU)
  export PD_SERVE_TEST_DEVICE=cuda
  local t=tests/e2e gpu1=$(( $(nvidia-smi -L | wc -l) > 1 ? 1 : 0 ))
  CUDA_VISIBLE_DEVICES=0 step e2e-cluster 420 python3 -m pytest -v -p no:cacheprovider $t/test_cluster.py \
    -k "not kill and not disconnect" &
  sleep 20  # the first group compiles flashinfer's kernels into the shared JIT cache
  CUDA_VISIBLE_DEVICES=$gpu1 step e2e-openai 420 python3 -m pytest -v -p no:cacheprovider $t/test_openai_api.py &
  CUDA_VISIBLE_DEVICES=0 step e2e-variants 420 python3 -m pytest -v -p no:cacheprovider \
    $t/test_overlap_cluster.py $t/test_fp8_cluster.py $t/test_quantized_cluster.py &
  CUDA_VISIBLE_DEVICES=$gpu1 step e2e-faults 420 python3 -m pytest -v -p no:cacheprovider \
    $t/test_cluster.py -k "kill or disconnect" &
  step e2e-launch 420 python3 -m pytest -v -p no:cacheprovider $t/test_launch.py $t/test_tp_cluster.py &
  wait
}

burst() {  # one cluster at a time on GPU 0, the Llama-3.1-8B shape with dummy weights
  local cfg launch pid
  for cfg in 1p1d colocated1; do
    case $cfg in
      1p1d) launch="--prefill 1 --decode 1 --mem-fraction-static 0.42" ;;
      colocated1) launch="--prefill 0 --decode 0 --colocated 1" ;;
    esac
    python3 -m pd_serve.cli --log-level warning launch $launch --gpu-ids 0 --port 8400 \
      --model "$big" --load-format dummy --device cuda >"$OUT/burst-$cfg-cluster.log" 2>&1 &
    pid=$!
    python3 - <<'PY'  # until the cluster is ready (at most 5 minutes)
import time, urllib.request
for _ in range(300):
    try:
        urllib.request.urlopen("http://127.0.0.1:8400/health", timeout=2)
        break
    except OSError:
        time.sleep(1)
PY
    step burst-$cfg "${BURST_TIMEOUT:-300}" python3 bench/serving.py \
      --base-url http://127.0.0.1:8400 --num-prompts 1000 --request-rate inf --input-len 2048 \
      --output-len 128 --no-progress --output "$OUT/serving-burst-h200-$cfg.json"
    sleep 3  # the workers report their pages once a second
    python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8400/metrics').read().decode())" \
      | grep -E '^pd_serve:(kv_pages_used|requests_total|requests_rejected|protocol_errors)' \
      >"$OUT/burst-$cfg-metrics.txt"
    kill -INT $pid; wait $pid
  done
}

# the phase-ratio steps take their rates from this profile (this run's, else PROFILE=...)
profile=${PROFILE:-$OUT/profile-h200-llama3-8b.json}
steps=${*:-tests onebatch e2e}
for s in $steps; do
  case $s in
    tests) step kernels 240 python3 -m pytest -q -p no:cacheprovider tests/kernels
           step gputests 300 python3 -m pytest -q -p no:cacheprovider tests/gpu ;;
    gputests) step gputests 300 python3 -m pytest -q -p no:cacheprovider tests/gpu ;;
    onebatch) step onebatch 420 python3 -m bench.one_batch --preset llama3-8b \
             --output "$OUT/one-batch-h200-llama3-8b.json" ${ONEBATCH_ARGS:-} ;;
    fp8) step fp8 420 python3 -m bench.one_batch --preset llama3-8b --quantization fp8 \
           --batch-sizes 1,64 --contexts 1024 --prefill-grid 4x2048 \
           --output "$OUT/one-batch-h200-llama3-8b-fp8.json" ${ONEBATCH_ARGS:-} ;;
    offline) step offline 420 python3 bench/offline.py --preset llama3-8b --quantization fp8 \
           --num-prompts 1000 --input-len 1000 --output-len 1000 \
           --output "$OUT/offline-h200-llama3-8b-fp8.json" ;;
    offline-fp8kv) step offline-fp8kv 420 python3 bench/offline.py --preset llama3-8b \
           --quantization fp8 --kv-cache-dtype fp8_e4m3 --max-running-requests 512 --cuda-graph-max-bs 512 \
           --num-prompts 1000 --input-len 1000 --output-len 1000 \
           --output "$OUT/offline-h200-llama3-8b-fp8-fp8kv.json" ;;
    profile) step profile 420 python3 -m pd_serve.cli profile --model "$big" --load-format dummy \
           --device cuda --transfer-gbps 200 --transfer-latency-ms 2 \
           --decode-batches 1,8,32,64,128,256 --decode-contexts 256,1024,2304 \
           --mixed-points 2048:16:1024,1984:64:1024,1920:128:2048,1024:32:1024,256:16:256,256:128:1024,64:64:1024 \
           --output "$OUT/profile-h200-llama3-8b.json" ;;
    phaseratio-prefill) step pr-prefill "${PR_TIMEOUT:-570}" python3 bench/phase_ratio.py --device cuda \
           --configs 1p1d,colocated2,colocated1 --rate-sweep plan --profile "$profile" \
           --slo ttft=2000,tpot=15 --model "$big" --worker-args "--load-format dummy" \
           --input-len 2048 --output-len 128 --num-prompts 100 --no-progress \
           --output-dir "$OUT/phase-ratio-prefill" ;;
    phaseratio-decode) step pr-decode "${PR_TIMEOUT:-570}" python3 bench/phase_ratio.py --device cuda \
           --configs 1p1d,colocated2,colocated1 --rate-sweep plan --profile "$profile" \
           --slo ttft=2000,tpot=8 --model "$big" --worker-args "--load-format dummy" \
           --input-len 256 --output-len 1024 --num-prompts 100 --no-progress \
           --output-dir "$OUT/phase-ratio-decode" ;;
    phaseratio-all-prefill) step pr-all-prefill "${PR_TIMEOUT:-570}" python3 bench/phase_ratio.py \
           --device cuda --rate-sweep plan --profile "$profile" --slo ttft=2000,tpot=15 \
           --model "$big" --worker-args "--load-format dummy" --input-len 2048 --output-len 128 \
           --num-prompts 400 --no-progress --output-dir "$OUT/phase-ratio-all-prefill" ;;
    phaseratio-all-decode) step pr-all-decode "${PR_TIMEOUT:-570}" python3 bench/phase_ratio.py \
           --device cuda --rate-sweep plan --profile "$profile" --slo ttft=2000,tpot=8 \
           --model "$big" --worker-args "--load-format dummy" --input-len 256 --output-len 1024 \
           --num-prompts 400 --no-progress --output-dir "$OUT/phase-ratio-all-decode" ;;
    phaseratio-limits) step pr-limits "${PR_TIMEOUT:-570}" python3 bench/phase_ratio.py --device cuda \
           --configs colocated2 --request-rates "${PR_RATES:-7,14,21,28,35}" \
           --slo ttft=2000,tpot=15 --model "$big" \
           --worker-args "--load-format dummy --max-running-requests 16 --chunked-prefill-size 1024" \
           --input-len 2048 --output-len 128 --num-prompts 100 --no-progress \
           --output-dir "$OUT/phase-ratio-prefill-colocated2-mr16" ;;
    transfer-fp8) step transfer-fp8 300 python3 bench/transfer.py --dtype float8_e4m3fn \
           --backends ipc,torch --in-flight-max-mib 1024 --output "$OUT/transfer-2xh200-fp8.json" ;;
    w4a16) step w4a16 180 python3 bench/w4a16.py --batch-sizes 1,16,64 --output "$OUT/w4a16-h200.json" ;;
    transfer) step transfertests 240 python3 -m pytest -q -p no:cacheprovider tests/transfer/test_transfer_gpu.py
              step transfer 420 python3 bench/transfer.py --backends torch,ipc --in-flight 32 \
                --in-flight-max-mib 1024 --output "$OUT/transfer-2xh200.json" ${TRANSFER_ARGS:-}
              for k in 8 32 128; do  # ipc with more or fewer requests in flight (1 GiB x 128: too big)
                step transfer-inflight$k 240 python3 bench/transfer.py --backends ipc --in-flight $k \
                  --sizes-mib $([ $k -le 32 ] && echo 8,64,256,1024 || echo 8,64) --latency-tokens 1024 \
                  --in-flight-max-mib 1024 --output "$OUT/transfer-2xh200-ipc-inflight$k.json"
              done ;;
    tp) PD_SERVE_RESULTS=$OUT/tp-agreement-2xh200.json step tpgpu 300 \
          python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_tp_gpu.py
        step tpbench 570 python3 bench/tp_handoff.py --preset llama3-8b --prefill-tokens 8192 \
          --model "$big" --load-format dummy --output "$OUT/tp-handoff-2xh200.json" ;;
    pdl) for v in ${PDL_VALUES:-0 1}; do  # programmatic dependent launch off / on (kernels/_triton.py)
           PD_SERVE_PDL=$v step onebatch-pdl$v 300 python3 -m bench.one_batch --preset llama3-8b \
             --enable-batch1-kernels --batch-sizes 1,64 --contexts 1024 --prefill-grid 1x512 \
             --no-hf --profile --output "$OUT/one-batch-h200-llama3-8b-pdl$v.json"
         done ;;
    e2e) e2e ;;
    burst) burst ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
python3 - "$OUT" <<'EOF'  # $OUT/summary.json: what ran, where, on which commit, and how it went
import json, os, sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
out = Path(sys.argv[1])
def ver(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return None
lines = (out / "steps.tsv").read_text().splitlines() if (out / "steps.tsv").exists() else []
steps = [dict(zip(("step", "rc", "seconds", "summary"), line.split("\t"))) for line in lines]
for s in steps:
    s["rc"], s["seconds"] = int(s["rc"]), int(s["seconds"])
json.dump({"commit": os.environ.get("PD_SERVE_COMMIT"),
           "gpus": (out / "gpu.txt").read_text().splitlines(),
           "versions": {n: ver(n) for n in ("torch", "triton", "flashinfer-python")},
           "steps": steps, "failed": [s["step"] for s in steps if s["rc"]]},
          open(out / "summary.json", "w"), indent=1)
EOF
# Everything in $OUT in one file too: the device tool brings back at most 8 files a call.
bundle=$(mktemp) && tar czf "$bundle" -C "$OUT" --exclude all.tgz . && mv "$bundle" "$OUT/all.tgz"
if [ -s "$OUT/failed-steps.txt" ]; then  # the script's status says whether every step passed
  echo "== failed: $(tr '\n' ' ' <"$OUT/failed-steps.txt")"
  exit 1
fi
