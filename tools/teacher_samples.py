"""Text sampled from a model, as heal data (the heal sweep's "teacher samples" rows in bench/RESULTS.md).

Sequences of --length tokens, --batch at a time, start from the BOS token and are sampled at temperature 1 with no
top-k/top-p (the model's own distribution); the BOS and end-of-text tokens are suppressed, so no sample ends early.
Each sample is decoded and written as one paragraph (samples separated by a blank line), appended to OUT batch by
batch.

    python tools/teacher_samples.py smollm2-135m runs/gen/teacher.txt --tokens 65536 --seed 0
"""

from __future__ import annotations

import argparse
import time

import torch

from tlm_io.load import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a checkpoint tlm-convert reads (e.g. smollm2-135m)")
    parser.add_argument("out", help="text file the samples are appended to")
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--length", type=int, default=128, help="tokens per sample")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tokenizer, _ = load_model(args.model)
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    t0, done = time.perf_counter(), 0
    with open(args.out, "a", encoding="utf-8") as f:
        while done < args.tokens:
            ids = torch.full((args.batch, 1), start)  # (batch, 1)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=args.length,
                                 suppress_tokens=[start, tokenizer.eos_token_id])  # (batch, 1 + length)
            f.write("".join(tokenizer.decode(row[1:]) + "\n\n" for row in out))
            f.flush()
            done += args.batch * args.length
            print(f"{done} tokens, {done / (time.perf_counter() - t0):.0f} tokens/s", flush=True)


if __name__ == "__main__":
    main()
