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
import threading
import time
from pathlib import Path

import torch

from tlm_convert.convert import SAMPLES_FILE
from tlm_convert.evalsets import eval_set_blocks, geomean
from tlm_convert.heal import heal_data, heal_recipe
from tlm_io.load import load_model
from tlm_io.perplexity import perplexity
from tlm_train.trainer import STOP_FILE, list_checkpoints, train


def ratios(before: dict[str, float], after: dict[str, float], in_domain: dict[str, bool]) -> dict:
    sets = {name: after[name] / before[name] for name in after}
    ood = [r for name, r in sets.items() if not in_domain[name]]
    return {"perplexity": after, "ratio": sets, "ood_geomean": geomean(ood)}


def window_seconds(metrics: Path, first_step: int, last_step: int, first_tokens: int) -> tuple[int, float]:
    """(tokens, seconds) of the training steps logged in metrics.jsonl after step ``first_step`` up to
    ``last_step`` (one resumed part of a run, which began at ``first_tokens``): each logged record's window is the
    tokens since the previous record (or the part's start) at its ``tokens_per_s``; steps after the last record
    of the part are not counted. Set-up and checkpoint writes are outside every window."""
    tokens = seconds = 0.0
    previous = first_tokens
    for line in (metrics.read_text().splitlines() if metrics.is_file() else []):  # none: stopped before a log
        record = json.loads(line) if line.strip() else {}
        if "tokens_per_s" not in record or not first_step < record["step"] <= last_step:
            continue
        window = record["tokens"] - previous
        tokens, seconds, previous = tokens + window, seconds + window / record["tokens_per_s"], record["tokens"]
    return int(tokens), seconds


def last_logged_step(metrics: Path) -> int:
    """The highest step of a training record (one with ``tokens_per_s``) in metrics.jsonl; 0 before the first."""
    steps = [0]
    for line in (metrics.read_text().splitlines() if metrics.is_file() else []):
        if line.strip():
            record = json.loads(line)
            if "tokens_per_s" in record:
                steps.append(record["step"])
    return max(steps)


def stop_at(run_dir: Path, deadline: float, step: int, done: threading.Event) -> None:
    """Writes run_dir/STOP once time.monotonic() passes ``deadline`` *and* metrics.jsonl has logged a step beyond
    ``step`` (the part's start: every part trains a few steps); returns without writing when ``done`` is set first."""
    if done.wait(max(0.0, deadline - time.monotonic())):
        return
    while not done.wait(0.05):
        if last_logged_step(run_dir / "metrics.jsonl") > step:
            (run_dir / STOP_FILE).touch()
            return


def curve(converted: str, work: str, points: list[int], *, report: dict | None = None, teacher=None,
          overrides: tuple[str, ...] = (), eval_tokens: int = 16384, device: str = "cpu", done: list | None = None,
          data: str | None = None, deadline: float | None = None, on_point=None) -> dict:
    """The heal curve of the ``converted`` folder: one heal run in ``work``, stopped at each of ``points`` (tokens),
    evaluated on the report's sets (``report``: the conversion report's keys, default its conversion_report.json)
    and resumed. ``teacher``: the teacher as a loaded model (None: the report's source, loaded by each part);
    ``done``: points measured already (a rerun goes on after them); ``data``: the heal text (None: the calibration
    sources joined beside ``work``); ``deadline``: a time.monotonic() at which the part running is stopped (its
    STOP file) and evaluated as the last point; ``on_point(result)``: after every point. Returns the curve:
    ``source_perplexity`` and ``points`` (0 first), each with wall and CPU seconds of the training alone, tokens/s
    of its logged steps (``tokens_per_s``), and whether a deadline ``stopped`` it."""
    report = report or json.loads((Path(converted) / "conversion_report.json").read_text())
    sets = report["perplexity_sets"]
    before = {s["data"]: s["before"] for s in sets}
    in_domain = {s["data"]: s["in_domain"] for s in sets}
    _, tokenizer, _ = load_model(converted)
    evalb = eval_set_blocks(tokenizer, [s["data"] for s in sets], report["seq_len"], eval_tokens)

    def evaluate(folder: str) -> dict:
        model, _, _ = load_model(folder, device=device, with_tokenizer=False)
        return {name: perplexity(model, blocks) for name, blocks in evalb.items()}

    if done:
        result_points = list(done)
    elif eval_tokens == 16384:
        result_points = [{"tokens": 0, "wall_seconds": 0.0, "cpu_seconds": 0.0,
                          **ratios(before, {s["data"]: s["after"] for s in sets}, in_domain)}]
    else:  # a cheaper evaluation than the report's: point 0 measured the same way
        result_points = [{"tokens": 0, "wall_seconds": 0.0, "cpu_seconds": 0.0,
                          **ratios(before, evaluate(converted), in_domain)}]
    result = {"source_perplexity": before, "points": result_points}
    wall, cpu = result_points[-1]["wall_seconds"], result_points[-1]["cpu_seconds"]
    samples = Path(converted) / SAMPLES_FILE
    joined = Path(work).with_name(Path(work).name + "-heal-data.txt")  # written once: resumes see one file
    if data is None:
        data = str(joined) if joined.is_file() else heal_data(report["calibration_data"],
                                                               samples if samples.is_file() else None, joined)
    run_dir = Path(work)
    for tokens in points:
        if any(p["tokens"] >= tokens for p in result["points"][1:]):
            continue
        recipe = heal_recipe(converted, report["source"] if teacher is None else "(in memory)", data, tokens, work,
                             report["seq_len"], report["seed"], device=device, overrides=tuple(overrides))
        resume = bool(list_checkpoints(run_dir)) if run_dir.exists() else False
        first_step = last_logged_step(run_dir / "metrics.jsonl") if resume else 0
        first_tokens = result["points"][-1]["tokens"] if resume else 0
        stop = threading.Event()
        if deadline is not None:
            threading.Thread(target=stop_at, args=(run_dir, deadline, first_step, stop), daemon=True).start()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        try:
            run = train(recipe, teacher=teacher, resume=resume or None)
        finally:
            stop.set()
        wall, cpu = wall + time.perf_counter() - wall0, cpu + time.process_time() - cpu0
        (run_dir / STOP_FILE).unlink(missing_ok=True)
        folder = run.final_dir if run.final_dir is not None else list_checkpoints(run_dir)[-1]
        window = window_seconds(run_dir / "metrics.jsonl", first_step, run.steps, first_tokens)
        point = {"tokens": run.tokens, "steps": run.steps, "lr": run.lr, "wall_seconds": wall, "cpu_seconds": cpu,
                 "last_loss": run.losses[-1] if run.losses else None,
                 "tokens_per_s": round(window[0] / window[1]) if window[1] else None,
                 **({"stopped": True} if run.stopped else {}), **ratios(before, evaluate(str(folder)), in_domain)}
        result["points"].append(point)
        if on_point is not None:
            on_point(result)
        if run.stopped:
            break
    return result


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
    if args.source:
        report = {**report, "source": args.source}
    result = {"converted": args.converted, "baseline": args.baseline, "teacher": report["source"],
              "overrides": args.overrides, "eval_tokens": args.eval_tokens, "seq_len": report["seq_len"],
              "threads": args.threads, "machine": f"{platform.processor() or platform.machine()}, torch "
                                                  f"{torch.__version__}",
              **({"choice": args.choice} if args.choice is not None else {})}
    done = None
    out = Path(args.out)
    if not args.append and out.is_file():  # a rerun into the same --work goes on from the points measured
        saved = json.loads(out.read_text())
        if saved.get("work") == args.work and saved.get("overrides") == args.overrides:
            done = saved["points"]
    result["work"] = args.work

    def on_point(curve_so_far: dict) -> None:
        point = curve_so_far["points"][-1]
        print(json.dumps({k: point[k] for k in ("tokens", "wall_seconds", "cpu_seconds", "ood_geomean")}),
              flush=True)
        if not args.append:
            write({**result, **curve_so_far}, args)

    result.update(curve(args.converted, args.work, args.points, report=report, overrides=tuple(args.overrides),
                        eval_tokens=args.eval_tokens, done=done, on_point=on_point))
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
