"""Evidence benchmark: does the cosine taper help at CPU scale, for each mixer?

Cosine 1.5/0.5 vs uniform vs reverse 0.5/1.5, trained from scratch at exactly equal parameter counts, for each of
the mixers and 3 seeds. The converted-vs-scratch study is ``python -m bench compare`` (``tlm compare
recipes/compare/*.yaml``: seeds, splits, paired tables); the 3-seed compare records of an earlier version (a
two-phase learning-rate schedule: the M steps restarted their warmup and cosine) stay in evidence.jsonl, out of
the summary (superseded).

Every run is ``tlm_train.train`` on a recipe built below (bytes as tokens, the bundled English text, held-out
``default-eval``); results are appended to bench/results/studies/evidence/evidence.jsonl one line per run, and runs
already there are skipped, so an interrupted benchmark is resumed by running the same command again. Runs go ``--workers`` at a time
with one thread each.

    python bench/evidence.py --workers 2                    # every run, cheapest evidence first
    python bench/evidence.py --summary                      # the tables for bench/STUDIES.md
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE / "results" / "studies" / "evidence" / "evidence.jsonl"
RUNS = HERE / "runs" / "evidence"  # checkpoints and metrics (git-ignored)

MIXERS = ("attention", "gated_attention", "titans", "hope_attention", "titans_mag")
SCHEDULES = {"cosine": ("cosine", "1.5/0.5"), "uniform": ("uniform", "1.5/0.5"), "reverse": ("cosine", "0.5/1.5")}
SEEDS = (0, 1, 2)
STEPS = 150  # x 16 sequences x 128 tokens = 307,200 training tokens per run
TITANS = {"titans_num_heads": 2, "titans_head_dim": 32, "titans_chunk_size": 16}
# titans_mag: the paper's MAG (issue 11): 4 persistent tokens, normalised branches, sliding window 64 in every layer
MIXER_EXTRA = {"attention": {}, "gated_attention": {}, "titans": TITANS,
               "hope_attention": {"hope_chunk_size": 16},  # levels (online, static, static), chain, inner lr 0
               "titans_mag": {**TITANS, "mixer": "titans", "titans_variant": "mag", "titans_persistent_tokens": 4,
                              "layer_types": ["sliding_attention"] * 6, "sliding_window": 64}}


def scratch_recipe(mixer: str, schedule: str, seed: int, steps: int = STEPS, out: Path | None = None) -> dict:
    kind, ratio = SCHEDULES[schedule]
    return {
        "output_dir": str(out or RUNS / f"{mixer}-{schedule}-s{seed}"),
        "tokenizer": "byte",
        "seed": seed,
        "model": {"schedule": kind, "ratio": ratio, "multiple_of": 16,
                  "config": {"hidden_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
                             "num_key_value_heads": 2, "intermediate_size": 384, "max_position_embeddings": 128,
                             "mixer": mixer, **MIXER_EXTRA[mixer]}},  # a variant's "mixer" overrides
        "data": {"train": "default", "eval": "default-eval", "eval_tokens": 65536, "seq_len": 128},
        "optim": {"lr": 2e-3, "min_lr": 2e-4, "warmup_steps": 15, "weight_decay": 0.1, "grad_clip": 1.0},
        "train": {"max_steps": steps, "batch_size": 16, "num_threads": 1},
        "log": {"every": 10, "eval_every": 0, "save_every": steps, "keep_last": 1, "progress": False,
                "tensorboard": False},
    }


def _done() -> set[str]:
    if not RESULTS.exists():
        return set()
    return {json.loads(line)["key"] for line in RESULTS.read_text().splitlines() if line.strip()}


def _append(record: dict) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def run_scratch(job: tuple[str, str, int]) -> dict:
    import shutil

    import torch

    torch.set_num_threads(1)
    from tlm_train.recipe import recipe_from_dict
    from tlm_train.trainer import train

    mixer, schedule, seed = job
    recipe = recipe_from_dict(scratch_recipe(mixer, schedule, seed))
    shutil.rmtree(recipe.output_dir, ignore_errors=True)  # a half-finished run restarts cleanly
    start = time.perf_counter()
    result = train(recipe)
    from safetensors import safe_open

    with safe_open(str(Path(result.final_dir) / "model.safetensors"), "pt") as f:
        params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return {"part": "scratch", "key": f"scratch/{mixer}/{schedule}/{seed}", "mixer": mixer, "schedule": schedule,
            "seed": seed, "params": params, "steps": result.steps, "tokens": result.tokens,
            "eval_loss": result.eval_loss, "train_loss_last10": statistics.mean(result.losses[-10:]),
            "seconds": time.perf_counter() - start, "threads": 1}


def _work(job):
    key = "scratch/{}/{}/{}".format(*job)
    if key in _done():  # finished meanwhile by another runner
        return {"skipped": key}
    try:
        record = run_scratch(job)
    except Exception as err:  # noqa: BLE001 - one failed run is recorded and the others go on
        return {"failed": f"scratch {job}: {type(err).__name__}: {err}"}
    _append(record)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--mixers", default=",".join(MIXERS))
    parser.add_argument("--summary", action="store_true")
    args = parser.parse_args()
    if args.summary:
        print(summary())
        return
    done = _done()
    mixers = args.mixers.split(",")
    cheap = [m for m in mixers if m in ("attention", "gated_attention")]
    costly = [m for m in mixers if m not in cheap]
    # cheapest evidence first: the attention mixers for every seed, then Titans and Hope seed by seed; what does not
    # fit in a session is resumed by the next call
    jobs = [(m, s, seed) for group in ([(m, seed) for seed in SEEDS for m in cheap],
                                       [(m, seed) for seed in SEEDS for m in costly])
            for m, seed in group for s in SCHEDULES]
    jobs = [job for job in jobs if "scratch/{}/{}/{}".format(*job) not in done]
    print(f"{len(jobs)} runs to do ({len(done)} already in {RESULTS})", flush=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with mp.get_context("spawn").Pool(args.workers, maxtasksperchild=1) as pool:
        for record in pool.imap_unordered(_work, jobs):
            if "failed" in record:
                print("FAILED", record["failed"], flush=True)
            elif "skipped" in record:
                print("skipped (already done)", record["skipped"], flush=True)
            else:
                print(record["key"], f"eval_loss {record.get('eval_loss', '')}", f"{record['seconds']:.0f}s", flush=True)


def _mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def summary() -> str:
    rows = [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()] if RESULTS.exists() else []
    lines = ["| mixer | schedule | params | eval loss (nats/byte), mean ± std | seeds | s/run |", "|---|---|---|---|---|---|"]
    for mixer in MIXERS:
        for schedule in SCHEDULES:
            got = [r for r in rows if r["part"] == "scratch" and r["mixer"] == mixer and r["schedule"] == schedule]
            if got:
                lines.append(f"| {mixer} | {schedule} | {got[0]['params']:,} | "
                             f"{_mean_std([r['eval_loss'] for r in got])} | {len(got)} | "
                             f"{statistics.mean(r['seconds'] for r in got):.0f} |")
    lines += ["", "Paired differences (same seed), eval loss of the schedule minus uniform:", "",
              "| mixer | cosine - uniform | reverse - uniform | cosine better in |", "|---|---|---|---|"]
    for mixer in MIXERS:
        by = {(r["schedule"], r["seed"]): r["eval_loss"] for r in rows if r["part"] == "scratch" and r["mixer"] == mixer}
        seeds = [s for s in SEEDS if all((k, s) in by for k in SCHEDULES)]
        if seeds:
            cos = [by["cosine", s] - by["uniform", s] for s in seeds]
            rev = [by["reverse", s] - by["uniform", s] for s in seeds]
            lines.append(f"| {mixer} | {_mean_std(cos)} | {_mean_std(rev)} | {sum(c < 0 for c in cos)}/{len(seeds)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    main()
