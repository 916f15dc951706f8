"""Heal step time in fp32 and in bf16 autocast, side by side: what `tlm-convert --heal-tokens` spends per step.

One step = the student's forward and backward plus the teacher's forward on --batch x --seq-len random tokens, the
loss the heal uses (tlm_train.trainer.distill_loss, KL at T 1), as ``tlm train`` runs it (bf16: torch.autocast on
the forwards, fp32 weights and loss). The precisions alternate step by step (fp32, bf16, bf16, fp32, ...) after one
untimed warm step each, so a slow phase of a shared machine hits both; the medians and their ratio are printed and
written to --out.

    python bench/heal_step_speed.py runs/conv --source smollm2-135m --steps 6 \\
        --out bench/results/heal_step_speed.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from tlm_convert.load import load_model
from tlm_train.trainer import bf16_is_fast, distill_loss


def step(student, teacher, ids, bf16: bool) -> tuple[float, float]:
    """(wall, CPU) seconds of one heal step without the optimizer."""
    wall, cpu = time.perf_counter(), time.process_time()
    with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext():
        logits = student(input_ids=ids, use_cache=False).logits
        with torch.no_grad():
            target = teacher(input_ids=ids, use_cache=False).logits
        loss = distill_loss(logits, target, 1.0)
    loss.backward()
    student.zero_grad(set_to_none=True)
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("student", help="a converted model folder")
    ap.add_argument("--source", default="smollm2-135m", help="the teacher")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per precision")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/heal_step_speed.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    student, _, _ = load_model(args.student, with_tokenizer=False)
    teacher, _, _ = load_model(args.source, with_tokenizer=False)
    student.train()
    ids = torch.randint(0, student.config.vocab_size, (args.batch, args.seq_len),
                        generator=torch.Generator().manual_seed(0))
    times = {"fp32": [], "bf16": []}
    step(student, teacher, ids, False), step(student, teacher, ids, True)  # warm
    for i in range(args.steps):
        for name in (("fp32", "bf16") if i % 2 == 0 else ("bf16", "fp32")):
            times[name].append(step(student, teacher, ids, name == "bf16"))
            print(f"{name}: {times[name][-1][0]:.2f} s", flush=True)
    tokens = args.batch * args.seq_len
    result = {"student": args.student, "source": args.source, "batch": args.batch, "seq_len": args.seq_len,
              "threads": args.threads, "machine": f"{platform.machine()}, torch {torch.__version__}",
              "bf16_is_fast": bf16_is_fast("cpu"), "steps": {k: [list(t) for t in v] for k, v in times.items()}}
    for name, ts in times.items():
        result[name] = {"median_wall_s": statistics.median(t[0] for t in ts),
                        "median_cpu_s": statistics.median(t[1] for t in ts)}
        result[name]["tokens_per_s"] = tokens / result[name]["median_wall_s"]
    result["speedup_bf16"] = result["fp32"]["median_wall_s"] / result["bf16"]["median_wall_s"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"fp32 {result['fp32']['tokens_per_s']:.0f} tokens/s, bf16 {result['bf16']['tokens_per_s']:.0f} tokens/s: "
          f"bf16 {result['speedup_bf16']:.2f}x")


if __name__ == "__main__":
    main()
