#!/usr/bin/env bash
# GPU readiness check (issues 12, 26): tlm-convert smollm2-135m on cuda (wall time, peak memory) and its heal for
# 180 s (heal tokens/s, peak memory, out-of-domain perplexity ratio at 0/1/2/3 min), then training tokens/s, MFU and
# peak memory of the 435M recipes (4 mixers x uniform / cosine, eager and torch.compile, bf16) in the time left;
# ends within its budget (450 s).
#   bash bench/gpu_check.sh                 # on one GPU; paste the printed table into bench/RESULTS.md
#   bash bench/gpu_check.sh --dry           # CPU smoke run, tiny shapes, seconds (run by the default tests)
#   bash bench/gpu_check.sh --only attention --budget-s 450    # more time per config
#   bash bench/gpu_check.sh --skip-convert                      # throughput only (the whole budget)
# Options: python bench/gpu_check.py --help
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python bench/gpu_check.py "$@"
