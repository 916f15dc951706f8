"""A taper reached in K stages during the heal (issue 23 item 2), against the one-shot conversion at equal tokens.

``tlm-convert --set taper_stages=K --heal-tokens N`` (tlm_convert.convert.convert_in_stages): stage k of K converts the
current model (the source, then the previous stage's healed TLM) to the ratio 1 + 0.5 k/K / 1 - 0.5 k/K (the last
stage: the target 1.5/0.5, so the final widths and parameter count are those of the one-shot conversion),
calibrated on the current model, then heals it for N/K tokens by distillation from the *original* source. Every
stage calibrates on the same text: the bundled mix and the source's own samples of a default conversion (its
calibration_samples.txt), equal shares, as the default conversion does. The final model is evaluated as
bench/quality_ablation.py evaluates (first 16,384 tokens of every bundled set, disjoint 512-token windows) against
the source's cached perplexities, and written as a heal curve of one point (bench/heal_curve.py's keys), which
``python -m bench report`` shows in the gradual-taper study (bench/STUDIES.md) beside the one-shot conversions'.

    python bench/gradual_taper.py --samples runs/q/obs_default/calibration_samples.txt --stages 3 \\
        --heal-tokens 24576 --work runs/q/gradual3 --out bench/results/studies/gradual-taper/heal_gradual3.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tlm_convert.convert import convert
from tlm_convert.evalsets import eval_set_blocks, perplexity_entries
from tlm_convert.options import SELF, ConvertOptions, Method
from tlm_io.load import load_model
from tlm_io.locate import resolve_builtin
from tlm_io.perplexity import perplexity

RESULTS = Path(__file__).parent / "results" / "quality"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="smollm2-135m")
    ap.add_argument("--samples", required=True, help="a default conversion's calibration_samples.txt")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--heal-tokens", type=int, required=True, help="in all, N/K after each stage")
    ap.add_argument("--importance", default="obs")
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    opts = ConvertOptions(calibration_data=("default", args.samples), heal_tokens=args.heal_tokens, overwrite=True,
                          method=Method(importance=args.importance, taper_stages=args.stages))
    cpu0, wall0 = time.process_time(), time.perf_counter()
    report = convert(resolve_builtin(args.source), str(work / "final"), opts)  # the CLI resolves names
    stages = report["taper_stages"]
    current = str(work / "final")
    model, tokenizer, _ = load_model(current)
    evalb = eval_set_blocks(tokenizer, "all-eval", 512, 16384)
    after = {name: perplexity(model, blocks) for name, blocks in evalb.items()}
    seconds = time.process_time() - cpu0, time.perf_counter() - wall0
    before = source_perplexity(args.source, evalb)  # not in the run's seconds
    result = curve(args, before, after, stages, *seconds)
    Path(args.out).write_text(json.dumps(result, indent=1))
    point = result["points"][-1]
    print(f"{result['label']}: ood_geomean={point['ood_geomean']:.4f} "
          + " ".join(f"{k}={v:.3f}" for k, v in point["ratio"].items()))


def source_perplexity(source: str, evalb: dict) -> dict:
    """The source's perplexity per set from bench/quality_ablation.py's cache (source.json for SmolLM2-135M, else
    source_SOURCE.json) where a row of that source wrote it, else measured here."""
    cache = RESULTS / ("source.json" if source == "smollm2-135m" else f"source_{source}.json")
    if cache.is_file():
        return json.loads(cache.read_text())
    model = load_model(source, with_tokenizer=False)[0]
    return {name: perplexity(model, blocks) for name, blocks in evalb.items()}


def curve(args, before: dict, after: dict, stages: list[dict], cpu_s: float, wall_s: float) -> dict:
    """The run as a heal curve of one point (bench/heal_curve.py's keys, read by ``python -m bench report`` beside
    the one-shot conversions' curves): its seconds are the whole run's, the K conversions included."""
    entries = perplexity_entries(before, after, ("default", SELF))
    sets = entries["perplexity_sets"]
    point = {"tokens": sum(s["heal_tokens"] for s in stages), "wall_seconds": round(wall_s, 1),
             "cpu_seconds": round(cpu_s, 1), "perplexity": after, "ratio": {s["data"]: s["ratio"] for s in sets},
             "ood_geomean": entries["perplexity_ratio_ood_geomean"], "stages": stages}
    return {"converted": args.source, "label": f"gradual taper, {args.stages} stages ({args.importance})",
            "teacher": args.source, "importance": args.importance, "eval_tokens": 16384, "seq_len": 512,
            "threads": torch.get_num_threads(), "in_domain": [s["data"] for s in sets if s["in_domain"]],
            "source_perplexity": before, "work": args.work, "points": [point],
            "notes": ["Wall and CPU seconds of the whole run: its conversions and heals (the one-shot curves count "
                      "the heal's training alone)."]}

if __name__ == "__main__":
    main()
