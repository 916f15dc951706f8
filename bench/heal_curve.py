"""Heal curve: a converted model's perplexity, as a ratio to its source's, after N tokens of logit distillation.

One training run with the heal recipe of ``tlm-convert --heal-tokens`` (tlm_convert.heal.HEAL_RECIPE: constant
learning rate after warmup, so the state after N tokens is that of a heal of N tokens), stopped at each point,
evaluated, and resumed (tlm train's exact resume). The evaluation is ``tlm eval``'s protocol with disjoint windows:
the first --eval-tokens tokens of each set in blocks of --seq-len (the conversion report's perplexity). Point 0
and the source perplexity come from the converted model's conversion_report.json (convert with --eval-data
all-eval). A user choice's curve goes to bench/results/quality/heal_NAME.json with ``--choice`` (bench/RESULTS.md), a
study's to bench/results/studies/STUDY/heal_NAME.json (bench/STUDIES.md). Wall and CPU seconds (user + system of this process) are those of the training alone, cumulative.

    tlm-convert smollm2-135m -o runs/conv --eval-data all-eval
    python bench/heal_curve.py runs/conv --work runs/heal_curve --points 25000 50000 100000 200000 400000 \\
        --out runs/heal_curve.json
    # a sweep point: other settings, a shorter run, a cheaper evaluation
    python bench/heal_curve.py runs/conv --work runs/sweep_lr1e-3 --points 25000 --set optim.lr=1e-3 \\
        --set optim.min_lr=1e-3 --eval-tokens 4096 --out runs/heal_sweep.jsonl --append
    # (the recipe's rate is relative to the weights' RMS; --set optim.lr_relative=false makes it absolute)

The JSON is rewritten after every point (a stopped run keeps the points it measured).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from tlm_convert.convert import SAMPLES_FILE
from tlm_convert.evalsets import eval_set_blocks, geomean
from tlm_convert.heal import heal_data, heal_recipe
from tlm_io.load import load_model
from tlm_io.perplexity import perplexity
from tlm_train.trainer import list_checkpoints, train


def ratios(before: dict[str, float], after: dict[str, float], in_domain: dict[str, bool]) -> dict:
    sets = {name: after[name] / before[name] for name in after}
    ood = [r for name, r in sets.items() if not in_domain[name]]
    return {"perplexity": after, "ratio": sets, "ood_geomean": geomean(ood)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("converted", help="a tlm-convert output folder (converted with --eval-data all-eval)")
    parser.add_argument("--source", default=None, help="the teacher [the report's source]")
    parser.add_argument("--baseline", default=None,
                        help="a JSON with the report's keys (perplexity_sets, source, calibration_data, seq_len, seed) "
                             "for a converted folder converted without --eval-data all-eval")
    parser.add_argument("--work", required=True, help="folder of the training run (resumed when it exists)")
    parser.add_argument("--points", type=int, nargs="+", default=[25000, 50000, 100000, 200000, 400000])
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="recipe override key=value")
    parser.add_argument("--eval-tokens", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="runs/heal_curve.json",
                        help="a choice's heal: bench/results/quality/heal_NAME.json; a study's: "
                             "bench/results/studies/STUDY/heal_NAME.json [runs/heal_curve.json]")
    parser.add_argument("--append", action="store_true", help="append one JSON line to --out (sweeps)")
    parser.add_argument("--choice", default=None,
                        help="the tlm-convert options this heal shows on bench/RESULTS.md (\"\": the default)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    report = json.loads(Path(args.baseline or Path(args.converted) / "conversion_report.json").read_text())
    if "heal" in json.loads((Path(args.converted) / "conversion_report.json").read_text()):
        sys.exit(f"error: {args.converted} holds a healed model (its report has a heal); the curve starts from a "
                 "conversion without --heal-tokens")
    sets = report["perplexity_sets"]
    before = {s["data"]: s["before"] for s in sets}
    in_domain = {s["data"]: s["in_domain"] for s in sets}
    teacher = args.source or report["source"]
    _, tokenizer, _ = load_model(args.converted)
    evalb = eval_set_blocks(tokenizer, [s["data"] for s in sets], report["seq_len"], args.eval_tokens)
    if args.eval_tokens == 16384:
        zero = {s["data"]: s["after"] for s in sets}
    else:  # a cheaper evaluation than the report's: point 0 measured the same way
        zero = {name: perplexity(load_model(args.converted, with_tokenizer=False)[0], blocks)
                for name, blocks in evalb.items()}
    result = {"converted": args.converted, "baseline": args.baseline, "teacher": teacher, "overrides": args.overrides,
              "eval_tokens": args.eval_tokens, "seq_len": report["seq_len"], "threads": args.threads,
              "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
              "source_perplexity": before, **({"choice": args.choice} if args.choice is not None else {}),
              "points": [{"tokens": 0, "wall_seconds": 0.0, "cpu_seconds": 0.0, **ratios(before, zero, in_domain)}]}
    wall = cpu = 0.0
    out = Path(args.out)
    if not args.append and out.is_file():  # a rerun into the same --work goes on from the points measured
        done = json.loads(out.read_text())
        if done.get("work") == args.work and done.get("overrides") == args.overrides:
            result["points"] = done["points"]
            wall, cpu = done["points"][-1]["wall_seconds"], done["points"][-1]["cpu_seconds"]
    result["work"] = args.work
    samples = Path(args.converted) / SAMPLES_FILE
    joined = Path(args.work).with_name(Path(args.work).name + "-heal-data.txt")  # written once: resumes see one file
    data = str(joined) if joined.is_file() else heal_data(report["calibration_data"],
                                                           samples if samples.is_file() else None, joined)
    for tokens in args.points:
        if any(p["tokens"] >= tokens for p in result["points"][1:]):
            continue
        recipe = heal_recipe(args.converted, teacher, data, tokens, args.work,
                             report["seq_len"], report["seed"], overrides=tuple(args.overrides))
        resume = bool(list_checkpoints(Path(args.work))) if Path(args.work).exists() else False
        cpu0, wall0 = time.process_time(), time.perf_counter()
        run = train(recipe, resume=resume or None)
        wall, cpu = wall + time.perf_counter() - wall0, cpu + time.process_time() - cpu0
        model, _, _ = load_model(str(run.final_dir), with_tokenizer=False)
        after = {name: perplexity(model, blocks) for name, blocks in evalb.items()}
        point = {"tokens": run.tokens, "steps": run.steps, "lr": run.lr, "wall_seconds": wall, "cpu_seconds": cpu,
                 "last_loss": run.losses[-1] if run.losses else None, **ratios(before, after, in_domain)}
        result["points"].append(point)
        print(json.dumps({k: point[k] for k in ("tokens", "wall_seconds", "cpu_seconds", "ood_geomean")}),
              flush=True)
        if not args.append:
            write(result, args)
    write(result, args)


def write(result: dict, args) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.append:  # one line per finished run
        with open(out, "a") as f:
            f.write(json.dumps(result) + "\n")
    else:
        out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
