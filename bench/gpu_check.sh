#!/usr/bin/env bash
# The GPU run of issue 51 (bench/README.md "gpu_check.sh": the plan, the calls, the budgets): the heal of the default
# SmolLM2-135M conversion to 10^7 tokens, tlm compare at GPU scale, the 435M recipes' training step, conversion of
# random 1B / 8B Llamas; each phase in its own process with a budget, the result file rewritten as items finish.
#   python bench/gpu_check.py --prepare          # here, once: .gpu/ (the GGUF in two parts, the wheels)
#   bash bench/gpu_check.sh --dry                # CPU: every phase at tiny shapes (the default tests run it)
#   bash bench/gpu_check.sh --dry --device cuda --out $OUT/smoke.json   # call 1: the smoke, stashes GGUF part 1
#   bash bench/gpu_check.sh --out $OUT/gpu.json                         # call 2: the run (9 minutes)
# Options: python bench/gpu_check.py --help
set -euo pipefail
cd "$(dirname "$0")/.."
# wheels a call carries (.gpu/wheels: gguf; .gpu/wheels-transformers: the project's floor) for a machine that lacks
# them, installed once into a folder the next call on the same machine finds
site="${TLM_GPU_SITE:-/tmp/tlm-gpu-site}"
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
install() { python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$@"; }
if [ -d .gpu/wheels ] && ! python3 -c "import gguf" 2>/dev/null; then install .gpu/wheels/*.whl; fi
if [ -d .gpu/wheels-transformers ] && ! python3 -c "import sys, transformers as t
sys.exit(tuple(int(x) for x in t.__version__.split('.')[:2]) < (5, 24))" 2>/dev/null; then
  install .gpu/wheels-transformers/*.whl
fi
exec python3 bench/gpu_check.py "$@"
