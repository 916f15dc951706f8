#!/bin/bash
# Byte-identical outputs before/after a refactor: 18 tiny CLI conversions over four families (every export format,
# low-memory, heal off) from WORKTREE, sha256 of every file written (OUTROOT/sha.txt) and of the reports without
# their seconds and memory (OUTROOT/norm.txt). Compare two trees:
#   bash tools/sha_check.sh OLD_TREE /tmp/sha_before; bash tools/sha_check.sh NEW_TREE /tmp/sha_after
#   diff /tmp/sha_before/sha.txt /tmp/sha_after/sha.txt; diff /tmp/sha_before/norm.txt /tmp/sha_after/norm.txt
# The tiny sources are built once into /tmp/size_check/src (tests/tiny_sources.py). OUTROOT is replaced.
set -e
WT=$1; OUT=$2
cd $WT; export PYTHONPATH=$PWD PYTHONDONTWRITEBYTECODE=1 OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
rm -rf $OUT; mkdir -p $OUT
SRC=/tmp/size_check/src
if [ ! -d $SRC ]; then
  nice -n 10 python -c "
import sys; sys.path.insert(0, 'tests')
from pathlib import Path
from tiny_sources import make_source, tiny_tokenizer
tok = tiny_tokenizer()
for fam in ['llama', 'gpt2', 'gemma3_text', 'qwen3']:
    make_source(Path('$SRC')/fam, fam, tokenizer=tok)
"
fi
C="--calibration-tokens 2048 --seq-len 64 --set multiple_of=1 --batch-size 4"
run() { name=$1; shift; nice -n 10 python -m tlm_convert "$@" -o $OUT/$name > $OUT/$name.log 2>&1 || echo "FAIL $name"; }
run llama_obs $SRC/llama $C
run llama_act $SRC/llama $C --set importance=activation
run llama_lowmem $SRC/llama $C --low-memory
run llama_lowmem_act $SRC/llama $C --low-memory --set importance=activation
run llama_local_sink $SRC/llama $C --set refit_target=local --set token_weighting=sink
run llama_deci $SRC/llama $C --export deci
run llama_hf $SRC/llama $C --export hf
run llama_padded $SRC/llama $C --export padded
run llama_gguf $SRC/llama $C --export gguf --dtype float16
run llama_titans $SRC/llama $C --mixer titans --set grow_init=split
run llama_recon $SRC/llama $C --set reconstruct_epochs=1 --set importance=magnitude
run llama_eval $SRC/llama $C --eval-data default-eval --eval-tokens 1024
run gpt2_obs $SRC/gpt2 $C
run gpt2_lowmem $SRC/gpt2 $C --low-memory
run gemma_obs $SRC/gemma3_text $C --dtype bfloat16
run gemma_lowmem $SRC/gemma3_text $C --low-memory
run qwen3_obs $SRC/qwen3 $C --set grow_init=zero
run qwen3_hf $SRC/qwen3 $C --export hf --low-memory
cd $OUT && find . -type f ! -name '*.log' | sort | xargs sha256sum > sha.txt
# normalised reports: drop timings and memory (they differ run to run)
python - <<'PY' > norm.txt
import hashlib, json, pathlib, re
for p in sorted(pathlib.Path('.').glob('*/conversion_report.json')):
    r = json.loads(p.read_text())
    for k in ('rss_after_load_mb', 'seconds', 'peak_rss_mb'):
        r.pop(k, None)
    print(hashlib.sha256(json.dumps(r, sort_keys=True).encode()).hexdigest(), p, '(normalised)')
for p in sorted(pathlib.Path('.').glob('*/report.md')):
    t = re.sub(r'^\| (load|sample|calibrate|rank|resize|save|eval|heal|total) \| [0-9.]+ \|$', '', p.read_text(), flags=re.M)
    t = re.sub(r'Peak memory \(RSS\): .*', '', t)
    print(hashlib.sha256(t.encode()).hexdigest(), p, '(normalised)')
for p in sorted(pathlib.Path('.').glob('*.log')):
    lines = [l for l in p.read_text().splitlines() if l.lower().startswith('error')]
    print(hashlib.sha256('\n'.join(lines).encode()).hexdigest(), p, '(error lines)')
PY
