"""``tlm eval --tasks`` (our loader's model in lm-eval's HFLM) against lm-eval's own HFLM loading the same
transformers checkpoint by path: the same tasks (the bundled samples), limit and batch size, side by side. Prints
and writes each path's evaluation seconds (wall and CPU, model loading excluded, best of ``--rounds`` alternating
runs), the throughput ratio (target >= 0.9x) and both accuracies per task (they should be equal).

    python bench/eval_speed.py MODEL_FOLDER --tasks arc_easy,piqa --limit 100 --out bench/results/eval_speed.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.suite import machine, table, torch_version  # noqa: E402
from tlm_io.harness import (accuracy_rows, check_limit, hf_model, offline_datasets, parse_tasks,  # noqa: E402
                            quiet_harness, task_folder, task_manager)
from tlm_io.load import load_model  # noqa: E402


def timed(lm, names, manager, limit) -> tuple[dict, float, float]:
    """lm-eval's results of ``lm`` on ``names`` and the (wall, CPU) seconds of the evaluation."""
    from lm_eval import simple_evaluate

    wall, cpu = time.perf_counter(), time.process_time()
    results = simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit, bootstrap_iters=0,
                              log_samples=False)
    return results, time.perf_counter() - wall, time.process_time() - cpu


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a transformers checkpoint folder (both paths read it)")
    ap.add_argument("--tasks", default="arc_easy,piqa")
    ap.add_argument("--limit", type=float, default=100)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from lm_eval.models.huggingface import HFLM

    names, limit = parse_tasks(args.tasks), check_limit(args.limit)
    ours_model, tokenizer, _ = load_model(args.model)
    stock = HFLM(pretrained=args.model, dtype="float32", device="cpu", batch_size=args.batch_size)
    ours = hf_model(ours_model, tokenizer, args.batch_size)
    best = {"ours": (None, float("inf"), float("inf")), "stock": (None, float("inf"), float("inf"))}
    with tempfile.TemporaryDirectory() as tmp, offline_datasets(), quiet_harness():
        task_folder(names, None, Path(tmp))
        manager = task_manager(names, [], Path(tmp))
        for _ in range(args.rounds):  # alternating, so a busy spell of a shared machine hits both
            for name, lm in (("ours", ours), ("stock", stock)):
                results, wall, cpu = timed(lm, names, manager, limit)
                _, best_wall, best_cpu = best[name]
                best[name] = (results, min(wall, best_wall), min(cpu, best_cpu))
    acc = {name: {(r["task"], r["metric"]): r["value"] for r in accuracy_rows(res)} for name, (res, _, _) in best.items()}
    keys = sorted(acc["ours"])
    delta = max(abs(acc["ours"][k] - acc["stock"].get(k, float("nan"))) for k in keys)
    raw = {"benchmark": "eval-speed", "topic": "other", "title": "tlm eval --tasks against lm-eval's own HFLM",
           "command": "python bench/eval_speed.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "machine": machine(), "torch": torch_version(), "threads": torch.get_num_threads(),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "quick": False,
           "model": args.model, "tasks": names, "limit": limit, "batch_size": args.batch_size, "rounds": args.rounds,
           "seconds": {k: {"wall": round(v[1], 2), "cpu": round(v[2], 2)} for k, v in best.items()},
           "throughput_ratio_wall": best["stock"][1] / best["ours"][1],
           "throughput_ratio_cpu": best["stock"][2] / best["ours"][2],
           "accuracy": {f"{t}/{m}": [acc["ours"][(t, m)], acc["stock"].get((t, m))] for t, m in keys},
           "max_abs_accuracy_delta": delta}
    accs = ", ".join(f"{k} {v[0]:.3f}" for k, v in raw["accuracy"].items())
    raw["tables"] = [
        table(f"evaluation seconds (best of {args.rounds}, model loading excluded), {', '.join(names)}, limit "
              f"{limit}, batch {args.batch_size}", ["path", "wall s", "CPU s", "throughput vs stock (wall / CPU)"],
              [["tlm eval --tasks (load_model + HFLM instance)", *raw["seconds"]["ours"].values(),
                f"{raw['throughput_ratio_wall']:.2f}x / {raw['throughput_ratio_cpu']:.2f}x"],
               ["lm-eval HFLM by path (transformers, fp32)", *raw["seconds"]["stock"].values(), "1.00x"]],
              f"target: >= 0.9x. Accuracy, ours: {accs}; the largest difference from the stock path's: {delta:.4f}.")]
    print(json.dumps({k: raw[k] for k in ("seconds", "throughput_ratio_wall", "throughput_ratio_cpu",
                                          "max_abs_accuracy_delta")}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(raw, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
