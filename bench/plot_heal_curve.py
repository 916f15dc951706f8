"""Plot heal curves: the out-of-domain geometric mean of the perplexity ratio against heal tokens.

Reads bench/heal_curve.py outputs (one JSON object, or JSON lines with --append: one run per line) and draws one
line per run (its points in token order), labelled by its ``label`` or else its student folder's name and its recipe
overrides:

    python bench/plot_heal_curve.py bench/results/heal_curve_mix_lr1e-4_b4.json \\
        bench/results/heal_self_400k_cos3e-4.jsonl --out bench/results/heal_curves.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def runs(path: Path) -> list[dict]:
    """The heal_curve.py runs in ``path`` (a JSON object or JSON lines)."""
    text = path.read_text()
    try:
        return [json.loads(text)]
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.splitlines() if line.strip()]


def label(run: dict) -> str:
    if run.get("label"):
        return run["label"]
    settings = [o.split(".", 1)[1] for o in run.get("overrides", []) if "." in o]
    return f"{Path(run['converted']).name}: {', '.join(settings) or 'the heal defaults of its day'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--out", default="bench/results/heal_curves.png")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for path in args.files:
        for run in runs(path):
            points = sorted(run["points"], key=lambda p: p["tokens"])
            tokens = [max(p["tokens"], 1e4) for p in points]  # the 0 point drawn at the axis' left edge
            ax.plot(tokens, [p["ood_geomean"] for p in points], marker="o", label=label(run))
    ax.axhline(1.10, color="grey", linestyle="--", linewidth=1, label="issue target x1.10")
    ax.set_xscale("log")
    ax.set_xlabel("heal tokens (the first point, drawn at 10^4, is 0: right after conversion)")
    ax.set_ylabel("perplexity / source's, OOD geometric mean")
    ax.set_title("Healing by distillation, 1.5/0.5: SmolLM2-135M (Gemma 3 where labelled)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
