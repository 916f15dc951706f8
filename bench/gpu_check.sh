#!/usr/bin/env bash
# The GPU run of issue 51 (bench/README.md "GPU run": the plan, the two calls, the budgets): the heal of the default
# SmolLM2-135M conversion to 10^7 tokens, tlm compare at GPU scale, the 435M recipes' training step, conversion of
# random 1B / 8B Llamas; each phase in its own process with a budget, the result file rewritten as items finish.
#   python bench/gpu_check.py --prepare          # here, once: .gpu/ (the GGUF in two parts, the gguf wheel)
#   bash bench/gpu_check.sh --dry                # CPU: every phase at tiny shapes (the default tests run it)
#   bash bench/gpu_check.sh --dry --device cuda --out $OUT/smoke.json   # call 1: the smoke, stashes GGUF part 1
#   bash bench/gpu_check.sh --out $OUT/gpu.json                         # call 2: the run (9 minutes)
# Options: python bench/gpu_check.py --help
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# a wheel this call carries (.gpu/wheels: gguf) for a machine that lacks it: installed once, beside the machine's own
site="${TLM_GPU_SITE:-/tmp/tlm-gpu-site}"
if [ -d .gpu/wheels ] && ! python3 -c "import gguf" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .gpu/wheels/*.whl
fi
if [ -d "$site" ]; then export PYTHONPATH="$PYTHONPATH:$site"; fi
exec python3 bench/gpu_check.py "$@"
