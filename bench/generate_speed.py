"""Sampling throughput of ``generate()`` on a real checkpoint (what ``--calibration-data self`` spends its time on).

Draws --batch samples of --length tokens at temperature 1 from the start token, --repeats times, and prints the
tokens per second of each draw and their median. Run it from two trees to compare code versions side by side on
the same machine (the KV cache's growth, tlm/cache.py):

    git archive OLD | tar -x -C /tmp/old
    for tree in /tmp/old .; do PYTHONPATH=$tree python bench/generate_speed.py --length 512 --batch 64; done
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tlm_convert.load import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer, _ = load_model(args.model)
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    rates = []
    for r in range(args.repeats):
        torch.manual_seed(r)
        ids = torch.full((args.batch, 1), start)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                           top_k=0, top_p=1.0, max_new_tokens=args.length, pad_token_id=start,
                           suppress_tokens=[start, tokenizer.eos_token_id])
        rates.append(args.batch * args.length / (time.perf_counter() - t0))
        print(f"draw {r}: {rates[-1]:.0f} tokens/s", flush=True)
    print(json.dumps({"model": args.model, "batch": args.batch, "length": args.length, "threads": args.threads,
                      "tokens_per_s": rates, "median": statistics.median(rates)}))


if __name__ == "__main__":
    main()
