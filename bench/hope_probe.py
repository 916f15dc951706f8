"""Short Hope-attention experiments at the CPU evidence scale (issue 11), one thread.

    # one run of the evidence recipe (bench/evidence.py, uniform) with config overrides and a shorter budget
    python bench/hope_probe.py run NAME STEPS '{"seed": 0, "hope_level_modes": ["static", "static", "static"]}'
    python bench/hope_probe.py run attn 60 '{"mixer": "attention"}'
    python bench/hope_probe.py run old 60 '{"hope_level_modes": ["static", "static", "static"]}' --old-chain
    # gradient norm (before clipping), its CMS share and rms(level-1 output)/rms(input) over the first 60 steps
    python bench/hope_probe.py dynamics

``--old-chain`` swaps in the chain of the code before issue 11, ``h ← h + MLP_ℓ(RMSNorm(h))`` with ``h_1 = MLP_1(x)``
(the RMSNorm reads the small output of level 1), for the before/after comparison. A run prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent


def old_chain_forward(self, x, state=None, use_cache=False):
    """The pre-issue-11 chain (static levels only): h_1 = MLP_1(x), h_{l+1} = h_l + MLP_{l+1}(RMSNorm_l(h_l))."""
    acc = None
    for i, level in enumerate(self.levels):
        inp = x if (self.topology == "sum" or i == 0) else self.norms[i - 1](acc)
        out = level(inp)
        acc = out if acc is None else acc + out
    return acc, None


def _recipe(overrides: dict, steps: int, out: str):
    import evidence
    from tlm_train.recipe import recipe_from_dict

    overrides = dict(overrides)
    seed, mixer = int(overrides.pop("seed", 0)), overrides.pop("mixer", "hope_attention")
    r = evidence.scratch_recipe(mixer, "uniform", seed, steps=steps, out=out)
    r["model"]["config"].update(overrides)
    r["optim"]["warmup_steps"] = max(2, steps // 10)  # 15 at the evidence budget of 150 steps
    return recipe_from_dict(r)


def run(name: str, steps: int, overrides: dict) -> None:
    from tlm_train.trainer import train

    recipe = _recipe(overrides, steps, str(HERE / "runs" / "hope_probe" / name))
    shutil.rmtree(recipe.output_dir, ignore_errors=True)
    start = time.perf_counter()
    result = train(recipe)
    print(json.dumps({"name": name, "overrides": overrides, "steps": steps, "eval_loss": result.eval_loss,
                      "train_loss_last10": statistics.mean(result.losses[-10:]),
                      "seconds": round(time.perf_counter() - start)}), flush=True)


def dynamics(steps: int = 60) -> None:
    """Both chains on the same data and init: AdamW lr 2e-3 (15 warmup, constant after), wd 0.1, clip 1.0."""
    import tlm.cms as cms
    from tlm_train.data import tokenize_cached, to_blocks
    from tlm_train.trainer import build_model_and_tokenizer

    recipe = _recipe({"hope_level_modes": ["static"] * 3}, 150, str(HERE / "runs" / "hope_probe" / "dynamics"))
    _, tok = build_model_and_tokenizer(recipe)
    blocks = to_blocks(tokenize_cached(tok, "default", max_tokens=16 * 128 * steps), 128).long()
    new_forward = cms.ContinuumMemory._forward
    for name, forward in (("old chain", old_chain_forward), ("sub-stream", new_forward)):
        cms.ContinuumMemory._forward = forward
        torch.manual_seed(0)
        model, _ = build_model_and_tokenizer(recipe)
        model.train()
        ratio = []
        hook = model.model.layers[3].mlp.levels[0].register_forward_hook(
            lambda m, i, o: ratio.append(float(o.detach().pow(2).mean().sqrt() / i[0].detach().pow(2).mean().sqrt())))
        decay = [p for p in model.parameters() if p.dim() >= 2]
        other = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}])
        for step in range(steps):
            for group in opt.param_groups:
                group["lr"] = 2e-3 * min(1.0, (step + 1) / 15)
            ids = blocks[step * 16 : (step + 1) * 16]
            loss = model(ids, labels=ids, use_cache=False).loss
            loss.backward()
            sq = {n: p.grad.pow(2).sum() for n, p in model.named_parameters() if p.grad is not None}
            total = float(sum(sq.values()) ** 0.5)
            share = float(sum(v for n, v in sq.items() if ".mlp." in n) ** 0.5) / total
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            if step % 6 == 5:
                print(f"{name:10s} step {step + 1:3d} loss {float(loss.detach()):.3f} grad-norm {total:7.3f} "
                      f"cms-share {share:.2f} rms(h1)/rms(x) {ratio[-1]:.3f}", flush=True)
        hook.remove()
    cms.ContinuumMemory._forward = new_forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["run", "dynamics"])
    parser.add_argument("args", nargs="*")
    parser.add_argument("--old-chain", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.what == "dynamics":
        dynamics()
        return
    if args.old_chain:
        import tlm.cms as cms

        cms.ContinuumMemory._forward = old_chain_forward
    name, steps, overrides = args.args[0], int(args.args[1]), json.loads(args.args[2] if len(args.args) > 2 else "{}")
    run(name, steps, overrides)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(0, str(HERE))
    main()
