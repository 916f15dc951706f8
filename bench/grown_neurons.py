"""How far a heal moved the neurons a conversion grew: per growing layer, the mean norm of the grown neurons' down
projection columns (and of the source neurons' columns, for scale) before and after the heal, and how far their
gate/up rows moved relative to where they started.

    python bench/grown_neurons.py CONVERTED HEALED [--out FILE.json] [--curve bench/results/quality/heal_NAME.json]

CONVERTED is the conversion's TLM folder (before the heal: bench/quality_ablation.py --save, or a heal's
heal-work/converted), HEALED the healed TLM folder (a heal run's final/). Growth appends neurons after the source
ones (tlm_convert.surgery), so in layer l the grown neurons are columns base..I_l of down_proj, base being the
source's uniform width (the report's widths_before). ``--curve``: the heal curve of that heal, into which the means over
the growing layers go (its ``grown_neurons`` key; bench/RESULTS.md shows them beside the heal table).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def col_norm(w: torch.Tensor) -> float:
    return float(w.float().norm(dim=0).mean()) if w.numel() else 0.0


def layer_movement(before: dict, after: dict, i: int, base: int) -> dict | None:
    prefix = f"model.layers.{i}.mlp."
    down0, down1 = before[prefix + "down_proj.weight"], after[prefix + "down_proj.weight"]  # (d, I)
    if down0.shape[1] <= base:
        return None
    row = {"layer": i, "width": down0.shape[1], "grown": down0.shape[1] - base,
           "grown_down_norm_before": col_norm(down0[:, base:]), "grown_down_norm_after": col_norm(down1[:, base:]),
           "source_down_norm_before": col_norm(down0[:, :base]), "source_down_norm_after": col_norm(down1[:, :base])}
    for name in ("gate_proj", "up_proj"):
        key = prefix + name + ".weight"
        if key in before:
            w0, w1 = before[key].float(), after[key].float()  # (I, d)
            moved = (w1 - w0).norm(dim=1) / w0.norm(dim=1).clamp(min=1e-12)  # relative row movement
            row[f"grown_{name}_moved"] = float(moved[base:].mean())
            row[f"source_{name}_moved"] = float(moved[:base].mean())
    return row


def summary(rows: list[dict]) -> dict:
    """Means over the growing layers: grown and source down-column norms before/after, relative gate/up movement."""
    keys = [k for k in rows[0] if k.startswith(("grown_", "source_"))] if rows else []
    return {"layers": len(rows), "neurons": sum(r["grown"] for r in rows),
            **{k: sum(r[k] for r in rows) / len(rows) for k in keys}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("converted")
    ap.add_argument("healed")
    ap.add_argument("--out", default=None)
    ap.add_argument("--curve", default=None, help="a heal curve JSON to record the means in (key grown_neurons)")
    args = ap.parse_args()
    converted, healed = Path(args.converted), Path(args.healed)
    config = json.loads((converted / "config.json").read_text())
    report = converted / "conversion_report.json"
    widths = config["intermediate_sizes"]
    base = (json.loads(report.read_text()).get("widths_before") or [sum(widths) // len(widths)])[0] \
        if report.is_file() else sum(widths) // len(widths)
    before, after = tensors(converted), tensors(healed)
    rows = [r for i in range(len(widths)) if (r := layer_movement(before, after, i, base)) is not None]
    result = {"converted": str(converted), "healed": str(healed), "base_width": base, "layers": rows}
    for r in rows:
        print(f"layer {r['layer']:2d} +{r['grown']:4d}: grown down |col| {r['grown_down_norm_before']:.4f} -> "
              f"{r['grown_down_norm_after']:.4f} (source {r['source_down_norm_after']:.4f}); gate/up rows moved "
              f"{r.get('grown_gate_proj_moved', float('nan')):.4f}/{r.get('grown_up_proj_moved', float('nan')):.4f} "
              f"(source {r.get('source_gate_proj_moved', float('nan')):.4f}/{r.get('source_up_proj_moved', 0):.4f})")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.curve:
        curve = json.loads(Path(args.curve).read_text())
        run = healed.parent / "run_summary.json"  # the heal's own record of how far it went
        tokens = json.loads(run.read_text()).get("tokens") if run.is_file() else None
        curve["grown_neurons"] = {"heal_tokens": tokens, **summary(rows)}
        Path(args.curve).write_text(json.dumps(curve, indent=1) + "\n")


if __name__ == "__main__":
    main()
