"""Framework overhead of ``tlm train``: its throughput vs a bare PyTorch loop on the same model and data.

Both train the same TLM (the evidence benchmark's attention model, cosine taper; 16 x 128 byte tokens per step) on
the same packed blocks, with the same AdamW, warmup + cosine schedule and gradient clipping. The bare loop is
forward -> cross entropy -> backward -> clip -> step, nothing else. ``tlm train`` adds its data order, progress
bar, metrics.jsonl, the stop checks and a final checkpoint. Runs alternate (bare, tlm, bare, tlm, ...) on one
thread in ABBA order; each run's steady-state tokens/s counts steps after the first ``--warmup`` ones (train's own windowed
tokens/s from metrics.jsonl; the bare loop is timed the same way), and the median of the per-round ratios is reported
(with the ratio of medians). Tokens per process-CPU-second are reported too: on one thread they are close to the
uncontended speed, so they are the figure to trust when other jobs share the cores.

    python bench/train_overhead.py --rounds 8 --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
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


def bare_loop(recipe, steps: int, warmup: int) -> tuple[float, float]:
    """(tokens/s, tokens per CPU second) of the plain loop over steps [warmup, steps)."""
    from tlm_io.load import load_tokenizer
    from tlm_io.text import to_blocks
    from tlm_train.data import tokenize_cached
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
            start, cpu_start = time.perf_counter(), time.process_time()
        ids = blocks[perm[step * bs : (step + 1) * bs]].long()
        loss = lm_loss(model(input_ids=ids, use_cache=False).logits, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        float(loss)  # what any loop logging the loss pays
    tokens = (steps - warmup) * bs * recipe.data.seq_len
    return tokens / (time.perf_counter() - start), tokens / (time.process_time() - cpu_start)


def tlm_train_run(recipe, warmup: int) -> tuple[float, float]:
    """(tokens/s, tokens per CPU second) of tlm train over its logged windows after ``warmup`` steps: wall time from
    its own windowed tokens/s, process CPU time read at each of its metrics lines (``_Run.log`` wrapped here)."""
    from tlm_train import trainer

    marks = []
    original = trainer._Run.log

    def log(self, record):
        if "loss" in record:
            marks.append((record["step"], time.process_time()))
        original(self, record)

    trainer._Run.log = log
    try:
        trainer.train(recipe, progress=True)
    finally:
        trainer._Run.log = original
    lines = [json.loads(x) for x in (Path(recipe.output_dir) / "metrics.jsonl").read_text().splitlines()]
    windows = [m for m in lines if "tokens_per_s" in m and m["step"] > warmup]
    per_window = recipe.log.every * recipe.train.batch_size * recipe.data.seq_len
    seconds = sum(per_window / m["tokens_per_s"] for m in windows)
    cpu = [t for step, t in marks if step >= warmup]
    cpu_tokens = (len(cpu) - 1) * per_window
    return len(windows) * per_window / seconds, cpu_tokens / (cpu[-1] - cpu[0])


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

    bare, ours, bare_cpu, ours_cpu = [], [], [], []
    load_start = os.getloadavg()
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            recipe = recipe_from_dict(recipe_dict(str(Path(tmp) / "run"), args.steps))
            recipe.train.num_threads = args.threads
            runs = [("bare", lambda: bare_loop(recipe, args.steps, args.warmup)),
                    ("tlm", lambda: tlm_train_run(recipe, args.warmup))]
            for name, fn in runs if r % 2 == 0 else runs[::-1]:  # ABBA: load drift hits both sides alike
                wall, cpu = fn()
                (bare if name == "bare" else ours).append(wall)
                (bare_cpu if name == "bare" else ours_cpu).append(cpu)
        print(f"round {r}: bare {bare[-1]:,.0f} tok/s ({bare_cpu[-1]:,.0f} per CPU s), tlm train {ours[-1]:,.0f} "
              f"tok/s ({ours_cpu[-1]:,.0f} per CPU s), ratio {ours[-1] / bare[-1]:.3f} (CPU "
              f"{ours_cpu[-1] / bare_cpu[-1]:.3f})", flush=True)
    ratios = [o / b for o, b in zip(ours, bare)]
    cpu_ratios = [o / b for o, b in zip(ours_cpu, bare_cpu)]
    result = {"command": " ".join(sys.argv), "machine": f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} CPUs, {args.threads} thread(s), torch {torch.__version__}",
              "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
              "bare_tokens_per_s": bare, "tlm_train_tokens_per_s": ours, "round_ratios": ratios,
              "median_round_ratio": statistics.median(ratios),
              "ratio_of_medians": statistics.median(ours) / statistics.median(bare),
              "bare_tokens_per_cpu_s": bare_cpu, "tlm_train_tokens_per_cpu_s": ours_cpu,
              "cpu_round_ratios": cpu_ratios, "median_cpu_round_ratio": statistics.median(cpu_ratios)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"tlm train / bare loop: median per-round ratio {result['median_round_ratio']:.3f} (wall), "
          f"{result['median_cpu_round_ratio']:.3f} (CPU time); ratio of medians {result['ratio_of_medians']:.3f} "
          f"({args.rounds} rounds, ABBA order)")


if __name__ == "__main__":
    main()
