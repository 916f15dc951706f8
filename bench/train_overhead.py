"""Framework overhead of ``tlm train``: its throughput vs a bare PyTorch loop on the same model and data.

Both train the same TLM (the evidence benchmark's attention model, cosine taper; 16 x 128 byte tokens per step) on
the same packed blocks, with the same AdamW, warmup + cosine schedule and gradient clipping. The bare loop is
forward -> cross entropy -> backward -> clip -> step, nothing else. ``tlm train`` adds its data order, progress
bar, metrics.jsonl, the stop checks and a final checkpoint. Runs alternate (bare, tlm, bare, tlm, ...) on one
thread in ABBA order; each run's steady-state tokens/s counts steps after the first ``--warmup`` ones (train's own windowed
tokens/s from metrics.jsonl; the bare loop is timed the same way), and the median of the per-round ratios is reported (with the ratio of medians).

    python bench/train_overhead.py --rounds 8 --steps 40
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def recipe_dict(out: str, steps: int) -> dict:
    from evidence import scratch_recipe

    r = scratch_recipe("attention", "cosine", seed=0, steps=steps, out=Path(out))
    r["log"].update(every=10, eval_every=0, save_every=steps)
    return r


def bare_loop(recipe, steps: int, warmup: int) -> float:
    """Tokens/s of the plain loop over steps [warmup, steps)."""
    from tlm_train.data import load_tokenizer, to_blocks, tokenize_cached
    from tlm_train.trainer import build_model_and_tokenizer, lm_loss, lr_factor

    model, tok = build_model_and_tokenizer(recipe)
    model.train()
    blocks = to_blocks(tokenize_cached(load_tokenizer("byte"), recipe.data.train), recipe.data.seq_len)
    perm = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(0))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=recipe.optim.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, recipe))
    bs = recipe.train.batch_size
    start = None
    for step in range(steps):
        if step == warmup:
            start = time.perf_counter()
        ids = blocks[perm[step * bs : (step + 1) * bs]].long()
        loss = lm_loss(model(input_ids=ids, use_cache=False).logits, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        float(loss)  # what any loop logging the loss pays
    return (steps - warmup) * bs * recipe.data.seq_len / (time.perf_counter() - start)


def tlm_train_run(recipe, warmup: int) -> float:
    """Tokens/s of tlm train over its logged windows after ``warmup`` steps (tokens / wall time of those windows)."""
    from tlm_train.trainer import train

    train(recipe, progress=True)
    lines = [json.loads(x) for x in (Path(recipe.output_dir) / "metrics.jsonl").read_text().splitlines()]
    windows = [m for m in lines if "tokens_per_s" in m and m["step"] > warmup]
    tokens = sum(recipe.log.every * recipe.train.batch_size * recipe.data.seq_len for _ in windows)
    seconds = sum(recipe.log.every * recipe.train.batch_size * recipe.data.seq_len / m["tokens_per_s"]
                  for m in windows)
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=str(HERE / "results" / "train_overhead.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from tlm_train.recipe import recipe_from_dict

    bare, ours = [], []
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            recipe = recipe_from_dict(recipe_dict(str(Path(tmp) / "run"), args.steps))
            recipe.train.num_threads = args.threads
            if r % 2 == 0:  # ABBA order: drift in the machine's load hits both sides alike
                bare.append(bare_loop(recipe, args.steps, args.warmup))
                ours.append(tlm_train_run(recipe, args.warmup))
            else:
                ours.append(tlm_train_run(recipe, args.warmup))
                bare.append(bare_loop(recipe, args.steps, args.warmup))
        print(f"round {r}: bare {bare[-1]:,.0f} tok/s, tlm train {ours[-1]:,.0f} tok/s, "
              f"ratio {ours[-1] / bare[-1]:.3f}", flush=True)
    ratios = [o / b for o, b in zip(ours, bare)]
    result = {"command": " ".join(sys.argv), "machine": f"{platform.processor() or platform.machine()}, "
              f"{torch.get_num_threads()} thread(s), torch {torch.__version__}",
              "bare_tokens_per_s": bare, "tlm_train_tokens_per_s": ours, "round_ratios": ratios,
              "median_round_ratio": statistics.median(ratios),
              "ratio_of_medians": statistics.median(ours) / statistics.median(bare)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"tlm train / bare loop: median per-round ratio {result['median_round_ratio']:.3f}, ratio of medians "
          f"{result['ratio_of_medians']:.3f} ({args.rounds} rounds, ABBA order)")


if __name__ == "__main__":
    main()
