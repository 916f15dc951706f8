"""One row of the conversion-quality ablation (issue 10 items 2-3): convert a source (SmolLM2-135M unless
``--source`` names another) in memory with the default options plus overrides, and measure perplexity on every
bundled evaluation set against the source.

    python bench/quality_ablation.py NAME [--source SRC] [--calibration-data SRC] [--calibration-tokens N]
        [--schedule S] [--ratio R] [--set FIELD=VALUE ...] [--calibration-seed N] [--calibration-cache FILE]
        [--save DIR] [--choice OPTIONS | --study STUDY]

``--set KNOB=VALUE`` sets a method knob as ``tlm-convert --set`` does (tlm_convert.options.method_from, docs/knobs.md),
and the row's ``settings`` keep every knob's value. The conversion is the one every ``tlm-convert`` runs
(convert_layers with the default widths, importance and settings); its CPU
seconds (user+sys of this process, all threads) and wall seconds are recorded. Evaluation: the first 16,384 tokens
of each set in disjoint 512-token windows, as ``tlm eval --data all-eval --max-tokens 16384 --seq-len 512 --stride
512``; the source's perplexities are cached in bench/results/quality/source.json (SmolLM2-135M) or
source_SRC.json (another source). Writes bench/results/quality/NAME.json (a user choice's row on bench/RESULTS.md:
``--choice`` names its tlm-convert options, "" for the default) or, with ``--study STUDY``,
bench/results/studies/STUDY/NAME.json (a row of that study on bench/STUDIES.md); the row names its source.

``--calibration-cache FILE`` keeps the calibration blocks (and the ``self`` samples among them) in a safetensors
file: the first row that names it draws them, later rows read the same tokens, so the rows of an ablation differ
only in what they set (the draw is seeded: the cached blocks are those the default conversion draws).
``--calibration-seed N`` draws the ``self`` samples with seed N (``tlm-convert --seed N`` draws them so; text blocks
are evenly spread, the same at every seed) and is the report's seed, so a heal of the saved row is seeded by it too;
a cache that exists is read as it is, whatever the seed (name one cache per seed). ``--set seed=N`` (not a knob:
``tlm-convert --seed`` sets both) is the layer loop's own seed alone (growth, Fisher draws).
``--save DIR`` writes the converted model (TLM format, with the tokenizer), its calibration_samples.txt and a
conversion_report.json with the keys bench/heal_curve.py reads, so the row can be healed.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

import torch

from safetensors.torch import load_file, save_file

from tlm_convert.calibrate import IN_MEMORY, ModelLayers, convert_layers, score_whole_model
from tlm_convert.convert import SAMPLES_FILE, layer_settings, measure_widths, plan_widths, resolve_importance
from tlm_convert.options import MEASURED, ConvertOptions, method_from
from tlm_convert.evalsets import eval_set_blocks, perplexity_entries
from tlm_convert.samples import calibration_blocks, samples_text
from tlm_io.errors import ConversionError
from tlm_io.export import export_model
from tlm_io.load import load_model
from tlm_io.perplexity import perplexity

RESULTS = Path(__file__).parent / "results" / "quality"
SOURCE = "smollm2-135m"


def source_cache(source: str) -> Path:
    """Where the source's perplexities on the evaluation sets are kept (read by the next row of that source)."""
    return RESULTS / ("source.json" if source == SOURCE else f"source_{source}.json")


def layer_seed(settings: list[str]) -> tuple[int | None, list[str]]:
    """``seed=N`` (the layer loop's seed) apart from the knobs of ``--set``."""
    seeds = [int(s.partition("=")[2]) for s in settings if s.partition("=")[0].strip() == "seed"]
    return (seeds[-1] if seeds else None), [s for s in settings if s.partition("=")[0].strip() != "seed"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("--source", default=SOURCE, help="the checkpoint to convert (a named source or a path)")
    ap.add_argument("--calibration-data", action="append", default=None,
                    help="repeat for a blend, each an equal share of --calibration-tokens ('self': samples of the "
                         "source) [the conversion's default]")
    defaults = ConvertOptions()
    ap.add_argument("--calibration-tokens", type=int, default=defaults.calibration_tokens)
    ap.add_argument("--in-domain-as", default=None, help="label the eval sets as for this calibration source")
    ap.add_argument("--schedule", default=defaults.schedule,
                    help="the conversion's --schedule (measured / measured-taper: widths from the Fisher profile of "
                         "the calibration blocks, tlm_convert.convert.measure_widths)")
    ap.add_argument("--ratio", default=str(defaults.ratio), help="the conversion's --ratio (first/last layer's "
                    "multiple of the source's width)")
    ap.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                    help="a method knob, as tlm-convert --set (docs/knobs.md); seed=N: the layer loop's seed alone")
    ap.add_argument("--calibration-seed", type=int, default=defaults.seed,
                    help="the seed of the self samples' draw [the conversion's default]")
    ap.add_argument("--calibration-cache", default=None, help="safetensors file of the calibration blocks")
    ap.add_argument("--save", default=None, help="write the converted model and a report here (for heal_curve.py)")
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--choice", default=None, help="the tlm-convert options this row shows (\"\": the default)")
    where.add_argument("--study", default=None, help="the study (bench/studies.py) this row belongs to")
    args = ap.parse_args()
    out = RESULTS.parent / "studies" / args.study if args.study else RESULTS
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    seed, knobs = layer_seed(args.set)
    try:
        opts = ConvertOptions(calibration_data=args.calibration_data, calibration_tokens=args.calibration_tokens,
                              schedule=args.schedule, ratio=args.ratio, seed=args.calibration_seed,
                              method=method_from(knobs))
        opts.validate()
    except ConversionError as err:
        raise SystemExit(f"error: {err}") from None
    if opts.method.taper_stages != 1:
        raise SystemExit("--set taper_stages: a staged conversion heals between stages; use bench/gradual_taper.py")
    model, tokenizer, src = load_model(args.source)
    sources = opts.calibration_data
    widths = plan_widths(src.tlm_config, opts)
    resolve_importance(opts, src.tlm_config.intermediate_sizes[0])
    evalb = eval_set_blocks(tokenizer, "all-eval", opts.seq_len, opts.eval_tokens)
    cache = source_cache(args.source)
    before = json.loads(cache.read_text()) if cache.exists() else None
    if before is None or set(before) != set(evalb):
        before = {name: perplexity(model, blocks, opts.batch_size) for name, blocks in evalb.items()}
        cache.write_text(json.dumps(before, indent=1))
    settings = layer_settings(opts)
    if seed is not None:
        settings.seed = seed
    cpu0, wall0 = time.process_time(), time.perf_counter()
    cache_file = Path(args.calibration_cache) if args.calibration_cache else None
    if cache_file is not None and cache_file.is_file():
        cached = load_file(str(cache_file))
        calib, samples = cached["calib"], cached.get("samples")
    else:
        calib, samples = calibration_blocks(tokenizer, sources, opts.seq_len, opts.calibration_tokens, model,
                                            opts.seed)
        if cache_file is not None:
            save_file({"calib": calib, **({} if samples is None else {"samples": samples})}, str(cache_file))
    sample_cpu, sample_wall = time.process_time() - cpu0, time.perf_counter() - wall0
    if opts.schedule in MEASURED:
        measured = measure_widths(model, calib, src.tlm_config, opts, settings)
        widths = measured["widths"]
        logging.info("measured widths %s (profile %s)", widths, [round(x, 3) for x in measured["profile"]])
    score_whole_model(model, calib, settings, widths)
    convert_layers(model.model, ModelLayers(model), calib, widths, settings, IN_MEMORY)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    model.config.intermediate_sizes = list(widths)
    after = {name: perplexity(model, blocks, opts.batch_size) for name, blocks in evalb.items()}
    entries = perplexity_entries(before, after, args.in_domain_as or opts.calibration_data)
    row = {"name": args.name, "source": args.source, "schedule": opts.schedule, "ratio": str(opts.ratio),
           "widths": list(widths),
           "calibration_data": list(sources), "calibration_tokens": int(calib.numel()),
           "sample_cpu_s": round(sample_cpu, 1), "sample_wall_s": round(sample_wall, 1),
           "settings": {**opts.record()["method"], "batch_size": settings.batch_size, "seed": settings.seed,
                        "scores_needed": settings.scores_needed},
           "convert_cpu_s": round(cpu, 1), "convert_wall_s": round(wall, 1),
           "threads": torch.get_num_threads(),
           "sets": {s["data"]: {"before": s["before"], "after": s["after"], "ratio": s["ratio"],
                                "in_domain": s["in_domain"]} for s in entries["perplexity_sets"]},
           "ood_geomean": entries.get("perplexity_ratio_ood_geomean"),
           **({"choice": args.choice} if args.choice is not None else {})}
    (out / f"{args.name}.json").write_text(json.dumps(row, indent=1))
    if args.save:
        save(model, src, tokenizer, samples, entries, sources, opts, Path(args.save), args.source)
    ratios = " ".join(f"{k}={v['ratio']:.3f}" for k, v in row["sets"].items())
    print(f"{args.name}: ood_geomean={row['ood_geomean']:.4f} {ratios} cpu={cpu:.0f}s wall={wall:.0f}s")
    assert math.isfinite(row["ood_geomean"])


def save(model, src, tokenizer, samples, entries, sources, opts, out: Path, source: str) -> None:
    """The converted model and what bench/heal_curve.py reads of a conversion report."""
    export_model(model, out, "tlm", src)
    if samples is not None:
        (out / SAMPLES_FILE).write_text(samples_text(tokenizer, samples), encoding="utf-8")
    report = {"source": source, "calibration_data": list(sources), "seq_len": opts.seq_len, "seed": opts.seed,
              **entries}
    (out / "conversion_report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
