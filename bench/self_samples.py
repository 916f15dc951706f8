"""Text sampled from a source model itself, as the conversion's ``--calibration-data self`` samples it
(tlm_convert.samples.sample_blocks: temperature 1, no top-k/top-p, no early end), written as a text file that a heal
or a recipe can train on (one paragraph per sample, tlm_convert.samples.samples_text).

    python bench/self_samples.py N --out FILE [--source smollm2-135m] [--seed S] [--seq-len 512]

N blocks of ``--seq-len`` tokens; the seed is the draw's (the conversion draws its samples with its ``--seed``, 0 by
default: pick another to get text the calibration has not seen). Logs the tokens and the CPU and wall seconds.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from tlm_convert.samples import sample_blocks, samples_text
from tlm_io.load import load_model

log = logging.getLogger("self_samples")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("blocks", type=int, help="how many samples (blocks of --seq-len tokens)")
    ap.add_argument("--out", required=True, help="the text file to write (refused when it exists)")
    ap.add_argument("--source", default="smollm2-135m", help="the model to sample (a named source or a path)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    out = Path(args.out)
    if args.blocks < 1:
        raise SystemExit(f"error: N is {args.blocks}; ask for at least one sample")
    if out.exists():
        raise SystemExit(f"error: {out} exists; remove it or pass another --out")
    model, tokenizer, _ = load_model(args.source)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    blocks = sample_blocks(model, tokenizer, args.blocks, args.seq_len, seed=args.seed, progress=True)  # (N, seq_len)
    out.write_text(samples_text(tokenizer, blocks), encoding="utf-8")
    log.info("%s: %d samples, %d tokens, %.0f CPU s, %.0f s", out, args.blocks, blocks.numel(),
             time.process_time() - cpu0, time.perf_counter() - wall0)


if __name__ == "__main__":
    main()
