"""Cross-layer compensation, measured before it is built (issue 10 item 3): can the grown neurons of the early layers
(random features of the early residual stream) carry what pruning the late layers removes?

The conversion leaves each grown neuron's output column at noise; its input rows are random. Here those columns are
fitted, by one weighted ridge regression over all grown neurons of all layers together, to the error the whole
conversion leaves in the last residual stream, E = h_src(L) − h_conv(L) (before the final norm), on calibration
tokens. Token weights 1/mean(h_src(L)²) (the final RMSNorm divides by that root), position 0 out (the attention
sink, orders of magnitude larger). The ridge solution does not depend on any metric over the d output dimensions
(every output shares the same regressors), so it is also the least-squares fit in logit space.

Two ways to use the fit, both evaluated on every bundled set against the source (``tlm eval``'s protocol, the
first --eval-tokens tokens of each set in disjoint 512-token windows):

* ``at_end``: the fitted correction F·W added to h_conv(L) right before the final norm. Not a TLM (it reads the
  early layers' features at the end); it says how much of the error the early features can predict at all.
* ``placed``: the fitted rows become the grown neurons' output columns in their own layers (the real
  compensation: the same parameters, the same architecture); the correction now enters the stream early and
  passes through every later layer, whose refits were made without it.

    python bench/cross_layer_probe.py runs/conv_mix --fit-tokens 32768 --out bench/results/quality/cross_layer.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tlm import TLMForCausalLM
from tlm_convert.compensate import refit_kept
from tlm_convert.data import load_text, token_blocks
from tlm_convert.evalsets import eval_set_blocks, geomean
from tlm_convert.load import load_model
from tlm_convert.perplexity import perplexity

QUALITY = Path(__file__).parent / "results" / "quality"


class GrownFeatures:
    """Forward pre-hooks on every grown layer's down_proj recording its grown neurons' activations (B, S, g_i)."""

    def __init__(self, model, source_widths: list[int]):
        self.layers = [i for i, layer in enumerate(model.model.layers)
                       if layer.mlp.down_proj.in_features > source_widths[i]]
        self.first = {i: source_widths[i] for i in self.layers}
        self.acts: dict[int, torch.Tensor] = {}
        self.handles = [model.model.layers[i].mlp.down_proj.register_forward_pre_hook(self._hook(i))
                        for i in self.layers]

    def _hook(self, i):
        def hook(_module, args):
            self.acts[i] = args[0][..., self.first[i]:].detach()
        return hook

    def features(self) -> torch.Tensor:
        """(B, S, G) the grown activations of all layers, in layer order."""
        return torch.cat([self.acts[i] for i in self.layers], -1)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def final_stream(model, ids) -> torch.Tensor:
    """h(L) (B, S, d): the last layer's output, before the final norm."""
    seen = {}
    handle = model.model.norm.register_forward_pre_hook(lambda _m, args: seen.__setitem__("h", args[0]))
    model.model(input_ids=ids, use_cache=False)
    handle.remove()
    return seen["h"]


@torch.no_grad()
def normal_equations(source, converted, grown: GrownFeatures, blocks: torch.Tensor, batch: int):
    """The weighted system of the fit of E = h_src(L) − h_conv(L) on the grown features: FᵀWF (G, G), FᵀWE (G, d)
    and ‖E‖²_W, fp64."""
    gram = rhs = None
    energy = 0.0
    for s in range(0, len(blocks), batch):
        ids = blocks[s : s + batch]
        h_src = final_stream(source, ids)
        h_conv = final_stream(converted, ids)
        f = grown.features().flatten(0, 1).double()  # (N, G)
        e = (h_src - h_conv).flatten(0, 1).double()  # (N, d)
        w = 1.0 / h_src.pow(2).mean(-1).double()  # (B, S)
        w[:, 0] = 0.0
        root = w.flatten().sqrt()[:, None]
        f, e = f * root, e * root
        if gram is None:
            gram = torch.zeros(f.shape[1], f.shape[1], dtype=torch.float64)
            rhs = torch.zeros(f.shape[1], e.shape[1], dtype=torch.float64)
        gram += f.T @ f
        rhs += f.T @ e
        energy += float(e.pow(2).sum())
    return gram, rhs, energy


def solve(gram, rhs, energy, damp: float):
    """The ridge solution W (G, d) and the weighted share of ‖E‖² it explains on the fitted tokens."""
    weights = refit_kept(gram, rhs, damp=damp).T.contiguous()  # (G, d)
    residual = energy - 2 * float((weights * rhs).sum()) + float((weights * (gram @ weights)).sum())  # ‖E − F W‖²
    return weights, 1.0 - residual / energy


@torch.no_grad()
def explained(source, converted, grown, weights, blocks, batch) -> float:
    """The weighted share of ‖E‖² the fit explains on other tokens."""
    err = total = 0.0
    for s in range(0, len(blocks), batch):
        ids = blocks[s : s + batch]
        h_src, h_conv = final_stream(source, ids), final_stream(converted, ids)
        f = grown.features().double()
        e = (h_src - h_conv).double()
        w = 1.0 / h_src.pow(2).mean(-1, keepdim=True).double()
        w[:, 0] = 0.0
        total += float((w * e.pow(2)).sum())
        err += float((w * (e - f @ weights).pow(2)).sum())
    return 1.0 - err / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("converted", help="a tlm-convert output folder of smollm2-135m (default options)")
    ap.add_argument("--source", default="smollm2-135m")
    ap.add_argument("--fit-data", default="default")
    ap.add_argument("--fit-tokens", type=int, default=32768)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--damp", type=float, nargs="+", default=[1e-2])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--skip-converted", action="store_true", help="no row for the converted model as it is")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    t0, cpu0 = time.perf_counter(), time.process_time()
    source, tokenizer, src = load_model(args.source)
    converted = TLMForCausalLM.from_pretrained(args.converted).eval()
    source_widths = src.tlm_config.intermediate_sizes
    grown = GrownFeatures(converted, source_widths)
    fit_blocks = token_blocks(tokenizer, load_text(args.fit_data), 512, args.fit_tokens)
    evalb = eval_set_blocks(tokenizer, "all-eval", 512, args.eval_tokens)
    cache = QUALITY / "source.json"
    before = json.loads(cache.read_text()) if args.eval_tokens == 16384 and cache.exists() else None
    if before is None:
        before = {name: perplexity(source, b) for name, b in evalb.items()}
    report = {"converted": args.converted, "fit_data": args.fit_data, "fit_tokens": int(fit_blocks.numel()),
              "grown_layers": grown.layers, "features": sum(converted.model.layers[i].mlp.down_proj.in_features
                                                           - source_widths[i] for i in grown.layers),
              "eval_tokens": args.eval_tokens, "threads": torch.get_num_threads(), "source": before, "rows": []}

    def row(name, model, **extra):
        after = {n: perplexity(model, b) for n, b in evalb.items()}
        ratio = {n: after[n] / before[n] for n in after}
        ood = geomean([r for n, r in ratio.items() if n != "default-eval"])
        report["rows"].append({"name": name, "perplexity": after, "ratio": ratio, "ood_geomean": ood, **extra})
        print(f"{name}: ood={ood:.4f} " + " ".join(f"{n}={r:.3f}" for n, r in ratio.items()), flush=True)
        Path(args.out).write_text(json.dumps(report, indent=1))

    grown.remove()
    if not args.skip_converted:
        row("converted", converted)
    held_out = torch.cat([b[: max(1, len(b) // 4)] for b in evalb.values()])  # the first quarter of every set
    original = {i: converted.model.layers[i].mlp.down_proj.weight.detach().clone() for i in grown.layers}
    grown = GrownFeatures(converted, source_widths)
    system = normal_equations(source, converted, grown, fit_blocks, args.batch)
    grown.remove()
    for damp in args.damp:
        grown = GrownFeatures(converted, source_widths)
        weights, fit_share = solve(*system, damp)
        share = explained(source, converted, grown, weights, held_out, args.batch)
        print(f"damp {damp}: explained share of the weighted final-stream error: fit {fit_share:.4f}, "
              f"eval sets {share:.4f}", flush=True)

        def add_at_end(_m, hook_args, w=weights.float()):
            return (hook_args[0] + grown.features() @ w,)

        handle = converted.model.norm.register_forward_pre_hook(add_at_end)
        row(f"at_end_damp{damp}", converted, damp=damp, explained_fit=fit_share, explained_eval=share)
        handle.remove()
        grown.remove()
        start = 0
        for i in grown.layers:  # the fitted rows become the grown neurons' output columns
            down = converted.model.layers[i].mlp.down_proj
            g = down.in_features - source_widths[i]
            down.weight.data[:, source_widths[i]:] = weights[start : start + g].T.float()
            start += g
        row(f"placed_damp{damp}", converted, damp=damp)
        for i in grown.layers:
            converted.model.layers[i].mlp.down_proj.weight.data.copy_(original[i])
    report["wall_s"], report["cpu_s"] = time.perf_counter() - t0, time.process_time() - cpu0
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
