"""Data path vs training step: tokens/s of reading batches alone against the CPU training step (issue 12).

1. A corpus: the bundled English sample's paragraphs as JSON lines, repeated to ``--corpus-mb`` MB.
2. Tokenization into the sharded cache (``tlm_train.data.token_shards``, byte tokenizer, ``--shard-mb`` MB of text
   per shard so the cache has many files) with 1 and with ``--num-proc`` processes: tokens/s of each.
3. The data path alone: the micro-batches of rank 0 through ``micro_batch_loader`` (the DataLoader ``tlm train``
   uses: BatchOrder over TokenBlocks over the memory-mapped shards, global shuffle), with 0 and ``--workers``
   workers, at the CPU recipe's shape (recipes/scratch/cpu/attention-cosine.yaml: batch 16 x 256) and at the GPU
   recipe's (8 x 4096). Tokens/s = tokens of the batches read / wall time, first batch (worker start) excluded.
4. The training step at the CPU recipe's shape: ``tlm train`` on that recipe (its model, batch and optimizer; data:
   the cache above) for ``--train-steps`` steps, tokens/s = the median of its per-step ``tokens_per_s`` after the
   first two steps (``--threads`` torch threads).

The data path is measured again after training (the machine is shared: the ratio uses the slower of the two).
Target: data path >= 10x the training step's tokens/s. Writes bench/results/data_path.json.

    python bench/data_path.py                       # 32 MB corpus in 2 MB shards, 2 workers, 8 training steps, 1 thread
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

CPU_RECIPE = ROOT / "recipes" / "scratch" / "cpu" / "attention-cosine.yaml"


def write_corpus(path: Path, megabytes: int) -> int:
    """JSON lines of the bundled sample's paragraphs, repeated to ``megabytes`` MB; returns the characters."""
    from tlm_io.text import BUNDLED

    paragraphs = [p for p in BUNDLED["default"].read_text(encoding="utf-8").split("\n\n") if p.strip()]
    lines = [json.dumps({"text": p}) + "\n" for p in paragraphs]
    chars, target = 0, megabytes << 20
    with open(path, "w", encoding="utf-8") as f:
        while chars < target:
            for line in lines:
                f.write(line)
                chars += len(line)
    return chars


def tokenize(corpus: Path, cache: Path, num_proc: int) -> dict:
    from tlm_io.load import byte_tokenizer
    from tlm_train.data import token_shards

    start = time.perf_counter()
    shards = token_shards(byte_tokenizer(), str(corpus), cache_dir=cache, num_proc=num_proc)
    seconds = time.perf_counter() - start
    return {"num_proc": num_proc, "tokens": len(shards), "shards": len(shards.counts), "seconds": round(seconds, 2),
            "tokens_per_s": round(len(shards) / seconds)}


def data_path(shards, batch: int, seq_len: int, workers: int, batches: int) -> dict:
    """Tokens/s of rank 0's micro-batches through the DataLoader (first batch excluded: worker start-up)."""
    from tlm_train.data import BatchOrder, micro_batch_loader
    from tlm_train.shards import TokenBlocks

    order = BatchOrder(TokenBlocks(shards, seq_len), batch_size=batch, grad_accum=1, world=1, seed=0)
    it = iter(micro_batch_loader(order, 0, 0, batches + 1, num_workers=workers))
    first = time.perf_counter()
    total = next(it).numel()
    start = time.perf_counter()
    count = 0
    for ids in it:
        count += ids.numel()
    seconds = time.perf_counter() - start
    del it
    return {"batch": batch, "seq_len": seq_len, "workers": workers, "batches": batches,
            "startup_s": round(start - first, 3), "seconds": round(seconds, 3), "tokens_per_s": round(count / seconds),
            "first_batch_tokens": total}


def training(corpus: Path, cache: Path, steps: int, threads: int, out: Path) -> dict:
    from tlm_train.recipe import load_recipe
    from tlm_train.trainer import train

    overrides = [f"output_dir={out}", f"data.train={corpus}", f"data.cache_dir={cache}", f"train.max_steps={steps}",
                 f"train.num_threads={threads}", "log.every=1", "log.eval_every=0", f"log.save_every={steps}",
                 "log.progress=false", "log.tensorboard=false", "data.eval_tokens=4096"]
    recipe = load_recipe(CPU_RECIPE, overrides)
    train(recipe)
    rates = [json.loads(line)["tokens_per_s"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if "tokens_per_s" in line]
    return {"recipe": str(CPU_RECIPE.relative_to(ROOT)), "batch": recipe.train.batch_size,
            "seq_len": recipe.data.seq_len, "steps": steps, "threads": threads,
            "step_tokens_per_s": [round(r) for r in rates], "tokens_per_s": round(statistics.median(rates[2:]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus-mb", type=int, default=32)
    ap.add_argument("--shard-mb", type=int, default=2, help="MB of text per cache shard (the default: 32)")
    ap.add_argument("--num-proc", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batches", type=int, default=400, help="micro-batches read per data-path measurement")
    ap.add_argument("--train-steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(HERE / "results" / "data_path.json"))
    args = ap.parse_args()
    import tlm_train.data as data

    data.SHARD_CHARS = args.shard_mb << 20
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.jsonl"
        chars = write_corpus(corpus, args.corpus_mb)
        tok = [tokenize(corpus, tmp / "cache-1", 1), tokenize(corpus, tmp / "cache", args.num_proc)]
        from tlm_io.load import byte_tokenizer
        from tlm_train.data import token_shards

        shards = token_shards(byte_tokenizer(), str(corpus), cache_dir=tmp / "cache")
        shapes = [(16, 256), (8, 4096)]
        before = [data_path(shards, b, s, w, args.batches) for b, s in shapes for w in (0, args.workers)]
        train_run = training(corpus, tmp / "cache", args.train_steps, args.threads, tmp / "run")
        after = [data_path(shards, b, s, w, args.batches) for b, s in shapes for w in (0, args.workers)]
    cpu_shape = [min(a["tokens_per_s"], b["tokens_per_s"]) for a, b in zip(before, after)
                 if a["batch"] == train_run["batch"] and a["seq_len"] == train_run["seq_len"]]
    ratio = min(cpu_shape) / train_run["tokens_per_s"]
    result = {"command": "python " + " ".join(sys.argv),
              "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "loadavg_start": load_start,
                          "loadavg_end": os.getloadavg()},
              "versions": {"python": platform.python_version(), "torch": torch.__version__},
              "corpus": {"chars": chars, "tokens": tok[0]["tokens"], "shard_chars": data.SHARD_CHARS},
              "tokenization": tok, "data_path_before": before, "training": train_run, "data_path_after": after,
              "ratio_data_path_vs_training": round(ratio, 1), "target": 10, "meets_target": ratio >= 10}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"tokenization: " + ", ".join(f"{t['num_proc']} proc {t['tokens_per_s']:,} tok/s ({t['shards']} shards)"
                                        for t in tok))
    print("| batch x seq | workers | data path tok/s (before / after training) |")
    print("|---|---|---|")
    for a, b in zip(before, after):
        print(f"| {a['batch']} x {a['seq_len']} | {a['workers']} | {a['tokens_per_s']:,} / {b['tokens_per_s']:,} |")
    print(f"training step ({train_run['recipe']}, {train_run['batch']} x {train_run['seq_len']}, "
          f"{args.threads} thread): {train_run['tokens_per_s']:,} tok/s")
    print(f"data path / training at the recipe shape (slowest data path): {ratio:,.1f}x (target >= 10x)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
