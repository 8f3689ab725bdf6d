#!/usr/bin/env bash
# Install vllm-pcp with its test extra into the active Python and run the CPU tests.
# GPU tests (tests/gpu) skip themselves on machines without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[test]"
python -m pytest -q tests "$@"
